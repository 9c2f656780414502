// @ts-check
// Pure helpers of the view: ranking, mixture-of-experts names, layouts, labels, why controls are off. The
// colour scale and the token labels live in graph.js (the graph view and the CLI's page use them
// too) and are re-exported here.
export { DIVERGING, symmetricMax, divergingRgb, divergingColor, textColor, formatScore, tokenLabel, shortLabel }
  from "./graph.js";

// ---------------------------------------------------------------- ranking

/**
 * Indices of the k largest entries (by |value| or by signed value), ties by index.
 * @param {number[]} values
 * @param {number} k
 * @param {"abs" | "signed"} [by]
 */
export function topIndices(values, k, by = "abs") {
  const key = by === "abs" ? (/** @type {number} */ v) => Math.abs(v) : (/** @type {number} */ v) => v;
  return values.map((v, i) => i)
    .filter((i) => Number.isFinite(values[i]))
    .sort((i, j) => key(values[j]) - key(values[i]) || i - j)
    .slice(0, Math.max(0, k));
}

/**
 * The k heads with the largest |score|: [{layer, head, score}]; with ``keep`` (layer, column), only those cells
 * (one kind's units: ``topUnits``).
 * @param {number[][]} scores [layer][head]
 * @param {number} k
 * @param {(layer: number, head: number) => boolean} [keep]
 */
export function topHeads(scores, k, keep) {
  const width = scores.length ? scores[0].length : 0;
  const flat = scores.flat().map((v, i) => !keep || keep(Math.floor(i / width), i % width) ? v : NaN);
  return topIndices(flat, k).map((i) => ({ layer: Math.floor(i / width), head: i % width, score: flat[i] }));
}

/** The k units of one kind with the largest |score| (a hybrid's rows of that kind, Falcon-H1's columns): [{layer,
 * head (its column), score}]. @param {Payload} data @param {string} kind @param {number} k */
export function topUnits(data, kind, k) {
  return topHeads(data.head_scores, k, (l, c) => unitKind(data, l, c) === kind);
}

/**
 * Top neurons over all layers from the per-layer top lists: [{layer, neuron, score}].
 * @param {{index: number[][], score: number[][]}} neurons
 * @param {number} k
 * @param {number | null} [layer]  only this layer
 */
export function topNeurons(neurons, k, layer = null) {
  /** @type {{layer: number, neuron: number, score: number}[]} */
  const all = [];
  neurons.index.forEach((row, l) => {
    if (layer !== null && layer !== l) return;
    row.forEach((n, j) => all.push({ layer: l, neuron: n, score: neurons.score[l][j] }));
  });
  return topIndices(all.map((c) => c.score), k).map((i) => all[i]);
}

// ---------------------------------------------------------------- mixture of experts

/** The payload has expert scores (a mixture-of-experts model). @param {Payload} data */
export function hasExperts(data) {
  return Array.isArray(data.expert_scores) && data.expert_scores.length > 0 && data.expert_scores[0].length > 0;
}

/** Whether layer ``layer``'s MLP is dense in a mixture of experts that has both kinds (Jamba's): no experts on that
 * row, its neurons its dense MLP's. @param {Payload} data @param {number} layer */
export function isDense(data, layer) {
  return Array.isArray(data.dense_layers) && data.dense_layers.includes(layer);
}

/** The first column of the units beside attention on every row (Falcon-H1's SSM heads after its attention
 * heads: ``beside`` [kind, first]), or null: one kind of unit per row. @param {Payload} data */
export function besideColumn(data) {
  return Array.isArray(data.beside) ? data.beside[1] : null;
}

/**
 * The kind of unit column ``column`` of layer ``layer``'s row of head scores holds: "head", a hybrid's mixer's on
 * its rows ("conv", "scan"), or beside attention (Falcon-H1's) the mixer's from column ``beside[1]`` on. Without a
 * column: the row's kind (its attention heads' beside attention).
 * @param {Payload} data @param {number} layer @param {number} [column]
 */
export function unitKind(data, layer, column) {
  const first = besideColumn(data);
  if (first !== null && column !== undefined && column >= first) return /** @type {any[]} */ (data.beside)[0];
  return data.layer_kinds?.[layer] ?? "head";
}

/** A unit's index among its kind's in the row: the column, less ``beside[1]`` for a unit beside attention.
 * @param {Payload} data @param {number} column */
export function unitIndex(data, column) {
  const first = besideColumn(data);
  return first !== null && column >= first ? column - first : column;
}

/** The kinds of unit the heads' grid holds, in order: ["head"], a hybrid's ["conv", "head"], Falcon-H1's
 * ["head", "scan"]. @param {Payload} data */
export function unitKinds(data) {
  return data.unit_kinds ?? ["head"];
}

/** A kind's units in words: "heads", "scan units". @param {string} kind */
export function unitsWord(kind) {
  return kind === "head" ? "heads" : `${kind} units`;
}

/** A unit of the heads' grid as shown, by its column: "L3.H2", a hybrid's "L0.C3", beside four attention heads
 * column 5's "L0.S1". @param {Payload} data @param {number} layer @param {number} head */
export function headLabel(data, layer, head) {
  return `L${layer}.${data.unit_letters?.[unitKind(data, layer, head)] ?? "H"}${unitIndex(data, head)}`;
}

/** A slot's name: "E2", or "shared" for the shared expert. @param {Payload} data @param {number} slot */
export function expertName(data, slot) {
  return data.expert_names?.[slot] ?? (slot < (data.n_experts ?? Infinity) ? `E${slot}` : "shared");
}

/** An expert as shown: "L3.E2", "L3.shared". @param {Payload} data @param {number} layer @param {number} slot */
export function expertLabel(data, layer, slot) {
  return `L${layer}.${expertName(data, slot)}`;
}

/**
 * Where neuron ``neuron`` of a layer sits: {expert, index} with expert a routed expert's number or
 * "shared", index the neuron within it; null on a dense model or a dense layer (``isDense``), or when the
 * experts' width is not known.
 * @param {Payload} data @param {number} neuron @param {number} layer
 * @returns {{expert: number | "shared", index: number} | null}
 */
export function neuronInExpert(data, neuron, layer) {
  const n = data.n_experts, d = data.d_expert;
  if (!hasExperts(data) || !n || !d || isDense(data, layer)) return null;
  const e = Math.floor(neuron / d);
  return e < n ? { expert: e, index: neuron % d } : { expert: "shared", index: neuron - n * d };
}

/**
 * A neuron as shown: "L3.N101" on a dense model, "L3.E2.N5" (neuron 5 of expert 2) or "L3.S.N5" (of the
 * shared expert) on a mixture of experts.
 * @param {Payload} data @param {number} layer @param {number} neuron
 */
export function neuronLabel(data, layer, neuron) {
  const at = neuronInExpert(data, neuron, layer);
  if (!at) return `L${layer}.N${neuron}`;
  return `L${layer}.${at.expert === "shared" ? "S" : `E${at.expert}`}.N${at.index}`;
}

/**
 * The k experts with the largest |score|: [{layer, slot, score}].
 * @param {number[][]} scores [layer][slot]
 * @param {number} k
 */
export function topExperts(scores, k) {
  return topHeads(scores, k).map((c) => ({ layer: c.layer, slot: c.head, score: c.score }));
}

/**
 * The neurons of one expert among the layer's top neurons the payload has, by |score|: [{neuron, index, score}]
 * (index: within the expert). [] when the experts' width is not known.
 * @param {Payload} data @param {number} layer @param {number} slot
 */
export function expertNeurons(data, layer, slot) {
  const names = data.expert_names ?? [];
  const want = names[slot] === "shared" ? "shared" : slot;
  /** @type {{neuron: number, index: number, score: number}[]} */
  const out = [];
  (data.neurons.index[layer] ?? []).forEach((n, j) => {
    const at = neuronInExpert(data, n, layer);
    if (at && at.expert === want) out.push({ neuron: n, index: at.index, score: data.neurons.score[layer][j] });
  });
  return topIndices(out.map((c) => c.score), out.length).map((i) => out[i]);
}

// ---------------------------------------------------------------- layout

/**
 * Cell positions of the layer x head heatmap; heads sharing a KV head (a GQA group) sit
 * together, with a wider gap between groups. Layer 0 is the top row. ``beside``: the first column of the units
 * beside attention (Falcon-H1's SSM heads): the KV groups are the attention heads', and the units beside them
 * follow after a wider gap, ``split`` the x of the separator drawn in it (null without).
 * @param {number} nLayers
 * @param {number} nHeads  the row's width (beside attention: its heads and the units beside them)
 * @param {number} nKv
 * @param {{cell?: number, gap?: number, groupGap?: number, besideGap?: number, left?: number, top?: number,
 *   beside?: number | null}} [opts]
 */
export function headLayout(nLayers, nHeads, nKv, opts = {}) {
  const { cell = 14, gap = 1, groupGap = 5, besideGap = 11, left = 30, top = 16, beside = null } = opts;
  const attn = beside !== null && beside > 0 && beside < nHeads ? beside : nHeads;  // the attention heads' columns
  const kv = nKv > 0 && attn % nKv === 0 ? nKv : attn;
  const groupSize = attn / kv;
  const x = (/** @type {number} */ h) => left + h * (cell + gap) + Math.floor(Math.min(h, attn - 1) / groupSize) * groupGap +
    (h >= attn ? besideGap : 0);
  const y = (/** @type {number} */ l) => top + l * (cell + gap);
  const cells = [];
  for (let l = 0; l < nLayers; l++) for (let h = 0; h < nHeads; h++) cells.push({ layer: l, head: h, x: x(h), y: y(l) });
  return {
    cells, cell, groupSize, attention: attn,
    width: x(nHeads - 1) + cell + 2,
    height: y(nLayers - 1) + cell + 2,
    rowY: y, colX: x,
    split: attn < nHeads ? (x(attn - 1) + cell + x(attn)) / 2 : null,
    /** The KV group of an attention head; null for a unit beside attention. */
    group: (/** @type {number} */ h) => h < attn ? Math.floor(h / groupSize) : null,
  };
}

/**
 * Cell positions of the layer x expert heatmap: the routed experts side by side, then the shared expert
 * (when there is one) after a wider gap. Layer 0 is the top row, as in the head heatmap.
 * @param {number} nLayers
 * @param {number} nSlots  routed experts, then the shared one
 * @param {number} nRouted
 * @param {{cell?: number, gap?: number, sharedGap?: number, left?: number, top?: number}} [opts]
 */
export function expertLayout(nLayers, nSlots, nRouted, opts = {}) {
  const { cell = 14, gap = 1, sharedGap = 5, left = 30, top = 16 } = opts;
  const x = (/** @type {number} */ s) => left + s * (cell + gap) + (s >= nRouted ? sharedGap : 0);
  const y = (/** @type {number} */ l) => top + l * (cell + gap);
  const cells = [];
  for (let l = 0; l < nLayers; l++) {
    for (let s = 0; s < nSlots; s++) cells.push({ layer: l, slot: s, shared: s >= nRouted, x: x(s), y: y(l) });
  }
  return {
    cells, cell,
    width: (nSlots > 0 ? x(nSlots - 1) + cell : left) + 2,
    height: (nLayers > 0 ? y(nLayers - 1) + cell : top) + 2,
    rowY: y, colX: x,
  };
}

/**
 * Greedy line wrapping: the row of each item so that no row is wider than maxWidth.
 * @param {number[]} widths
 * @param {number} maxWidth
 * @param {number} [gap]
 */
export function wrapRows(widths, maxWidth, gap = 2) {
  const rows = [];
  let row = 0, used = 0;
  for (const w of widths) {
    if (used > 0 && used + gap + w > maxWidth) { row++; used = 0; }
    rows.push(row);
    used += (used > 0 ? gap : 0) + w;
  }
  return rows;
}


/**
 * Which of n evenly spaced axis positions get a label so that labels sit at least ``minGap``
 * pixels apart: every ``step``-th one, always ``keep`` (the target), dropping its close neighbours.
 * @param {number} n  positions
 * @param {number} pitch  pixels between neighbouring positions
 * @param {number} minGap  pixels a label needs
 * @param {number | null} [keep]
 */
export function axisTicks(n, pitch, minGap, keep = null) {
  const step = Math.max(1, Math.ceil(minGap / Math.max(pitch, 1e-9)));
  const hasKeep = keep !== null && keep !== undefined && keep >= 0 && keep < n;
  const out = [];
  for (let i = 0; i < n; i += step) if (!hasKeep || i === keep || Math.abs(i - /** @type {number} */ (keep)) >= step) out.push(i);
  if (hasKeep && !out.includes(/** @type {number} */ (keep))) out.push(/** @type {number} */ (keep));
  return out.sort((a, b) => a - b);
}

/**
 * The path weights, named: "query 0.25 · key 0.25 · value 0.50 · gate 0.50 · up 0.50", then
 * " · router 0.50 · expert 0.50" on a mixture of experts (where the payload has them).
 */
export function weightsText(/** @type {Record<string, number>} */ w) {
  return ["query", "key", "value", "gate", "up", "router", "expert"].filter((k, i) => i < 5 || typeof w[k] === "number")
    .map((k) => `${k} ${Number(w[k]).toFixed(2)}`).join(" · ");
}

/** Mutable so that tests can shorten it: how long the view waits for the kernel's answer. */
export const timing = { helloMs: 2500 };

/** Why the kernel-needing controls are off ("" when they are on). @param {Kernel} kernel @param {boolean} hasModel @param {string} kind */
export function offlineReason(kernel, hasModel, kind) {
  if (kernel === "connecting") return "connecting to the kernel…";
  if (kernel === "none") {
    return "static page: changing the target, weights or method, verifying, and the details of heads and neurons " +
      "not exported need a running kernel — open the notebook in JupyterLab and run it";
  }
  if (!hasModel) return "no model attached: pass model and tokenizer to CircuitWidget to change the target, weights or method";
  if (kind === "vector") return "the target is a vector direction: target, weights and method are fixed";
  return "";
}

/**
 * Why the graph's verify button is off ("" when it is on): path patching runs the model in the kernel.
 * @param {Kernel} kernel @param {boolean} hasModel @param {boolean} verifiable  the circuit has its tensors
 */
export function graphVerifyReason(kernel, hasModel, verifiable) {
  if (kernel === "connecting") return "connecting to the kernel…";
  if (kernel === "none") {
    return "static page: verifying an edge runs the model (path patching) and needs a running kernel — open the " +
      "notebook in JupyterLab and run it (or call circuit.verify(model, tokenizer, edge) in Python)";
  }
  if (!hasModel) return "no model attached: pass model and tokenizer to CircuitWidget to verify edges";
  if (!verifiable) return "this circuit has no tensors (read back from JSON): compute it with dpa.circuit to verify edges";
  return "";
}
