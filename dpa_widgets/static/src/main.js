// @ts-check
// render(): the whole view, drawn again when a trait changes; the hello handshake with the kernel.
import { h } from "./dom.js";
import { timing, hasExperts } from "./helpers.js";
import { viewContext } from "./context.js";
import { headerView, currentView, hasGraph } from "./header.js";
import { controlsView } from "./controls.js";
import { tokensView } from "./tokens.js";
import { headsView } from "./heads.js";
import { expertsView } from "./experts.js";
import { neuronsView } from "./neurons.js";
import { detailView } from "./detail.js";
import { footerView } from "./footer.js";
import { graphView, updateGraph } from "./graph-view.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** The panels of the view on show: the scores (heatmaps, neurons, selection) or the circuit graph. @param {Ctx} ctx */
function panels(ctx) {
  if (currentView(ctx) === "graph") return [headerView(ctx), controlsView(ctx), graphView(ctx)];
  const main = [headsView(ctx), ...(hasExperts(ctx.get("_data")) ? [expertsView(ctx)] : []), neuronsView(ctx), detailView(ctx)];
  return [headerView(ctx), controlsView(ctx), tokensView(ctx), h("div", { class: "dpa-main" }, main), ctx.hoverLine,
    footerView(ctx)];
}

/**
 * How to find a focused element again after a redraw: its data-focus key (pressable), or for a control (an
 * input, select or button) the selector of its tag and classes; null for anything else.
 * @param {Element} el @returns {((root: Element) => Element | null) | null}
 */
function refinder(el) {
  const key = el.closest("[data-focus]")?.getAttribute("data-focus");
  if (key) return (root) => [...root.querySelectorAll("[data-focus]")].find((n) => n.getAttribute("data-focus") === key) ?? null;
  const cls = el.getAttribute("class");
  if (!cls || !el.matches("input, select, button")) return null;
  const selector = el.tagName.toLowerCase() + cls.trim().split(/\s+/).map((c) => `.${c}`).join("");
  return (root) => root.querySelector(selector);
}

/** Draw everything again, keeping each scroll area's offsets and the keyboard focus. @param {Ctx} ctx */
function redraw(ctx) {
  const root = ctx.root;
  /** @type {Map<string, number[]>} scroll offsets by panel, kept across redraws */
  const scrolls = new Map([...root.querySelectorAll("[data-scroll]")].map((n) =>
    [n.getAttribute("data-scroll") || "", [n.scrollTop, n.scrollLeft]]));
  if (!hasGraph(ctx) && ctx.graph) ctx.graph = null;  // the graph went away (never in practice): draw afresh
  const active = root.ownerDocument.activeElement;
  const find = active && active !== root && root.contains(active) ? refinder(active) : null;
  root.replaceChildren(...panels(ctx));
  if (find) /** @type {HTMLElement | null} */ (find(root))?.focus({ preventScroll: true });  // a keyboard user keeps their place
  root.querySelectorAll("[data-scroll]").forEach((n) => {
    const saved = scrolls.get(n.getAttribute("data-scroll") || "");
    if (saved) [n.scrollTop, n.scrollLeft] = saved;
    else if (n.hasAttribute("data-start")) {
      // first showing: centre the start row once the view is laid out (el may not be in the page yet)
      setTimeout(() => { n.scrollTop = Number(n.getAttribute("data-start")) - n.clientHeight / 2; }, 0);
    }
  });
  root.classList.toggle("dpa-busy", !!ctx.get("_busy"));
  root.classList.toggle("dpa-stale", !!ctx.get("_error"));  // a failed recompute: the picture is not of the settings shown
}

const SELECTION_TRAITS = ["change:selected_head", "change:selected_neuron", "change:selected_expert", "change:selected_token"];
const VIEW_TRAITS = ["change:_data", "change:_details", "change:_live", "change:_busy", "change:_error",
  "change:_comparison", "change:_verify", "change:_methods", "change:weights_preset", "change:weights_p",
  "change:contrast", "change:method", "change:top_k", "change:_graph", "change:view"];
const GRAPH_TRAITS = ["change:selected_node", "change:selected_edge", "change:graph_threshold", "change:_graph_verify"];

/**
 * Listen to the traits and to the kernel's answer to "hello" (live only once it answers: saved state, a
 * book page, says _live = true with no kernel behind it). Returns the cleanup.
 * @param {Ctx} ctx
 */
function listen(ctx) {
  const model = ctx.model;
  const draw = () => ctx.redraw();
  const onSelect = () => { ctx.writeSelection(); draw(); };
  const onGraph = () => updateGraph(ctx);
  const onMessage = (/** @type {any} */ msg) => {
    if (!msg || msg.action !== "hello" || ctx.kernel === "live") return;
    ctx.kernel = "live";
    clearTimeout(timer);
    draw();
  };
  SELECTION_TRAITS.forEach((e) => model.on(e, onSelect));
  VIEW_TRAITS.forEach((e) => model.on(e, draw));
  GRAPH_TRAITS.forEach((e) => model.on(e, onGraph));
  model.on("msg:custom", onMessage);
  const timer = setTimeout(() => { if (ctx.kernel === "connecting") { ctx.kernel = "none"; draw(); } }, timing.helloMs);
  return () => {
    clearTimeout(timer);
    model.off("msg:custom", onMessage);
    SELECTION_TRAITS.forEach((e) => model.off(e, onSelect));
    VIEW_TRAITS.forEach((e) => model.off(e, draw));
    GRAPH_TRAITS.forEach((e) => model.off(e, onGraph));
    ctx.graph?.handle.destroy();
  };
}

/** @param {{model: any, el: HTMLElement}} ctx */
function render({ model, el }) {
  const root = /** @type {HTMLElement} */ (h("div", { class: "dpa-circuit" }));
  el.replaceChildren(root);
  const ctx = viewContext(model, root);
  ctx.redraw = () => redraw(ctx);
  const cleanup = listen(ctx);
  ctx.redraw();
  try {
    model.send({ action: "hello" });  // a static page has no comm: nothing is sent and nothing answers
  } catch (e) {
    ctx.kernel = "none";
    ctx.redraw();
  }
  return cleanup;
}

export default { render };
