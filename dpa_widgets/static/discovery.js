// @ts-check
// DiscoveryWidget's view (dpa_widgets/discovery.py): a MIB circuit kept at a chosen size, with its faithfulness f.
// One self-contained ES module (anywidget's `_esm`): no imports, no network, no build step. It draws a header
// (method, model, CPR, CMD), the size and ranking controls, the f curve of both rankings (log x axis) with the
// chosen point marked, and a layered diagram of the circuit: the input, each layer's heads and MLP, the logits,
// left to right; an edge leaves a writer on its right and enters a head at its query, key or value input.
//
// The circuits at the evaluated sizes come in `_data` (both rankings), so moving between them needs no kernel;
// another size is set on the `size` trait and evaluated in the kernel, which answers in `_points` (only once the
// kernel has answered the view's "hello": saved widget state has no kernel behind it).

/**
 * @typedef {[number, number, number]} Edge  [writer index, reader index, score]
 * @typedef {{size: number, ranking: string, asked: number, kept: number, f: number | null, nodes: number[],
 *   edges: Edge[]}} Circuit
 * @typedef {{size: number, signed: Circuit, absolute: Circuit, error: string}} Point
 * @typedef {{sizes: number[], edges: number[], kept: number[], f: (number | null)[]}} Curve
 * @typedef {{method: string, model: string, n_layers: number, n_heads: number, parallel: boolean,
 *   n_edges: number, writers: [string, number, number][], readers: [string, number, string][], sizes: number[],
 *   evaluated: boolean, max_edges: number, cpr: number | null, cmd: number | null,
 *   curves: Record<string, Curve> | null, circuits: Record<string, Circuit[]>}} Data
 */

const NS = "http://www.w3.org/2000/svg";
/** ColorBrewer RdBu, negative blue -> white -> positive red: the stops of dpa's other views. */
const DIVERGING = [
  [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240], [255, 255, 255],
  [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43],
];
const RANKING_TEXT = { signed: "signed · CPR", absolute: "|score| · CMD" };
const RANKING_TITLE = {
  signed: "edges ranked by score (MIB's CPR: the area under f, higher is better)",
  absolute: "edges ranked by |score| (MIB's CMD: the area of |1 − f|, lower is better)",
};
export const timing = { helloMs: 2500 };  // how long the view waits for the kernel's answer

// ---------------------------------------------------------------- small helpers

/** An HTML element. @param {string} tag @param {Record<string, any>} [attrs] @param {(Node | string)[]} [kids] */
function h(tag, attrs = {}, kids = []) {
  return fill(document.createElement(tag), attrs, kids);
}

/** An SVG element. @param {string} tag @param {Record<string, any>} [attrs] @param {(Node | string)[]} [kids] */
function s(tag, attrs = {}, kids = []) {
  return fill(document.createElementNS(NS, tag), attrs, kids);
}

/** @template {Element} E @param {E} node @param {Record<string, any>} attrs @param {(Node | string)[]} kids @returns {E} */
function fill(node, attrs, kids) {
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  node.append(...kids);
  return node;
}

/** A share as a percentage: 0.001 -> "0.1%", 0.05 -> "5%", 0.0125 -> "1.25%". @param {number} p */
export function percent(p) {
  return `${Number((p * 100).toPrecision(3))}%`;
}

/** f with three decimals, or "unknown". @param {number | null | undefined} f */
export function fText(f) {
  if (f === null || f === undefined || !Number.isFinite(f)) return "unknown";
  const text = f.toFixed(3);
  return text === "-0.000" ? "0.000" : text;
}

/** A compact signed score. @param {number} v */
function scoreText(v) {
  if (!Number.isFinite(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  return (v < 0 ? "−" : "+") + (a >= 1e4 || a < 1e-3 ? a.toExponential(2) : a.toPrecision(3));
}

/** @param {number} n */
const count = (n) => n.toLocaleString("en-US");

/** How strong a score looks, in [0, 1]: the square root of its share of the largest |score|, so that the
 * edges after a dominant one still show. @param {number} v @param {number} max */
const strength = (v, max) => (max > 0 ? Math.sqrt(Math.min(1, Math.abs(v) / max)) : 0);

/** The colour of a score on the symmetric scale [-max, max], never paler than a third of the way out. */
function edgeColor(/** @type {number} */ v, /** @type {number} */ max) {
  const m = strength(v, max);
  const x = Math.sign(v) * (0.3 + 0.7 * m);
  const pos = (x + 1) / 2 * (DIVERGING.length - 1);
  const i = Math.min(Math.floor(pos), DIVERGING.length - 2);
  const f = pos - i;
  const [a, b] = [DIVERGING[i], DIVERGING[i + 1]];
  return `rgb(${a.map((c, k) => Math.round(c + (b[k] - c) * f)).join(", ")})`;
}

const same = (/** @type {number} */ a, /** @type {number} */ b) => Math.abs(a - b) <= 1e-9 * Math.max(Math.abs(a), Math.abs(b));

/**
 * The circuit on view and where it came from: a size evaluated on demand (its point), else the payload's.
 * @param {Data} data @param {Point[]} points @param {number} size @param {string} ranking
 * @returns {{circuit: Circuit | null, point: Point | null}}
 */
export function circuitAt(data, points, size, ranking) {
  const point = points.find((p) => same(p.size, size)) ?? null;
  if (point) return { circuit: point[/** @type {"signed" | "absolute"} */ (ranking)], point };
  const k = data.sizes.findIndex((p) => same(p, size));
  return { circuit: k >= 0 ? data.circuits[ranking][k] : null, point: null };
}

// ---------------------------------------------------------------- the f curve

const CURVE = { w: 330, h: 200, left: 42, right: 14, top: 14, bottom: 36 };

/**
 * The f curve of both rankings over the share of edges (log axis), sizes evaluated on demand as diamonds, the
 * chosen point ringed with its f written out. A click on a point chooses its size (and ranking).
 * @param {Data} data @param {Point[]} points @param {number} size @param {string} ranking
 * @param {(size: number, ranking: string) => void} choose
 */
function curveView(data, points, size, ranking, choose) {
  const { w, h: ht, left, right, top, bottom } = CURVE;
  /** @type {{ranking: string, size: number, f: number | null, extra: boolean}[]} */
  const all = [];
  for (const r of ["signed", "absolute"]) {
    const c = data.curves?.[r];
    if (c) c.sizes.forEach((p, k) => all.push({ ranking: r, size: p, f: c.f[k], extra: false }));
    for (const p of points) all.push({ ranking: r, size: p.size, f: p[/** @type {"signed"} */ (r)].f, extra: true });
  }
  const xs = [...data.sizes, ...points.map((p) => p.size), size].map(Math.log10);
  const x0 = Math.min(...xs) - 0.12, x1 = 0.06;
  const fs = all.map((p) => p.f).filter((f) => f !== null && Number.isFinite(f)).map(Number);
  let y0 = Math.min(0, ...fs), y1 = Math.max(1, ...fs);
  const pad = (y1 - y0) * 0.06;
  y0 -= pad; y1 += pad;
  const X = (/** @type {number} */ p) => left + (Math.log10(p) - x0) / (x1 - x0) * (w - left - right);
  const Y = (/** @type {number} */ f) => top + (y1 - f) / (y1 - y0) * (ht - top - bottom);
  const svg = s("svg", { class: "dpa-d-curve", width: w, height: ht, viewBox: `0 0 ${w} ${ht}`, role: "img",
    "aria-label": "faithfulness f over the share of edges kept" });
  // axes: decades on x, a few round values on y, the full model (f = 1) and the empty circuit (f = 0)
  for (let d = Math.ceil(x0); d <= 0; d++) {
    const x = X(10 ** d);
    svg.append(s("line", { class: "dpa-d-grid", x1: x, x2: x, y1: top, y2: ht - bottom }),
      s("text", { class: "dpa-d-tick", x, y: ht - bottom + 13, "text-anchor": "middle", text: percent(10 ** d) }));
  }
  for (const f of yTicks(y0, y1)) {
    svg.append(s("line", { class: f === 1 || f === 0 ? "dpa-d-ref" : "dpa-d-grid", x1: left, x2: w - right, y1: Y(f), y2: Y(f) }),
      s("text", { class: "dpa-d-tick", x: left - 5, y: Y(f) + 3.5, "text-anchor": "end", text: String(Number(f.toFixed(2))) }));
  }
  svg.append(s("text", { class: "dpa-d-axis", x: (left + w - right) / 2, y: ht - 6, "text-anchor": "middle",
    text: "share of edges kept" }),
  s("text", { class: "dpa-d-axis", x: 11, y: (top + ht - bottom) / 2, "text-anchor": "middle",
    transform: `rotate(-90 11 ${(top + ht - bottom) / 2})`, text: "faithfulness f" }));
  if (!fs.length) {
    svg.append(s("text", { class: "dpa-d-axis", x: (left + w - right) / 2, y: Y((y0 + y1) / 2), "text-anchor": "middle",
      text: data.evaluated ? "f is not finite" : "not evaluated: f unknown" }));
  }
  // the other ranking under the chosen one
  for (const r of ranking === "signed" ? ["absolute", "signed"] : ["signed", "absolute"]) {
    const mine = all.filter((p) => p.ranking === r && p.f !== null && Number.isFinite(p.f))
      .sort((a, b) => a.size - b.size);
    const line = mine.filter((p) => !p.extra);
    const cls = `dpa-d-series dpa-d-${r}${r === ranking ? " dpa-d-chosen" : ""}`;
    const g = s("g", { class: cls });
    if (line.length > 1) {
      g.append(s("polyline", { class: "dpa-d-line", points: line.map((p) => `${X(p.size)},${Y(Number(p.f))}`).join(" ") }));
    }
    for (const p of mine) {
      const x = X(p.size), y = Y(Number(p.f));
      const mark = p.extra
        ? s("path", { class: "dpa-d-mark dpa-d-extra", d: `M${x} ${y - 4.5}L${x + 4.5} ${y}L${x} ${y + 4.5}L${x - 4.5} ${y}Z` })
        : s("circle", { class: "dpa-d-mark", cx: x, cy: y, r: 3.2 });
      mark.setAttribute("data-size", String(p.size));
      mark.append(s("title", { text: `${RANKING_TEXT[/** @type {"signed"} */ (r)]}: f = ${fText(p.f)} at ${percent(p.size)}` +
        (p.extra ? " (evaluated on demand)" : "") }));
      mark.addEventListener("click", () => choose(p.size, r));
      g.append(mark);
    }
    svg.append(g);
  }
  // the chosen point
  const chosen = all.find((p) => p.ranking === ranking && same(p.size, size));
  const x = X(size);
  svg.append(s("line", { class: "dpa-d-guide", x1: x, x2: x, y1: top, y2: ht - bottom }));
  if (chosen && chosen.f !== null && Number.isFinite(chosen.f)) {
    const y = Y(chosen.f);
    const label = `f = ${fText(chosen.f)}`;
    // the label where it is farthest from every drawn point and segment (it says which point it is by the ring)
    const lw = 7 * label.length, inPlot = (/** @type {number} */ cx, /** @type {number} */ cy) =>
      cx - lw / 2 >= left && cx + lw / 2 <= w - right && cy - 7 >= top && cy + 5 <= ht - bottom;
    const drawn = all.filter((p) => p.f !== null && Number.isFinite(p.f)).map((p) => [X(p.size), Y(Number(p.f))]);
    for (const r of ["signed", "absolute"]) {  // and the lines' midpoints
      const line = all.filter((p) => p.ranking === r && !p.extra && p.f !== null && Number.isFinite(p.f));
      for (let i = 1; i < line.length; i++) {
        const [ax, ay, bx, by] = [X(line[i - 1].size), Y(Number(line[i - 1].f)), X(line[i].size), Y(Number(line[i].f))];
        const steps = Math.ceil(Math.hypot(bx - ax, by - ay) / 4);  // a point every 4 px
        for (let k = 1; k < steps; k++) drawn.push([ax + k / steps * (bx - ax), ay + k / steps * (by - ay)]);
      }
    }
    /** how far the label's box at (cx, cy) is from a drawn point: negative when the point is inside it */
    const gap = (/** @type {number} */ cx, /** @type {number} */ cy) => Math.min(...drawn.map(([px, py]) => {
      const dx = Math.abs(px - cx) - lw / 2 - 2, dy = Math.abs(py - cy) - 8;
      return dx < 0 && dy < 0 ? Math.max(dx, dy) : Math.hypot(Math.max(dx, 0), Math.max(dy, 0));
    }));
    let best = { d: -Infinity, cx: x + 10 + lw / 2, cy: y - 12 };
    for (const dy of [-1, 1, -2, 2, -3, 3, 0]) {
      for (const dx of [1, -1]) {
        const cx = x + dx * (10 + lw / 2), cy = y + dy * 12;
        if (!inPlot(cx, cy)) continue;
        const d = gap(cx, cy);
        if (d > best.d + 0.5) best = { d, cx, cy };
      }
    }
    svg.append(s("circle", { class: "dpa-d-here", cx: x, cy: y, r: 6.5 }),
      s("text", { class: "dpa-d-here-label", x: best.cx, y: best.cy + 4, "text-anchor": "middle", text: label }));
  }
  return svg;
}

/** Round y ticks over [a, b]: at most six, always 0 and 1 when inside. @param {number} a @param {number} b */
function yTicks(a, b) {
  const span = b - a;
  const step = [0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 50, 100].find((t) => span / t <= 6) ?? span / 5;
  const out = [];
  for (let v = Math.ceil(a / step) * step; v <= b + 1e-9; v += step) out.push(Math.abs(v) < 1e-9 ? 0 : v);
  return out;
}

// ---------------------------------------------------------------- the circuit diagram

const NODE = { w: 40, h: 24, pitch: 30, col: 64, top: 24, left: 8, bottom: 8, wide: 46 };
const PORT = { q: 5, k: 12, v: 19 };
/** How much larger than life a small diagram may be drawn to fill its panel. */
const UPSCALE = 1.5;

/**
 * The layered diagram of a circuit: columns input, L0 heads, L0 MLP, L1 heads, ..., logits; nodes not in the
 * circuit dashed; the shown edges weakest first (the strongest on top), coloured and sized by score.
 * @param {Data} data @param {Circuit} circuit @param {(text: string) => void} hover
 */
function diagramView(data, circuit, hover) {
  const L = data.n_layers, H = data.n_heads;
  const colHeight = H * NODE.pitch - (NODE.pitch - NODE.h);
  const columns = 2 * L + 2;
  const base = NODE.left + NODE.wide - NODE.w;  // the input is wider than a head: column 0's right edge lines up
  const colX = (/** @type {number} */ c) => base + c * NODE.col;
  const width = colX(columns - 1) + NODE.wide + NODE.left;
  const height = NODE.top + colHeight + NODE.bottom;
  const mid = NODE.top + (colHeight - NODE.h) / 2;
  /** the box of writer w: x, y (top left) @type {{x: number, y: number}[]} */
  const box = data.writers.map(([, layer, head]) => {
    if (layer < 0) return { x: NODE.left, y: mid };
    if (head < 0) return { x: colX(2 + 2 * layer), y: mid };
    return { x: colX(1 + 2 * layer), y: NODE.top + head * NODE.pitch };
  });
  const logits = { x: colX(columns - 1), y: mid };
  /** where reader r is entered @param {number} r */
  const port = (r) => {
    const [, owner, letter] = data.readers[r];
    const b = owner < 0 ? logits : box[owner];
    return { x: b.x, y: b.y + (letter ? PORT[/** @type {"q"} */ (letter)] : NODE.h / 2) };
  };
  const svg = s("svg", { class: "dpa-d-diagram", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `the circuit: ${circuit.kept} edges` });
  for (let l = 0; l < L; l++) {
    const x = colX(1 + 2 * l);
    svg.append(s("text", { class: "dpa-d-layer", x: x + (NODE.col + NODE.w) / 2, y: 13, "text-anchor": "middle", text: `L${l}` }));
    if (l % 2 === 1) svg.prepend(s("rect", { class: "dpa-d-band", x: x - (NODE.col - NODE.w) / 2, y: 0, width: 2 * NODE.col, height }));
  }
  const edges = [...circuit.edges].sort((a, b) => Math.abs(a[2]) - Math.abs(b[2]));
  const max = Math.max(0, ...edges.map((e) => Math.abs(e[2])));
  /** which ports of each head carry a shown edge @type {Map<number, Set<string>>} */
  const used = new Map();
  const g = s("g", { class: "dpa-d-edges" });
  for (const [w, r, score] of edges) {
    const a = box[w], b = port(r);
    const x1 = a.x + NODE.w, y1 = a.y + NODE.h / 2, dx = Math.max(14, (b.x - x1) * 0.45);
    // an edge past the next column bows up or down (by its reader), so that it does not run straight through the
    // nodes of the row it starts on (the input, the MLPs and the logits share the middle row)
    const span = Math.round((b.x - x1 + NODE.w) / NODE.col);  // columns from the writer's to the reader's
    const bow = span <= 1 ? 0 : (r % 2 ? 1 : -1) * Math.min(colHeight / 2, 6 + 8 * span);
    const cy = (/** @type {number} */ y) => Math.max(NODE.top, Math.min(NODE.top + colHeight, y + bow));
    const [, owner, letter] = data.readers[r];
    if (letter) used.set(owner, (used.get(owner) ?? new Set()).add(letter));
    const name = `${data.writers[w][0]} → ${data.readers[r][0]}`;
    const path = s("path", {
      class: "dpa-d-edge", d: `M${x1} ${y1}C${x1 + dx} ${cy(y1)},${b.x - dx} ${cy(b.y)},${b.x} ${b.y}`,
      stroke: edgeColor(score, max), "stroke-width": (0.7 + 3.5 * strength(score, max)).toFixed(2),
      "data-w": w, "data-o": owner, "data-score": score,
    }, [s("title", { text: `${name}: ${scoreText(score)}` })]);
    path.addEventListener("mouseenter", () => hover(`${name}   score ${scoreText(score)}`));
    path.addEventListener("mouseleave", () => hover(""));
    g.append(path);
  }
  svg.append(g);
  const inCircuit = new Set(circuit.nodes);
  /** @param {number} w writer index, -1 for the logits */
  const node = (w) => {
    const b = w < 0 ? logits : box[w];
    const [name, layer, head] = w < 0 ? ["logits", L, -1] : data.writers[w];
    const on = w < 0 ? circuit.kept > 0 : inCircuit.has(w);
    const gNode = s("g", { class: `dpa-d-node${on ? " dpa-d-in" : ""}`, "data-node": name, transform: `translate(${b.x} ${b.y})` });
    const wide = w < 0 || layer < 0 ? NODE.wide : NODE.w;  // the input and the logits
    gNode.append(s("rect", { width: wide, height: NODE.h, rx: 3 }));
    const label = layer < 0 ? "input" : w < 0 ? "logits" : head < 0 ? "MLP" : `h${head}`;
    const isHead = w >= 0 && layer >= 0 && head >= 0;
    gNode.append(s("text", { class: "dpa-d-label", x: isHead ? NODE.w - 5 : wide / 2, y: NODE.h / 2 + 3.5,
      "text-anchor": isHead ? "end" : "middle", text: label }));
    if (isHead) {
      for (const [letter, y] of Object.entries(PORT)) {
        const carries = used.get(w)?.has(letter);
        gNode.append(s("text", { class: `dpa-d-port${carries ? " dpa-d-port-on" : ""}`, x: 3, y: y + 2.6, text: letter }));
      }
    }
    gNode.append(s("title", { text: w < 0 ? "logits" : `${name}${on ? "" : " (not in the circuit)"}` }));
    gNode.addEventListener("mouseenter", () => {
      svg.classList.add("dpa-d-focus");
      g.querySelectorAll(".dpa-d-edge").forEach((e) => {
        const mine = e.getAttribute("data-w") === String(w) || e.getAttribute("data-o") === String(w);
        e.classList.toggle("dpa-d-lit", mine);
      });
      const n = g.querySelectorAll(".dpa-d-lit").length;
      hover(`${name}${on ? "" : " (not in the circuit)"}: ${n} edge${n === 1 ? "" : "s"} drawn`);
    });
    gNode.addEventListener("mouseleave", () => {
      svg.classList.remove("dpa-d-focus");
      g.querySelectorAll(".dpa-d-lit").forEach((e) => e.classList.remove("dpa-d-lit"));
      hover("");
    });
    return gNode;
  };
  const nodes = s("g", { class: "dpa-d-nodes" });
  data.writers.forEach((_, w) => nodes.append(node(w)));
  nodes.append(node(-1));
  svg.append(nodes);
  return { svg, max, width, height };
}

/** The colour legend of edge scores. @param {number} max */
function legend(max) {
  const stops = DIVERGING.map((c, i) => `rgb(${c.join(",")}) ${(i / (DIVERGING.length - 1) * 100).toFixed(0)}%`);
  return h("span", { class: "dpa-d-legend" }, [
    h("span", { text: "edge score" }), h("span", { text: scoreText(-max) }),
    h("span", { class: "dpa-d-legend-bar", style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
    h("span", { text: scoreText(max) }),
    h("span", { class: "dpa-d-muted", text: "· width ∝ √|score| · q k v: a head's query, key, value input" })]);
}

// ---------------------------------------------------------------- the view

/** A selector for the focused control, to focus it again after a redraw (a keyboard user keeps their place).
 * @param {HTMLElement} root @returns {string | null} */
function focusKey(root) {
  const el = root.ownerDocument.activeElement;
  if (!el || !root.contains(el) || !el.matches("button, input")) return null;
  for (const name of ["data-size", "data-ranking"]) {
    const v = el.getAttribute(name);
    if (v !== null) return `[${name}="${v}"]`;
  }
  const cls = [...el.classList].find((c) => c.startsWith("dpa-d-"));
  return cls ? `.${cls}` : null;
}

/** @param {{model: any, el: HTMLElement}} ctx */
function render({ model, el }) {
  const root = h("div", { class: "dpa-discovery" });
  el.append(root);
  const state = { kernel: "connecting", other: "", otherError: "", fit: false };

  /** @param {number} size @param {string} [ranking] */
  const choose = (size, ranking) => {
    if (ranking && ranking !== model.get("ranking")) model.set("ranking", ranking);
    model.set("size", size);
    model.save_changes();
  };

  function draw() {
    /** @type {Data} */
    const data = model.get("_data");
    if (!data || !data.circuits) { root.replaceChildren(h("div", { class: "dpa-d-muted", text: "no data" })); return; }
    /** @type {Point[]} */
    const points = model.get("_points") ?? [];
    const size = Number(model.get("size")), ranking = model.get("ranking");
    const busy = !!model.get("_busy"), error = model.get("_error") || "";
    const live = !!model.get("_live");
    const scroll = root.querySelector(".dpa-d-scroll");
    const kept = scroll ? [scroll.scrollLeft, scroll.scrollTop] : null;
    const focused = focusKey(root);
    const { circuit, point } = circuitAt(data, points, size, ranking);
    const f = circuit?.f ?? null;

    // header
    const header = h("div", { class: "dpa-d-header" }, [
      h("span", { class: "dpa-d-title", text: "MIB circuit" }),
      h("span", { class: "dpa-d-chip", text: data.method }),
      ...(data.model ? [h("span", { class: "dpa-d-model", text: data.model })] : []),
      h("span", { class: "dpa-d-muted", text: `${count(data.n_edges)} edges · ${data.n_layers} layers × ${data.n_heads} heads` }),
      h("span", { class: "dpa-d-spacer" }),
      h("span", { class: "dpa-d-score", title: "area under f over the ten sizes, edges ranked by score (higher is better)" },
        [h("b", { text: "CPR " }), data.cpr === null ? "unknown" : data.cpr.toFixed(3), h("span", { class: "dpa-d-muted", text: " ↑" })]),
      h("span", { class: "dpa-d-score", title: "area of |1 − f| over the ten sizes, edges ranked by |score| (lower is better)" },
        [h("b", { text: "CMD " }), data.cmd === null ? "unknown" : data.cmd.toFixed(3), h("span", { class: "dpa-d-muted", text: " ↓" })]),
    ]);

    // controls: the sizes, another size (a kernel), the ranking
    const sizes = [...data.sizes];
    for (const p of [...points.map((q) => q.size), size]) if (!sizes.some((q) => same(q, p))) sizes.push(p);
    sizes.sort((a, b) => a - b);
    const sizeButtons = h("span", { class: "dpa-d-seg dpa-d-sizes", role: "group", "aria-label": "circuit size" },
      sizes.map((p) => {
        const custom = !data.sizes.some((q) => same(q, p));
        const on = same(p, size);
        return h("button", { class: `dpa-d-size${on ? " dpa-d-on" : ""}${custom ? " dpa-d-custom" : ""}`,
          "data-size": p, "aria-pressed": on ? "true" : "false", disabled: busy && !on,
          title: `keep the top ${percent(p)} of edges${custom ? " (evaluated on demand)" : ""}`,
          text: percent(p), onclick: () => { if (!on) choose(p); } });
      }));
    const controls = h("div", { class: "dpa-d-controls" }, [
      h("span", { class: "dpa-d-group" }, [h("span", { class: "dpa-d-label-text", text: "Size" }), sizeButtons])]);
    if (live) {
      const usable = state.kernel === "live" && !busy;
      const input = /** @type {HTMLInputElement} */ (h("input", { class: "dpa-d-other", type: "number", min: 0.001, max: 100,
        step: "any", placeholder: "%", value: state.other, disabled: !usable, "aria-label": "another size, in % of edges" }));
      const go = () => {
        const v = Number(input.value);
        state.other = input.value;
        if (!input.value || !Number.isFinite(v) || v <= 0 || v > 100) {
          state.otherError = "a size is a share of the edges in (0, 100] %";
          draw();
          return;
        }
        state.otherError = "";
        choose(Number((v / 100).toPrecision(12)));
      };
      input.addEventListener("keydown", (ev) => { if (ev.key === "Enter") { ev.preventDefault(); go(); } });
      input.addEventListener("input", () => { state.other = input.value; });
      controls.append(h("span", { class: "dpa-d-group" }, [h("span", { class: "dpa-d-label-text", text: "other" }), input,
        h("span", { class: "dpa-d-muted", text: "%" }),
        h("button", { class: "dpa-d-go", disabled: !usable, text: "evaluate", onclick: go,
          title: "evaluate f at this size in the kernel (patched forward passes on the pairs)" })]));
    }
    controls.append(h("span", { class: "dpa-d-group" }, [h("span", { class: "dpa-d-label-text", text: "Ranking" }),
      h("span", { class: "dpa-d-seg", role: "group", "aria-label": "ranking" }, ["signed", "absolute"].map((r) =>
        h("button", { class: `dpa-d-ranking${r === ranking ? " dpa-d-on" : ""}`, "data-ranking": r,
          "aria-pressed": r === ranking ? "true" : "false", title: RANKING_TITLE[/** @type {"signed"} */ (r)],
          text: RANKING_TEXT[/** @type {"signed"} */ (r)], onclick: () => { if (r !== ranking) choose(size, r); } })))]));

    // what is known and what is going on
    const notes = [];
    if (busy) notes.push(h("div", { class: "dpa-d-status", text: `evaluating f at ${percent(size)} in the kernel (patched forward passes on the pairs)…` }));
    if (error) notes.push(h("div", { class: "dpa-d-error", text: error }));
    if (state.otherError) notes.push(h("div", { class: "dpa-d-error", text: state.otherError }));
    const why = !live
      ? (data.evaluated ? "f is known only at the evaluated sizes: pass model= and pairs= to DiscoveryWidget to evaluate others"
        : "this discovery was not evaluated (evaluate=False): f is unknown; pass model= and pairs= to DiscoveryWidget to evaluate the sizes chosen")
      : state.kernel === "connecting" ? "connecting to the kernel…"
        : state.kernel === "none" ? "static page: evaluating f at another size needs a running kernel — open the notebook in JupyterLab and run it" : "";
    if (why) notes.push(h("div", { class: `dpa-d-note${state.kernel === "connecting" && live ? " dpa-d-connecting" : ""}`, text: why }));

    // the f curve and its readout
    const readout = h("div", { class: "dpa-d-readout" }, [
      h("span", { class: "dpa-d-f", "data-f": f === null ? "" : f, text: `f = ${fText(f)}` }),
      h("span", { class: "dpa-d-muted", text: ` at ${percent(size)} of edges, ${RANKING_TEXT[/** @type {"signed"} */ (ranking)]}` +
        (f === null && point && !point.error && busy ? " (evaluating…)" : "") }),
    ]);
    const curvePanel = h("div", { class: "dpa-d-panel dpa-d-curve-panel" }, [
      h("div", { class: "dpa-d-caption", text: "Faithfulness" }), readout,
      curveView(data, points, size, ranking, choose),
      h("div", { class: "dpa-d-key" }, ["signed", "absolute"].map((r) => h("span", { class: `dpa-d-key-${r}${r === ranking ? " dpa-d-chosen" : ""}` }, [
        h("span", { class: "dpa-d-swatch" }), RANKING_TEXT[/** @type {"signed"} */ (r)]]))),
      h("div", { class: "dpa-d-muted dpa-d-small", text: "f = (m(C) − m(∅)) / (m(full) − m(∅)); 1: the circuit does what the model does" }),
    ]);

    // the circuit
    const hoverLine = h("div", { class: "dpa-d-hover" });
    const circuitPanel = h("div", { class: "dpa-d-panel dpa-d-circuit-panel" });
    if (circuit) {
      const shown = circuit.edges.length;
      const { svg, max, width } = diagramView(data, circuit, (t) => { hoverLine.textContent = t; });
      // life size, or larger (up to UPSCALE) to fill the panel, scrolled when wider; "fit": all of it in view
      svg.setAttribute("style", state.fit ? `width: min(100%, ${UPSCALE * width}px)`
        : `width: clamp(${width}px, 100%, ${UPSCALE * width}px)`);
      const zoom = h("span", { class: "dpa-d-seg dpa-d-zoom", role: "group", "aria-label": "zoom" }, [[false, "1:1"], [true, "fit"]]
        .map(([fit, text]) => h("button", { class: `dpa-d-zoom-${text === "fit" ? "fit" : "one"}${state.fit === fit ? " dpa-d-on" : ""}`,
          "aria-pressed": state.fit === fit ? "true" : "false", text,
          title: fit ? "the whole circuit in the panel's width" : "life size (scroll sideways when it is wider than the panel)",
          onclick: () => { state.fit = /** @type {boolean} */ (fit); draw(); } })));
      circuitPanel.append(
        h("div", { class: "dpa-d-panel-head" }, [
          h("span", { class: "dpa-d-caption", text: `Circuit at ${percent(size)} of edges` }),
          h("span", { class: "dpa-d-kept", "data-kept": circuit.kept, text: `${count(circuit.kept)} edges kept` }),
          h("span", { class: "dpa-d-muted", title: "int(size × edges) asked for; pruning drops the edges that lie on no path from the input to the logits",
            text: `(${count(circuit.asked)} asked, then pruned)` }),
          h("span", { class: "dpa-d-showing", "data-shown": shown,
            text: `showing ${count(shown)} of ${count(circuit.kept)} edges${shown < circuit.kept ? " (the strongest by |score|)" : ""}` }),
        ]),
        h("div", { class: "dpa-d-panel-head" }, [...(shown ? [legend(max)] : []), h("span", { class: "dpa-d-spacer" }), zoom]),
        circuit.kept === 0 ? h("div", { class: "dpa-d-note", text: circuit.asked === 0
          ? `no edge at this size: int(${percent(size)} × ${count(data.n_edges)} edges) = 0`
          : `pruning left no edge: none of the ${count(circuit.asked)} edges asked for lies on a path from the input to the logits` }) : "",
        h("div", { class: "dpa-d-scroll" }, [svg]), hoverLine);
    } else {
      circuitPanel.append(h("div", { class: "dpa-d-muted", text: busy ? "computing the circuit…" : `no circuit at ${percent(size)}` }));
    }
    root.replaceChildren(header, controls, ...notes, h("div", { class: "dpa-d-main" }, [curvePanel, circuitPanel]));
    root.classList.toggle("dpa-d-busy", busy);
    root.dataset.size = String(size);
    root.dataset.ranking = ranking;
    const newScroll = root.querySelector(".dpa-d-scroll");
    if (kept && newScroll) [newScroll.scrollLeft, newScroll.scrollTop] = kept;
    if (focused) /** @type {HTMLElement | null} */ (root.querySelector(focused))?.focus({ preventScroll: true });
  }

  const traits = ["_data", "_points", "size", "ranking", "_busy", "_error", "_live"].map((t) => `change:${t}`);
  traits.forEach((e) => model.on(e, draw));
  const onMessage = (/** @type {any} */ msg) => {
    if (!msg || msg.action !== "hello" || state.kernel === "live") return;
    state.kernel = "live";
    clearTimeout(timer);
    draw();
  };
  model.on("msg:custom", onMessage);
  const timer = setTimeout(() => { if (state.kernel === "connecting") { state.kernel = "none"; draw(); } }, timing.helloMs);
  draw();
  try {
    model.send({ action: "hello" });  // saved state has no comm: nothing answers, and other sizes stay off
  } catch (e) {
    state.kernel = "none";
    draw();
  }
  return () => {
    clearTimeout(timer);
    traits.forEach((e) => model.off(e, draw));
    model.off("msg:custom", onMessage);
  };
}

export default { render };
