// @ts-check
// The selection panel: a head's edge grid, a neuron's tokens, an expert's positions, a token's routes.
import { h, legend } from "./dom.js";
import { symmetricMax, divergingColor, formatScore, tokenLabel, shortLabel, axisTicks, topIndices, topHeads, topExperts,
  hasExperts, expertName, expertLabel, expertNeurons, neuronLabel, neuronInExpert, headLabel, unitKind, unitKinds, topUnits,
  unitsWord } from "./helpers.js";
/** @typedef {import("./context.js").Ctx} Ctx */

/**
 * The [query][key] edge grid on a canvas, with query tokens down the left and key tokens along
 * the top (sticky while the grid scrolls; thinned to one label every ~12 px, the target row always
 * labelled), first scrolled to the target's row.
 * @param {Ctx} ctx @param {number[][]} edges @param {string[]} tokens @param {string} key @param {number} targetRow
 */
export function edgeCanvas(ctx, edges, tokens, key, targetRow) {
  const n = edges.length;
  const cell = Math.max(1, Math.min(16, Math.floor(360 / Math.max(n, 1))));
  const px = Math.max(cell, 2); // at least 2 screen pixels a cell (pixelated), so one row stays visible
  const shown = n * px;
  const canvas = /** @type {HTMLCanvasElement} */ (h("canvas", { class: "dpa-edges", width: n * cell, height: n * cell,
    style: `width:${shown}px;height:${shown}px` }));
  const paint = canvas.getContext("2d");
  const max = symmetricMax(edges.flat());
  if (paint) {
    for (let q = 0; q < n; q++) for (let k = 0; k <= q && k < edges[q].length; k++) {
      paint.fillStyle = divergingColor(edges[q][k], max);
      paint.fillRect(k * cell, q * cell, cell, cell);
    }
  }
  canvas.addEventListener("mousemove", (ev) => {
    const r = canvas.getBoundingClientRect();
    const k = Math.floor((ev.clientX - r.left) / r.width * n), q = Math.floor((ev.clientY - r.top) / r.height * n);
    if (q >= 0 && q < n && k >= 0 && k <= q) ctx.setHover(`edge ${q} ${JSON.stringify(tokens[q])} ← ${k} ${JSON.stringify(tokens[k])}: ${formatScore(edges[q][k])}`);
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

/** @param {[string, number][] | null | undefined} pairs @param {string} label @param {string} [why] why there are
 * none with the model at hand (dpa does not read this model's neurons through the lens: Falcon-H1's) */
export function tokenList(pairs, label, why) {
  if (!pairs && why) return h("div", { class: "dpa-muted dpa-no-vocab", title: why, text: `${label}: not read on this model (${why.split(":")[0]})` });
  if (!pairs) return h("div", { class: "dpa-muted", text: `${label}: needs the model` });
  return h("div", { class: "dpa-vocab" }, [h("span", { class: "dpa-muted", text: `${label}: ` }),
    ...pairs.map(([t, v]) => h("code", { title: formatScore(v), text: tokenLabel(t) }))]);
}

/** What stands in for details not (yet) here: the kernel sends them on selection; a static page has none. */
export function missing(/** @type {Ctx} */ ctx, /** @type {string} */ what) {
  const text = ctx.kernel === "live" ? "loading…" : ctx.kernel === "connecting" ? "waiting for the kernel…" :
    `details not exported for this ${what}: this static page only has those of the top units and neurons` +
    `${hasExperts(ctx.get("_data")) ? " (and experts)" : ""} ` +
    `(and what was selected when it was saved); run the notebook to see them`;
  return h("div", { class: "dpa-muted dpa-missing", text });
}

/** A clickable chip that selects a unit. @param {Ctx} ctx @param {string} text @param {string} trait @param {any} value */
function pick(ctx, text, trait, value) {
  const chip = h("code", { class: "dpa-pick", text });
  chip.addEventListener("click", () => ctx.setTrait(trait, value));
  return chip;
}

/** A labelled row of chips. @param {string} label @param {Node[]} chips @param {string} [cls] */
function chips(label, chips, cls = "dpa-vocab") {
  return h("div", { class: cls }, [h("span", { class: "dpa-muted", text: label }), ...chips]);
}

/** The selected head (or unit of the heads' grid, by its column): its score and its query → key edge grid.
 * @param {Ctx} ctx @param {number[]} head */
function headDetail(ctx, [l, hd]) {
  const data = ctx.get("_data");
  const d = ctx.detail(`head:${l}:${hd}`);
  const kind = unitKind(data, l, hd);  // "head", or a hybrid's or Falcon-H1's mixer unit ("scan", "conv")
  const title = h("div", { class: "dpa-detail-title", text: `${kind} ${headLabel(data, l, hd)} · ${formatScore(data.head_scores[l][hd])} summed over positions` });
  if (!d) return [title, missing(ctx, kind === "head" ? "head" : `${kind} unit`)];
  if (d.edges) return [title, edgeCanvas(ctx, d.edges, data.tokens, `edges:${l}:${hd}`, data.target.position)];
  return [title, h("div", { class: "dpa-muted", text: "edge scores need the model (or a result with edges=True)" })];
}

/** The selected neuron: its score and the tokens it promotes and suppresses. @param {Ctx} ctx @param {number[]} neuron */
function neuronDetail(ctx, [l, n]) {
  const data = ctx.get("_data");
  const d = ctx.detail(`neuron:${l}:${n}`);
  const parts = [h("div", { class: "dpa-detail-title", text: `neuron ${neuronLabel(data, l, n)}` + (d ? ` · ${formatScore(d.score)} summed over positions` : "") })];
  if (neuronInExpert(data, n, l)) {
    parts.push(h("div", { class: "dpa-muted", text: `neuron ${n} of layer ${l}'s experts, in order` }));
  }
  if (!d) return [...parts, missing(ctx, "neuron")];
  parts.push(tokenList(d.promotes, "promotes", d.no_vocab), tokenList(d.suppresses, "suppresses", d.no_vocab));
  if (!d.by_pos) parts.push(h("div", { class: "dpa-muted", text: "per-position scores need the model" }));
  return parts;
}

/** The selected expert: its score, the positions it is routed at, its top neurons. @param {Ctx} ctx @param {number[]} expert */
function expertDetail(ctx, [l, e]) {
  const data = ctx.get("_data");
  const d = ctx.detail(`expert:${l}:${e}`);
  const shared = expertName(data, e) === "shared";
  const score = data.expert_scores?.[l]?.[e];
  const parts = [h("div", { class: "dpa-detail-title dpa-expert-title",
    text: `expert ${expertLabel(data, l, e)}${shared ? " (shared)" : ""} · ${formatScore(score ?? NaN)}` })];
  if (!d) parts.push(missing(ctx, "expert"));
  else if (!d.by_pos) parts.push(h("div", { class: "dpa-muted", text: "per-position scores need the model (or a result with neuron_positions=True)" }));
  else {
    const byPos = d.by_pos;
    const at = topIndices(byPos, 8).filter((p) => byPos[p] !== 0);
    parts.push(chips("at positions: ", at.length ? at.map((p) => h("code", { title: JSON.stringify(data.tokens[p]),
      text: `${p} ${tokenLabel(data.tokens[p] ?? "")} ${formatScore(byPos[p])}` }))
      : [h("span", { class: "dpa-muted", text: "not routed at any position" })], "dpa-vocab dpa-expert-positions"));
  }
  const inside = expertNeurons(data, l, e).slice(0, 8);
  if (inside.length) {
    parts.push(chips("its top neurons: ", inside.map((c) =>
      pick(ctx, `${neuronLabel(data, l, c.neuron)} ${formatScore(c.score)}`, "selected_neuron", [l, c.neuron]))));
  }
  return parts;
}

/** The selected token: its score and the heads, neurons (and experts) that route it. @param {Ctx} ctx @param {number} p */
function tokenDetail(ctx, p) {
  const data = ctx.get("_data");
  const parts = [h("div", { class: "dpa-detail-title", text: `token ${p} ${JSON.stringify(data.tokens[p])} · ${formatScore(data.token_scores[p])}` })];
  const r = data.token_routes ? data.token_routes[p] : null;
  if (!r) return [...parts, h("div", { class: "dpa-muted", text: "routes need edge and neuron-position scores" })];
  const readers = unitKinds(data).length > 1 ? "units" : unitsWord(unitKinds(data)[0]);  // (a hybrid's, Falcon-H1's)
  parts.push(chips(`${readers} reading it: `, r.heads.map(([l, hd, v]) => h("code", { text: `${headLabel(data, l, hd)} ${formatScore(v)}` }))));
  parts.push(chips("neurons at it: ", r.neurons.map(([l, n, v]) => h("code", { text: `${neuronLabel(data, l, n)} ${formatScore(v)}` }))));
  if (r.experts) {
    parts.push(chips("experts at it: ", r.experts.map(([l, e, v]) => h("code", { text: `${expertLabel(data, l, e)} ${formatScore(v)}` }))));
  }
  return parts;
}

/** Nothing selected: how to select, and the top heads (and experts) to start from. @param {Ctx} ctx */
function emptyDetail(ctx) {
  const data = ctx.get("_data");
  const kinds = unitKinds(data);
  const parts = [h("div", { class: "dpa-muted", text: `hover to preview · click a ${kinds.length > 1 ? "unit" : "head"}, neuron${hasExperts(data) ? ", expert" : ""} or token to lock it` }),
    ...kinds.map((kind) => chips(`top ${unitsWord(kind)}: `, (kinds.length > 1 ? topUnits(data, kind, 8) : topHeads(data.head_scores, 8))
      .map((c) => pick(ctx, `${headLabel(data, c.layer, c.head)} ${formatScore(c.score)}`, "selected_head", [c.layer, c.head]))))];
  if (hasExperts(data) && data.expert_scores) {
    parts.push(chips("top experts: ", topExperts(data.expert_scores, 8).map((c) =>
      pick(ctx, `${expertLabel(data, c.layer, c.slot)} ${formatScore(c.score)}`, "selected_expert", [c.layer, c.slot]))));
  }
  return parts;
}

/** The selection panel: the details of what is selected, or where to start. @param {Ctx} ctx */
export function detailView(ctx) {
  const data = ctx.get("_data");
  const s = ctx.sel();
  const parts = [];
  if (s.head) parts.push(...headDetail(ctx, s.head));
  if (s.neuron) parts.push(...neuronDetail(ctx, s.neuron));
  if (s.expert && hasExperts(data)) parts.push(...expertDetail(ctx, s.expert));
  if (s.token !== null && s.token < data.tokens.length) parts.push(...tokenDetail(ctx, s.token));
  if (!parts.length) parts.push(...emptyDetail(ctx));
  return h("section", { class: "dpa-panel dpa-detail" }, [
    h("div", { class: "dpa-panel-head" }, [h("span", { class: "dpa-caption", text: "selection" })]), ...parts]);
}
