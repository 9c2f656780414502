// @ts-check
// The footer: verify by ablation, and the exports.
import { h, download, downloadPng } from "./dom.js";
import { formatScore, besideColumn } from "./helpers.js";
import { selectionPayload, viewSvg } from "./export.js";
import { stripScores } from "./tokens.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** @param {Ctx} ctx */
export function footerView(ctx) {
  const live = ctx.canRecompute();
  const mode = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-verify-mode" }, [
    h("option", { value: "disrupt", text: "disrupt (ablate units)" }),
    h("option", { value: "recover", text: "recover (keep only units)" })]));
  const units = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-verify-units" }, [
    h("option", { value: "selection", text: "selected unit" }),
    h("option", { value: "top_tokens", text: `top-${ctx.get("top_k")} tokens` }),
    h("option", { value: "top_components", text: `top-${ctx.get("top_k")} heads + neurons`,
      // beside attention (Falcon-H1's) dpa's component ablations are refused by name: tokens only
      disabled: besideColumn(ctx.get("_data")) !== null,
      title: besideColumn(ctx.get("_data")) !== null ? "not on this model: its layers run attention and a " +
        `${ctx.get("_data").beside?.[0]} block side by side, and component ablations read one token mixer per layer` : undefined })]));
  const go = h("button", { class: "dpa-verify", text: "Verify", disabled: !live || ctx.get("_busy"), title: ctx.reason() || "run the ablation in the kernel" });
  go.addEventListener("click", () => ctx.model.send({ action: "verify", mode: mode.value, units: units.value }));
  const v = ctx.get("_verify") || {};
  const result = v.p_before === undefined ? "" :
    `${v.mode}: ${(v.units || []).slice(0, 6).join(", ")}${(v.units || []).length > 6 ? " …" : ""} → ` +
    `p(${JSON.stringify(v.token)}) ${v.p_before.toFixed(3)} → ${v.p_after.toFixed(3)} (${formatScore(v.p_after - v.p_before)})`;
  const json = h("button", { class: "dpa-export-json", text: "selection JSON" });
  json.addEventListener("click", () => download("selection.json", JSON.stringify(selectionPayload(ctx.get("_data"), ctx.sel()), null, 2), "application/json"));
  const svgBtn = h("button", { class: "dpa-export-svg", text: "SVG" });
  const svgNow = () => viewSvg(ctx.get("_data"), { tokenScores: stripScores(ctx).scores, caption: stripScores(ctx).caption, head: ctx.get("selected_head") });
  svgBtn.addEventListener("click", () => download("circuit.svg", svgNow(), "image/svg+xml"));
  const png = h("button", { class: "dpa-export-png", text: "PNG" });
  png.addEventListener("click", () => downloadPng(svgNow(), "circuit.png"));
  mode.disabled = units.disabled = !live;
  return h("div", { class: "dpa-footer" }, [
    h("span", { class: "dpa-group" }, [h("span", { class: "dpa-muted", text: "Verify by ablation:" }), mode, units, go]),
    h("span", { class: "dpa-verify-result", text: result }),
    h("span", { class: "dpa-spacer" }),
    h("span", { class: "dpa-group dpa-export" }, [h("span", { class: "dpa-muted", text: "Export:" }), json, svgBtn, png]),
  ]);
}
