// @ts-check
// The selection as JSON, and the standalone SVG of the scores view (the export buttons).
import { symmetricMax, divergingColor, textColor, formatScore, tokenLabel, headLayout, expertLayout, wrapRows,
  hasExperts, expertName, neuronInExpert, neuronLabel, isDense, besideColumn, unitKind, unitIndex, headLabel, unitsWord }
  from "./helpers.js";

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
    const lay = headLayout(data.n_layers, data.n_heads, data.n_kv_heads, { beside: besideColumn(data) });
    out.head = { layer: l, head: h, kv_group: lay.group(h), score: data.head_scores[l]?.[h] ?? null };
    if (data.unit_kinds) {  // a hybrid's or Falcon-H1's grid: head is the column; the unit's kind, index and name
      const kind = unitKind(data, l, h);
      out.head = { layer: l, head: h, kind, index: unitIndex(data, h), label: headLabel(data, l, h),
        ...(kind === "head" ? { kv_group: lay.group(h) } : {}), score: out.head.score };
    }
  }
  if (sel.neuron) {
    const [l, n] = sel.neuron;
    const j = data.neurons.index[l]?.indexOf(n) ?? -1;
    out.neuron = { layer: l, neuron: n, score: j >= 0 ? data.neurons.score[l][j] : null };
    const at = neuronInExpert(data, n, l);
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
  const lay = headLayout(data.n_layers, data.n_heads, data.n_kv_heads, { cell: 10, left: 40, top: hTop, beside: besideColumn(data) });
  const hMax = symmetricMax(heads.flat());
  for (const c of lay.cells) {
    const sel = opts.head && opts.head[0] === c.layer && opts.head[1] === c.head;
    const v = heads[c.layer][c.head];  // (null: a baseline's cell it does not score)
    parts.push(`<rect x="${c.x}" y="${c.y}" width="10" height="10" fill="${v === null ? "#e0e0e0" : divergingColor(v, hMax)}"` +
      (sel ? ` stroke="#000" stroke-width="2"` : "") + `/>`);
  }
  if (lay.split !== null) {  // beside attention (Falcon-H1's): the rule between the heads and the units beside them
    parts.push(`<line x1="${lay.split}" x2="${lay.split}" y1="${hTop - 2}" y2="${lay.height}" stroke="#616161" stroke-width="1.5"/>`);
  }
  for (let l = 0; l < data.n_layers; l += Math.max(1, Math.ceil(data.n_layers / 10))) {
    parts.push(`<text x="${lay.colX(0) - 4}" y="${lay.rowY(l) + 9}" text-anchor="end">L${l}</text>`);
  }
  // the bars clear the heads caption ("heads (max |score| …)", ~170 px) on narrow models too
  const bx = Math.max(lay.width + 60, lay.colX(0) + (lay.split === null ? 190 : 250)), bw = 200, mMax = symmetricMax(data.mlp_totals);
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
    for (const c of el.cells.filter((e) => !isDense(data, e.layer))) {  // (a dense layer: no experts)
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
    `<text x="${lay.colX(0)}" y="${hTop - 6}" fill="#555">${besideColumn(data) === null ? "heads" :
      `heads | ${unitsWord(unitKind(data, 0, data.n_heads - 1))}`} (max |score| ${formatScore(hMax)})</text>` +
    `<text x="${bx}" y="${hTop - 6}" fill="#555">MLP totals per layer (max ${formatScore(mMax)})</text>` +
    `</svg>`;
}
