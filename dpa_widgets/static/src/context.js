// @ts-check
// What every part of the view shares, made once per render(): the model and its traits, whether a kernel
// answered, the UI state that is not a trait, and the helpers that read and write traits.
import { h } from "./dom.js";
import { offlineReason } from "./helpers.js";
import { selectionPayload } from "./export.js";

/**
 * @param {any} model  the anywidget model
 * @param {HTMLElement} root
 */
export function viewContext(model, root) {
  const get = (/** @type {keyof Model} */ name) => model.get(name);
  const ctx = {
    model, root, get,
    /** @type {{hover: string, neuronLayer: number|null, neuronCount: number}} */
    ui: { hover: "", neuronLayer: null, neuronCount: 12, /** @type {number[] | null} */ headCursor: null,
      /** @type {number | null} */ barCursor: null },
    /** @type {Kernel} */
    kernel: "connecting",
    hoverLine: h("div", { class: "dpa-hover", text: " " }),
    /** Draw the whole view again (main.js sets it). */
    redraw: () => {},
    /** @type {{holder: HTMLElement, handle: any, data: any} | null} the graph view, kept across redraws */
    graph: null,
    /** The controls that recompute (target, weights, method, verify) are on. */
    canRecompute: () => ctx.kernel === "live" && !!get("_live") && get("_data").target.kind !== "vector",
    reason: () => offlineReason(ctx.kernel, !!get("_live"), get("_data").target.kind),
    setTrait: (/** @type {string} */ name, /** @type {any} */ value) => {
      model.set(name, value);
      model.save_changes();
    },
    sel: () => ({ head: get("selected_head"), neuron: get("selected_neuron"), expert: get("selected_expert") ?? null,
      token: get("selected_token") }),
    writeSelection: () => ctx.setTrait("selection", selectionPayload(get("_data"), ctx.sel())),
    detail: (/** @type {string} */ key) => /** @type {Detail | undefined} */ ((get("_details") || {})[key]),
    setHover: (/** @type {string} */ text) => {
      ctx.ui.hover = text;
      ctx.hoverLine.textContent = text || " ";
    },
  };
  return ctx;
}

/** @typedef {ReturnType<typeof viewContext>} Ctx */
