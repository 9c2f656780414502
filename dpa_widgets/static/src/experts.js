// @ts-check
// The layer x expert heatmap (mixture of experts only).
import { h, legend } from "./dom.js";
import { symmetricMax, divergingColor, formatScore, expertLayout, expertLabel, axisTicks, isDense } from "./helpers.js";
import { gridSize } from "./heads.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** The layer x expert heatmap (mixture of experts only): rows level with the head heatmap's layers. @param {Ctx} ctx */
export function expertsView(ctx) {
  const data = ctx.get("_data");
  const scores = /** @type {number[][]} */ (data.expert_scores);
  const slots = scores[0].length;
  const nRouted = Math.min(data.n_experts ?? slots, slots);
  const max = symmetricMax(scores.flat());
  const { cell, top } = gridSize(data);
  const lay = expertLayout(data.n_layers, slots, nRouted, { cell, top });
  const svg = h("svg", { class: "dpa-experts", width: lay.width, height: lay.height, role: "grid" });
  const locked = ctx.get("selected_expert");
  const t = ctx.get("selected_token");
  const r = t !== null && data.token_routes ? data.token_routes[t] : null;
  const routed = new Set(r && r.experts ? r.experts.map(([l, e]) => `${l}:${e}`) : []);
  for (const c of lay.cells) {
    if (isDense(data, c.layer)) continue;  // a dense layer of a mixed layout (Jamba's): no experts, no cells
    const v = scores[c.layer][c.slot];
    const isSel = locked && locked[0] === c.layer && locked[1] === c.slot;
    const name = expertLabel(data, c.layer, c.slot);
    const rect = h("rect", {
      x: c.x, y: c.y, width: cell, height: cell, fill: divergingColor(v, max),
      class: "dpa-expert" + (c.shared ? " dpa-shared" : "") + (isSel ? " dpa-locked" : "") +
        (routed.has(`${c.layer}:${c.slot}`) ? " dpa-routed" : ""),
      "data-layer": c.layer, "data-expert": c.slot,
    }, [h("title", { text: `${name}${c.shared ? " (shared expert)" : ""}: ${formatScore(v)}` })]);
    rect.addEventListener("mouseenter", () => ctx.setHover(`expert ${name}: ${formatScore(v)}`));
    rect.addEventListener("click", () => ctx.setTrait("selected_expert", isSel ? null : [c.layer, c.slot]));
    svg.append(rect);
  }
  // axes: layer numbers down the left, expert numbers along the top, "S" over the shared expert
  for (const l of axisTicks(data.n_layers, cell + 1, 11)) {
    svg.append(h("text", { x: lay.colX(0) - 4, y: lay.rowY(l) + cell / 2 + 3.5, "text-anchor": "end", class: "dpa-axis dpa-tick", text: `L${l}` }));
  }
  const digits = String(Math.max(nRouted - 1, 0)).length;
  for (const e of axisTicks(nRouted, cell + 1, digits * 6 + 3)) {
    svg.append(h("text", { x: lay.colX(e) + cell / 2, y: top - 4, "text-anchor": "middle", class: "dpa-axis dpa-tick", text: e }));
  }
  for (let e = nRouted; e < slots; e++) {
    svg.append(h("text", { x: lay.colX(e) + cell / 2, y: top - 4, "text-anchor": "middle", class: "dpa-axis dpa-tick", text: "S" },
      [h("title", { text: "the shared expert (every token goes through it)" })]));
  }
  svg.append(h("text", { x: lay.colX(0) - 4, y: top - 4, "text-anchor": "end", class: "dpa-axis dpa-tick", text: "E" }));
  const cmp = ctx.get("_comparison") || {};
  const title = "experts (layer × expert)" + (cmp.level === "component" ? " · dpa" : "");
  return h("section", { class: "dpa-panel dpa-experts-panel" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: title }), legend(max, "")]),
    h("div", { class: "dpa-scroll", "data-scroll": "experts" }, [svg]),
  ]);
}
