// @ts-check
/**
 * The circuit graph of a ``dpa.Circuit`` (``Circuit.to_json()``) drawn as SVG: tokens at the bottom, a row per
 * layer's attention and MLP, the target at the top, one column per position; edges coloured and sized by their
 * signed direct effect. A threshold slider prunes live (the rule of ``Circuit.prune``), hovering a node lights
 * its inputs and outputs, clicking selects a node or an edge and the side panel shows its in- and out-flows.
 *
 * One plain ES module with no imports: the widget's bundle includes it (dpa_widgets/static/build.mjs), and
 * ``dpa circuit --html`` pastes it into a page's inline ``<script type="module">`` followed by
 * ``renderGraph(document.getElementById("graph"), DATA, {})``. The pure parts (colour scale, influence and
 * pruning, layout, edge geometry) are exported for Node's test runner.
 *
 * @typedef GraphNode  one entry of Circuit.to_json()["nodes"]
 * @property {number} id
 * @property {"token" | "head" | "neuron" | "expert" | "target" | "rest"} kind  (an expert: a mixture of experts' unit)
 * @property {string} label               "tok3", "L2.H1@5", "L3.N17@5", "L3.E2@5", "L2.H1" (positions=False), "target", "rest:…"
 * @property {number | null} layer
 * @property {number | null} index
 * @property {number | null} position
 * @property {number | null} of           a rest node: the node whose in-flow it completes
 * @property {number | null} score
 * @property {number | null} in_gap
 * @property {number | null} bias_in
 * @property {number | null} out_rest
 * @property {number | null} [influence]
 * @property {(number | null)[]} [in_positions]  a unit's or the target's in-flow by the position it reads
 *
 * @typedef GraphData  Circuit.to_json()
 * @property {string} [kind]
 * @property {string} [model]
 * @property {string[]} tokens
 * @property {{kind: string, position: number, token: string | null, contrast: string | null}} target
 * @property {number} [target_logit]
 * @property {boolean} positions
 * @property {GraphNode[]} nodes
 * @property {[number, number, number][]} edges  [source id, destination id, effect], non-zero ones
 *
 * @typedef Verified  Circuit.verify's answer for one edge (CircuitWidget.verify_edge)
 * @property {string} source
 * @property {string} destination
 * @property {number} edge                 the edge, E(source -> destination)
 * @property {number | null} [first_order]  the linearised model's prediction of the patch (every path at weight 1)
 * @property {number | null} direct         the measured change of the destination's score
 * @property {number | null} target
 * @property {number | null} ratio        direct / first_order (direct / edge without first_order)
 *
 * @typedef GraphOptions  every key optional; ``update(options)`` changes only the keys it is given
 * @property {GraphData} [data]             replace the graph (update only)
 * @property {number} [threshold]           keep the fewest units whose influence adds up to this share (0–1; 1)
 * @property {string | null} [selected]     the selected node's label
 * @property {[string, string] | null} [selectedEdge]  the selected edge: [source label, destination label]
 * @property {number} [minEdge]             edges under this share of the largest |effect| are not drawn (0.01)
 * @property {number} [maxWidth]            token labels stand level under their columns up to this width (1100)
 * @property {Record<string, Verified>} [verified]  path-patching results by edgeKey(source, destination)
 * @property {string} [verifyReason]        why the verify button is off ("" when onVerify is given: on)
 * @property {boolean} [busy]               a verification is running
 * @property {(label: string | null) => void} [onSelect]
 * @property {(edge: [string, string] | null) => void} [onSelectEdge]
 * @property {(label: string | null) => void} [onHover]
 * @property {(threshold: number) => void} [onThreshold]   the slider was let go
 * @property {(edge: [string, string]) => void} [onVerify] run path patching on this edge (a kernel)
 */

// ---------------------------------------------------------------- colour scale and labels

/**
 * ColorBrewer RdBu (colour-blind safe), negative blue -> white at zero -> positive red: the same nine
 * stops as dpa.report.RDBU (the terminal and HTML reports), so a score has one colour everywhere.
 */
export const DIVERGING = [
  [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240], [255, 255, 255],
  [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43],
];

/**
 * Largest |value| over the entries not masked out; 1 when there are none or all are zero.
 * @param {number[]} values
 * @param {boolean[]} [skip]  true entries are ignored (special tokens)
 */
export function symmetricMax(values, skip) {
  let m = 0;
  values.forEach((v, i) => {
    if (!(skip && skip[i]) && Number.isFinite(v)) m = Math.max(m, Math.abs(v));
  });
  if (m === 0) values.forEach((v) => { if (Number.isFinite(v)) m = Math.max(m, Math.abs(v)); });
  return m > 0 ? m : 1;
}

/**
 * The colour of ``value`` on the symmetric scale [-max, max], clipped at the ends.
 * @param {number} value
 * @param {number} max
 * @returns {[number, number, number]}
 */
export function divergingRgb(value, max) {
  const x = Math.max(-1, Math.min(1, max > 0 && Number.isFinite(value) ? value / max : 0));
  const pos = (x + 1) / 2 * (DIVERGING.length - 1);
  const i = Math.min(Math.floor(pos), DIVERGING.length - 2);
  const f = pos - i;
  const [a, b] = [DIVERGING[i], DIVERGING[i + 1]];
  return /** @type {[number, number, number]} */ (a.map((c, k) => Math.round(c + (b[k] - c) * f)));
}

/** @param {number} value @param {number} max */
export function divergingColor(value, max) {
  const [r, g, b] = divergingRgb(value, max);
  return `rgb(${r}, ${g}, ${b})`;
}

/** Black or white text, whichever reads better on the scale colour of ``value``. */
export function textColor(/** @type {number} */ value, /** @type {number} */ max) {
  const [r, g, b] = divergingRgb(value, max);
  return 0.2126 * r + 0.7152 * g + 0.0722 * b > 140 ? "#000" : "#fff";  // dpa.report.ink_for
}

/** A compact signed number: 3 significant digits, exponent for tiny or huge values. */
export function formatScore(/** @type {number | null | undefined} */ v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  const s = a >= 1e4 || a < 1e-3 ? a.toExponential(2) : a.toPrecision(3);
  return (v < 0 ? "−" : "+") + s;
}

/** A token as shown: spaces as "·", newlines as "↵", tabs as "→", empty as "∅". */
export function tokenLabel(/** @type {string} */ tok) {
  if (tok === "") return "∅";
  return tok.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "→");
}

/** A label cut to ``max`` characters, the cut marked with "…". */
export function shortLabel(/** @type {string} */ text, /** @type {number} */ max) {
  const chars = [...text];
  return chars.length <= max ? text : chars.slice(0, Math.max(1, max - 1)).join("") + "…";
}

// ---------------------------------------------------------------- influence and pruning (dpa/circuit.py)

/** The unit kinds (what pruning keeps or drops) and their letter in labels, as dpa.circuit.LETTER. */
export const UNIT_LETTER = { head: "H", neuron: "N", expert: "E" };

/** A head, a neuron or an expert. @param {GraphNode} node */
export function isUnit(node) {
  return Object.hasOwn(UNIT_LETTER, node.kind);
}

/** The key of an edge in ``verified``: "L0.H1@3->L2.N5@3". @param {string} source @param {string} destination */
export function edgeKey(source, destination) {
  return `${source}->${destination}`;
}

/**
 * Each node's share of the target through the graph, as ``dpa.circuit.influence``: influence[target] = 1 and
 * influence[s] = sum over d of |E[s, d]| / (sum over every source s' of |E[s', d]|) * influence[d].
 * @param {number[]} ids  the nodes' ids
 * @param {[number, number, number][]} edges
 * @param {number} target  the target's id
 * @returns {Map<number, number>}
 */
export function influence(ids, edges, target) {
  /** @type {Map<number, number>} */
  const total = new Map();
  for (const [, d, e] of edges) total.set(d, (total.get(d) ?? 0) + Math.abs(e ?? 0));
  /** @type {Map<number, [number, number][]>} */
  const out = new Map(ids.map((i) => [i, []]));
  for (const [s, d, e] of edges) {
    const t = total.get(d) ?? 0;
    if (t > 0) out.get(s)?.push([d, Math.abs(e ?? 0) / t]);
  }
  /** @type {Map<number, number>} */
  const memo = new Map();
  const visiting = new Set();
  const of = (/** @type {number} */ s) => {
    const known = memo.get(s);
    if (known !== undefined) return known;
    if (visiting.has(s)) return 0;  // a cycle: not a circuit graph (sources sit below destinations)
    visiting.add(s);
    let v = s === target ? 1 : 0;
    for (const [d, share] of out.get(s) ?? []) v += share * of(d);
    visiting.delete(s);
    memo.set(s, v);
    return v;
  };
  return new Map(ids.map((i) => [i, of(i)]));
}

/**
 * The fewest ``units`` whose influence adds up to ``threshold`` of theirs in total (ties: the lower id), as
 * ``dpa.circuit.prune_units``; sorted by id.
 * @param {Map<number, number>} infl
 * @param {number[]} units
 * @param {number} threshold
 */
export function pruneUnits(infl, units, threshold) {
  const values = units.map((u) => infl.get(u) ?? 0);
  const total = values.reduce((a, b) => a + b, 0);
  if (!units.length || !(total > 0)) return [];
  const order = units.map((u, k) => k).sort((a, b) => values[b] - values[a] || units[a] - units[b]);
  const kept = [];
  let running = 0;
  for (const k of order) {
    if (running >= threshold * total * (1 - 1e-12)) break;
    kept.push(units[k]);
    running += values[k];
  }
  return kept.sort((a, b) => a - b);
}

/**
 * The graph as ``Circuit.prune(threshold).to_json()`` has it, with the ids of ``data`` kept: the tokens, the
 * kept units and the target; what the dropped units sent to a kept node joins its rest node (``score`` and
 * edge), what a kept node sent to dropped units joins its ``out_rest``; ``influence`` recomputed.
 * @param {GraphData} data
 * @param {number} threshold  in [0, 1]
 * @returns {GraphData}
 */
export function pruneGraph(data, threshold) {
  const nodes = data.nodes;
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const target = /** @type {GraphNode} */ (nodes.find((n) => n.kind === "target"));
  const units = nodes.filter(isUnit).map((n) => n.id);
  const kept = new Set(pruneUnits(influence(nodes.map((n) => n.id), data.edges, target.id), units, threshold));
  const dropped = (/** @type {number} */ id) => isUnit(/** @type {GraphNode} */ (byId.get(id))) && !kept.has(id);
  const keep = (/** @type {GraphNode} */ n) => n.kind === "token" || n.kind === "target" || kept.has(n.id);
  /** @type {Map<number, number>} */
  const restIn = new Map();  // kept destination -> its rest: the rest edge plus the dropped units' edges
  /** @type {Map<number, number>} */
  const outRest = new Map();  // kept node -> what it sent to dropped units
  /** @type {[number, number, number][]} */
  const edges = [];
  for (const [s, d, e] of data.edges) {
    const src = /** @type {GraphNode} */ (byId.get(s));
    const dst = /** @type {GraphNode} */ (byId.get(d));
    if (!keep(dst)) {
      if (keep(src)) outRest.set(s, (outRest.get(s) ?? 0) + e);
    } else if (src.kind === "rest" || dropped(s)) {
      restIn.set(d, (restIn.get(d) ?? 0) + e);
    } else {
      edges.push([s, d, e]);
    }
  }
  const rests = nodes.filter((n) => n.kind === "rest" && n.of !== null && keep(/** @type {GraphNode} */ (byId.get(n.of))));
  for (const r of rests) {
    const v = restIn.get(/** @type {number} */ (r.of)) ?? 0;
    if (v !== 0) edges.push([r.id, /** @type {number} */ (r.of), v]);
  }
  const out = [...nodes.filter(keep).map((n) => ({ ...n, out_rest: (n.out_rest ?? 0) + (outRest.get(n.id) ?? 0) })),
    ...rests.map((r) => ({ ...r, score: restIn.get(/** @type {number} */ (r.of)) ?? 0 }))];
  const infl = influence(out.map((n) => n.id), edges, target.id);
  return { ...data, nodes: out.map((n) => ({ ...n, influence: infl.get(n.id) ?? 0 })), edges };
}

/**
 * A node's flows in ``graph``: its incoming and outgoing edges (rest edges apart) by |effect|, the top ``k`` of
 * each, and the terms its score is made of: score = sum of in-flow + rest + bias_in + in_gap.
 * @param {GraphData} graph
 * @param {number} id
 * @param {number} [k]
 */
export function nodeFlows(graph, id, k = 8) {
  const byId = new Map(graph.nodes.map((n) => [n.id, n]));
  const node = /** @type {GraphNode} */ (byId.get(id));
  /** @type {{source: number, destination: number, effect: number}[]} */
  const incoming = [], outgoing = [];
  let rest = 0;
  for (const [s, d, e] of graph.edges) {
    if (d === id && byId.get(s)?.kind === "rest") rest += e;
    else if (d === id) incoming.push({ source: s, destination: d, effect: e });
    else if (s === id) outgoing.push({ source: s, destination: d, effect: e });
  }
  const byAbs = (/** @type {{effect: number}} */ a, /** @type {{effect: number}} */ b) => Math.abs(b.effect) - Math.abs(a.effect);
  incoming.sort(byAbs);
  outgoing.sort(byAbs);
  const sum = (/** @type {{effect: number}[]} */ list) => list.reduce((a, c) => a + c.effect, 0);
  return {
    node, rest, inSum: sum(incoming), outSum: sum(outgoing), nIn: incoming.length, nOut: outgoing.length,
    incoming: incoming.slice(0, k), outgoing: outgoing.slice(0, k),
  };
}

// ---------------------------------------------------------------- layout and edge geometry

/** Sizes of the drawing, in px; any of them can be passed to graphLayout. */
export const GRAPH = {
  charW: 6.2,       // a character of the 10 px labels
  pad: 8,           // around a label in its box
  unitH: 16, unitMinW: 22, unitGap: 4,
  colGap: 6, minCol: 14,
  rowPitch: 44,     // a row with units (the edges run through the space above its boxes)
  emptyRow: 6,      // a layer's attention or MLP with no unit drawn
  left: 70, top: 8, right: 10,
  tokenH: 16, dot: 10, maxLabel: 12,
  maxWidth: 1100,   // token labels stand level under their columns up to this width, else slant
};

/** Which row a node sits in: -1 tokens, 2 * layer for a head, 2 * layer + 1 for a neuron or an expert (the
 * layer's MLP), Infinity the target. */
export function rowOf(/** @type {GraphNode} */ node) {
  if (node.kind === "head") return 2 * /** @type {number} */ (node.layer);
  if (isUnit(node)) return 2 * /** @type {number} */ (node.layer) + 1;
  return node.kind === "token" ? -1 : Infinity;
}

/** The text in a unit's box: "H3", "N1066", "E2" (its layer is the row, its position the column). */
export function unitText(/** @type {GraphNode} */ node) {
  return `${UNIT_LETTER[/** @type {keyof UNIT_LETTER} */ (node.kind)]}${node.index}`;
}

/** What the target node says: "·Mary", "·Mary − ·John", "vector". @param {GraphData} data */
export function targetText(data) {
  const t = data.target;
  const tok = t.token === null || t.token === undefined ? "vector" : tokenLabel(t.token);
  return t.contrast === null || t.contrast === undefined ? tok : `${tok} − ${tokenLabel(t.contrast)}`;
}

/**
 * How a node is named in text: "L2.H1@5 ·John", "tok5 ·John", "target ·Mary".
 * @param {GraphData} data @param {GraphNode} node
 */
export function nodeName(data, node) {
  if (node.kind === "target") return `target ${targetText(data)}`;
  if (node.kind === "rest") return `rest of ${node.label.slice(5)}`;
  const tok = node.position === null ? null : data.tokens[node.position];
  return tok === null || tok === undefined ? node.label : `${node.label} ${shortLabel(tokenLabel(tok), 14)}`;
}

/** @param {string} text @param {typeof GRAPH} S */
function textWidth(text, S) {
  return [...text].length * S.charW + S.pad;
}

/** @param {GraphNode} node @param {typeof GRAPH} S */
function unitWidth(node, S) {
  return Math.max(S.unitMinW, textWidth(unitText(node), S));
}

/** @param {GraphNode[]} list @param {typeof GRAPH} S */
function cellWidth(list, S) {
  return list.reduce((a, n) => a + unitWidth(n, S), 0) + S.unitGap * Math.max(0, list.length - 1);
}

/**
 * One column per position: as wide as its widest cell (the units of one row at that position), or its token
 * label when every label fits in ``maxWidth`` ("level" labels), else the labels slant under narrow columns.
 * @param {GraphData} data @param {GraphNode[]} units @param {typeof GRAPH} S
 */
function graphColumns(data, units, S) {
  const need = data.tokens.map(() => S.minCol);
  /** @type {Map<string, GraphNode[]>} */
  const cells = new Map();
  for (const u of units) {
    const key = `${rowOf(u)}:${u.position}`;
    if (!cells.has(key)) cells.set(key, []);
    /** @type {GraphNode[]} */ (cells.get(key)).push(u);
  }
  for (const list of cells.values()) {
    list.sort((a, b) => /** @type {number} */ (a.index) - /** @type {number} */ (b.index));
    const p = list[0].position;
    if (p !== null && p < need.length) need[p] = Math.max(need[p], cellWidth(list, S));
  }
  const labels = data.tokens.map((t) => shortLabel(tokenLabel(t), S.maxLabel));
  const labelW = labels.map((t) => textWidth(t, S));
  const levelW = need.reduce((a, w, p) => a + Math.max(w, labelW[p]) + S.colGap, 0);
  const level = S.left + levelW + S.right <= S.maxWidth;
  const widths = need.map((w, p) => (level ? Math.max(w, labelW[p]) : w));
  let x = S.left;
  const xs = widths.map((w) => { const at = x; x += w + S.colGap; return at; });
  return { xs, widths, level, labels, labelW, cells, right: x - S.colGap };
}

/**
 * The rows from the top: the target, then each layer's MLP and attention (the highest layer first), then the
 * tokens. A row with no unit is a thin band, so the layers stay in order without the empty ones taking room.
 * @param {number} nRows @param {GraphNode[]} units @param {typeof GRAPH} S
 */
function graphRows(nRows, units, S) {
  const used = new Set(units.map(rowOf));
  const rows = [{ row: Infinity, y: S.top, h: S.rowPitch, used: true, label: "target" }];
  let y = S.top + S.rowPitch;
  for (let r = nRows - 1; r >= 0; r--) {
    const h = used.has(r) ? S.rowPitch : S.emptyRow;
    rows.push({ row: r, y, h, used: used.has(r), label: `L${r >> 1} ${r % 2 ? "MLP" : "attn"}` });
    y += h;
  }
  rows.push({ row: -1, y, h: S.rowPitch, used: true, label: "tokens" });
  return rows;
}

/**
 * Where every node of ``graph`` (rest nodes apart) is drawn: a box per node id, the rows (with their labels)
 * and the columns, and the size of the picture.
 * @param {GraphData} graph
 * @param {Partial<typeof GRAPH>} [sizes]
 */
export function graphLayout(graph, sizes = {}) {
  const S = { ...GRAPH, ...sizes };
  const shown = graph.nodes.filter((n) => n.kind !== "rest");
  const units = shown.filter(isUnit);
  const nRows = units.length ? 2 * Math.max(...units.map((n) => /** @type {number} */ (n.layer))) + 2 : 0;
  const cols = graphColumns(graph, graph.positions ? units : [], S);
  const rows = graphRows(nRows, units, S);
  const rowY = new Map(rows.map((r) => [r.row, r.y + (r.h - S.unitH) / 2]));
  /** @type {Map<number, {x: number, y: number, w: number, h: number}>} */
  const boxes = new Map();
  let right = cols.right;
  if (graph.positions) {
    for (const list of cols.cells.values()) {
      const p = /** @type {number} */ (list[0].position);
      placeRow(boxes, list, cols.xs[p] + (cols.widths[p] - cellWidth(list, S)) / 2, /** @type {number} */ (rowY.get(rowOf(list[0]))), S);
    }
  } else {
    /** @type {Map<number, GraphNode[]>} */
    const byRow = new Map();
    for (const u of units) byRow.set(rowOf(u), [...(byRow.get(rowOf(u)) ?? []), u]);
    const widest = Math.max(0, ...[...byRow.values()].map((l) => cellWidth(l, S)));
    right = Math.max(right, S.left + widest);
    for (const [r, list] of byRow) {
      list.sort((a, b) => /** @type {number} */ (a.index) - /** @type {number} */ (b.index));
      placeRow(boxes, list, S.left + (right - S.left - cellWidth(list, S)) / 2, /** @type {number} */ (rowY.get(r)), S);
    }
  }
  const tokenY = /** @type {number} */ (rowY.get(-1));
  placeTokens(boxes, shown, cols, tokenY, S);
  const width = right + S.right;
  placeTarget(boxes, graph, cols, width, S);
  const slant = cols.level ? 0 : Math.max(0, ...cols.labels.map((t, p) => textWidth(`${p} ${t}`, S))) * Math.SQRT1_2 + 4;
  const height = tokenY + S.tokenH + 4 + slant + 4;
  return { boxes, rows, columns: cols, width, height, level: cols.level, tokenY, sizes: S };
}

/**
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes
 * @param {GraphNode[]} list @param {number} x @param {number} y @param {typeof GRAPH} S
 */
function placeRow(boxes, list, x, y, S) {
  for (const n of list) {
    const w = unitWidth(n, S);
    boxes.set(n.id, { x, y, w, h: S.unitH });
    x += w + S.unitGap;
  }
}

/**
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes @param {GraphNode[]} shown
 * @param {ReturnType<typeof graphColumns>} cols @param {number} y @param {typeof GRAPH} S
 */
function placeTokens(boxes, shown, cols, y, S) {
  for (const n of shown) {
    if (n.kind !== "token" || n.position === null || n.position >= cols.xs.length) continue;
    const p = n.position;
    const w = cols.level ? cols.labelW[p] : Math.min(S.dot, cols.widths[p]);
    const h = cols.level ? S.tokenH : S.dot;
    boxes.set(n.id, { x: cols.xs[p] + (cols.widths[p] - w) / 2, y: y + (S.unitH - h) / 2, w, h });
  }
}

/**
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes @param {GraphData} graph
 * @param {ReturnType<typeof graphColumns>} cols @param {number} width @param {typeof GRAPH} S
 */
function placeTarget(boxes, graph, cols, width, S) {
  const t = graph.nodes.find((n) => n.kind === "target");
  if (!t) return;
  const w = textWidth(`target ${targetText(graph)}`, S);
  const p = graph.target.position;
  const centre = graph.positions && p >= 0 && p < cols.xs.length ? cols.xs[p] + cols.widths[p] / 2 : (S.left + width) / 2;
  const x = Math.max(S.left, Math.min(width - S.right - w, centre - w / 2));
  boxes.set(t.id, { x, y: S.top + (S.rowPitch - S.unitH) / 2, w, h: S.unitH });
}

/** @param {number} v */
const px = (v) => Math.round(v * 10) / 10;

/**
 * The edge from a source (below) to a destination (above) as an SVG path: a cubic from the top middle of the
 * source's box to the bottom middle of the destination's, leaving and arriving vertically.
 * @param {{x: number, y: number, w: number, h: number}} from
 * @param {{x: number, y: number, w: number, h: number}} to
 */
export function edgePath(from, to) {
  const x1 = from.x + from.w / 2, y1 = from.y, x2 = to.x + to.w / 2, y2 = to.y + to.h;
  const mid = (y1 + y2) / 2;
  return `M${px(x1)},${px(y1)} C${px(x1)},${px(mid)} ${px(x2)},${px(mid)} ${px(x2)},${px(y2)}`;
}

/** The midpoint of edgePath(from, to) (the cubic at t = 1/2). @param {{x: number, y: number, w: number, h: number}} from @param {{x: number, y: number, w: number, h: number}} to */
export function edgeMidpoint(from, to) {
  return { x: (from.x + from.w / 2 + to.x + to.w / 2) / 2, y: (from.y + to.y + to.h) / 2 };
}

/** An edge's stroke width: 0.6 px at zero to 6 px at the largest |effect|. @param {number} effect @param {number} max */
export function edgeWidth(effect, max) {
  return px(0.6 + 5.4 * Math.min(1, Math.abs(effect) / (max > 0 ? max : 1)));
}

/**
 * The edges drawn: between drawn nodes (no rest edge), |effect| at least ``minEdge`` of the largest, weakest
 * first (so the strong ones are drawn on top); and that largest |effect| (the colour scale's end).
 * @param {GraphData} graph @param {number} minEdge
 */
export function drawnEdges(graph, minEdge) {
  const rest = new Set(graph.nodes.filter((n) => n.kind === "rest").map((n) => n.id));
  const real = graph.edges.filter(([s, , e]) => !rest.has(s) && Number.isFinite(e) && e !== 0);
  const max = symmetricMax(real.map((e) => e[2]));
  const edges = real.filter(([, , e]) => Math.abs(e) >= minEdge * max).sort((a, b) => Math.abs(a[2]) - Math.abs(b[2]));
  return { edges, max };
}

// ---------------------------------------------------------------- the view

const SVG_TAGS = new Set(["svg", "g", "rect", "text", "path", "title", "line", "tspan"]);

/**
 * @param {string} tag
 * @param {Record<string, any>} [attrs]  "text" sets the text; undefined, null and false are left out
 * @param {(Node | string)[]} [children]
 */
function make(tag, attrs = {}, children = []) {
  const node = SVG_TAGS.has(tag) ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c);
  return node;
}

const GRAPH_CSS = `
.dpa-graph { --g-fg: var(--jp-ui-font-color1, #1f1f1f); --g-muted: var(--jp-ui-font-color2, #616161);
  --g-border: var(--jp-border-color2, #d5d5d5); --g-bg: var(--jp-layout-color0, #fff);
  --g-chip: var(--jp-layout-color2, #eee); --g-accent: var(--jp-brand-color1, #1976d2);
  font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 12px; color: var(--g-fg);
  display: flex; flex-direction: column; gap: 4px; min-width: 0; }
.dpa-graph-toolbar { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: center; }
.dpa-graph-toolbar input[type=range] { width: 140px; vertical-align: middle; }
.dpa-graph-muted { color: var(--g-muted); }
.dpa-graph-legends { display: inline-flex; flex-wrap: wrap; gap: 4px 14px; }
.dpa-graph-legend { display: inline-flex; gap: 4px; align-items: center; color: var(--g-muted); font-size: 11px; }
.dpa-graph-legend-bar { display: inline-block; width: 70px; height: 9px; border: 1px solid var(--g-border); }
.dpa-graph-body { display: flex; flex-wrap: wrap; gap: 6px; align-items: flex-start; }
.dpa-graph-scroll { flex: 1 1 480px; min-width: 0; max-width: max-content; max-height: 720px; overflow: auto;
  border: 1px solid var(--g-border); border-radius: 4px; background: var(--g-bg); }
.dpa-graph-canvas { display: grid; width: max-content; }
.dpa-graph-canvas > svg { grid-area: 1 / 1; display: block; }
.dpa-graph-rows { position: sticky; left: 0; z-index: 1; pointer-events: none; }
.dpa-graph-axis { fill: var(--g-muted); font-size: 10px; }
.dpa-graph-toklabel { fill: var(--g-fg); font-size: 10px; font-family: var(--jp-code-font-family, monospace); }
.dpa-graph-toklabel.dpa-graph-at-target { font-weight: 700; }
.dpa-graph-node { cursor: pointer; }
.dpa-graph-node rect { stroke: var(--g-muted); stroke-width: 0.6; }
.dpa-graph-node text { font-size: 10px; pointer-events: none; font-family: var(--jp-code-font-family, monospace); }
.dpa-graph-node.dpa-graph-target rect { stroke: var(--g-fg); stroke-width: 1.2; }
.dpa-graph-node.dpa-graph-selected rect { stroke: var(--g-fg); stroke-width: 2.5; }
.dpa-graph-edge { fill: none; pointer-events: none; stroke-linecap: round; }
.dpa-graph-hit { fill: none; stroke: transparent; pointer-events: stroke; cursor: pointer; }
.dpa-graph-halo { fill: none; stroke: var(--g-fg); pointer-events: none; stroke-linecap: round; }
.dpa-graph-focus .dpa-graph-edge:not(.dpa-graph-lit) { opacity: 0.06; }
.dpa-graph-focus .dpa-graph-node:not(.dpa-graph-lit) { opacity: 0.3; }
.dpa-graph-check { fill: var(--g-fg); font-size: 10px; paint-order: stroke; stroke: var(--g-bg); stroke-width: 3px; }
.dpa-graph-panel { flex: 1 1 280px; max-width: 440px; min-width: 220px; border: 1px solid var(--g-border);
  border-radius: 4px; padding: 4px 6px; background: var(--g-bg); box-sizing: border-box; }
.dpa-graph-title { font-weight: 600; margin: 2px 0 4px; word-break: break-all; }
.dpa-graph-subtitle { font-weight: 600; margin: 4px 0 2px; }
.dpa-graph-terms { display: grid; grid-template-columns: auto auto; gap: 0 10px; margin: 2px 0 6px; }
.dpa-graph-terms span:nth-child(2n) { text-align: right; font-family: var(--jp-code-font-family, monospace); }
.dpa-graph-flows { margin: 2px 0 6px; }
.dpa-graph-flow { display: flex; gap: 6px; align-items: center; padding: 0 3px; border-radius: 3px; cursor: pointer;
  font-family: var(--jp-code-font-family, monospace); white-space: nowrap; }
.dpa-graph-flow:hover, .dpa-graph-flow.dpa-graph-selected { background: var(--g-chip); }
.dpa-graph-flow .dpa-graph-num { margin-left: auto; }
.dpa-graph-swatch { display: inline-block; flex: none; width: 10px; height: 10px; border: 1px solid var(--g-border); }
.dpa-graph button { font: inherit; color: var(--g-fg); background: var(--g-chip); border: 1px solid var(--g-border);
  border-radius: 3px; padding: 1px 6px; cursor: pointer; }
.dpa-graph button:disabled { opacity: 0.5; cursor: default; }
.dpa-graph-reason { color: var(--g-muted); font-size: 11px; border-left: 3px solid var(--g-accent); padding: 0 5px; margin: 3px 0; }
.dpa-graph-result { margin: 3px 0; }
.dpa-graph-hover { min-height: 1.3em; color: var(--g-muted); font-family: var(--jp-code-font-family, monospace);
  white-space: pre; overflow: hidden; text-overflow: ellipsis; }
`;

/** The reason the verify button is off on a page with no kernel (the CLI's page, a saved widget). */
export const STATIC_VERIFY_REASON = "static page: verifying an edge runs the model (path patching) — in Python, " +
  "circuit.verify(model, tokenizer, (source, destination)), or CircuitWidget with the model in a running notebook";

/**
 * Draw ``data`` (Circuit.to_json()) into ``el`` (its content replaced): toolbar with the pruning slider and the
 * colour legends, the SVG, the side panel of the selected node or edge, and a hover line.
 * @param {HTMLElement} el
 * @param {GraphData} data
 * @param {GraphOptions} [options]
 * @returns {{update: (options: GraphOptions) => void, destroy: () => void, readonly graph: GraphData,
 *   readonly layout: ReturnType<typeof graphLayout>, readonly renderMs: number}}
 */
export function renderGraph(el, data, options = {}) {
  const g = graphState(el, data);
  graphFrame(g);
  el.replaceChildren(g.root);
  graphOptions(g, options, true);
  return {
    update: (/** @type {GraphOptions} */ o) => graphOptions(g, o, false),
    destroy: () => { g.destroyed = true; g.root.remove(); },
    get graph() { return /** @type {GraphData} */ (g.pruned); },
    get layout() { return /** @type {ReturnType<typeof graphLayout>} */ (g.layout); },
    get renderMs() { return g.renderMs; },
  };
}

/** @param {HTMLElement} el @param {GraphData} data */
function graphState(el, data) {
  return {
    el, data, root: /** @type {HTMLElement} */ (make("div", { class: "dpa-graph" })),
    /** @type {GraphOptions} */ opts: {},
    threshold: 1, minEdge: 0.01,
    /** @type {string | null} */ selected: null,
    /** @type {[string, string] | null} */ selectedEdge: null,
    /** @type {number | null} */ hovered: null,
    /** @type {GraphData | null} */ pruned: null,
    /** @type {ReturnType<typeof graphLayout> | null} */ layout: null,
    /** @type {Map<number, GraphNode>} */ byId: new Map(),
    /** @type {Map<string, number>} */ byLabel: new Map(),
    /** @type {Map<number, Element>} */ nodeEls: new Map(),
    /** @type {Map<string, Element>} */ edgeEls: new Map(),
    /** @type {Map<number, {edges: string[], nodes: number[]}>} */ adj: new Map(),
    /** @type {Element[]} */ lit: [],
    /** @type {Element | null} */ svg: null, /** @type {Element | null} */ halo: null,
    /** @type {Record<string, HTMLElement>} */ parts: {},
    unitCount: 0, drawnEdges: 0, renderMs: 0, nodeMax: 1, edgeMax: 1, scrolled: false, destroyed: false,
  };
}

/** @typedef {ReturnType<typeof graphState>} GraphState */

/** A colour legend: label, -max, the scale, +max. @param {string} label @param {number} max */
function gradientLegend(label, max) {
  const stops = DIVERGING.map((c, i) => `rgb(${c.join(",")}) ${(i / (DIVERGING.length - 1) * 100).toFixed(0)}%`);
  return make("span", { class: "dpa-graph-legend", title: "symmetric scale, white at zero (logit units)" }, [
    make("span", { text: label }), make("span", { text: formatScore(-max) }),
    make("span", { class: "dpa-graph-legend-bar", style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
    make("span", { text: formatScore(max) })]);
}

/** The fixed parts: style, toolbar (slider, counts, legends), scroll area, panel, hover line. @param {GraphState} g */
function graphFrame(g) {
  const slider = /** @type {HTMLInputElement} */ (make("input", { type: "range", min: 0, max: 1, step: 0.01,
    class: "dpa-graph-threshold", title: "keep the fewest heads and neurons whose influence on the target adds up " +
      "to this share of all of theirs (Circuit.prune)" }));
  slider.addEventListener("input", () => { g.threshold = Number(slider.value); graphRedraw(g); });
  slider.addEventListener("change", () => g.opts.onThreshold?.(Number(slider.value)));
  const p = {
    slider, sliderText: make("span", { class: "dpa-graph-kept" }), legends: make("span", { class: "dpa-graph-legends" }),
    scroll: make("div", { class: "dpa-graph-scroll", "data-scroll": "graph" }),
    panel: make("div", { class: "dpa-graph-panel" }), hover: make("div", { class: "dpa-graph-hover", text: " " }),
  };
  g.parts = /** @type {Record<string, HTMLElement>} */ (p);
  const toolbar = make("div", { class: "dpa-graph-toolbar" }, [
    make("label", {}, ["prune ", slider]), p.sliderText, p.legends]);
  g.root.replaceChildren(make("style", { text: GRAPH_CSS }), toolbar,
    make("div", { class: "dpa-graph-body" }, [p.scroll, p.panel]), p.hover);
  graphEvents(g);
}

/**
 * Take the options: a new graph or threshold redraws the SVG; a selection or a verification only the
 * highlight and the panel.
 * @param {GraphState} g @param {GraphOptions} o @param {boolean} first
 */
function graphOptions(g, o, first) {
  let redraw = first;
  if (o.data && o.data !== g.data) { g.data = o.data; redraw = true; }
  if (typeof o.threshold === "number" && Number.isFinite(o.threshold)) {
    const t = Math.max(0, Math.min(1, o.threshold));
    if (t !== g.threshold) { g.threshold = t; redraw = true; }
  }
  if (typeof o.minEdge === "number" && o.minEdge !== g.minEdge) { g.minEdge = o.minEdge; redraw = true; }
  if (o.maxWidth !== undefined && o.maxWidth !== g.opts.maxWidth) redraw = true;
  if ("selected" in o) g.selected = o.selected || null;
  if ("selectedEdge" in o) g.selectedEdge = o.selectedEdge && o.selectedEdge.length === 2 ? o.selectedEdge : null;
  const verifiedBefore = g.opts.verified;
  g.opts = { ...g.opts, ...o };
  delete g.opts.data;
  if (redraw || g.opts.verified !== verifiedBefore) graphRedraw(g);
  else { graphHighlight(g); graphPanel(g); }
}

/** Prune, lay out and draw the SVG again, then the highlight and the panel. @param {GraphState} g */
function graphRedraw(g) {
  const t0 = clock();
  g.byId = new Map(g.data.nodes.map((n) => [n.id, n]));
  g.byLabel = new Map(g.data.nodes.map((n) => [n.label, n.id]));
  g.pruned = pruneGraph(g.data, g.threshold);
  g.layout = graphLayout(g.pruned, g.opts.maxWidth ? { maxWidth: g.opts.maxWidth } : {});
  const canvas = graphSvg(g, g.pruned, g.layout);
  g.parts.scroll.replaceChildren(canvas);
  g.svg = canvas.querySelector(".dpa-graph-svg");
  /** @type {HTMLInputElement} */ (g.parts.slider).value = String(g.threshold);
  const all = g.data.nodes.filter(isUnit).length;
  g.unitCount = g.pruned.nodes.filter(isUnit).length;
  g.parts.sliderText.textContent = `${Math.round(g.threshold * 100)}% of the units' influence on the target: ${g.unitCount} of ` +
    `${all} units · ${g.drawnEdges} edges drawn (|effect| ≥ ${Math.round(g.minEdge * 100)}% of the largest)`;
  g.parts.legends.replaceChildren(gradientLegend("node score", g.nodeMax), gradientLegend("edge effect", g.edgeMax));
  graphHighlight(g);
  graphPanel(g);
  if (!g.scrolled) {  // first drawing: bring the target's column into view (the page may lay it out later)
    g.scrolled = true;
    scrollWhenLaidOut(g, 40, 0);
  } else scrollToTarget(g, false);  // pruned or new data: the columns moved
  g.renderMs = clock() - t0;
  g.root.setAttribute("data-render-ms", g.renderMs.toFixed(1));
}

/**
 * The first scroll to the target, once the page has laid the drawing out (a notebook output may be attached
 * later than it is drawn): after ``delay`` ms, then every 50 ms, ``tries`` times at most.
 * @param {GraphState} g @param {number} tries @param {number} delay
 */
function scrollWhenLaidOut(g, tries, delay) {
  setTimeout(() => {
    if (g.destroyed) return;
    if (g.parts.scroll.clientWidth) scrollToTarget(g, true);
    else if (tries > 1) scrollWhenLaidOut(g, tries - 1, 50);
  }, delay);
}

/**
 * Scroll the drawing sideways so that the target (and the units at its position) is in view: on the first
 * drawing unless already scrolled, later only when it went out of view.
 * @param {GraphState} g @param {boolean} first
 */
function scrollToTarget(g, first) {
  const sc = g.parts.scroll;
  const t = g.pruned?.nodes.find((n) => n.kind === "target");
  const box = t && g.layout?.boxes.get(t.id);
  if (!box || !sc.clientWidth || (first && sc.scrollLeft !== 0)) return;
  if (box.x >= sc.scrollLeft && box.x + box.w <= sc.scrollLeft + sc.clientWidth) return;
  sc.scrollLeft = Math.max(0, box.x + box.w / 2 - sc.clientWidth * 0.6);
}

const clock = () => (typeof performance !== "undefined" ? performance.now() : Date.now());

/**
 * The SVG: row labels, edges (a visible path and a wider transparent one to click), nodes, verified-edge marks.
 * @param {GraphState} g @param {GraphData} graph @param {ReturnType<typeof graphLayout>} lay
 */
function graphSvg(g, graph, lay) {
  const svg = make("svg", { class: "dpa-graph-svg", width: Math.ceil(lay.width), height: Math.ceil(lay.height),
    viewBox: `0 0 ${Math.ceil(lay.width)} ${Math.ceil(lay.height)}`, role: "img",
    "aria-label": `circuit graph: ${g.unitCount} units` });
  const { edges, max } = drawnEdges(graph, g.minEdge);
  g.drawnEdges = edges.length;
  g.edgeMax = max;
  g.halo = make("path", { class: "dpa-graph-halo", d: "", visibility: "hidden" });
  const edgeLayer = make("g", { class: "dpa-graph-edges" }, [g.halo]);
  const hitLayer = make("g", { class: "dpa-graph-hits" });
  g.edgeEls = new Map();
  g.adj = new Map(graph.nodes.map((n) => [n.id, { edges: [], nodes: [] }]));
  for (const [s, d, e] of edges) {
    const a = lay.boxes.get(s), b = lay.boxes.get(d);
    if (!a || !b) continue;
    const key = edgeKey(/** @type {GraphNode} */ (g.byId.get(s)).label, /** @type {GraphNode} */ (g.byId.get(d)).label);
    const path = edgePath(a, b);
    const el = make("path", { class: "dpa-graph-edge", d: path, stroke: divergingColor(e, max),
      "stroke-width": edgeWidth(e, max), "data-edge": key });
    edgeLayer.append(el);
    hitLayer.append(make("path", { class: "dpa-graph-hit", d: path, "stroke-width": Math.max(7, edgeWidth(e, max) + 4),
      "data-edge": key }, [make("title", { text: `${key.replace("->", " → ")}: ${formatScore(e)}` })]));
    g.edgeEls.set(key, el);
    g.adj.get(s)?.edges.push(key); g.adj.get(s)?.nodes.push(d);
    g.adj.get(d)?.edges.push(key); g.adj.get(d)?.nodes.push(s);
  }
  svg.append(edgeLayer, hitLayer, graphNodes(g, graph, lay), graphChecks(g, lay));
  return make("div", { class: "dpa-graph-canvas" }, [svg, rowLabels(lay)]);
}

/** The row labels ("L3 attn", "L3 MLP", "tokens", "target") on a strip that stays at the left while the
 * drawing scrolls sideways. @param {ReturnType<typeof graphLayout>} lay */
function rowLabels(lay) {
  const w = lay.sizes.left - 6, hgt = Math.ceil(lay.height);
  const strip = make("svg", { class: "dpa-graph-rows", width: w, height: hgt, viewBox: `0 0 ${w} ${hgt}` }, [
    make("rect", { x: 0, y: 0, width: w, height: hgt, style: "fill: var(--g-bg); opacity: 0.85" })]);
  for (const r of lay.rows) {
    if (r.used) strip.append(make("text", { class: "dpa-graph-axis", x: 4, y: px(r.y + r.h / 2 + 3.5), text: r.label }));
  }
  return strip;
}

/** The node boxes, and the token labels under them. @param {GraphState} g @param {GraphData} graph @param {ReturnType<typeof graphLayout>} lay */
function graphNodes(g, graph, lay) {
  const layer = make("g", { class: "dpa-graph-nodes" });
  const scored = graph.nodes.filter((n) => isUnit(n) || n.kind === "token");
  const max = symmetricMax(scored.map((n) => n.score ?? NaN));
  g.nodeMax = max;
  g.nodeEls = new Map();
  for (const n of graph.nodes) {
    const box = lay.boxes.get(n.id);
    if (!box) continue;
    const v = n.score ?? NaN;
    const target = n.kind === "target";
    const fill = target ? null : divergingColor(v, max);
    const text = target ? `target ${targetText(graph)}` : isUnit(n) ? unitText(n) :
      lay.level ? lay.columns.labels[/** @type {number} */ (n.position)] : "";
    const el = make("g", { class: `dpa-graph-node dpa-graph-${n.kind}`, "data-id": n.id, "data-label": n.label }, [
      make("rect", { x: px(box.x), y: px(box.y), width: px(box.w), height: px(box.h), rx: n.kind === "head" ? 8 : 2, fill,
        style: target ? "fill: var(--g-chip)" : null }),
      ...(text ? [make("text", { x: px(box.x + box.w / 2), y: px(box.y + box.h / 2 + 3.5), "text-anchor": "middle",
        fill: target ? "currentColor" : textColor(v, max), text })] : []),
      make("title", { text: `${nodeName(graph, n)}: score ${formatScore(n.score)} · influence ${(n.influence ?? 0).toFixed(3)}` }),
    ]);
    layer.append(el);
    g.nodeEls.set(n.id, el);
    if (n.kind === "token" && !lay.level) layer.append(slantedLabel(graph, lay, n, box));
  }
  return layer;
}

/** A token's label slanting down from under its dot (columns too narrow for level labels). */
function slantedLabel(/** @type {GraphData} */ graph, /** @type {ReturnType<typeof graphLayout>} */ lay,
  /** @type {GraphNode} */ n, /** @type {{x: number, y: number, w: number, h: number}} */ box) {
  const x = px(box.x + box.w / 2 - 3), y = px(lay.tokenY + lay.sizes.unitH + 6);
  const p = /** @type {number} */ (n.position);
  return make("text", { class: "dpa-graph-toklabel" + (p === graph.target.position ? " dpa-graph-at-target" : ""),
    x, y, transform: `rotate(45 ${x} ${y})`, text: `${p} ${lay.columns.labels[p]}` });
}

/** "✓ ratio" marks at the middle of the verified edges drawn. @param {GraphState} g @param {ReturnType<typeof graphLayout>} lay */
function graphChecks(g, lay) {
  const layer = make("g", { class: "dpa-graph-checks" });
  for (const [key, v] of Object.entries(g.opts.verified ?? {})) {
    const [s, d] = [g.byLabel.get(v.source), g.byLabel.get(v.destination)];
    if (!g.edgeEls.has(key) || s === undefined || d === undefined) continue;
    const a = lay.boxes.get(s), b = lay.boxes.get(d);
    if (!a || !b) continue;
    const at = edgeMidpoint(a, b);
    layer.append(make("text", { class: "dpa-graph-check", x: px(at.x + 4), y: px(at.y), "data-edge": key,
      text: `✓ ${ratioText(v.ratio)}` }));
  }
  return layer;
}

/** @param {number | null | undefined} r */
function ratioText(r) {
  return r === null || r === undefined || !Number.isFinite(r) ? "ratio –" : `×${r.toFixed(2)}`;
}

/** Hover, click and leave, delegated from the scroll area (one listener each, however many edges). @param {GraphState} g */
function graphEvents(g) {
  const scroll = g.parts.scroll;
  const hit = (/** @type {Event} */ ev) => {
    const t = /** @type {Element | null} */ (ev.target);
    const node = t?.closest?.("[data-id]");
    if (node) return { id: Number(node.getAttribute("data-id")) };
    const edge = t?.closest?.("[data-edge]");
    return edge ? { edge: /** @type {string} */ (edge.getAttribute("data-edge")) } : {};
  };
  scroll.addEventListener("mouseover", (ev) => {
    const h = hit(ev);
    if (h.id !== undefined) graphHover(g, h.id);
    else if (h.edge) { graphHover(g, null); hoverText(g, edgeHoverText(g, h.edge)); }
    else graphHover(g, null);
  });
  scroll.addEventListener("mouseleave", () => graphHover(g, null));
  scroll.addEventListener("click", (ev) => {
    const h = hit(ev);
    if (h.id !== undefined) selectNode(g, /** @type {GraphNode} */ (g.byId.get(h.id)).label);
    else if (h.edge) selectEdge(g, /** @type {[string, string]} */ (h.edge.split("->")));
    else { selectNode(g, null); selectEdge(g, null); }
  });
}

/** @param {GraphState} g @param {string} text */
function hoverText(g, text) {
  g.parts.hover.textContent = text || " ";
}

/** @param {GraphState} g @param {string} key */
function edgeHoverText(g, key) {
  const [s, d] = key.split("->");
  const e = g.pruned?.edges.find(([a, b]) => g.byId.get(a)?.label === s && g.byId.get(b)?.label === d);
  return `edge ${s} → ${d}: ${formatScore(e ? e[2] : NaN)} (click to select)`;
}

/** @param {GraphState} g @param {number | null} id */
function graphHover(g, id) {
  if (id === g.hovered) return;
  g.hovered = id;
  graphHighlight(g);
  const n = id === null ? null : g.byId.get(id);
  if (n && g.pruned) {
    const f = nodeFlows(g.pruned, n.id, 0);
    hoverText(g, `${nodeName(g.pruned, n)}: score ${formatScore(n.score)} · ${f.nIn} inputs, ${f.nOut} outputs · ` +
      `influence ${(g.pruned.nodes.find((m) => m.id === n.id)?.influence ?? 0).toFixed(3)}`);
  } else hoverText(g, "");
  g.opts.onHover?.(n ? n.label : null);
}

/** @param {GraphState} g @param {string | null} label */
function selectNode(g, label) {
  const next = label === g.selected ? null : label;
  g.selected = next;
  graphHighlight(g);
  graphPanel(g);
  g.opts.onSelect?.(next);
}

/** @param {GraphState} g @param {[string, string] | null} edge */
function selectEdge(g, edge) {
  const same = edge && g.selectedEdge && edge[0] === g.selectedEdge[0] && edge[1] === g.selectedEdge[1];
  g.selectedEdge = same ? null : edge;
  graphHighlight(g);
  graphPanel(g);
  g.opts.onSelectEdge?.(g.selectedEdge);
}

/**
 * Light the hovered node (else the selected one) with its edges and neighbours, dim the rest; mark the
 * selected node and draw the halo behind the selected edge.
 * @param {GraphState} g
 */
function graphHighlight(g) {
  for (const el of g.lit) el.classList.remove("dpa-graph-lit", "dpa-graph-selected");
  g.lit = [];
  const mark = (/** @type {Element | undefined} */ el, /** @type {string} */ cls) => {
    if (el) { el.classList.add(cls); g.lit.push(el); }
  };
  const sel = g.selected === null ? undefined : g.byLabel.get(g.selected);
  const focus = g.hovered ?? (sel !== undefined && g.nodeEls.has(sel) ? sel : null);
  if (focus !== null) {
    mark(g.nodeEls.get(focus), "dpa-graph-lit");
    const adj = g.adj.get(focus);
    for (const k of adj?.edges ?? []) mark(g.edgeEls.get(k), "dpa-graph-lit");
    for (const n of adj?.nodes ?? []) mark(g.nodeEls.get(n), "dpa-graph-lit");
  }
  g.svg?.classList.toggle("dpa-graph-focus", focus !== null);
  if (sel !== undefined) mark(g.nodeEls.get(sel), "dpa-graph-selected");
  const edge = g.selectedEdge ? g.edgeEls.get(edgeKey(...g.selectedEdge)) : undefined;
  if (g.halo) {
    g.halo.setAttribute("visibility", edge ? "visible" : "hidden");
    if (edge) {
      g.halo.setAttribute("d", edge.getAttribute("d") ?? "");
      g.halo.setAttribute("stroke-width", String(Number(edge.getAttribute("stroke-width")) + 3));
      mark(edge, "dpa-graph-lit");
    }
  }
}

// ---------------------------------------------------------------- the side panel

/** The panel: the selected node's flows, the selected edge with its verification, or how to use the view. @param {GraphState} g */
function graphPanel(g) {
  const parts = [];
  const id = g.selected === null ? undefined : g.byLabel.get(g.selected);
  if (id !== undefined) parts.push(...nodePanel(g, id));
  if (g.selectedEdge) parts.push(...edgePanel(g, g.selectedEdge));
  if (!parts.length) {
    parts.push(make("div", { class: "dpa-graph-muted", text: "hover a node to light its inputs and outputs · click a " +
      "node for its in- and out-flows, an edge (or an entry of a node's lists) to select it and verify it" }));
  }
  g.parts.panel.replaceChildren(...parts);
}

/** @param {GraphState} g @param {number} id */
function nodePanel(g, id) {
  const graph = /** @type {GraphData} */ (g.pruned);
  const node = graph.nodes.find((n) => n.id === id);
  const full = /** @type {GraphNode} */ (g.byId.get(id));
  if (!node) {
    return [make("div", { class: "dpa-graph-title", text: nodeName(g.data, full) }),
      make("div", { class: "dpa-graph-muted", text: "pruned away at this threshold: move the slider up to see it" })];
  }
  const f = nodeFlows(graph, id, 8);
  const terms = [["score", node.score]];
  if (node.kind !== "token") {
    terms.push(["in from the nodes drawn", f.inSum], ["rest (units left out)", f.rest], ["bias", node.bias_in],
      ["control paths (in_gap)", node.in_gap]);
  }
  if (node.kind !== "target") terms.push(["out to the nodes drawn", f.outSum], ["out to units left out", node.out_rest]);
  terms.push(["influence on the target", null]);
  const termEls = terms.flatMap(([k, v]) => [make("span", { text: String(k) }),
    make("span", { text: k === "influence on the target" ? (node.influence ?? 0).toFixed(3) : formatScore(/** @type {number} */ (v)) })]);
  const out = [make("div", { class: "dpa-graph-title", text: nodeName(graph, node) }),
    make("div", { class: "dpa-graph-terms" }, termEls)];
  const reads = readPositions(graph, node, 4);
  if (reads) out.push(make("div", { class: "dpa-graph-muted dpa-graph-reads", text: reads }));
  if (node.kind !== "token") out.push(flowList(g, `top inputs (${f.incoming.length} of ${f.nIn})`, f.incoming));
  if (node.kind !== "target") out.push(flowList(g, `top outputs (${f.outgoing.length} of ${f.nOut})`, f.outgoing));
  return out;
}

/** "reads at: 5 ·John +0.31, 1 ·Mary −0.12": the positions its in-flow comes from, by |value| (in_positions). */
function readPositions(/** @type {GraphData} */ graph, /** @type {GraphNode} */ node, /** @type {number} */ k) {
  const by = node.in_positions;
  if (!by || by.length < 2) return "";
  const top = by.map((v, p) => [p, v ?? 0]).filter(([, v]) => v !== 0)
    .sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]) || a[0] - b[0]).slice(0, k);
  return top.length ? "in-flow by the position read: " + top.map(([p, v]) =>
    `${p} ${shortLabel(tokenLabel(graph.tokens[p] ?? ""), 10)} ${formatScore(v)}`).join(", ") : "";
}

/**
 * A clickable list of edges (click: select the edge).
 * @param {GraphState} g @param {string} title @param {{source: number, destination: number, effect: number}[]} list
 */
function flowList(g, title, list) {
  const max = symmetricMax(list.map((c) => c.effect));
  const rows = list.map((c) => {
    const s = /** @type {GraphNode} */ (g.byId.get(c.source)), d = /** @type {GraphNode} */ (g.byId.get(c.destination));
    const other = g.selected === s.label ? d : s;
    const isSel = g.selectedEdge && g.selectedEdge[0] === s.label && g.selectedEdge[1] === d.label;
    const row = make("div", { class: "dpa-graph-flow" + (isSel ? " dpa-graph-selected" : ""), "data-edge": edgeKey(s.label, d.label),
      title: `${s.label} → ${d.label}` }, [
      make("span", { class: "dpa-graph-swatch", style: `background:${divergingColor(c.effect, max)}` }),
      make("span", { text: nodeName(g.data, other) }), make("span", { class: "dpa-graph-num", text: formatScore(c.effect) })]);
    row.addEventListener("click", () => selectEdge(g, [s.label, d.label]));
    return row;
  });
  return make("div", { class: "dpa-graph-flows" }, [make("div", { class: "dpa-graph-muted", text: title }),
    ...(rows.length ? rows : [make("div", { class: "dpa-graph-muted", text: "none" })])]);
}

/** The selected edge: its effect, the verify button (or why it is off) and the path-patching result. @param {GraphState} g @param {[string, string]} edge */
function edgePanel(g, edge) {
  const [s, d] = edge.map((l) => g.byLabel.get(l));
  const key = edgeKey(edge[0], edge[1]);
  const e = g.data.edges.find(([a, b]) => a === s && b === d);
  const name = (/** @type {number | undefined} */ i, /** @type {string} */ l) => (i === undefined ? l : nodeName(g.data, /** @type {GraphNode} */ (g.byId.get(i))));
  const reason = g.opts.onVerify ? (g.opts.verifyReason ?? "") : (g.opts.verifyReason || STATIC_VERIFY_REASON);
  const button = /** @type {HTMLButtonElement} */ (make("button", { class: "dpa-graph-verify", text: "verify",
    disabled: !!reason || !!g.opts.busy, title: reason || "path patching on the real model: remove the source's " +
      "write from the residual stream as the destination reads it, and measure the change of the destination's score" }));
  button.addEventListener("click", () => g.opts.onVerify?.([edge[0], edge[1]]));
  const v = (g.opts.verified ?? {})[key];
  return [
    make("div", { class: "dpa-graph-title", text: `edge ${name(s, edge[0])} → ${name(d, edge[1])}` }),
    make("div", { class: "dpa-graph-terms" }, [make("span", { text: "direct effect (edge)" }), make("span", { text: formatScore(e ? e[2] : 0) })]),
    make("div", {}, [button]),
    ...(reason ? [make("div", { class: "dpa-graph-reason", text: reason })] : []),
    v ? verifiedTerms(v) : make("div", { class: "dpa-graph-result", text: g.opts.busy ? "verifying…" : "" }),
  ];
}

/** A path-patching result as a table: the edge, the prediction, the measured change, their ratio, the target's change. @param {Verified} v */
function verifiedTerms(v) {
  const rows = [["edge (DPA)", formatScore(v.edge)]];
  if (v.first_order !== undefined) rows.push(["predicted, every path μ = 1", formatScore(v.first_order)]);
  rows.push(["measured direct change", formatScore(v.direct)],
    [v.first_order !== undefined ? "ratio measured / predicted" : "ratio measured / edge",
      v.ratio === null || v.ratio === undefined || !Number.isFinite(v.ratio) ? "–" : v.ratio.toFixed(3)],
    ["change of the target through it", formatScore(v.target)]);
  return make("div", { class: "dpa-graph-result" }, [make("div", { class: "dpa-graph-subtitle", text: "path patching" }),
    make("div", { class: "dpa-graph-terms" }, rows.flatMap(([k, x]) => [make("span", { text: k }), make("span", { text: x })]))]);
}
