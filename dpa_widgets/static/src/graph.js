// @ts-check
/**
 * The circuit graph of a ``dpa.Circuit`` (``Circuit.to_json()``) drawn as SVG: tokens at the bottom, a row per
 * layer's attention and MLP, the target at the top, one column per position; edges coloured and sized by their
 * signed direct effect. A threshold slider prunes live (the rule of ``Circuit.prune``), hovering a node lights
 * its inputs and outputs, clicking selects a node or an edge and the side panel shows its in- and out-flows.
 *
 * One plain ES module with no imports: the widget's bundle includes it (dpa_widgets/bundle.py), and
 * ``dpa circuit --html`` (dpa_widgets/page.py) pastes it into a page's inline ``<script type="module">``
 * followed by ``renderGraph(document.getElementById("graph"), DATA, {})``. The pure parts (colour scale,
 * influence and pruning, layout, edge geometry) are exported for Node's test runner.
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
 * @property {[number, number | null][]} [in_positions]  a unit's or the target's in-flow by the position it reads:
 *   the non-zero entries as [position, value]
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
  if (threshold >= 1) return [...units].sort((a, b) => a - b);  // 1: nothing pruned, units of no influence too
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
  gapCol: 22,       // a run of positions with no unit in a long prompt: one narrow column
  mini: 4, miniPitch: 6,  // the dots of the tokens read in such a column
  maxCell: 240,     // a cell wider than this wraps into lines
  lineGap: 3,
  rowPitch: 36,     // a row with units (the edges run through the space above its boxes)
  emptyRow: 3,      // a layer's attention or MLP with no unit drawn
  left: 8, top: 8, right: 8,  // the row labels sit outside the drawing, in the view's own strip
  tokenH: 16, dot: 10, maxLabel: 12,
  maxWidth: 1100,   // token labels stand level under their columns up to this width, else slant
  minEdge: 0.01,    // as drawnEdges: a token with a drawn edge keeps its column
};

/** Which row a node sits in: -1 tokens, 2 * layer for a head, 2 * layer + 1 for a neuron or an expert (the
 * layer's MLP), Infinity the target. */
export function rowOf(/** @type {GraphNode} */ node) {
  if (node.kind === "head") return 2 * /** @type {number} */ (node.layer);
  if (isUnit(node)) return 2 * /** @type {number} */ (node.layer) + 1;
  return node.kind === "token" ? -1 : Infinity;
}

/** The text in a unit's box: "H3", "N1066", "E2", a hybrid's convolution unit "C3" (its layer is the row, its
 * position the column): a unit in a head's place takes the letter its label gives ("L0.C3@8"). */
export function unitText(/** @type {GraphNode} */ node) {
  const named = node.kind === "head" ? /^L\d+\.([A-Z])\d+/.exec(node.label ?? "") : null;
  return `${named ? named[1] : UNIT_LETTER[/** @type {keyof UNIT_LETTER} */ (node.kind)]}${node.index}`;
}

/** What the target node says: "·Mary", "·Mary − ·John", "vector". @param {GraphData} data */
export function targetText(data) {
  const t = data.target;
  const tok = t.token === null || t.token === undefined ? "vector" : tokenLabel(t.token);
  return t.contrast === null || t.contrast === undefined ? tok : `${tok} − ${tokenLabel(t.contrast)}`;
}

/** The target box's text: "target ·Mary", cut to 40 characters (the whole of it in the box's title). @param {GraphData} data */
export function targetBoxText(data) {
  return shortLabel(`target ${targetText(data)}`, 40);
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

/** The width of a 10 px label with its padding. @param {string} text @param {typeof GRAPH} [S] */
export function textWidth(text, S = GRAPH) {
  return [...text].length * S.charW + S.pad;
}

/** @param {GraphNode} node @param {typeof GRAPH} S */
function unitWidth(node, S) {
  return Math.max(S.unitMinW, textWidth(unitText(node), S));
}

/**
 * How the units of one cell (one row at one position, sorted by index) sit: side by side in one line when
 * that is at most ``maxCell`` wide, else in lines of equal slots as wide as the widest unit, as many per line
 * as fit in ``maxCell``.
 * @param {GraphNode[]} list @param {typeof GRAPH} S
 */
function cellShape(list, S) {
  const widths = list.map((n) => unitWidth(n, S));
  const one = widths.reduce((a, w) => a + w, 0) + S.unitGap * Math.max(0, list.length - 1);
  if (one <= S.maxCell || list.length < 2) return { w: one, lines: 1, perLine: list.length, slot: 0 };
  const slot = Math.max(...widths);
  const perLine = Math.max(1, Math.min(list.length, Math.floor((S.maxCell + S.unitGap) / (slot + S.unitGap))));
  return { w: perLine * slot + (perLine - 1) * S.unitGap, lines: Math.ceil(list.length / perLine), perLine, slot };
}

/** The height of ``lines`` lines of units. @param {number} lines @param {typeof GRAPH} S */
function linesHeight(lines, S) {
  return lines * S.unitH + (lines - 1) * S.lineGap;
}

/**
 * The positions that keep a column of their own in a long prompt: those with a unit drawn and the target's (a
 * lone position between two such keeps its column too). The others, in runs, share one narrow column.
 * @param {GraphData} data @param {GraphNode[]} units
 */
export function shownPositions(data, units) {
  const n = data.tokens.length;
  const shown = new Array(n).fill(false);
  for (const u of units) if (u.position !== null && u.position >= 0 && u.position < n) shown[u.position] = true;
  const t = data.target?.position;
  if (typeof t === "number" && t >= 0 && t < n) shown[t] = true;
  for (let p = 0; p < n; p++) {
    if (!shown[p] && (p === 0 || shown[p - 1]) && (p === n - 1 || shown[p + 1])) shown[p] = true;
  }
  return shown;
}

/**
 * One column per position, as wide as its widest cell and its token label, when that fits in ``maxWidth``.
 * Else only shownPositions keep a column; each run of the others is one narrow column of ``gaps`` where the
 * tokens with an edge drawn (drawnEdges) stand as small dots side by side (``slots``: position -> x), the
 * others not at all. The kept columns are as wide as their label when every one fits ("level" labels), else
 * as their cells, with the labels slanting under them.
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
    if (p !== null && p < need.length) need[p] = Math.max(need[p], cellShape(list, S).w);
  }
  const labels = data.tokens.map((t) => shortLabel(tokenLabel(t), S.maxLabel));
  const labelW = labels.map((t) => textWidth(t, S));
  const all = need.reduce((a, w, p) => a + Math.max(w, labelW[p]) + S.colGap, 0);
  const shown = S.left + all + S.right <= S.maxWidth ? need.map(() => true) : shownPositions(data, units);
  const read = new Set();
  const tokenAt = new Map(data.nodes.filter((m) => m.kind === "token").map((m) => [m.id, m.position]));
  for (const [src] of drawnEdges(data, S.minEdge).edges) if (tokenAt.has(src)) read.add(tokenAt.get(src));
  /** @type {{from: number, to: number, tokens: number[]}[]} */
  const runs = [];
  shown.forEach((on, p) => {
    if (on) return;
    const last = runs.at(-1);
    if (last && last.to === p - 1) last.to = p;
    else runs.push({ from: p, to: p, tokens: [] });
    if (read.has(p)) /** @type {{tokens: number[]}} */ (runs.at(-1)).tokens.push(p);
  });
  const gapWidth = (/** @type {{tokens: number[]}} */ r) => Math.max(S.gapCol, r.tokens.length * S.miniPitch + 6);
  const gapStart = new Map(runs.map((r) => [r.from, r]));
  const levelW = shown.reduce((a, on, p) => a + (on ? Math.max(need[p], labelW[p]) + S.colGap :
    gapStart.has(p) ? gapWidth(/** @type {{tokens: number[]}} */ (gapStart.get(p))) + S.colGap : 0), 0);
  const level = S.left + levelW + S.right <= S.maxWidth;
  const xs = new Array(shown.length).fill(0), widths = new Array(shown.length).fill(0);
  /** @type {{from: number, to: number, x: number, w: number, tokens: number[]}[]} */
  const gaps = [];
  /** @type {Map<number, number>} */
  const slots = new Map();
  let x = S.left;
  for (let p = 0; p < shown.length; p++) {
    if (shown[p]) {
      xs[p] = x; widths[p] = level ? Math.max(need[p], labelW[p]) : need[p];
      x += widths[p] + S.colGap;
    } else {
      const run = /** @type {{from: number, to: number, tokens: number[]}} */ (gapStart.get(p));
      const w = gapWidth(run);
      gaps.push({ ...run, x, w });
      for (let q = run.from; q <= run.to; q++) { xs[q] = x; widths[q] = w; }
      const start = x + (w - run.tokens.length * S.miniPitch) / 2;
      run.tokens.forEach((q, k) => slots.set(q, start + k * S.miniPitch + (S.miniPitch - S.mini) / 2));
      x += w + S.colGap;
      p = run.to;
    }
  }
  return { xs, widths, level, labels, labelW, cells, shown, gaps, slots, right: Math.max(S.left, x - S.colGap) };
}

/**
 * The rows from the top: the target, then each layer's MLP and attention (the highest layer first), then the
 * tokens. A row with no unit is a thin band, so the layers stay in order without the empty ones taking room;
 * a row whose cells wrap is taller by its extra lines (``lines``: row -> most lines of a cell).
 * @param {number} nRows @param {GraphNode[]} units @param {Map<number, number>} lines @param {typeof GRAPH} S
 */
function graphRows(nRows, units, lines, S) {
  const used = new Set(units.map(rowOf));
  const rows = [{ row: Infinity, y: S.top, h: S.rowPitch, used: true, label: "target" }];
  let y = S.top + S.rowPitch;
  for (let r = nRows - 1; r >= 0; r--) {
    const h = used.has(r) ? S.rowPitch + linesHeight(lines.get(r) ?? 1, S) - S.unitH : S.emptyRow;
    rows.push({ row: r, y, h, used: used.has(r), label: `L${r >> 1} ${r % 2 ? "MLP" : "attn"}` });
    y += h;
  }
  rows.push({ row: -1, y, h: S.rowPitch, used: true, label: "tokens" });
  return rows;
}

/**
 * Where every node of ``graph`` (rest nodes apart) is drawn: a box per node id (a token in a "⋯" run has
 * none), the rows (with their labels), the columns and their gaps, and the size of the picture, which holds
 * every box, the target's label and the slanted token labels.
 * @param {GraphData} graph
 * @param {Partial<typeof GRAPH>} [sizes]
 */
export function graphLayout(graph, sizes = {}) {
  const S = { ...GRAPH, ...sizes };
  const shown = graph.nodes.filter((n) => n.kind !== "rest");
  const units = shown.filter(isUnit);
  const nRows = units.length ? 2 * Math.max(...units.map((n) => /** @type {number} */ (n.layer))) + 2 : 0;
  const cols = graphColumns(graph, graph.positions ? units : [], S);
  /** @type {GraphNode[][]} the cells: a row's units at a position (over all positions: a whole row) */
  let cells = [...cols.cells.values()];
  if (!graph.positions) {
    /** @type {Map<number, GraphNode[]>} */
    const byRow = new Map();
    for (const u of units) byRow.set(rowOf(u), [...(byRow.get(rowOf(u)) ?? []), u]);
    cells = [...byRow.values()];
    cells.forEach((l) => l.sort((a, b) => /** @type {number} */ (a.index) - /** @type {number} */ (b.index)));
  }
  const shapes = new Map(cells.map((l) => [l, cellShape(l, graph.positions ? S : { ...S, maxCell: Math.max(S.maxCell, 480) })]));
  /** @type {Map<number, number>} */
  const lines = new Map();
  for (const [l, sh] of shapes) lines.set(rowOf(l[0]), Math.max(lines.get(rowOf(l[0])) ?? 1, sh.lines));
  const rows = graphRows(nRows, units, lines, S);
  const rowMid = new Map(rows.map((r) => [r.row, r.y + r.h / 2]));
  /** @type {Map<number, {x: number, y: number, w: number, h: number}>} */
  const boxes = new Map();
  let right = cols.right;
  if (!graph.positions) right = Math.max(right, S.left + Math.max(0, ...[...shapes.values()].map((sh) => sh.w)));
  for (const [list, sh] of shapes) {
    const p = list[0].position;
    const x = graph.positions && p !== null ? cols.xs[p] + (cols.widths[p] - sh.w) / 2 : S.left + (right - S.left - sh.w) / 2;
    placeCell(boxes, list, sh, x, /** @type {number} */ (rowMid.get(rowOf(list[0]))) - linesHeight(sh.lines, S) / 2, S);
  }
  const rowY = new Map(rows.map((r) => [r.row, r.y + (r.h - S.unitH) / 2]));
  const tokenY = /** @type {number} */ (rowY.get(-1));
  placeTokens(boxes, shown, cols, tokenY, S);
  const targetW = textWidth(targetBoxText(graph), S);
  // the last slanted label runs to the right of its column: the picture holds it
  const slantW = (/** @type {number} */ p) => textWidth(`${p} ${cols.labels[p]}`, S) * Math.SQRT1_2;
  let reach = right;
  if (!cols.level) cols.shown.forEach((on, p) => { if (on) reach = Math.max(reach, cols.xs[p] + cols.widths[p] / 2 + slantW(p)); });
  const width = Math.max(reach, S.left + targetW) + S.right;
  placeTarget(boxes, graph, cols, width, targetW, S);
  const slant = cols.level ? 0 : Math.max(0, ...cols.labels.map((t, p) => (cols.shown[p] ? slantW(p) : 0))) + 4;
  const height = tokenY + S.tokenH + 4 + slant + 4;
  return { boxes, rows, columns: cols, width, height, level: cols.level, tokenY, sizes: S };
}

/**
 * The boxes of one cell from (x, y): one line side by side, or lines of equal slots (cellShape).
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes @param {GraphNode[]} list
 * @param {ReturnType<typeof cellShape>} sh @param {number} x @param {number} y @param {typeof GRAPH} S
 */
function placeCell(boxes, list, sh, x, y, S) {
  let at = x;
  list.forEach((n, k) => {
    const w = unitWidth(n, S);
    if (sh.lines === 1) { boxes.set(n.id, { x: at, y, w, h: S.unitH }); at += w + S.unitGap; return; }
    const line = Math.floor(k / sh.perLine), col = k % sh.perLine;
    boxes.set(n.id, { x: x + col * (sh.slot + S.unitGap) + (sh.slot - w) / 2, y: y + line * (S.unitH + S.lineGap), w, h: S.unitH });
  });
}

/**
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes @param {GraphNode[]} shown
 * @param {ReturnType<typeof graphColumns>} cols @param {number} y @param {typeof GRAPH} S
 */
function placeTokens(boxes, shown, cols, y, S) {
  for (const n of shown) {
    if (n.kind !== "token" || n.position === null || n.position >= cols.xs.length) continue;
    const p = n.position;
    const slot = cols.slots.get(p);
    if (!cols.shown[p]) {  // in a narrow column: a small dot when an edge from it is drawn, else nothing
      if (slot !== undefined) boxes.set(n.id, { x: slot, y: y + (S.unitH - S.mini) / 2, w: S.mini, h: S.mini });
      continue;
    }
    const w = cols.level ? cols.labelW[p] : Math.min(S.dot, cols.widths[p]);
    const h = cols.level ? S.tokenH : S.dot;
    boxes.set(n.id, { x: cols.xs[p] + (cols.widths[p] - w) / 2, y: y + (S.unitH - h) / 2, w, h });
  }
}

/**
 * @param {Map<number, {x: number, y: number, w: number, h: number}>} boxes @param {GraphData} graph
 * @param {ReturnType<typeof graphColumns>} cols @param {number} width @param {number} w @param {typeof GRAPH} S
 */
function placeTarget(boxes, graph, cols, width, w, S) {
  const t = graph.nodes.find((n) => n.kind === "target");
  if (!t) return;
  const p = graph.target.position;
  const centre = graph.positions && p >= 0 && p < cols.xs.length ? cols.xs[p] + cols.widths[p] / 2 : width / 2;
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

/** The point of edgePath(from, to) at ``t`` (0 at the source, 1 at the destination). @param {{x: number, y: number, w: number, h: number}} from @param {{x: number, y: number, w: number, h: number}} to @param {number} t */
export function edgePoint(from, to, t) {
  const x1 = from.x + from.w / 2, y1 = from.y, x2 = to.x + to.w / 2, y2 = to.y + to.h, mid = (y1 + y2) / 2;
  const u = 1 - t;
  return { x: (u * u * u + 3 * u * u * t) * x1 + (3 * u * t * t + t * t * t) * x2,
    y: u * u * u * y1 + 3 * u * t * (u + t) * mid + t * t * t * y2 };
}

/** Two boxes share area. @param {{x: number, y: number, w: number, h: number}} a @param {{x: number, y: number, w: number, h: number}} b */
export function overlaps(a, b) {
  return a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
}

/**
 * Where a ``w`` × ``h`` label of an edge goes: at the first point along the curve, from its middle outwards,
 * where it fits beside the curve (right, else left) inside the picture without touching any box of ``avoid``
 * (the nodes, the labels placed before); null when there is no such place.
 * @param {{x: number, y: number, w: number, h: number}} from @param {{x: number, y: number, w: number, h: number}} to
 * @param {number} w @param {number} h @param {{x: number, y: number, w: number, h: number}[]} avoid
 * @param {number} width @param {number} height
 */
export function edgeLabelBox(from, to, w, h, avoid, width, height) {
  const free = (/** @type {{x: number, y: number, w: number, h: number}} */ r) => r.x >= 0 && r.y >= 0 &&
    r.x + r.w <= width && r.y + r.h <= height && !avoid.some((b) => overlaps(r, b));
  for (let step = 0; step <= 9; step++) {  // t = 0.5, 0.45, 0.55, 0.4, ... 0.05, 0.95
    for (const t of step ? [0.5 - 0.05 * step, 0.5 + 0.05 * step] : [0.5]) {
      const at = edgePoint(from, to, t);
      for (const dy of [0, -h * 0.6, h * 0.6]) {
        for (const r of [{ x: at.x + 4, y: at.y - h / 2 + dy, w, h }, { x: at.x - 4 - w, y: at.y - h / 2 + dy, w, h }]) {
          if (free(r)) return r;
        }
      }
    }
  }
  return null;
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
.dpa-graph-scroll { flex: 3 1 560px; min-width: 0; display: flex; overflow: hidden;
  border: 1px solid var(--g-border); border-radius: 4px; background: var(--g-bg); }
.dpa-graph-rows { position: relative; flex: none; width: 58px; overflow: hidden; border-right: 1px solid var(--g-border); }
.dpa-graph-rowlabel { position: absolute; left: 4px; right: 2px; height: 12px; font-size: 10px; line-height: 12px;
  color: var(--g-muted); white-space: nowrap; overflow: hidden; }
.dpa-graph-viewport { position: relative; flex: 1 1 auto; min-width: 0; overflow: hidden; cursor: grab; touch-action: none; }
.dpa-graph-viewport:focus-visible { outline: 2px solid var(--g-accent); outline-offset: -2px; }
.dpa-graph-viewport.dpa-graph-dragging { cursor: grabbing; }
.dpa-graph-svg { display: block; }
.dpa-graph-zoom { display: inline-flex; gap: 3px; align-items: center; }
.dpa-graph-zoom-level { min-width: 3.2em; text-align: right; color: var(--g-muted); }
.dpa-graph-gap { fill: var(--g-muted); font-size: 12px; }
.dpa-graph-gapband { fill: none; stroke: var(--g-border); stroke-dasharray: 2 2; }
.dpa-graph-node:focus { outline: none; }
.dpa-graph-node:focus-visible rect { stroke: var(--g-accent); stroke-width: 2.5; }
.dpa-graph-flow:focus-visible { outline: 2px solid var(--g-accent); outline-offset: -1px; }
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
.dpa-graph-panel { flex: 1 1 260px; max-width: 400px; min-width: 220px; border: 1px solid var(--g-border);
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
.dpa-graph-verified { row-gap: 3px; }
.dpa-graph-verified span:nth-child(2n+1) { color: var(--g-muted); font-size: 11px; }
.dpa-graph-verdict { font-size: 11px; margin: 3px 0; border-left: 3px solid var(--g-accent); padding: 0 5px; }
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
    destroy: () => { g.destroyed = true; g.resize?.disconnect(); g.root.remove(); },
    get graph() { return /** @type {GraphData} */ (g.pruned); },
    get layout() { return /** @type {ReturnType<typeof graphLayout>} */ (g.layout); },
    get renderMs() { return g.renderMs; },
    get view() { return { ...g.view }; },
    fit: () => fitView(g),
    zoom: (/** @type {number} */ factor) => zoomAt(g, factor),
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
    unitCount: 0, drawnEdges: 0, renderMs: 0, nodeMax: 1, edgeMax: 1, destroyed: false,
    /** how the drawing shows: drawing point (X, Y) at ((X - x) k, (Y - y) k) of a w × h px viewport */
    view: { x: 0, y: 0, k: 1, w: 0, h: 0, fitted: true },
    /** @type {{x: number, y: number, moved: boolean} | null} */ drag: null, dragged: false,
    /** @type {ResizeObserver | null} */ resize: null,
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

/** The fixed parts: style, toolbar (slider, counts, zoom, legends), the drawing's frame (row labels and
 * viewport), panel, hover line. @param {GraphState} g */
function graphFrame(g) {
  const slider = /** @type {HTMLInputElement} */ (make("input", { type: "range", min: 0, max: 1, step: 0.01,
    class: "dpa-graph-threshold", "aria-label": "prune: share of the units' influence kept",
    title: "keep the fewest heads and neurons whose influence on the target adds up " +
      "to this share of all of theirs (Circuit.prune)" }));
  slider.addEventListener("input", () => { g.threshold = Number(slider.value); graphRedraw(g); });
  slider.addEventListener("change", () => g.opts.onThreshold?.(Number(slider.value)));
  const button = (/** @type {string} */ cls, /** @type {string} */ text, /** @type {string} */ title, /** @type {() => void} */ f) => {
    const b = make("button", { class: cls, text, title, "aria-label": title, type: "button" });
    b.addEventListener("click", f);
    return b;
  };
  const p = {
    slider, sliderText: make("span", { class: "dpa-graph-kept" }), legends: make("span", { class: "dpa-graph-legends" }),
    scroll: make("div", { class: "dpa-graph-scroll" }),
    rows: make("div", { class: "dpa-graph-rows", "aria-hidden": "true" }),
    viewport: make("div", { class: "dpa-graph-viewport", tabindex: 0, role: "group",
      "aria-label": "circuit graph: drag or arrow keys pan, + and − zoom, 0 fits; Tab to a node, then the arrow keys " +
        "go from node to node and Enter selects",
      title: "drag or arrow keys: pan · ctrl + wheel, + or −: zoom · 0: fit" }),
    zoomLevel: make("span", { class: "dpa-graph-zoom-level" }),
    panel: make("div", { class: "dpa-graph-panel" }), hover: make("div", { class: "dpa-graph-hover", text: " " }),
  };
  p.scroll.append(p.rows, p.viewport);
  g.parts = /** @type {Record<string, HTMLElement>} */ (p);
  const zoom = make("span", { class: "dpa-graph-zoom" }, [
    button("dpa-graph-zoom-out", "−", "zoom out (−)", () => zoomAt(g, 1 / 1.25)),
    button("dpa-graph-zoom-in", "+", "zoom in (+)", () => zoomAt(g, 1.25)),
    button("dpa-graph-fit", "fit", "show the whole circuit (0)", () => fitView(g)), p.zoomLevel]);
  const toolbar = make("div", { class: "dpa-graph-toolbar" }, [
    make("label", {}, ["prune ", slider]), p.sliderText, zoom, p.legends]);
  g.root.replaceChildren(make("style", { text: GRAPH_CSS }), toolbar,
    make("div", { class: "dpa-graph-body" }, [p.scroll, p.panel]), p.hover);
  graphEvents(g);
  viewEvents(g);
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
  g.svg = graphSvg(g, g.pruned, g.layout);
  g.parts.viewport.replaceChildren(g.svg);
  /** @type {HTMLInputElement} */ (g.parts.slider).value = String(g.threshold);
  const all = g.data.nodes.filter(isUnit).length;
  g.unitCount = g.pruned.nodes.filter(isUnit).length;
  g.svg?.setAttribute("aria-label", `circuit graph: ${g.unitCount} units`);
  g.parts.sliderText.textContent = `${Math.round(g.threshold * 100)}% of the units' influence on the target: ${g.unitCount} of ` +
    `${all} units · ${g.drawnEdges} edges drawn (|effect| ≥ ${Math.round(g.minEdge * 100)}% of the largest)`;
  g.parts.legends.replaceChildren(gradientLegend("node score", g.nodeMax), gradientLegend("edge effect", g.edgeMax));
  graphHighlight(g);
  graphPanel(g);
  if (!(g.view.fitted && fitView(g))) showView(g);  // a new drawing fits again unless zoomed or panned
  g.renderMs = clock() - t0;
  g.root.setAttribute("data-render-ms", g.renderMs.toFixed(1));
}

// ---------------------------------------------------------------- the view: fit, zoom and pan

/** The tallest the viewport opens: 85% of the window, between 360 and 1000 px. @param {GraphState} g */
function maxViewHeight(g) {
  const win = typeof window !== "undefined" && window.innerHeight ? window.innerHeight : 900;
  return Math.max(360, Math.min(1000, 0.85 * win));
}

/**
 * Show the whole drawing: the largest scale up to 1 at which it fits the viewport's width and the tallest
 * height (a drawing that would go under 60% to fit that height makes the viewport taller), centred sideways. False (and nothing done) while the page has not laid the viewport out.
 * @param {GraphState} g @param {boolean} [refit]  false: only when the viewport's width changed
 */
function fitView(g, refit = true) {
  const lay = g.layout, w = g.parts.viewport.clientWidth;
  if (!lay || !w || g.destroyed) return false;
  if (!refit && g.view.fitted && Math.abs(w - g.view.w) < 1 && g.view.h > 0) { showView(g); return true; }
  // the whole width always; the height too unless that takes the drawing under 60% (then the page scrolls)
  const k = Math.min(1, w / lay.width, Math.max(maxViewHeight(g) / lay.height, 0.6));
  g.view = { k, w, h: Math.ceil(lay.height * k), x: (lay.width - w / k) / 2, y: 0, fitted: true };
  showView(g);
  return true;
}

/** The scale at which the whole drawing fits (fitView's), for the zoom's lower bound. @param {GraphState} g */
function fitScale(g) {
  const lay = g.layout, v = g.view;
  return lay && v.w ? Math.min(1, v.w / lay.width, v.h / lay.height) : 1;
}

/**
 * Zoom by ``factor`` about the viewport point (sx, sy) (its middle by default), between half the fitting
 * scale and 4.
 * @param {GraphState} g @param {number} factor @param {number} [sx] @param {number} [sy]
 */
function zoomAt(g, factor, sx, sy) {
  const v = g.view;
  if (!g.layout || !v.w) return;
  const k = Math.max(0.5 * fitScale(g), Math.min(4, v.k * factor));
  const ax = sx ?? v.w / 2, ay = sy ?? v.h / 2;
  const h = Math.max(v.h, Math.min(Math.ceil(g.layout.height * k), maxViewHeight(g)));  // zooming in may need room
  g.view = { ...v, k, h, x: v.x + ax / v.k - ax / k, y: v.y + ay / v.k - ay / k, fitted: false };
  showView(g);
}

/** Move the drawing by (dx, dy) screen px. @param {GraphState} g @param {number} dx @param {number} dy */
function panBy(g, dx, dy) {
  const v = g.view;
  g.view = { ...v, x: v.x - dx / v.k, y: v.y - dy / v.k, fitted: false };
  showView(g);
}

/** Bring a node's box into view (a node reached with Tab), panning as little as needed. @param {GraphState} g @param {number} id */
function showBox(g, id) {
  const b = g.layout?.boxes.get(id), v = g.view;
  if (!b || !v.w) return;
  const vw = v.w / v.k, vh = v.h / v.k, m = 8 / v.k;
  let { x, y } = v;
  if (b.x - m < x) x = b.x - m; else if (b.x + b.w + m > x + vw) x = b.x + b.w + m - vw;
  if (b.y - m < y) y = b.y - m; else if (b.y + b.h + m > y + vh) y = b.y + b.h + m - vh;
  if (x !== v.x || y !== v.y) { g.view = { ...v, x, y, fitted: false }; showView(g); }
}

/**
 * Draw the view: the SVG's size and viewBox, the row labels beside it at their rows' heights (one label
 * where two would touch), the zoom level. Keeps a quarter of the viewport on the drawing at least.
 * @param {GraphState} g
 */
function showView(g) {
  const lay = g.layout, svg = g.svg;
  if (!lay || !svg) return;
  if (!g.view.w) g.view = { x: 0, y: 0, k: 1, w: Math.ceil(lay.width), h: Math.ceil(lay.height), fitted: true };
  const v = g.view, vw = v.w / v.k, vh = v.h / v.k;
  v.x = Math.max(Math.min(0, lay.width - vw) - 0.75 * vw, Math.min(v.x, Math.max(0, lay.width - vw) + 0.75 * vw));
  v.y = Math.max(Math.min(0, lay.height - vh) - 0.75 * vh, Math.min(v.y, Math.max(0, lay.height - vh) + 0.75 * vh));
  svg.setAttribute("width", String(v.w));
  svg.setAttribute("height", String(v.h));
  svg.setAttribute("viewBox", `${px(v.x)} ${px(v.y)} ${px(vw)} ${px(vh)}`);
  g.parts.viewport.style.height = `${v.h}px`;
  const labels = [];
  /** @type {number[]} */
  const taken = [];
  const ends = lay.rows.filter((r) => r.row === Infinity || r.row === -1);  // target and tokens first, then the layers
  for (const r of [...ends, ...lay.rows.filter((x) => !ends.includes(x)).reverse()]) {
    const top = (r.y + r.h / 2 - v.y) * v.k - 6;
    if (!r.used || top < 0 || top > v.h - 12 || taken.some((t) => Math.abs(t - top) < 12)) continue;
    taken.push(top);
    labels.push(make("div", { class: "dpa-graph-rowlabel", style: `top: ${px(top)}px`, text: r.label }));
  }
  g.parts.rows.replaceChildren(...labels);
  g.parts.zoomLevel.textContent = `${Math.round(v.k * 100)}%`;
  g.root.setAttribute("data-zoom", v.k.toFixed(3));
}

/**
 * Zoom and pan: the buttons (graphFrame), ctrl + wheel at the pointer, dragging the background, and the keys
 * +, −, 0 and the arrows on the focused viewport; a node reached with Tab lights up like a hovered one and is
 * brought into view, Enter or space selects it. A change of the viewport's width fits the drawing again
 * unless it was zoomed or panned.
 * @param {GraphState} g
 */
function viewEvents(g) {
  const vp = g.parts.viewport;
  vp.addEventListener("wheel", (ev) => {
    if (!(ev.ctrlKey || ev.metaKey)) return;  // a plain wheel scrolls the page
    ev.preventDefault();
    const r = vp.getBoundingClientRect();
    zoomAt(g, Math.exp(-ev.deltaY * 0.002), ev.clientX - r.left, ev.clientY - r.top);
  }, { passive: false });
  vp.addEventListener("pointerdown", (ev) => {
    const t = /** @type {Element | null} */ (ev.target);
    if (ev.button !== 0 || t?.closest?.("[data-id], [data-edge]")) return;
    g.drag = { x: ev.clientX, y: ev.clientY, moved: false };
    vp.setPointerCapture?.(ev.pointerId);
  });
  vp.addEventListener("pointermove", (ev) => {
    const d = g.drag;
    if (!d) return;
    const dx = ev.clientX - d.x, dy = ev.clientY - d.y;
    if (!d.moved && Math.hypot(dx, dy) < 3) return;
    if (!d.moved) vp.classList.add("dpa-graph-dragging");
    d.moved = true;
    d.x = ev.clientX; d.y = ev.clientY;
    panBy(g, dx, dy);
  });
  const end = () => {
    if (!g.drag) return;
    g.dragged = g.drag.moved;
    g.drag = null;
    vp.classList.remove("dpa-graph-dragging");
  };
  vp.addEventListener("pointerup", end);
  vp.addEventListener("pointercancel", end);
  vp.addEventListener("keydown", (ev) => {
    const t = /** @type {Element | null} */ (ev.target);
    const node = t?.closest?.("[data-id]");
    const step = 40;
    /** @type {Record<string, () => void>} */
    const keys = {
      "+": () => zoomAt(g, 1.25), "=": () => zoomAt(g, 1.25), "-": () => zoomAt(g, 1 / 1.25), "−": () => zoomAt(g, 1 / 1.25),
      "0": () => fitView(g), ArrowLeft: () => panBy(g, step, 0), ArrowRight: () => panBy(g, -step, 0),
      ArrowUp: () => panBy(g, 0, step), ArrowDown: () => panBy(g, 0, -step),
      Escape: () => { selectNode(g, null); selectEdge(g, null); },
    };
    if (node && (ev.key === "Enter" || ev.key === " ")) {
      ev.preventDefault();
      selectNode(g, /** @type {GraphNode} */ (g.byId.get(Number(node.getAttribute("data-id"))))?.label ?? null);
      /** @type {HTMLElement | undefined} */ (g.nodeEls.get(Number(node.getAttribute("data-id"))))?.focus({ preventScroll: true });
    } else if (node && ev.key.startsWith("Arrow") && !ev.ctrlKey && !ev.metaKey && !ev.altKey) {
      ev.preventDefault();  // from node to node; on the viewport itself the arrows pan
      const next = nodeToward(g, Number(node.getAttribute("data-id")), ev.key);
      if (next !== null) {
        setRoving(g, /** @type {GraphNode} */ (g.byId.get(next)).label);
        /** @type {HTMLElement} */ (g.nodeEls.get(next)).focus({ preventScroll: true });
      }
    } else if (keys[ev.key] && !ev.ctrlKey && !ev.metaKey && !ev.altKey) {
      ev.preventDefault();
      keys[ev.key]();
    }
  });
  vp.addEventListener("focusin", (ev) => {
    const node = /** @type {Element | null} */ (ev.target)?.closest?.("[data-id]");
    vp.scrollLeft = 0; vp.scrollTop = 0;  // the browser scrolls a hidden overflow to a focused child: the view pans instead
    if (!node) return;
    const id = Number(node.getAttribute("data-id"));
    showBox(g, id);
    graphHover(g, id);
  });
  vp.addEventListener("focusout", () => graphHover(g, null));
  if (typeof ResizeObserver !== "undefined") {
    g.resize = new ResizeObserver(() => {
      if (g.destroyed) return;
      if (g.view.fitted) fitView(g, false);
      else if (vp.clientWidth && Math.abs(vp.clientWidth - g.view.w) >= 1) { g.view = { ...g.view, w: vp.clientWidth }; showView(g); }
    });
    g.resize.observe(vp);
  } else fitWhenLaidOut(g, 40, 0);
}

/**
 * Without ResizeObserver: fit once the page has laid the viewport out (a notebook output may be attached
 * later than it is drawn): after ``delay`` ms, then every 50 ms, ``tries`` times at most.
 * @param {GraphState} g @param {number} tries @param {number} delay
 */
function fitWhenLaidOut(g, tries, delay) {
  setTimeout(() => {
    if (g.destroyed) return;
    if (!fitView(g, false) && tries > 1) fitWhenLaidOut(g, tries - 1, 50);
  }, delay);
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
  svg.append(edgeLayer, hitLayer, graphNodes(g, graph, lay), graphGaps(lay), graphChecks(g, lay, hitLayer));
  return svg;
}

/**
 * Each narrow column of a long prompt's positions with no unit: a "⋯" in the token row, or, when some of its
 * tokens have an edge drawn (their dots), a dashed frame round the dots. @param {ReturnType<typeof graphLayout>} lay
 */
function graphGaps(lay) {
  const S = lay.sizes, y = lay.tokenY;
  return make("g", { class: "dpa-graph-gaps" }, lay.columns.gaps.map((gap) => {
    const title = make("title", { text: `positions ${gap.from}–${gap.to} (${gap.to - gap.from + 1} tokens, no unit kept ` +
      `there)${gap.tokens.length ? `: the dots are the ${gap.tokens.length} with an edge drawn, by position` : ""}` });
    const data = { "data-from": gap.from, "data-to": gap.to };
    if (!gap.tokens.length) {
      return make("text", { class: "dpa-graph-gap", x: px(gap.x + gap.w / 2), y: px(y + S.unitH / 2 + 4), "text-anchor": "middle",
        text: "⋯", ...data }, [title]);
    }
    return make("rect", { class: "dpa-graph-gapband", x: px(gap.x + 1), y: px(y + 1), width: px(gap.w - 2), height: px(S.unitH - 2),
      rx: 3, ...data }, [title]);
  }));
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
    const wide = n.kind === "token" && lay.columns.shown[/** @type {number} */ (n.position)];  // not a dot in a narrow column
    const text = target ? targetBoxText(graph) : isUnit(n) ? unitText(n) :
      lay.level && wide ? lay.columns.labels[/** @type {number} */ (n.position)] : "";
    const el = make("g", { class: `dpa-graph-node dpa-graph-${n.kind}`, "data-id": n.id, "data-label": n.label,
      tabindex: n.label === rovingLabel(g, graph) ? 0 : -1, role: "button",
      "aria-label": `${nodeName(graph, n)}, score ${formatScore(n.score)}` }, [
      make("rect", { x: px(box.x), y: px(box.y), width: px(box.w), height: px(box.h), rx: n.kind === "head" ? 8 : 2, fill,
        style: target ? "fill: var(--g-chip)" : null }),
      ...(text ? [make("text", { x: px(box.x + box.w / 2), y: px(box.y + box.h / 2 + 3.5), "text-anchor": "middle",
        fill: target ? "currentColor" : textColor(v, max), text })] : []),
      make("title", { text: `${nodeName(graph, n)}: score ${formatScore(n.score)} · influence ${(n.influence ?? 0).toFixed(3)}` }),
    ]);
    layer.append(el);
    g.nodeEls.set(n.id, el);
    if (wide && !lay.level) layer.append(slantedLabel(graph, lay, n, box));
  }
  return layer;
}

/**
 * The one node in the Tab order (a roving tabindex: the arrow keys go from node to node): the selected node
 * when it is drawn, else the target. @param {GraphState} g @param {GraphData} graph
 */
function rovingLabel(g, graph) {
  return g.selected !== null && graph.nodes.some((n) => n.label === g.selected) ? g.selected : "target";
}

/** Put ``label``'s node alone in the Tab order. @param {GraphState} g @param {string} label */
function setRoving(g, label) {
  for (const [id, el] of g.nodeEls) el.setAttribute("tabindex", g.byId.get(id)?.label === label ? "0" : "-1");
}

/**
 * The node next to ``id`` in the direction of an arrow key: the nearest box whose centre lies that way (by
 * distance, the sideways offset counting double). @param {GraphState} g @param {number} id @param {string} key
 */
function nodeToward(g, id, key) {
  const boxes = g.layout?.boxes;
  const from = boxes?.get(id);
  if (!boxes || !from) return null;
  const c = (/** @type {{x: number, y: number, w: number, h: number}} */ b) => [b.x + b.w / 2, b.y + b.h / 2];
  const [x0, y0] = c(from);
  const [dx, dy] = { ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowUp: [0, -1], ArrowDown: [0, 1] }[key] ?? [0, 0];
  let best = null, bestD = Infinity;
  for (const [other, b] of boxes) {
    if (other === id || !g.nodeEls.has(other)) continue;
    const [x, y] = c(b);
    const along = (x - x0) * dx + (y - y0) * dy, across = Math.abs((x - x0) * dy) + Math.abs((y - y0) * dx);
    if (along <= 0.5) continue;
    const d = along + 2 * across;
    if (d < bestD) { bestD = d; best = other; }
  }
  return best;
}

/** A token's label slanting down from under its dot (columns too narrow for level labels). */
function slantedLabel(/** @type {GraphData} */ graph, /** @type {ReturnType<typeof graphLayout>} */ lay,
  /** @type {GraphNode} */ n, /** @type {{x: number, y: number, w: number, h: number}} */ box) {
  const x = px(box.x + box.w / 2 - 3), y = px(lay.tokenY + lay.sizes.unitH + 6);
  const p = /** @type {number} */ (n.position);
  return make("text", { class: "dpa-graph-toklabel" + (p === graph.target.position ? " dpa-graph-at-target" : ""),
    x, y, transform: `rotate(45 ${x} ${y})`, text: `${p} ${lay.columns.labels[p]}` });
}

/**
 * "✓ ×ratio" beside each verified edge drawn, where it touches no node, no other mark and stays inside the
 * picture (edgeLabelBox); where there is no such place, the edge's tooltip (in ``hits``) says it instead.
 * @param {GraphState} g @param {ReturnType<typeof graphLayout>} lay @param {Element} hits
 */
function graphChecks(g, lay, hits) {
  const layer = make("g", { class: "dpa-graph-checks" });
  const avoid = [...lay.boxes.values()];
  for (const [key, v] of Object.entries(g.opts.verified ?? {})) {
    const [s, d] = [g.byLabel.get(v.source), g.byLabel.get(v.destination)];
    if (!g.edgeEls.has(key) || s === undefined || d === undefined) continue;
    const a = lay.boxes.get(s), b = lay.boxes.get(d);
    if (!a || !b) continue;
    const text = `✓ ${ratioText(v.ratio)}`;
    const r = edgeLabelBox(a, b, textWidth(text, lay.sizes) - lay.sizes.pad + 4, 12, avoid, lay.width, lay.height);
    const hit = [...hits.children].find((e) => e.getAttribute("data-edge") === key)?.querySelector("title");
    if (hit && !hit.textContent?.includes("verified")) hit.textContent += ` · verified ${text.slice(2)}`;
    if (!r) continue;  // no room beside the edge clear of the nodes and the other marks: its tooltip says it
    avoid.push(r);
    layer.append(make("text", { class: "dpa-graph-check", x: px(r.x + 2), y: px(r.y + 9.5), "data-edge": key, text }));
  }
  return layer;
}

/** @param {number | null | undefined} r */
function ratioText(r) {
  return r === null || r === undefined || !Number.isFinite(r) ? "ratio –" : `×${r.toFixed(2).replace("-", "−")}`;
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
    if (g.dragged) { g.dragged = false; return; }  // the end of a drag is no click
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
    const where = isUnit(n) ? (g.pruned.positions ? " at this position" : " over all positions") : "";
    hoverText(g, `${nodeName(g.pruned, n)}: score${where} ${formatScore(n.score)} · ${f.nIn} inputs, ${f.nOut} outputs · ` +
      `influence ${(g.pruned.nodes.find((m) => m.id === n.id)?.influence ?? 0).toFixed(3)}`);
  } else hoverText(g, "");
  g.opts.onHover?.(n ? n.label : null);
}

/** @param {GraphState} g @param {string | null} label */
function selectNode(g, label) {
  const next = label === g.selected ? null : label;
  g.selected = next;
  if (g.pruned) setRoving(g, rovingLabel(g, g.pruned));
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
  const active = g.root.ownerDocument.activeElement;
  const again = active && g.parts.panel.contains(active) ?
    [active.getAttribute("data-edge"), active.matches("button.dpa-graph-verify")] : null;
  g.parts.panel.replaceChildren(...parts);
  if (again) {  // a keyboard user keeps their place: the same flow entry, or the verify button
    const el = again[1] ? g.parts.panel.querySelector("button.dpa-graph-verify") :
      [...g.parts.panel.querySelectorAll(".dpa-graph-flow")].find((e) => e.getAttribute("data-edge") === again[0]);
    /** @type {HTMLElement | null | undefined} */ (el)?.focus({ preventScroll: true });
  }
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
  const terms = [[scoreName(graph, node), node.score]];
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

/**
 * What a node's score is: at its position (a circuit by position: the scores view sums over positions, so
 * its number for the same head is another), summed over positions, or the target's value.
 * @param {GraphData} graph @param {GraphNode} node
 */
export function scoreName(graph, node) {
  if (node.kind === "target") return "value (the target's logit units)";
  if (node.kind === "token") return "score (the token's input attribution)";
  return graph.positions && node.position !== null ? `score at position ${node.position} only` : "score summed over positions";
}

/** "reads at: 5 ·John +0.31, 1 ·Mary −0.12": the positions its in-flow comes from, by |value| (in_positions). */
function readPositions(/** @type {GraphData} */ graph, /** @type {GraphNode} */ node, /** @type {number} */ k) {
  const by = node.in_positions;
  if (!by || graph.tokens.length < 2) return "";
  const top = by.map(([p, v]) => [p, v ?? 0]).filter(([, v]) => v !== 0)
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
      title: `${s.label} → ${d.label}`, tabindex: 0, role: "button" }, [
      make("span", { class: "dpa-graph-swatch", style: `background:${divergingColor(c.effect, max)}` }),
      make("span", { text: nodeName(g.data, other) }), make("span", { class: "dpa-graph-num", text: formatScore(c.effect) })]);
    row.addEventListener("click", () => selectEdge(g, [s.label, d.label]));
    row.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); selectEdge(g, [s.label, d.label]); }
    });
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

/**
 * A path-patching result: each number named, their ratio, and what the signs say (verifyVerdict). An edge
 * into the target has no separate prediction (the target is linear in the residual stream: the edge is it).
 * @param {Verified} v
 */
function verifiedTerms(v) {
  const ratio = v.ratio === null || v.ratio === undefined || !Number.isFinite(v.ratio) ? "–" : v.ratio.toFixed(3).replace("-", "−");
  const rows = v.destination === "target" ? [
    ["DPA's edge: the source's direct effect on the target (the target is linear in the residual stream, so this " +
      "is also the first-order prediction)", formatScore(v.edge)],
    ["measured change: the target in the real model, clean minus with the source removed from the final norm's input",
      formatScore(v.direct)],
    ["measured / edge", ratio],
  ] : [
    ["DPA's edge: the source's share of the destination's score, each of the destination's paths (query, key, " +
      "value; gate, up) at its weight μ", formatScore(v.edge)],
    ...(v.first_order === undefined || v.first_order === null ? [] : [["first-order prediction: the same paths at " +
      "weight 1, what the linearised model predicts removing the source from the destination's input does",
    formatScore(v.first_order)]]),
    ["measured change: the destination's score S = z · G in the real model (G held at its DPA value), clean minus " +
      "with the source removed from what the destination reads", formatScore(v.direct)],
    [v.first_order === undefined || v.first_order === null ? "measured / edge" : "measured / predicted", ratio],
    ["the target's change when the destination's write alone is patched (everything after it recomputed)",
      formatScore(v.target)],
  ];
  return make("div", { class: "dpa-graph-result" }, [make("div", { class: "dpa-graph-subtitle", text: "path patching" }),
    make("div", { class: "dpa-graph-terms dpa-graph-verified" }, rows.flatMap(([k, x]) => [make("span", { text: k }), make("span", { text: x })])),
    make("div", { class: "dpa-graph-verdict", text: verifyVerdict(v) })]);
}

/**
 * What a verification says in words: whether the real model moved the destination the way the first-order
 * prediction said (sign, then size), what a disagreement means, and which number answers what.
 * @param {Verified} v
 */
export function verifyVerdict(v) {
  const sign = (/** @type {number | null | undefined} */ x) => (x === null || x === undefined || !Number.isFinite(x) || x === 0 ? 0 : Math.sign(x));
  const toTarget = v.destination === "target";
  const hasPrediction = toTarget || (v.first_order !== undefined && v.first_order !== null);
  const predicted = toTarget || !hasPrediction ? v.edge : /** @type {number} */ (v.first_order);
  const what = hasPrediction ? "the first-order prediction" : "DPA's edge";
  const parts = [];
  if (!sign(v.direct) || !sign(predicted)) parts.push("One of the two is zero: nothing to compare.");
  else if (sign(v.direct) !== sign(predicted)) {
    parts.push(`Sign disagreement: removing the source moves the ${toTarget ? "target" : "destination"} the other way ` +
      `from ${what}. The prediction is exact for a small change (it already counts, to first order, how the ` +
      (toTarget ? "target responds" : "attention pattern or the gate responds") + "); removing the whole of the " +
      "source's write is a large change, and here what comes beyond first order (" +
      (toTarget ? "the final norm's scale, frozen in the linearised model" : "a softmax or a gate saturating or switching") +
      ") outweighs it.");
  } else if (!hasPrediction) {
    parts.push("Same sign as DPA's edge. Their sizes do not compare: the edge counts each path at its weight μ.");
  } else {
    const r = Math.abs(/** @type {number} */ (v.direct) / predicted);
    parts.push(r >= 0.8 && r <= 1.25 ? `The real model agrees with ${what} in sign and size (×${r.toFixed(2)}): ` +
      "the first-order picture holds for this edge." : `Same sign as ${what}, at ×${r.toFixed(2)} its size: ` +
      "removing the whole write is beyond first order here.");
  }
  if (!toTarget && hasPrediction && sign(v.edge) && sign(v.first_order) && sign(v.edge) !== sign(v.first_order)) {
    parts.push("DPA's edge and the prediction differ in sign: the destination's paths pull different ways (the value " +
      "path against the query and key paths) and μ weighs them unlike the prediction's weight 1 each.");
  }
  parts.push("Which tells more: the measured change is the causal answer for removing this source as this " +
    (toTarget ? "model reads it" : "destination reads it; the target's change says whether that matters for the output") +
    ". The edge is an attribution share: compare it with the other edges into the same node (with conservative " +
    "weights they add up to its score, else its in_gap holds the rest), and the measured change with the " +
    "prediction, not with the edge.");
  return parts.join(" ");
}
