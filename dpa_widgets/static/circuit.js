// @ts-check
/**
 * Circuit inspector for a Dual Path Attribution result: one plain ES module, no framework,
 * no bundler, no network. The pure helpers (colour scale, ranking, layout, export) are
 * exported so that Node's test runner can test them without a DOM.
 *
 * @typedef Model  The widget's traits, snake_case on both sides (dpa_widgets/circuit.py).
 * @property {Payload} _data                  the attribution as the view draws it
 * @property {Record<string, Detail>} _details  head / neuron / expert details by key ("head:L:H", "neuron:L:N",
 *   "expert:L:S")
 * @property {boolean} _live                  a model is attached: the controls recompute in the kernel. Saved
 *   state keeps it true (a book page), so the view trusts it only once a kernel answered its "hello"
 *   message (see Kernel below): with no answer the page is static and the controls stay off.
 * @property {boolean} _busy                  the kernel is computing
 * @property {string} _error                  the last error message ("" = none)
 * @property {string[]} _methods              "dpa" and the baselines the kernel offers
 * @property {Comparison} _comparison         the current baseline against DPA ({} for DPA)
 * @property {Verification} _verify           the last ablation check ({} = none yet)
 * @property {number[] | null} selected_head  [layer, head]
 * @property {number[] | null} selected_neuron [layer, neuron]
 * @property {number[] | null} selected_expert [layer, slot] (mixture of experts; null on a dense model)
 * @property {number | null} selected_token   a position
 * @property {Record<string, any>} selection  the selection as JSON (written by this view)
 * @property {string} target                  target token ("" = the model's prediction)
 * @property {string} contrast                contrast foil ("" = none)
 * @property {string} weights_preset          "default", "custom" (the result's own weights) or a sensitivity family
 * @property {string[]} _presets               the weights_preset choices on offer
 * @property {number} weights_p               p of the family, in [0, 1]
 * @property {string} method                  "dpa" or a baseline name
 * @property {number} top_k                   k for "top-k" ablation and top lists
 *
 * @typedef {"connecting" | "live" | "none"} Kernel  whether a kernel answered the view's
 *   {action: "hello"} (CircuitWidget._on_message replies {action: "hello", live}): "connecting" until
 *   it does or timing.helloMs pass, then "none" (a static page: book, save_html) unless a late answer comes.
 *
 * @typedef Payload
 * @property {string[]} tokens
 * @property {number[]} token_scores
 * @property {boolean[]} special
 * @property {{kind: string, position: number, token: string|null, token_id: number|null,
 *   contrast: string|null, contrast_id: number|null, probability: number|null, logprob: number|null}} target
 * @property {number} target_logit
 * @property {number} completeness_gap
 * @property {string[]} [caveats]             what dpa cannot vouch for (Attribution.caveats)
 * @property {Record<string, number>} weights  query, key, value, gate, up (and router, expert on a mixture of experts)
 * @property {string} method
 * @property {string} model_name
 * @property {number} n_layers
 * @property {number} n_heads
 * @property {number} n_kv_heads
 * @property {number} d_mlp
 * @property {number[][]} head_scores         [layer][head]
 * @property {number[]} mlp_totals            [layer] sum of all neuron scores
 * @property {{index: number[][], score: number[][]}} neurons  top neurons per layer by |score|
 * @property {[string, number][]} top_predictions
 * @property {Route[] | null} token_routes    per position: the components that route the token
 * @property {number} [n_experts]             mixture of experts only (absent on a dense model): routed experts
 * @property {number | null} [d_expert]       ... neurons per routed expert: neuron n of a layer is neuron
 *   n % d_expert of expert n // d_expert, the shared expert's after n_experts * d_expert (null: not known)
 * @property {string[]} [expert_names]        ... one per slot: "E0" .. "E{n-1}", then "shared" if there is one
 * @property {number[][]} [expert_scores]     ... [layer][slot]
 *
 * @typedef Route
 * @property {[number, number, number][]} heads    [layer, head, score of edges with this key]
 * @property {[number, number, number][]} neurons  [layer, neuron, score at this position]
 * @property {[number, number, number][]} [experts] [layer, slot, score at this position] (mixture of experts)
 *
 * @typedef Detail
 * @property {"head" | "neuron" | "expert"} kind
 * @property {number} layer
 * @property {number} index
 * @property {number} score
 * @property {number[][] | null} [edges]      head: [query][key] edge scores
 * @property {number[] | null} [by_key]       head: per key position (sum over queries)
 * @property {number[] | null} [by_pos]       neuron or expert: per position
 * @property {[string, number][] | null} [promotes]    neuron: tokens its output direction raises
 * @property {[string, number][] | null} [suppresses]
 *
 * @typedef Comparison
 * @property {string} [method]
 * @property {"input" | "component"} [level]
 * @property {number[]} [token_scores]
 * @property {number[][]} [head_scores]
 * @property {number | null} [rho]            Spearman rank correlation with DPA (tokens or heads)
 * @property {number | null} [rho_neurons]    ... and on neurons, for component methods that score them
 *
 * @typedef Verification
 * @property {string} [mode]
 * @property {string[]} [units]
 * @property {number} [p_before]
 * @property {number} [p_after]
 * @property {string} [token]
 */

// ---------------------------------------------------------------- colour scale

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
export function formatScore(/** @type {number} */ v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  const s = a >= 1e4 || a < 1e-3 ? a.toExponential(2) : a.toPrecision(3);
  return (v < 0 ? "−" : "+") + s;
}

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
 * The k heads with the largest |score|: [{layer, head, score}].
 * @param {number[][]} scores [layer][head]
 * @param {number} k
 */
export function topHeads(scores, k) {
  const width = scores.length ? scores[0].length : 0;
  const flat = scores.flat();
  return topIndices(flat, k).map((i) => ({ layer: Math.floor(i / width), head: i % width, score: flat[i] }));
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
 * "shared", index the neuron within it; null on a dense model, or when the experts' width is not known.
 * @param {Payload} data @param {number} neuron
 * @returns {{expert: number | "shared", index: number} | null}
 */
export function neuronInExpert(data, neuron) {
  const n = data.n_experts, d = data.d_expert;
  if (!hasExperts(data) || !n || !d) return null;
  const e = Math.floor(neuron / d);
  return e < n ? { expert: e, index: neuron % d } : { expert: "shared", index: neuron - n * d };
}

/**
 * A neuron as shown: "L3.N101" on a dense model, "L3.E2.N5" (neuron 5 of expert 2) or "L3.S.N5" (of the
 * shared expert) on a mixture of experts.
 * @param {Payload} data @param {number} layer @param {number} neuron
 */
export function neuronLabel(data, layer, neuron) {
  const at = neuronInExpert(data, neuron);
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
    const at = neuronInExpert(data, n);
    if (at && at.expert === want) out.push({ neuron: n, index: at.index, score: data.neurons.score[layer][j] });
  });
  return topIndices(out.map((c) => c.score), out.length).map((i) => out[i]);
}

// ---------------------------------------------------------------- layout

/**
 * Cell positions of the layer x head heatmap; heads sharing a KV head (a GQA group) sit
 * together, with a wider gap between groups. Layer 0 is the top row.
 * @param {number} nLayers
 * @param {number} nHeads
 * @param {number} nKv
 * @param {{cell?: number, gap?: number, groupGap?: number, left?: number, top?: number}} [opts]
 */
export function headLayout(nLayers, nHeads, nKv, opts = {}) {
  const { cell = 14, gap = 1, groupGap = 5, left = 30, top = 16 } = opts;
  const kv = nKv > 0 && nHeads % nKv === 0 ? nKv : nHeads;
  const groupSize = nHeads / kv;
  const x = (/** @type {number} */ h) => left + h * (cell + gap) + Math.floor(h / groupSize) * groupGap;
  const y = (/** @type {number} */ l) => top + l * (cell + gap);
  const cells = [];
  for (let l = 0; l < nLayers; l++) for (let h = 0; h < nHeads; h++) cells.push({ layer: l, head: h, x: x(h), y: y(l) });
  return {
    cells, cell, groupSize,
    width: x(nHeads - 1) + cell + 2,
    height: y(nLayers - 1) + cell + 2,
    rowY: y, colX: x,
    group: (/** @type {number} */ h) => Math.floor(h / groupSize),
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

// ---------------------------------------------------------------- selection and export

/**
 * What is selected, with its scores, as plain JSON (the ``selection`` trait and the download).
 * @param {Payload} data
 * @param {{head: number[]|null, neuron: number[]|null, expert?: number[]|null, token: number|null}} sel
 */
export function selectionPayload(data, sel) {
  /** @type {Record<string, any>} */
  const out = { target: data.target, method: data.method, model_name: data.model_name };
  if (sel.head) {
    const [l, h] = sel.head;
    out.head = { layer: l, head: h, kv_group: headLayout(data.n_layers, data.n_heads, data.n_kv_heads).group(h),
      score: data.head_scores[l]?.[h] ?? null };
  }
  if (sel.neuron) {
    const [l, n] = sel.neuron;
    const j = data.neurons.index[l]?.indexOf(n) ?? -1;
    out.neuron = { layer: l, neuron: n, score: j >= 0 ? data.neurons.score[l][j] : null };
    const at = neuronInExpert(data, n);
    if (at) Object.assign(out.neuron, { expert: at.expert, index_in_expert: at.index, label: neuronLabel(data, l, n) });
  }
  if (sel.expert && hasExperts(data)) {
    const [l, e] = sel.expert;
    out.expert = { layer: l, slot: e, name: expertName(data, e), score: data.expert_scores?.[l]?.[e] ?? null };
  }
  if (sel.token !== null && sel.token !== undefined && sel.token < data.tokens.length) {
    const p = sel.token;
    out.token = { position: p, token: data.tokens[p], score: data.token_scores[p],
      routes: data.token_routes ? data.token_routes[p] : null };
  }
  return out;
}

/** @param {string} s */
export function escapeXml(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

/**
 * A standalone SVG of the view: token strip, head heatmap, MLP totals (and the expert heatmap below the heads,
 * on a mixture of experts), legend (light colours).
 * @param {Payload} data
 * @param {{tokenScores?: number[], heads?: number[][], head?: number[]|null, caption?: string}} [opts]
 */
export function viewSvg(data, opts = {}) {
  const scores = opts.tokenScores ?? data.token_scores;
  const heads = opts.heads ?? data.head_scores;
  const width = 760, charW = 7.2, lineH = 22;
  const labels = data.tokens.map(tokenLabel);
  const widths = labels.map((t) => Math.max(12, t.length * charW + 8));
  const rows = wrapRows(widths, width - 20, 3);
  const tMax = symmetricMax(scores, data.special);
  const parts = [];
  let x = 10, row = 0;
  const top = 46;
  labels.forEach((t, i) => {
    if (rows[i] !== row) { row = rows[i]; x = 10; }
    const y = top + row * lineH;
    parts.push(`<rect x="${x.toFixed(1)}" y="${y}" width="${widths[i].toFixed(1)}" height="18" rx="3" ` +
      `fill="${divergingColor(scores[i], tMax)}" stroke="#ccc" stroke-width="0.5"/>` +
      `<text x="${(x + 4).toFixed(1)}" y="${y + 13}" fill="${textColor(scores[i], tMax)}">${escapeXml(t)}</text>`);
    x += widths[i] + 3;
  });
  const hTop = top + (rows.length ? rows[rows.length - 1] + 1 : 0) * lineH + 30;
  const lay = headLayout(data.n_layers, data.n_heads, data.n_kv_heads, { cell: 10, left: 40, top: hTop });
  const hMax = symmetricMax(heads.flat());
  for (const c of lay.cells) {
    const sel = opts.head && opts.head[0] === c.layer && opts.head[1] === c.head;
    parts.push(`<rect x="${c.x}" y="${c.y}" width="10" height="10" fill="${divergingColor(heads[c.layer][c.head], hMax)}"` +
      (sel ? ` stroke="#000" stroke-width="2"` : "") + `/>`);
  }
  for (let l = 0; l < data.n_layers; l += Math.max(1, Math.ceil(data.n_layers / 10))) {
    parts.push(`<text x="${lay.colX(0) - 4}" y="${lay.rowY(l) + 9}" text-anchor="end">L${l}</text>`);
  }
  // the bars clear the heads caption ("heads (max |score| …)", ~170 px) on narrow models too
  const bx = Math.max(lay.width + 60, lay.colX(0) + 190), bw = 200, mMax = symmetricMax(data.mlp_totals);
  data.mlp_totals.forEach((v, l) => {
    const w = Math.abs(v) / mMax * bw / 2;
    parts.push(`<rect x="${(v >= 0 ? bx + bw / 2 : bx + bw / 2 - w).toFixed(1)}" y="${lay.rowY(l)}" width="${w.toFixed(1)}" ` +
      `height="10" fill="${divergingColor(v, mMax)}" stroke="#888" stroke-width="0.3"/>`);
  });
  let bottom = Math.max(lay.height, hTop + 20);
  if (hasExperts(data) && data.expert_scores) {
    const slots = data.expert_scores[0].length;
    const eTop = lay.height + 34;
    const ecell = Math.max(3, Math.min(10, Math.floor((width - 60) / slots) - 1));
    const el = expertLayout(data.n_layers, slots, data.n_experts ?? slots, { cell: ecell, left: 40, top: eTop });
    const eMax = symmetricMax(data.expert_scores.flat());
    for (const c of el.cells) {
      parts.push(`<rect x="${c.x}" y="${c.y}" width="${ecell}" height="${ecell}" ` +
        `fill="${divergingColor(data.expert_scores[c.layer][c.slot], eMax)}"/>`);
    }
    for (let l = 0; l < data.n_layers; l += Math.max(1, Math.ceil(data.n_layers / 10))) {
      parts.push(`<text x="${el.colX(0) - 4}" y="${el.rowY(l) + ecell - 1}" text-anchor="end">L${l}</text>`);
    }
    parts.push(`<text x="${el.colX(0)}" y="${eTop - 6}" fill="#555">experts: layer × ` +
      `${data.n_experts ?? slots} routed${slots > (data.n_experts ?? slots) ? " + shared" : ""} (max |score| ${formatScore(eMax)})</text>`);
    bottom = el.height;
  }
  const height = bottom + 20;
  const t = data.target;
  const title = `${data.model_name || "model"} · target ${JSON.stringify(t.token)}` +
    (t.contrast ? ` vs ${JSON.stringify(t.contrast)}` : "") + ` · ${data.method}`;
  return `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" ` +
    `font-family="sans-serif" font-size="11">` +
    `<rect width="100%" height="100%" fill="#fff"/>` +
    `<text x="10" y="18" font-size="13" font-weight="bold">${escapeXml(title)}</text>` +
    `<text x="10" y="34" fill="#555">${escapeXml(opts.caption ?? "tokens")} (max |score| ${formatScore(tMax)})</text>` +
    parts.join("") +
    `<text x="${lay.colX(0)}" y="${hTop - 6}" fill="#555">heads (max |score| ${formatScore(hMax)})</text>` +
    `<text x="${bx}" y="${hTop - 6}" fill="#555">MLP totals per layer (max ${formatScore(mMax)})</text>` +
    `</svg>`;
}

// ---------------------------------------------------------------- DOM helpers

/**
 * @param {string} tag
 * @param {Record<string, any>} [attrs]
 * @param {(Node | string)[]} [children]
 */
function h(tag, attrs = {}, children = []) {
  const svg = ["svg", "rect", "text", "g", "line", "title"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c);
  return node;
}

/** @param {string} name @param {string} text @param {string} type */
function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h("a", { href: url, download: name });
  document.body.append(a);
  /** @type {HTMLAnchorElement} */ (a).click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/** @param {string} svg @param {string} name */
function downloadPng(svg, name) {
  const img = new Image();
  img.onload = () => {
    const canvas = document.createElement("canvas");
    canvas.width = img.width * 2;
    canvas.height = img.height * 2;
    const ctx = /** @type {CanvasRenderingContext2D} */ (canvas.getContext("2d"));
    ctx.scale(2, 2);
    ctx.drawImage(img, 0, 0);
    canvas.toBlob((blob) => {
      if (!blob) return;
      const url = URL.createObjectURL(blob);
      const a = h("a", { href: url, download: name });
      document.body.append(a);
      /** @type {HTMLAnchorElement} */ (a).click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 1000);
    }, "image/png");
  };
  img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svg);
}

/** A gradient legend: -max ... 0 ... +max. @param {number} max @param {string} label */
function legend(max, label) {
  const stops = DIVERGING.map((c, i) => `rgb(${c.join(",")}) ${(i / (DIVERGING.length - 1) * 100).toFixed(0)}%`);
  return h("div", { class: "dpa-legend", title: "symmetric scale, white at zero" }, [
    h("span", { class: "dpa-legend-label", text: label }),
    h("span", { class: "dpa-legend-num", text: formatScore(-max) }),
    h("span", { class: "dpa-legend-bar", style: `background: linear-gradient(to right, ${stops.join(", ")})` }),
    h("span", { class: "dpa-legend-num", text: formatScore(max) }),
  ]);
}

// ---------------------------------------------------------------- the view

/** @param {{model: any, el: HTMLElement}} ctx */
function render({ model, el }) {
  const get = (/** @type {keyof Model} */ name) => model.get(name);
  /** @type {{hover: string, neuronLayer: number|null, neuronCount: number}} */
  const ui = { hover: "", neuronLayer: null, neuronCount: 12 };
  const root = h("div", { class: "dpa-circuit" });
  el.replaceChildren(root);
  /** @type {Kernel} */
  let kernel = "connecting";
  /** The controls that recompute (target, weights, method, verify) are on. */
  const canRecompute = () => kernel === "live" && !!get("_live") && get("_data").target.kind !== "vector";
  const reason = () => offlineReason(kernel, !!get("_live"), get("_data").target.kind);

  const setTrait = (/** @type {string} */ name, /** @type {any} */ value) => {
    model.set(name, value);
    model.save_changes();
  };
  const sel = () => ({ head: get("selected_head"), neuron: get("selected_neuron"), expert: get("selected_expert") ?? null,
    token: get("selected_token") });
  const writeSelection = () => setTrait("selection", selectionPayload(get("_data"), sel()));
  const detail = (/** @type {string} */ key) => /** @type {Detail | undefined} */ ((get("_details") || {})[key]);

  /** The scores the token strip shows now, and what they are. */
  function stripScores() {
    const data = get("_data");
    const s = sel();
    if (s.head) {
      const d = detail(`head:${s.head[0]}:${s.head[1]}`);
      if (d && d.by_key) return { scores: d.by_key, caption: `tokens coloured by head L${s.head[0]}.H${s.head[1]} (its edges from each key)` };
    }
    if (s.neuron) {
      const d = detail(`neuron:${s.neuron[0]}:${s.neuron[1]}`);
      if (d && d.by_pos) return { scores: d.by_pos, caption: `tokens coloured by neuron ${neuronLabel(data, s.neuron[0], s.neuron[1])} (its contribution at each position)` };
    }
    if (s.expert) {
      const d = detail(`expert:${s.expert[0]}:${s.expert[1]}`);
      if (d && d.by_pos) return { scores: d.by_pos, caption: `tokens coloured by expert ${expertLabel(data, s.expert[0], s.expert[1])} (its contribution at each position)` };
    }
    const cmp = get("_comparison") || {};
    if (cmp.level === "input" && cmp.token_scores) return { scores: cmp.token_scores, caption: `input scores · ${cmp.method}` };
    return { scores: data.token_scores, caption: `input scores · ${data.method}` };
  }

  function headerView() {
    const data = get("_data");
    const t = data.target;
    const what = t.kind === "contrast" ? `${JSON.stringify(t.token)} − ${JSON.stringify(t.contrast)}` :
      t.kind === "vector" ? "a vector direction" : JSON.stringify(t.token);
    return h("div", { class: "dpa-header" }, [
      h("span", { class: "dpa-title", text: `Target ${what}` }),
      h("span", { text: t.probability === null ? "" : `p = ${t.probability.toFixed(3)}` }),
      h("span", { text: `${t.kind === "contrast" ? "logit difference" : t.kind} ${formatScore(data.target_logit)}` }),
      h("span", { title: "sum of token scores − target", text: `gap ${formatScore(data.completeness_gap)}` }),
      ...(data.caveats || []).filter((c) => c.startsWith("path weights off")).map((c) =>
        h("span", { class: "dpa-error", title: c, text: "⚠ weights off the paper's constraints" })),
      h("span", { class: "dpa-muted", text: `${data.model_name} · position ${t.position}` }),
    ]);
  }

  function controlsView() {
    const data = get("_data");
    const live = canRecompute();
    const why = reason();
    const busy = get("_busy");
    const preds = data.top_predictions || [];
    const current = data.target.token ?? "";
    const tgt = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-target", disabled: !live || busy, title: why || "target token" }));
    const options = preds.map(([tok, p]) => [tok, `${tokenLabel(tok)}  ${(p * 100).toFixed(1)}%`]);
    if (!preds.some(([tok]) => tok === current)) options.unshift([current, `${tokenLabel(current)}`]);
    for (const [value, label] of options) tgt.append(h("option", { value, text: label, selected: value === current }));
    tgt.addEventListener("change", () => setTrait("target", tgt.value));
    const typed = /** @type {HTMLInputElement} */ (h("input", { class: "dpa-typed", placeholder: "or type a token", size: 10, disabled: !live || busy, title: why || null }));
    typed.addEventListener("change", () => typed.value && setTrait("target", typed.value));
    const foil = /** @type {HTMLInputElement} */ (h("input", { class: "dpa-contrast", placeholder: "contrast foil", size: 10,
      value: get("contrast"), disabled: !live || busy, title: why || "attribute target − foil (empty: no contrast)" }));
    foil.addEventListener("change", () => setTrait("contrast", foil.value));
    const preset = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-preset", disabled: !live || busy, title: why || "path weights" }));
    for (const f of get("_presets") || ["default", "control_content", "attention", "query_key", "mlp"]) {
      preset.append(h("option", { value: f, text: f.replace("_", "-"), selected: f === get("weights_preset") }));
    }
    preset.addEventListener("change", () => setTrait("weights_preset", preset.value));
    const pval = h("span", { class: "dpa-pval", text: Number(get("weights_p")).toFixed(2) });
    const p = /** @type {HTMLInputElement} */ (h("input", { type: "range", min: 0, max: 1, step: 0.05, value: get("weights_p"),
      class: "dpa-p", title: why || "p of the sensitivity family",
      disabled: !live || busy || ["default", "custom"].includes(get("weights_preset")) }));
    p.addEventListener("input", () => { pval.textContent = Number(p.value).toFixed(2); });
    p.addEventListener("change", () => setTrait("weights_p", Number(p.value)));
    const method = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-method", disabled: !live || busy, title: why || "attribution method" }));
    for (const m of get("_methods") || ["dpa"]) method.append(h("option", { value: m, text: m, selected: m === get("method") }));
    method.addEventListener("change", () => setTrait("method", method.value));
    const cmp = get("_comparison") || {};
    const r2 = (/** @type {number|null|undefined} */ r) => (typeof r === "number" && Number.isFinite(r) ? r.toFixed(2) : "–");
    const rho = !cmp.method ? "" : cmp.level === "input" ? `Spearman ρ = ${r2(cmp.rho)} with DPA (token ranks)` :
      `Spearman ρ with DPA: heads ${r2(cmp.rho)}` + ("rho_neurons" in cmp ? `, neurons ${r2(cmp.rho_neurons)}` : "");
    const w = data.weights;
    return h("div", { class: "dpa-controls" }, [
      h("label", {}, ["target ", tgt]), typed,
      h("label", {}, ["vs ", foil]),
      h("label", {}, ["weights ", preset]), h("label", { class: "dpa-slider" }, ["p ", p, pval]),
      h("span", { class: "dpa-muted dpa-weights", title: "path weights μ of the attention (query, key, value) and MLP (gate, up) paths" +
        ("router" in w ? ", and of the router (control) and the experts (content)" : ""),
        text: `μ: ${weightsText(w)}` }),
      h("label", {}, ["method ", method]), h("span", { class: "dpa-rho", text: rho }),
      h("span", { class: "dpa-status", text: busy ? "computing…" : "" }),
      h("div", { class: "dpa-offline" + (kernel === "connecting" ? " dpa-connecting" : ""), role: "status", text: why, hidden: !why }),
      h("span", { class: "dpa-error", role: "alert",
        text: get("_error") ? `⚠ ${get("_error")} — the picture below is still the last result computed` : "" }),
    ]);
  }

  function tokensView() {
    const data = get("_data");
    const { scores, caption } = stripScores();
    const max = symmetricMax(scores, data.special);
    const s = sel();
    const strip = h("div", { class: "dpa-tokens", role: "list", "data-scroll": "tokens" });
    data.tokens.forEach((tok, i) => {
      const v = scores[i];
      const chip = h("span", {
        class: "dpa-token" + (data.special[i] ? " dpa-special" : "") + (s.token === i ? " dpa-locked" : "") +
          (i === data.target.position ? " dpa-target-pos" : ""),
        role: "listitem", "data-pos": i, title: `${i}: ${JSON.stringify(tok)}  ${formatScore(v)}`,
        style: `background:${divergingColor(v, max)};color:${textColor(v, max)}`, text: tokenLabel(tok),
      });
      chip.addEventListener("mouseenter", () => setHover(`token ${i} ${JSON.stringify(tok)}: ${formatScore(v)}`));
      chip.addEventListener("click", () => {
        setTrait("selected_token", s.token === i ? null : i);
      });
      strip.append(chip);
    });
    return h("section", { class: "dpa-panel dpa-tokens-panel" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: caption }), legend(max, "")]),
      strip,
    ]);
  }

  /** Cell size and top margin of the head heatmap (the MLP bars share them, row for row). @param {Payload} data */
  function gridSize(data) {
    const cell = data.n_layers > 40 ? 8 : data.n_heads > 24 ? 9 : 14;
    const gqa = data.n_kv_heads > 0 && data.n_kv_heads < data.n_heads && data.n_heads % data.n_kv_heads === 0;
    return { cell, top: gqa ? 26 : 16 };
  }

  /** Heads routing the selected token, as a set of "l:h". */
  function routedHeads() {
    const data = get("_data");
    const t = get("selected_token");
    const r = t !== null && data.token_routes ? data.token_routes[t] : null;
    return new Set(r ? r.heads.map(([l, hd]) => `${l}:${hd}`) : []);
  }

  function headsView() {
    const data = get("_data");
    const cmp = get("_comparison") || {};
    const scores = cmp.level === "component" && cmp.head_scores ? cmp.head_scores : data.head_scores;
    const max = symmetricMax(scores.flat());
    const { cell, top } = gridSize(data);
    const lay = headLayout(data.n_layers, data.n_heads, data.n_kv_heads, { cell, top });
    const svg = h("svg", { class: "dpa-heatmap", width: lay.width, height: lay.height, role: "grid" });
    const locked = get("selected_head");
    const routed = routedHeads();
    for (const c of lay.cells) {
      const v = scores[c.layer][c.head];
      const isSel = locked && locked[0] === c.layer && locked[1] === c.head;
      const r = h("rect", {
        x: c.x, y: c.y, width: cell, height: cell, fill: divergingColor(v, max),
        class: "dpa-head" + (isSel ? " dpa-locked" : "") + (routed.has(`${c.layer}:${c.head}`) ? " dpa-routed" : ""),
        "data-layer": c.layer, "data-head": c.head,
      }, [h("title", { text: `L${c.layer}.H${c.head} (KV group ${lay.group(c.head)}): ${formatScore(v)}` })]);
      r.addEventListener("mouseenter", () => setHover(`head L${c.layer}.H${c.head} (KV group ${lay.group(c.head)}): ${formatScore(v)}`));
      r.addEventListener("click", () => setTrait("selected_head", isSel ? null : [c.layer, c.head]));
      svg.append(r);
    }
    // axes: layer numbers down the left, head numbers along the top, KV groups above them (GQA only)
    for (const l of axisTicks(data.n_layers, cell + 1, 11)) {
      svg.append(h("text", { x: lay.colX(0) - 4, y: lay.rowY(l) + cell / 2 + 3.5, "text-anchor": "end", class: "dpa-axis dpa-tick", text: `L${l}` }));
    }
    const digits = String(data.n_heads - 1).length;
    for (const hd of axisTicks(data.n_heads, cell + 1, digits * 6 + 3)) {
      svg.append(h("text", { x: lay.colX(hd) + cell / 2, y: top - 4, "text-anchor": "middle", class: "dpa-axis dpa-tick", text: hd }));
    }
    svg.append(h("text", { x: lay.colX(0) - 4, y: top - 4, "text-anchor": "end", class: "dpa-axis dpa-tick", text: "H" }));
    const groups = data.n_heads / lay.groupSize;
    if (lay.groupSize > 1) {
      const pitch = lay.groupSize > 0 && groups > 1 ? lay.colX(lay.groupSize) - lay.colX(0) : 100;
      for (const g of axisTicks(groups, pitch, String(groups - 1).length * 6 + 16)) {
        svg.append(h("text", { x: lay.colX(g * lay.groupSize), y: 10, class: "dpa-axis dpa-tick", text: `kv${g}` },
          [h("title", { text: `KV group ${g}: heads ${g * lay.groupSize}–${(g + 1) * lay.groupSize - 1} share keys and values` })]));
      }
    }
    const title = cmp.level === "component" ? `heads · ${cmp.method}` : "heads (layer × head)";
    return h("section", { class: "dpa-panel" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: title }), legend(max, "")]),
      h("div", { class: "dpa-scroll", "data-scroll": "heads" }, [svg]),
    ]);
  }

  /** The layer x expert heatmap (mixture of experts only): rows level with the head heatmap's layers. */
  function expertsView() {
    const data = get("_data");
    const scores = /** @type {number[][]} */ (data.expert_scores);
    const slots = scores[0].length;
    const nRouted = Math.min(data.n_experts ?? slots, slots);
    const max = symmetricMax(scores.flat());
    const { cell, top } = gridSize(data);
    const lay = expertLayout(data.n_layers, slots, nRouted, { cell, top });
    const svg = h("svg", { class: "dpa-experts", width: lay.width, height: lay.height, role: "grid" });
    const locked = get("selected_expert");
    const t = get("selected_token");
    const r = t !== null && data.token_routes ? data.token_routes[t] : null;
    const routed = new Set(r && r.experts ? r.experts.map(([l, e]) => `${l}:${e}`) : []);
    for (const c of lay.cells) {
      const v = scores[c.layer][c.slot];
      const isSel = locked && locked[0] === c.layer && locked[1] === c.slot;
      const name = expertLabel(data, c.layer, c.slot);
      const rect = h("rect", {
        x: c.x, y: c.y, width: cell, height: cell, fill: divergingColor(v, max),
        class: "dpa-expert" + (c.shared ? " dpa-shared" : "") + (isSel ? " dpa-locked" : "") +
          (routed.has(`${c.layer}:${c.slot}`) ? " dpa-routed" : ""),
        "data-layer": c.layer, "data-expert": c.slot,
      }, [h("title", { text: `${name}${c.shared ? " (shared expert)" : ""}: ${formatScore(v)}` })]);
      rect.addEventListener("mouseenter", () => setHover(`expert ${name}: ${formatScore(v)}`));
      rect.addEventListener("click", () => setTrait("selected_expert", isSel ? null : [c.layer, c.slot]));
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
    const cmp = get("_comparison") || {};
    const title = "experts (layer × expert)" + (cmp.level === "component" ? " · dpa" : "");
    return h("section", { class: "dpa-panel dpa-experts-panel" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: title }), legend(max, "")]),
      h("div", { class: "dpa-scroll", "data-scroll": "experts" }, [svg]),
    ]);
  }

  function neuronsView() {
    const data = get("_data");
    const totals = data.mlp_totals;
    const max = symmetricMax(totals);
    const { cell, top } = gridSize(data);
    const lay = headLayout(data.n_layers, 1, 1, { cell, left: 0, top });  // rows level with the head heatmap's
    const bw = 120;
    const svg = h("svg", { class: "dpa-bars", width: bw + 4, height: lay.height });
    svg.append(h("line", { x1: bw / 2, x2: bw / 2, y1: 0, y2: lay.height, class: "dpa-zero" }));
    totals.forEach((v, l) => {
      const w = Math.abs(v) / max * bw / 2;
      const bar = h("rect", { x: v >= 0 ? bw / 2 : bw / 2 - w, y: lay.rowY(l), width: Math.max(w, 0.5), height: cell,
        fill: divergingColor(v, max), class: "dpa-bar" + (ui.neuronLayer === l ? " dpa-locked" : ""), "data-layer": l },
      [h("title", { text: `MLP L${l}: ${formatScore(v)}` })]);
      bar.addEventListener("mouseenter", () => setHover(`MLP layer ${l} total: ${formatScore(v)} (click: its top neurons)`));
      bar.addEventListener("click", () => { ui.neuronLayer = ui.neuronLayer === l ? null : l; redraw(); });
      svg.append(bar);
    });
    const locked = get("selected_neuron");
    const t = get("selected_token");
    const routedN = new Set(t !== null && data.token_routes ? data.token_routes[t].neurons.map(([l, n]) => `${l}:${n}`) : []);
    const list = h("ol", { class: "dpa-neuron-list" });
    const items = topNeurons(data.neurons, ui.neuronCount, ui.neuronLayer);
    const nMax = symmetricMax(items.map((c) => c.score));
    for (const c of items) {
      const isSel = locked && locked[0] === c.layer && locked[1] === c.neuron;
      const li = h("li", { class: "dpa-neuron" + (isSel ? " dpa-locked" : "") + (routedN.has(`${c.layer}:${c.neuron}`) ? " dpa-routed" : ""),
        "data-layer": c.layer, "data-neuron": c.neuron }, [
        h("span", { class: "dpa-swatch", style: `background:${divergingColor(c.score, nMax)}` }),
        h("span", { text: neuronLabel(data, c.layer, c.neuron) }), h("span", { class: "dpa-num", text: formatScore(c.score) }),
      ]);
      if (neuronInExpert(data, c.neuron)) li.setAttribute("title", `neuron ${c.neuron} of layer ${c.layer}`);
      li.addEventListener("mouseenter", () => setHover(`neuron ${neuronLabel(data, c.layer, c.neuron)}: ${formatScore(c.score)}`));
      li.addEventListener("click", () => setTrait("selected_neuron", isSel ? null : [c.layer, c.neuron]));
      list.append(li);
    }
    const more = h("button", { class: "dpa-more", text: "show more" });
    more.addEventListener("click", () => { ui.neuronCount += 12; redraw(); });
    const scope = ui.neuronLayer === null ? "all layers" : `layer ${ui.neuronLayer}`;
    return h("section", { class: "dpa-panel" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: `MLP totals · top neurons (${scope})` }),
        legend(max, "")]),
      h("div", { class: "dpa-neurons" }, [h("div", { class: "dpa-scroll", "data-scroll": "bars" }, [svg]),
        h("div", { class: "dpa-list-wrap", "data-scroll": "neurons" }, [list, more])]),
    ]);
  }

  /**
   * The [query][key] edge grid on a canvas, with query tokens down the left and key tokens along
   * the top (sticky while the grid scrolls; thinned to one label every ~12 px, the target row always
   * labelled), first scrolled to the target's row.
   * @param {number[][]} edges @param {string[]} tokens @param {string} key @param {number} targetRow
   */
  function edgeCanvas(edges, tokens, key, targetRow) {
    const n = edges.length;
    const cell = Math.max(1, Math.min(16, Math.floor(360 / Math.max(n, 1))));
    const px = Math.max(cell, 2); // at least 2 screen pixels a cell (pixelated), so one row stays visible
    const shown = n * px;
    const canvas = /** @type {HTMLCanvasElement} */ (h("canvas", { class: "dpa-edges", width: n * cell, height: n * cell,
      style: `width:${shown}px;height:${shown}px` }));
    const ctx = canvas.getContext("2d");
    const max = symmetricMax(edges.flat());
    if (ctx) {
      for (let q = 0; q < n; q++) for (let k = 0; k <= q && k < edges[q].length; k++) {
        ctx.fillStyle = divergingColor(edges[q][k], max);
        ctx.fillRect(k * cell, q * cell, cell, cell);
      }
    }
    canvas.addEventListener("mousemove", (ev) => {
      const r = canvas.getBoundingClientRect();
      const k = Math.floor((ev.clientX - r.left) / r.width * n), q = Math.floor((ev.clientY - r.top) / r.height * n);
      if (q >= 0 && q < n && k >= 0 && k <= q) setHover(`edge ${q} ${JSON.stringify(tokens[q])} ← ${k} ${JSON.stringify(tokens[k])}: ${formatScore(edges[q][k])}`);
    });
    const ticks = axisTicks(n, px, 12, targetRow);
    const label = (/** @type {number} */ i) => `${i} ${shortLabel(tokenLabel(tokens[i] ?? ""), 8)}`;
    const side = Math.min(100, 8 + 6.1 * Math.max(3, ...ticks.map((i) => [...label(i)].length)));  // 10px monospace
    const tick = (/** @type {number} */ i, /** @type {Record<string, any>} */ at) => h("text", {
      ...at, class: "dpa-axis dpa-tick" + (i === targetRow ? " dpa-tick-target" : ""), text: label(i) },
      [h("title", { text: `${i}: ${JSON.stringify(tokens[i])}` })]);
    const queries = h("svg", { class: "dpa-edge-axis dpa-edge-queries", width: side, height: shown });
    const keys = h("svg", { class: "dpa-edge-axis dpa-edge-keys", width: shown, height: side });
    for (const i of ticks) {
      const c = i * px + px / 2;
      queries.append(tick(i, { x: side - 3, y: c + 3.5, "text-anchor": "end" }));
      keys.append(tick(i, { x: c + 3.5, y: side - 3, transform: `rotate(-90 ${c + 3.5} ${side - 3})` }));
    }
    const grid = h("div", { class: "dpa-edge-grid", style: `grid-template-columns:${side}px ${shown}px;grid-template-rows:${side}px ${shown}px` }, [
      h("div", { class: "dpa-edge-corner" }), keys, queries, canvas]);
    return h("div", {}, [h("div", { class: "dpa-muted", text: "edges: query (rows) ← key (columns)" }), legend(max, ""),
      h("div", { class: "dpa-scroll dpa-edge-wrap", "data-scroll": key, "data-start": side + targetRow * px + px / 2 }, [grid])]);
  }

  /** @param {[string, number][] | null | undefined} pairs @param {string} label */
  function tokenList(pairs, label) {
    if (!pairs) return h("div", { class: "dpa-muted", text: `${label}: needs the model` });
    return h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: `${label}: ` }),
      ...pairs.map(([t, v]) => h("code", { title: formatScore(v), text: tokenLabel(t) }))]);
  }

  /** What stands in for details not (yet) here: the kernel sends them on selection; a static page has none. */
  function missing(/** @type {string} */ what) {
    const text = kernel === "live" ? "loading…" : kernel === "connecting" ? "waiting for the kernel…" :
      `details not exported for this ${what}: this static page only has those of the top heads and neurons` +
      `${hasExperts(get("_data")) ? " (and experts)" : ""} ` +
      `(and what was selected when it was saved); run the notebook to see them`;
    return h("div", { class: "dpa-muted dpa-missing", text });
  }

  function detailView() {
    const data = get("_data");
    const s = sel();
    const parts = [];
    if (s.head) {
      const [l, hd] = s.head;
      const d = detail(`head:${l}:${hd}`);
      parts.push(h("div", { class: "dpa-detail-title", text: `head L${l}.H${hd} · ${formatScore(data.head_scores[l][hd])}` }));
      if (!d) parts.push(missing("head"));
      else if (d.edges) parts.push(edgeCanvas(d.edges, data.tokens, `edges:${l}:${hd}`, data.target.position));
      else parts.push(h("div", { class: "dpa-muted", text: "edge scores need the model (or a result with edges=True)" }));
    }
    if (s.neuron) {
      const [l, n] = s.neuron;
      const d = detail(`neuron:${l}:${n}`);
      parts.push(h("div", { class: "dpa-detail-title", text: `neuron ${neuronLabel(data, l, n)}` + (d ? ` · ${formatScore(d.score)}` : "") }));
      if (neuronInExpert(data, n)) parts.push(h("div", { class: "dpa-muted", text: `neuron ${n} of layer ${l}'s experts, in order` }));
      if (!d) parts.push(missing("neuron"));
      else {
        parts.push(tokenList(d.promotes, "promotes"), tokenList(d.suppresses, "suppresses"));
        if (!d.by_pos) parts.push(h("div", { class: "dpa-muted", text: "per-position scores need the model" }));
      }
    }
    if (s.expert && hasExperts(data)) {
      const [l, e] = s.expert;
      const d = detail(`expert:${l}:${e}`);
      const shared = expertName(data, e) === "shared";
      const score = data.expert_scores?.[l]?.[e];
      parts.push(h("div", { class: "dpa-detail-title dpa-expert-title",
        text: `expert ${expertLabel(data, l, e)}${shared ? " (shared)" : ""} · ${formatScore(score ?? NaN)}` }));
      if (!d) parts.push(missing("expert"));
      else if (!d.by_pos) parts.push(h("div", { class: "dpa-muted", text: "per-position scores need the model (or a result with neuron_positions=True)" }));
      else {
        const byPos = d.by_pos;
        const at = topIndices(byPos, 8).filter((p) => byPos[p] !== 0);
        parts.push(h("div", { class: "dpa-vocab dpa-expert-positions" }, [h("span", { class: "dpa-muted", text: "at positions: " }),
          ...(at.length ? at.map((p) => h("code", { title: JSON.stringify(data.tokens[p]), text: `${p} ${tokenLabel(data.tokens[p] ?? "")} ${formatScore(byPos[p])}` }))
            : [h("span", { class: "dpa-muted", text: "not routed at any position" })])]));
      }
      const inside = expertNeurons(data, l, e).slice(0, 8);
      if (inside.length) {
        parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "its top neurons: " }),
          ...inside.map((c) => {
            const chip = h("code", { class: "dpa-pick", text: `${neuronLabel(data, l, c.neuron)} ${formatScore(c.score)}` });
            chip.addEventListener("click", () => setTrait("selected_neuron", [l, c.neuron]));
            return chip;
          })]));
      }
    }
    if (s.token !== null && s.token < data.tokens.length) {
      const p = s.token;
      parts.push(h("div", { class: "dpa-detail-title", text: `token ${p} ${JSON.stringify(data.tokens[p])} · ${formatScore(data.token_scores[p])}` }));
      const r = data.token_routes ? data.token_routes[p] : null;
      if (!r) parts.push(h("div", { class: "dpa-muted", text: "routes need edge and neuron-position scores" }));
      else {
        parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "heads reading it: " }),
          ...r.heads.map(([l, hd, v]) => h("code", { text: `L${l}.H${hd} ${formatScore(v)}` }))]));
        parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "neurons at it: " }),
          ...r.neurons.map(([l, n, v]) => h("code", { text: `${neuronLabel(data, l, n)} ${formatScore(v)}` }))]));
        if (r.experts) {
          parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "experts at it: " }),
            ...r.experts.map(([l, e, v]) => h("code", { text: `${expertLabel(data, l, e)} ${formatScore(v)}` }))]));
        }
      }
    }
    if (!parts.length) {
      parts.push(h("div", { class: "dpa-muted", text: `hover to preview · click a head, neuron${hasExperts(data) ? ", expert" : ""} or token to lock it` }));
      const top = topHeads(data.head_scores, 8).map((c) => {
        const chip = h("code", { class: "dpa-pick", text: `L${c.layer}.H${c.head} ${formatScore(c.score)}` });
        chip.addEventListener("click", () => setTrait("selected_head", [c.layer, c.head]));
        return chip;
      });
      parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "top heads: " }), ...top]));
      if (hasExperts(data) && data.expert_scores) {
        const experts = topExperts(data.expert_scores, 8).map((c) => {
          const chip = h("code", { class: "dpa-pick", text: `${expertLabel(data, c.layer, c.slot)} ${formatScore(c.score)}` });
          chip.addEventListener("click", () => setTrait("selected_expert", [c.layer, c.slot]));
          return chip;
        });
        parts.push(h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: "top experts: " }), ...experts]));
      }
    }
    return h("section", { class: "dpa-panel dpa-detail" }, [
      h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: "selection" })]), ...parts]);
  }

  function footerView() {
    const data = get("_data");
    const live = canRecompute();
    const mode = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-verify-mode" }, [
      h("option", { value: "disrupt", text: "disrupt (ablate units)" }),
      h("option", { value: "recover", text: "recover (keep only units)" })]));
    const units = /** @type {HTMLSelectElement} */ (h("select", { class: "dpa-verify-units" }, [
      h("option", { value: "selection", text: "selected unit" }),
      h("option", { value: "top_tokens", text: `top-${get("top_k")} tokens` }),
      h("option", { value: "top_components", text: `top-${get("top_k")} heads + neurons` })]));
    const go = h("button", { class: "dpa-verify", text: "Verify", disabled: !live || get("_busy"), title: reason() || "run the ablation in the kernel" });
    go.addEventListener("click", () => model.send({ action: "verify", mode: mode.value, units: units.value }));
    const v = get("_verify") || {};
    const result = v.p_before === undefined ? "" :
      `${v.mode}: ${(v.units || []).slice(0, 6).join(", ")}${(v.units || []).length > 6 ? " …" : ""} → ` +
      `p(${JSON.stringify(v.token)}) ${v.p_before.toFixed(3)} → ${v.p_after.toFixed(3)} (${formatScore(v.p_after - v.p_before)})`;
    const json = h("button", { class: "dpa-export-json", text: "selection JSON" });
    json.addEventListener("click", () => download("selection.json", JSON.stringify(selectionPayload(get("_data"), sel()), null, 2), "application/json"));
    const svgBtn = h("button", { class: "dpa-export-svg", text: "SVG" });
    const svgNow = () => viewSvg(get("_data"), { tokenScores: stripScores().scores, caption: stripScores().caption, head: get("selected_head") });
    svgBtn.addEventListener("click", () => download("circuit.svg", svgNow(), "image/svg+xml"));
    const png = h("button", { class: "dpa-export-png", text: "PNG" });
    png.addEventListener("click", () => downloadPng(svgNow(), "circuit.png"));
    mode.disabled = units.disabled = !live;
    return h("div", { class: "dpa-footer" }, [
      h("span", { class: "dpa-group" }, [h("span", { class: "dpa-muted", text: "Verify by ablation:" }), mode, units, go]),
      h("span", { class: "dpa-verify-result", text: result }),
      h("span", { class: "dpa-spacer" }),
      h("span", { class: "dpa-group dpa-export" }, [h("span", { class: "dpa-muted", text: "Export:" }), json, svgBtn, png]),
    ]);
  }

  const hoverLine = h("div", { class: "dpa-hover", text: " " });
  function setHover(/** @type {string} */ text) {
    ui.hover = text;
    hoverLine.textContent = text || " ";
  }

  function redraw() {
    /** @type {Map<string, number[]>} scroll offsets by panel, kept across redraws */
    const scrolls = new Map([...root.querySelectorAll("[data-scroll]")].map((n) =>
      [n.getAttribute("data-scroll") || "", [n.scrollTop, n.scrollLeft]]));
    root.replaceChildren(
      headerView(), controlsView(), tokensView(),
      h("div", { class: "dpa-main" }, [headsView(), ...(hasExperts(get("_data")) ? [expertsView()] : []), neuronsView(), detailView()]),
      hoverLine, footerView(),
    );
    root.querySelectorAll("[data-scroll]").forEach((n) => {
      const saved = scrolls.get(n.getAttribute("data-scroll") || "");
      if (saved) [n.scrollTop, n.scrollLeft] = saved;
      else if (n.hasAttribute("data-start")) {
        // first showing: centre the start row once the view is laid out (el may not be in the page yet)
        setTimeout(() => { n.scrollTop = Number(n.getAttribute("data-start")) - n.clientHeight / 2; }, 0);
      }
    });
    root.classList.toggle("dpa-busy", !!get("_busy"));
    root.classList.toggle("dpa-stale", !!get("_error"));  // a failed recompute: the picture is not of the settings shown
  }

  const onSelect = () => { writeSelection(); redraw(); };
  const selectionTraits = ["change:selected_head", "change:selected_neuron", "change:selected_expert", "change:selected_token"];
  const viewTraits = ["change:_data", "change:_details", "change:_live", "change:_busy", "change:_error",
    "change:_comparison", "change:_verify", "change:_methods", "change:weights_preset", "change:weights_p",
    "change:contrast", "change:method", "change:top_k"];
  selectionTraits.forEach((e) => model.on(e, onSelect));
  viewTraits.forEach((e) => model.on(e, redraw));
  // Live only once the kernel answers: saved state (a book page) says _live = true with no kernel behind it.
  const onMessage = (/** @type {any} */ msg) => {
    if (!msg || msg.action !== "hello" || kernel === "live") return;
    kernel = "live";
    clearTimeout(timer);
    redraw();
  };
  model.on("msg:custom", onMessage);
  const timer = setTimeout(() => { if (kernel === "connecting") { kernel = "none"; redraw(); } }, timing.helloMs);
  redraw();
  try {
    model.send({ action: "hello" });  // a static page has no comm: nothing is sent and nothing answers
  } catch (e) {
    kernel = "none";
    clearTimeout(timer);
    redraw();
  }
  return () => {
    clearTimeout(timer);
    model.off("msg:custom", onMessage);
    selectionTraits.forEach((e) => model.off(e, onSelect));
    viewTraits.forEach((e) => model.off(e, redraw));
  };
}

export default { render };
