// @ts-check
// The layer x head heatmap.
import { arrowCursor, h, legend } from "./dom.js";
import { symmetricMax, divergingColor, formatScore, headLayout, axisTicks, headLabel, unitKind, besideColumn, unitsWord }
  from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/** Cell size and top margin of the head heatmap (the MLP bars share them, row for row): room above the numbers for
 * the KV groups (GQA) and, beside attention, for the two kinds' names. @param {Payload} data */
export function gridSize(data) {
  const cell = data.n_layers > 40 ? 8 : data.n_heads > 24 ? 9 : 14;
  const attn = besideColumn(data) ?? data.n_heads;
  const gqa = data.n_kv_heads > 0 && data.n_kv_heads < attn && attn % data.n_kv_heads === 0;
  return { cell, top: 16 + (gqa ? 10 : 0) + (besideColumn(data) !== null ? 11 : 0) };
}

/** Heads routing the selected token, as a set of "l:h". @param {Ctx} ctx */
export function routedHeads(ctx) {
  const data = ctx.get("_data");
  const t = ctx.get("selected_token");
  const r = t !== null && data.token_routes ? data.token_routes[t] : null;
  return new Set(r ? r.heads.map(([l, hd]) => `${l}:${hd}`) : []);
}

/**
 * The heatmap from the keyboard: in the Tab order; the arrow keys move a cursor over the cells (from the
 * selected head, else L0.H0), Enter or space selects the head under it (again: unselects).
 * @param {Ctx} ctx @param {Element} svg @param {any} data @param {ReturnType<typeof headLayout>} lay
 * @param {number[] | null} locked
 */
function headKeys(ctx, svg, data, lay, locked) {
  const cur = ctx.ui.headCursor ?? (locked ? [locked[0], locked[1]] : [0, 0]);
  const down = lay.rowY(Math.min(1, data.n_layers - 1)) >= lay.rowY(0) ? 1 : -1;  // which way the layers run
  const mark = () => {
    svg.querySelectorAll(".dpa-cursor").forEach((n) => n.classList.remove("dpa-cursor"));
    if (unitKind(data, cur[0]) === "mlp") return ctx.setHover(`L${cur[0]} is an MLP layer: no units`);
    svg.querySelector(`rect.dpa-head[data-layer="${cur[0]}"][data-head="${cur[1]}"]`)?.classList.add("dpa-cursor");
    ctx.setHover(`${unitKind(data, cur[0], cur[1])} ${headLabel(data, cur[0], cur[1])}: ${formatScore(data.head_scores[cur[0]][cur[1]])} summed over positions` +
      " · Enter selects");
  };
  /** @type {Record<string, number[]>} */
  const moves = { ArrowUp: [-down, 0], ArrowDown: [down, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
  arrowCursor(svg, "heads", "heads, layer by head: the arrow keys move, Enter selects", {
    move: (arrow) => {
      if (!moves[arrow]) return false;
      cur[0] = Math.max(0, Math.min(data.n_layers - 1, cur[0] + moves[arrow][0]));
      cur[1] = Math.max(0, Math.min(data.n_heads - 1, cur[1] + moves[arrow][1]));
      ctx.ui.headCursor = cur;
      return true;
    },
    mark,
    act: () => {
      if (unitKind(data, cur[0]) === "mlp") return;
      const same = locked && locked[0] === cur[0] && locked[1] === cur[1];
      ctx.ui.headCursor = cur;
      ctx.setTrait("selected_head", same ? null : [cur[0], cur[1]]);
    },
  });
  if (ctx.ui.headCursor) mark();
}

/** A cell's name in titles: "L1.H2 (KV group 0)", a hybrid's convolution unit "L0.C3 (channels 24-31)", Falcon-H1's
 * scan unit beside attention "L0.S1". @param {any} data @param {ReturnType<typeof headLayout>} lay
 * @param {{layer: number, head: number}} c */
function cellName(data, lay, c) {
  const kind = unitKind(data, c.layer, c.head);
  if (kind === "head") return `${headLabel(data, c.layer, c.head)} (KV group ${lay.group(c.head)})`;
  const width = (data.unit_widths || {})[kind];  // a convolution's, where d_model is known
  return headLabel(data, c.layer, c.head) + (width ? ` (channels ${c.head * width}–${(c.head + 1) * width - 1})` : "");
}

/**
 * The axes: layer numbers down the left (a hybrid's with each row's kind), each kind's unit numbers along the top,
 * the KV groups above the attention heads (GQA only); beside attention (Falcon-H1's), a rule between the heads and
 * the units beside them and each block named above it ("H0–H3", "S0–S3").
 * @param {Element} svg @param {any} data @param {ReturnType<typeof headLayout>} lay @param {boolean} mixed
 */
function headAxes(svg, data, lay, mixed) {
  const { cell } = lay;
  const top = lay.rowY(0);
  const tick = (/** @type {Record<string, any>} */ at, /** @type {string | number} */ text) =>
    h("text", { ...at, class: "dpa-axis dpa-tick", text });
  for (const l of axisTicks(data.n_layers, cell + 1, 11)) {
    const kind = unitKind(data, l);
    svg.append(tick({ x: lay.colX(0) - 4, y: lay.rowY(l) + cell / 2 + 3.5, "text-anchor": "end" },
      mixed ? `L${l} ${kind === "head" ? "attn" : kind}` : `L${l}`));
  }
  const first = besideColumn(data);
  const blocks = first === null ? [[0, data.n_heads]] : [[0, first], [first, data.n_heads]];  // [from, to) columns
  for (const [from, to] of blocks) {
    for (const i of axisTicks(to - from, cell + 1, String(to - from - 1).length * 6 + 3)) {
      svg.append(tick({ x: lay.colX(from + i) + cell / 2, y: top - 4, "text-anchor": "middle" }, i));
    }
  }
  if (first === null) {
    const axis = !mixed || data.layer_kinds.includes("head") ? "H" : "U";  // heads, or units alone
    svg.append(tick({ x: lay.colX(0) - 4, y: top - 4, "text-anchor": "end" }, axis));
  }
  const kvY = first === null ? 10 : 21;
  const groups = lay.attention / lay.groupSize;
  if (lay.groupSize > 1) {
    const pitch = groups > 1 ? lay.colX(lay.groupSize) - lay.colX(0) : 100;
    for (const g of axisTicks(groups, pitch, String(groups - 1).length * 6 + 16)) {
      svg.append(h("text", { x: lay.colX(g * lay.groupSize), y: kvY, class: "dpa-axis dpa-tick", text: `kv${g}` },
        [h("title", { text: `KV group ${g}: heads ${g * lay.groupSize}–${(g + 1) * lay.groupSize - 1} share keys and values` })]));
    }
  }
  if (first !== null && lay.split !== null) besideMarks(svg, data, lay, blocks);
}

/** Beside attention: the rule between the blocks and each block's name above it, its kind's letter and range.
 * @param {Element} svg @param {any} data @param {ReturnType<typeof headLayout>} lay @param {number[][]} blocks */
function besideMarks(svg, data, lay, blocks) {
  const split = /** @type {number} */ (lay.split);
  svg.append(h("line", { class: "dpa-beside-sep", x1: split, x2: split, y1: 1, y2: lay.height - 1 }));
  for (const [from, to] of blocks) {
    const kind = unitKind(data, 0, from);
    const letter = data.unit_letters?.[kind] ?? "H";
    const what = kind === "head" ? `attention heads 0–${to - from - 1}` :
      `${kind} units 0–${to - from - 1}: the ${kind} block run beside attention in every layer (columns ${from}–${to - 1})`;
    const mid = (lay.colX(from) + lay.colX(to - 1) + lay.cell) / 2;
    svg.append(h("text", { x: mid, y: 10, "text-anchor": "middle", class: "dpa-axis dpa-kind", "data-kind": kind,
      text: `${letter}0–${letter}${to - from - 1}` }, [h("title", { text: what })]));
  }
}

/** The heatmap's caption: what its cells are. @param {any} data @param {boolean} mixed */
function headsCaption(data, mixed) {
  if (besideColumn(data) !== null) return `heads | ${unitsWord(data.beside[0])} (layer × unit)`;  // (side by side in each layer)
  const others = [...new Set((data.layer_kinds ?? []).filter((k) => k !== "head" && k !== "mlp"))].join(", ");
  const heads = !mixed || data.layer_kinds.includes("head");  // (Mamba-2's layers: scan units alone)
  return !mixed ? "heads (layer × head)" : heads ? `heads and ${others} units (layer × unit)` : `${others} units (layer × unit)`;
}

/** @param {Ctx} ctx */
export function headsView(ctx) {
  const data = ctx.get("_data");
  const cmp = ctx.get("_comparison") || {};
  const scores = cmp.level === "component" && cmp.head_scores ? cmp.head_scores : data.head_scores;
  const max = symmetricMax(scores.flat());
  const { cell, top } = gridSize(data);
  const mixed = (data.layer_kinds ?? []).some((k) => k !== "head");  // a hybrid: each row says its kind
  const lay = headLayout(data.n_layers, data.n_heads, data.n_kv_heads,
    { cell, top, left: mixed ? 62 : 30, beside: besideColumn(data) });
  const svg = h("svg", { class: "dpa-heatmap", width: lay.width, height: lay.height, role: "grid" });
  const locked = ctx.get("selected_head");
  const routed = routedHeads(ctx);
  for (const c of lay.cells) {
    if (unitKind(data, c.layer) === "mlp") continue;  // a layer whose one block is an MLP (Nemotron-H's): no units
    const v = scores[c.layer][c.head];
    const isSel = locked && locked[0] === c.layer && locked[1] === c.head;
    const said = v === null ? `not scored by ${cmp.method}` : `${formatScore(v)} summed over positions`;  // (a baseline
    const r = h("rect", {  // of the attention heads alone beside Falcon-H1's scan units)
      x: c.x, y: c.y, width: cell, height: cell, fill: divergingColor(v ?? NaN, max),
      class: "dpa-head" + (isSel ? " dpa-locked" : "") + (routed.has(`${c.layer}:${c.head}`) ? " dpa-routed" : "") +
        (v === null ? " dpa-unscored" : ""),
      "data-layer": c.layer, "data-head": c.head, "data-kind": unitKind(data, c.layer, c.head),
    }, [h("title", { text: `${cellName(data, lay, c)}: ${said}` })]);
    r.addEventListener("mouseenter", () => ctx.setHover(`${unitKind(data, c.layer, c.head)} ${cellName(data, lay, c)}: ${said}`));
    r.addEventListener("click", () => ctx.setTrait("selected_head", isSel ? null : [c.layer, c.head]));
    svg.append(r);
  }
  headKeys(ctx, svg, data, lay, locked);
  headAxes(svg, data, lay, mixed);
  const title = (cmp.level === "component" ? `heads · ${cmp.method}` : headsCaption(data, mixed)) + " · summed over positions";
  return h("section", { class: "dpa-panel" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: title }), legend(max, "")]),
    h("div", { class: "dpa-scroll", "data-scroll": "heads" }, [svg]),
  ]);
}
