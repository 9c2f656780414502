// @ts-check
// The MLP totals per layer and the list of top neurons.
import { arrowCursor, h, legend, pressable } from "./dom.js";
import { symmetricMax, divergingColor, formatScore, headLayout, topNeurons, neuronLabel, neuronInExpert } from "./helpers.js";
import { gridSize } from "./heads.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/**
 * The MLP bars from the keyboard: the arrow keys move a cursor over the layers (from the layer shown), Enter
 * or space filters the neuron list to it (again: all layers).
 * @param {Ctx} ctx @param {Element} svg @param {number[]} totals
 */
function barKeys(ctx, svg, totals) {
  let at = ctx.ui.barCursor ?? ctx.ui.neuronLayer ?? 0;
  arrowCursor(svg, "bars", "MLP totals by layer: the arrow keys move, Enter shows that layer's top neurons (again: all layers)", {
    move: (arrow) => {
      if (arrow !== "ArrowUp" && arrow !== "ArrowDown") return false;
      at = Math.max(0, Math.min(totals.length - 1, at + (arrow === "ArrowDown" ? 1 : -1)));
      ctx.ui.barCursor = at;
      return true;
    },
    mark: () => {
      svg.querySelectorAll(".dpa-cursor").forEach((n) => n.classList.remove("dpa-cursor"));
      svg.querySelector(`rect.dpa-bar[data-layer="${at}"]`)?.classList.add("dpa-cursor");
      ctx.setHover(`MLP layer ${at} total: ${formatScore(totals[at])} · Enter: its top neurons`);
    },
    act: () => {
      ctx.ui.barCursor = at;
      ctx.ui.neuronLayer = ctx.ui.neuronLayer === at ? null : at;
      ctx.redraw();
    },
  });
}

/** @param {Ctx} ctx */
export function neuronsView(ctx) {
  const data = ctx.get("_data");
  if (data.d_mlp === 0) {  // every layer one token-mixing block (Mamba-2's): no MLP, no neurons
    return h("section", { class: "dpa-panel dpa-no-mlp" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: "MLP neurons" })]),
      h("p", { class: "dpa-muted", text: "no MLP: each layer of this model is one token-mixing block" })]);
  }
  const totals = data.mlp_totals;
  const max = symmetricMax(totals);
  const { cell, top } = gridSize(data);
  const lay = headLayout(data.n_layers, 1, 1, { cell, left: 0, top });  // rows level with the head heatmap's
  const bw = 120;
  const svg = h("svg", { class: "dpa-bars", width: bw + 4, height: lay.height });
  barKeys(ctx, svg, totals);
  svg.append(h("line", { x1: bw / 2, x2: bw / 2, y1: 0, y2: lay.height, class: "dpa-zero" }));
  totals.forEach((v, l) => {
    const w = Math.abs(v) / max * bw / 2;
    const bar = h("rect", { x: v >= 0 ? bw / 2 : bw / 2 - w, y: lay.rowY(l), width: Math.max(w, 0.5), height: cell,
      fill: divergingColor(v, max), class: "dpa-bar" + (ctx.ui.neuronLayer === l ? " dpa-locked" : ""), "data-layer": l },
    [h("title", { text: `MLP L${l}: ${formatScore(v)}` })]);
    bar.addEventListener("mouseenter", () => ctx.setHover(`MLP layer ${l} total: ${formatScore(v)} (click: its top neurons)`));
    bar.addEventListener("click", () => { ctx.ui.neuronLayer = ctx.ui.neuronLayer === l ? null : l; ctx.redraw(); });
    svg.append(bar);
  });
  const locked = ctx.get("selected_neuron");
  const t = ctx.get("selected_token");
  const routedN = new Set(t !== null && data.token_routes ? data.token_routes[t].neurons.map(([l, n]) => `${l}:${n}`) : []);
  const list = h("ol", { class: "dpa-neuron-list" });
  const items = topNeurons(data.neurons, ctx.ui.neuronCount, ctx.ui.neuronLayer);
  const nMax = symmetricMax(items.map((c) => c.score));
  for (const c of items) {
    const isSel = locked && locked[0] === c.layer && locked[1] === c.neuron;
    const li = h("li", { class: "dpa-neuron" + (isSel ? " dpa-locked" : "") + (routedN.has(`${c.layer}:${c.neuron}`) ? " dpa-routed" : ""),
      "data-layer": c.layer, "data-neuron": c.neuron }, [
      h("span", { class: "dpa-swatch", style: `background:${divergingColor(c.score, nMax)}` }),
      h("span", { text: neuronLabel(data, c.layer, c.neuron) }), h("span", { class: "dpa-num", text: formatScore(c.score) }),
    ]);
    if (neuronInExpert(data, c.neuron, c.layer)) li.setAttribute("title", `neuron ${c.neuron} of layer ${c.layer}`);
    li.addEventListener("mouseenter", () => ctx.setHover(`neuron ${neuronLabel(data, c.layer, c.neuron)}: ${formatScore(c.score)}`));
    pressable(li, `neuron:${c.layer}:${c.neuron}`, () => ctx.setTrait("selected_neuron", isSel ? null : [c.layer, c.neuron]));
    list.append(li);
  }
  const more = h("button", { class: "dpa-more", text: "show more" });
  more.addEventListener("click", () => { ctx.ui.neuronCount += 12; ctx.redraw(); });
  const scope = ctx.ui.neuronLayer === null ? "all layers" : `layer ${ctx.ui.neuronLayer}`;
  return h("section", { class: "dpa-panel" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: `MLP totals · top neurons (${scope}) · summed over positions` }),
      legend(max, "")]),
    h("div", { class: "dpa-neurons" }, [h("div", { class: "dpa-scroll", "data-scroll": "bars" }, [svg]),
      h("div", { class: "dpa-list-wrap", "data-scroll": "neurons" }, [list, more])]),
  ]);
}
