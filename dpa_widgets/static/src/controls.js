// @ts-check
// The controls that recompute in the kernel: target, contrast, path weights, method.
import { h } from "./dom.js";
import { tokenLabel, weightsText } from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** Enter in a text box submits it (its "change" event), as Tab or a click elsewhere does.
 * @param {HTMLInputElement} box */
function submitOnEnter(box) {
  box.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" || event.isComposing) return;
    event.preventDefault();
    box.dispatchEvent(new box.ownerDocument.defaultView.Event("change"));
  });
}

/** @param {Ctx} ctx */
export function controlsView(ctx) {
  const data = ctx.get("_data");
  const live = ctx.canRecompute();
  const why = ctx.reason();
  const busy = ctx.get("_busy");
  const preds = data.top_predictions || [];
  const current = data.target.token ?? "";
  const tgt = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-target", disabled: !live || busy, title: why || "target token" }));
  const options = preds.map(([tok, p]) => [tok, `${tokenLabel(tok)}  ${(p * 100).toFixed(1)}%`]);
  if (!preds.some(([tok]) => tok === current)) options.unshift([current, `${tokenLabel(current)}`]);
  for (const [value, label] of options) tgt.append(h("option", { value, text: label, selected: value === current }));
  tgt.addEventListener("change", () => ctx.setTrait("target", tgt.value));
  const typed = /** @type {HTMLInputElement} */ (h("input", { class: "dpa-typed", placeholder: "or type a token", size: 10, disabled: !live || busy, title: why || "a target token of your own (Enter)",
    "aria-label": "target token (type it, then Enter)" }));
  typed.addEventListener("change", () => typed.value && ctx.setTrait("target", typed.value));
  submitOnEnter(typed);
  const foil = /** @type {HTMLInputElement} */ (h("input", { class: "dpa-contrast", placeholder: "contrast foil", size: 10,
    value: ctx.get("contrast"), disabled: !live || busy, title: why || "attribute target − foil (empty: no contrast; Enter)",
    "aria-label": "contrast foil token (Enter; empty: no contrast)" }));
  foil.addEventListener("change", () => ctx.setTrait("contrast", foil.value));
  submitOnEnter(foil);
  const preset = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-preset", disabled: !live || busy, title: why || "path weights" }));
  for (const f of ctx.get("_presets") || ["default", "control_content", "attention", "query_key", "mlp"]) {
    preset.append(h("option", { value: f, text: f.replace("_", "-"), selected: f === ctx.get("weights_preset") }));
  }
  preset.addEventListener("change", () => ctx.setTrait("weights_preset", preset.value));
  const pval = h("span", { class: "dpa-pval", text: Number(ctx.get("weights_p")).toFixed(2) });
  const p = /** @type {HTMLInputElement} */ (h("input", { type: "range", min: 0, max: 1, step: 0.05, value: ctx.get("weights_p"),
    class: "dpa-p", title: why || "p of the sensitivity family",
    disabled: !live || busy || ["default", "custom"].includes(ctx.get("weights_preset")) }));
  p.addEventListener("input", () => { pval.textContent = Number(p.value).toFixed(2); });
  p.addEventListener("change", () => ctx.setTrait("weights_p", Number(p.value)));
  const method = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-method", disabled: !live || busy, title: why || "attribution method" }));
  for (const m of ctx.get("_methods") || ["dpa"]) method.append(h("option", { value: m, text: m, selected: m === ctx.get("method") }));
  method.addEventListener("change", () => ctx.setTrait("method", method.value));
  const cmp = ctx.get("_comparison") || {};
  const r2 = (/** @type {number|null|undefined} */ r) => (typeof r === "number" && Number.isFinite(r) ? r.toFixed(2) : "–");
  const rho = !cmp.method ? "" : cmp.level === "input" ? `Spearman ρ = ${r2(cmp.rho)} with DPA (token ranks)` :
    `Spearman ρ with DPA: heads ${r2(cmp.rho)}` + ("rho_neurons" in cmp ? `, neurons ${r2(cmp.rho_neurons)}` : "");
  const w = data.weights;
  return h("div", { class: "dpa-controls" }, [
    h("label", {}, ["target ", tgt]), typed,
    h("label", {}, ["vs ", foil]),
    h("label", {}, ["weights ", preset]), h("label", { class: "dpa-slider" }, ["p ", p, pval]),
    h("span", { class: "dpa-muted dpa-weights", title: "path weights μ of the attention (query, key, value) and MLP (gate, up) paths" +
      ("router" in w ? ", and of the router (control) and the experts (content)" : ""),
      text: `μ: ${weightsText(w)}` }),
    h("label", {}, ["method ", method]), h("span", { class: "dpa-rho", text: rho }),
    h("span", { class: "dpa-status", text: busy ? "computing…" : "" }),
    h("div", { class: "dpa-offline" + (ctx.kernel === "connecting" ? " dpa-connecting" : ""), role: "status", text: why, hidden: !why }),
    h("span", { class: "dpa-error", role: "alert",
      text: ctx.get("_error") ? `⚠ ${ctx.get("_error")} — the picture below is still the last result computed` : "" }),
  ]);
}
