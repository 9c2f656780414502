// @ts-check
// The header line: the view tabs (with a circuit graph), the target, its probability and value, the gap, the model.
import { h } from "./dom.js";
import { formatScore } from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** The widget has a circuit graph to show (CircuitWidget(..., circuit=...)). @param {Ctx} ctx */
export function hasGraph(ctx) {
  const graph = ctx.get("_graph");
  return !!graph && Array.isArray(graph.nodes);
}

/** Which view is on: "graph" only when there is a graph. @param {Ctx} ctx */
export function currentView(ctx) {
  return hasGraph(ctx) && ctx.get("view") === "graph" ? "graph" : "scores";
}

/** "scores | circuit graph" tabs (the `view` trait), when there is a graph. @param {Ctx} ctx */
function viewTabs(ctx) {
  if (!hasGraph(ctx)) return [];
  const on = currentView(ctx);
  const tabs = /** @type {const} */ (["scores", "graph"]).map((v) => {
    const tab = h("button", { class: "dpa-tab" + (v === on ? " dpa-tab-on" : ""), role: "tab", "data-view": v, "data-focus": `tab:${v}`,
      "aria-selected": String(v === on), text: v === "graph" ? "circuit graph" : "scores" });
    tab.addEventListener("click", () => ctx.setTrait("view", v));
    return tab;
  });
  return [h("span", { class: "dpa-tabs", role: "tablist" }, tabs)];
}

/** @param {Ctx} ctx */
export function headerView(ctx) {
  const data = ctx.get("_data");
  const t = data.target;
  const what = t.kind === "contrast" ? `${JSON.stringify(t.token)} − ${JSON.stringify(t.contrast)}` :
    t.kind === "vector" ? "a vector direction" : JSON.stringify(t.token);
  const terms = t.terms || [];  // a target of several tokens, each read at its own position (teacher forcing)
  const each = terms.map((x) => `${x.contrast ? "minus " : ""}${JSON.stringify(x.token)} after position ${x.position}: ${formatScore(x.value)}`).join("\n");
  const mine = terms.filter((x) => !x.contrast).length;
  const kind = t.kind === "contrast" ? "logit difference" : t.kind;
  return h("div", { class: "dpa-header" }, [
    ...viewTabs(ctx),
    h("span", { class: "dpa-title", text: `Target ${what}` + (terms.length ? ` (${mine}${mine < terms.length ? ` − ${terms.length - mine}` : ""} tokens, teacher-forced)` : ""),
      title: each }),
    h("span", { text: t.probability === null ? "" : `p = ${t.probability.toFixed(3)}` }),
    h("span", { title: each, text: `${terms.length ? t.kind === "contrast" ? "logit sums' difference" : `sum of ${terms.length} ${t.kind === "logprob" ?
      "(logit − expected logit)s, p held fixed," : "logits"}` : kind} ${formatScore(data.target_logit)}` }),
    h("span", { title: "sum of token scores − target", text: `gap ${formatScore(data.completeness_gap)}` }),
    ...(data.caveats || []).filter((c) => c.startsWith("path weights off")).map((c) =>
      h("span", { class: "dpa-error", title: c, text: "⚠ weights off the paper's constraints" })),
    h("span", { class: "dpa-muted", text: `${data.model_name} · position ${t.position}` }),
  ]);
}
