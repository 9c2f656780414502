// @ts-check
// The circuit graph view: graph.js's renderGraph, wired to the traits. Its element and drawing are
// kept across redraws of the rest of the view (a selection or a slider move updates it in place).
import { renderGraph } from "./graph.js";
import { h } from "./dom.js";
import { graphVerifyReason } from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** The options renderGraph gets from the traits and the kernel state. @param {Ctx} ctx */
export function graphOptionsFor(ctx) {
  const graph = ctx.get("_graph");
  const reason = graphVerifyReason(ctx.kernel, !!ctx.get("_live"), !!graph.verifiable);
  return {
    threshold: ctx.get("graph_threshold"),
    selected: ctx.get("selected_node") || null,
    selectedEdge: ctx.get("selected_edge") ?? null,
    verified: ctx.get("_graph_verify") || {},
    verifyReason: reason,
    busy: !!ctx.get("_busy"),
    onSelect: (/** @type {string | null} */ label) => ctx.setTrait("selected_node", label ?? ""),
    onSelectEdge: (/** @type {[string, string] | null} */ edge) => ctx.setTrait("selected_edge", edge),
    onThreshold: (/** @type {number} */ t) => ctx.setTrait("graph_threshold", t),
    onVerify: (/** @type {[string, string]} */ edge) => ctx.model.send({ action: "verify_edge", edge }),
  };
}

/** Bring the drawn graph up to date with the traits (no-op when the graph view was never shown). @param {Ctx} ctx */
export function updateGraph(ctx) {
  const g = ctx.graph;
  if (!g) return;
  const data = ctx.get("_graph");
  if (data !== g.data) {
    g.data = data;
    g.handle.update({ data, ...graphOptionsFor(ctx) });
  } else g.handle.update(graphOptionsFor(ctx));
}

/** The graph panel (the drawing is made once and then updated). @param {Ctx} ctx */
export function graphView(ctx) {
  if (!ctx.graph) {
    const holder = /** @type {HTMLElement} */ (h("div", { class: "dpa-graph-holder" }));
    const data = ctx.get("_graph");
    ctx.graph = { holder, data, handle: renderGraph(holder, data, graphOptionsFor(ctx)) };
  } else updateGraph(ctx);
  const data = ctx.get("_graph");
  const caption = `circuit graph · ${data.positions ? "units at a position" : "units over all positions"} · ` +
    "direct effects in logit units (dpa.circuit)";
  return h("section", { class: "dpa-panel dpa-graph-panel-outer" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: caption })]), ctx.graph.holder]);
}
