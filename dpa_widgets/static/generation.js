// @ts-check
// GenerationWidget's view (dpa_widgets/generation.py): a generation attributed step by step. One self-contained
// ES module (anywidget's `_esm`): no imports, no network, no build step. It draws a header, the prompt and the
// generated text, the [generated x source] matrix of token scores (a row per generated token, a column per
// token before it; each row on its own colour scale; the cells at and after a row's position empty), and the
// opened step: its target, value and probability, its heads as a [layer x head] heat map, its top neurons and
// sources. The one trait it sets is `step` (a row clicked: opened; clicked again: closed). Everything it draws
// is in `_data`, so a saved page (dpa_widgets.save_html) works the same with no kernel.

/**
 * @typedef {{positive: [number, number, number][], negative: [number, number, number][]}} Neurons
 * @typedef {{positive: [number, number][], negative: [number, number][]}} Sources
 * @typedef {{token: string, position: number, value: number, probability: number | null,
 *   head_scores: number[][], neurons: Neurons, sources: Sources}} Step
 * @typedef {{model_name: string, kind: string, generated_by: string, tokens: string[], prompt_length: number,
 *   text: [string, string], rows: number[][], steps: Step[], n_layers: number, n_heads: number,
 *   layer_kinds?: string[], unit_letters?: Record<string, string>, beside?: [string, number]}} Data
 */

/** ColorBrewer RdBu, negative blue -> white -> positive red: the stops of dpa's other views. */
const DIVERGING = [
  [33, 102, 172], [67, 147, 195], [146, 197, 222], [209, 229, 240], [255, 255, 255],
  [253, 219, 199], [244, 165, 130], [214, 96, 77], [178, 24, 43],
];

/** An HTML element. @param {string} tag @param {Record<string, any>} [attrs] @param {(Node | string)[]} [kids] */
function h(tag, attrs = {}, kids = []) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = String(v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, String(v));
  }
  node.append(...kids);
  return node;
}

/** The colour of `v` on a scale of ±`max`. @param {number} v @param {number} max @returns {number[]} */
export function diverging(v, max) {
  const x = max > 0 ? Math.max(-1, Math.min(1, v / max)) : 0;
  const f = (x + 1) * 4;  // 0 .. 8 over the nine stops
  const i = Math.min(7, Math.floor(f));
  const t = f - i;
  return DIVERGING[i].map((c, k) => Math.round(c + (DIVERGING[i + 1][k] - c) * t));
}

/** @param {number[]} rgb */
const css = (rgb) => `rgb(${rgb.join(",")})`;
/** Dark ink on light cells, white on dark ones. @param {number[]} rgb */
const ink = (rgb) => (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140 ? "#111" : "#fff");

/** A token as one short visible label: line breaks and tabs shown, a blank token shown as ␣. @param {string} tok */
export function label(tok) {
  const shown = tok.replace(/\n/g, "⏎").replace(/\t/g, "⇥");
  return shown.trim() === "" ? "␣".repeat(Math.max(1, shown.length)) : shown;
}

/** What a step's value is. @param {Data} data */
const quantity = (data) => (data.kind === "logprob" ? "log p (linearised)" : "logit");
/** @param {number} v */
const fmt = (v) => (v >= 0 ? "+" : "") + v.toFixed(3);
/** @param {number[]} xs */
const maxAbs = (xs) => xs.reduce((m, x) => Math.max(m, Math.abs(x)), 0);

/** The matrix: rows = generated tokens, columns = sources. @param {Data} data @param {number | null} open
 * @param {(j: number) => void} toggle */
function matrix(data, open, toggle) {
  const n = data.prompt_length;
  const sources = data.tokens.slice(0, n + data.steps.length - 1);
  const head = h("tr", {}, [h("th", { class: "dpa-gen-corner", text: "generated ↓ · source →" }),
    ...sources.map((tok, i) => h("th", { class: "dpa-gen-col" + (i >= n ? " dpa-gen-generated" : ""),
      title: `${i}: ${JSON.stringify(tok)}${i >= n ? " (generated)" : ""}` }, [h("span", { text: label(tok) })]))]);
  const body = data.steps.map((step, j) => {
    const row = data.rows[j];
    const max = maxAbs(row);
    const cells = sources.map((tok, i) => {
      if (i >= row.length) return h("td", { class: "dpa-gen-future" });
      const rgb = diverging(row[i], max);
      return h("td", { style: `background:${css(rgb)};color:${ink(rgb)}`,
        title: `step ${j} (${JSON.stringify(step.token)}) from ${i} ${JSON.stringify(tok)}: ${fmt(row[i])}` });
    });
    const name = h("th", { class: "dpa-gen-row", role: "button", tabindex: 0,
      title: `step ${j}: ${JSON.stringify(step.token)} after position ${step.position}, ${quantity(data)} ${fmt(step.value)}` +
        (step.probability === null ? "" : `, p = ${step.probability.toFixed(3)}`) + " (click: its heads and neurons)",
      onclick: () => toggle(j), onkeydown: (/** @type {KeyboardEvent} */ e) => {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); toggle(j); }
      } }, [label(step.token)]);
    return h("tr", { class: j === open ? "dpa-gen-open" : "", onclick: (/** @type {MouseEvent} */ e) => {
      if (e.target instanceof HTMLElement && e.target.tagName === "TD") toggle(j);
    } }, [name, ...cells]);
  });
  return h("div", { class: "dpa-gen-matrix" }, [h("table", {}, [h("thead", {}, [head]), h("tbody", {}, body)])]);
}

/** Column ``k`` of layer ``l``'s row of head scores: its kind and name ("head", "H2"; a hybrid's row "conv", "C3";
 * beside attention, Falcon-H1's, from column beside[1] on "scan", "S1"). @param {Data} data @param {number} l
 * @param {number} k */
function unitName(data, l, k) {
  const first = data.beside ? data.beside[1] : null;
  const kind = first !== null && k >= first ? data.beside[0] : data.layer_kinds?.[l] ?? "head";
  return { kind, name: `${data.unit_letters?.[kind] ?? "H"}${first !== null && k >= first ? k - first : k}` };
}

/** The opened step: target, heads, neurons, sources. @param {Data} data @param {number} j */
function detail(data, j) {
  const step = data.steps[j];
  const heads = step.head_scores;
  const max = maxAbs(heads.flat());
  const grid = h("table", { class: "dpa-gen-heads" }, [
    h("tr", {}, [h("th", { text: "" }), ...heads[0].map((_, k) => h("th", { text: data.beside ? unitName(data, 0, k).name : `H${k}` }))]),
    ...heads.map((row, l) => h("tr", {}, [h("th", { text: `L${l}` }), ...row.map((v, k) => {
      const rgb = diverging(v, max);
      const { kind, name } = unitName(data, l, k);  // a hybrid's convolution rows: conv L0 C3
      return h("td", { style: `background:${css(rgb)}`, title: `${kind} L${l} ${name}: ${fmt(v)}` });
    })])),
  ]);
  const list = (/** @type {string} */ title, /** @type {string[]} */ items) =>
    h("div", { class: "dpa-gen-list" }, [h("b", { text: title }), ...(items.length ? items : ["none"]).map((x) => h("div", { text: x }))]);
  const neuron = (/** @type {[number, number, number]} */ [l, i, v]) => `L${l}.N${i} ${fmt(v)}`;
  const source = (/** @type {[number, number]} */ [i, v]) => `${i} ${JSON.stringify(data.tokens[i])} ${fmt(v)}`;
  return h("div", { class: "dpa-gen-detail" }, [
    h("div", { class: "dpa-gen-title", text: `step ${j}: ${JSON.stringify(step.token)} after position ${step.position} · ` +
      `${quantity(data)} ${fmt(step.value)}` + (step.probability === null ? "" : ` · p = ${step.probability.toFixed(3)}`) }),
    h("div", { class: "dpa-gen-panels" }, [
      h("div", {}, [h("b", { text: "heads" }), grid]),
      list("neurons raising it", step.neurons.positive.map(neuron)),
      list("neurons lowering it", step.neurons.negative.map(neuron)),
      list("sources raising it", step.sources.positive.map(source)),
      list("sources lowering it", step.sources.negative.map(source)),
    ]),
  ]);
}

/** The whole view. @param {any} model */
export function view(model) {
  /** @type {Data} */
  const data = model.get("_data");
  const open = model.get("step");
  const toggle = (/** @type {number} */ j) => { model.set("step", open === j ? null : j); model.save_changes(); };
  const n = data.prompt_length;
  return h("div", { class: "dpa-gen" }, [
    h("div", { class: "dpa-gen-header" }, [
      h("b", { text: `Generation of ${data.steps.length} tokens (${data.generated_by})` }),
      h("span", { class: "dpa-gen-muted", text: ` · ${data.model_name} · each row: that token's ${quantity(data)}, ` +
        "attributed to every token before it (its own colour scale)" }),
    ]),
    h("div", { class: "dpa-gen-text" }, [h("span", { class: "dpa-gen-muted", text: data.text[0] }),
      h("span", { class: "dpa-gen-new", text: data.text[1] })]),
    matrix(data, open, toggle),
    open === null || open === undefined ? h("div", { class: "dpa-gen-muted", text: "click a row for its heads and neurons" })
      : detail(data, open),
    h("div", { class: "dpa-gen-muted dpa-gen-foot", text: `${n} prompt tokens, then the generated ones (italic); ` +
      "red raises the generated token, blue lowers it; grey: after the step's position (it cannot see them)" }),
  ]);
}

export default {
  /** @param {{model: any, el: HTMLElement}} ctx */
  render({ model, el }) {
    const draw = () => el.replaceChildren(view(model));
    model.on("change:step", draw);
    model.on("change:_data", draw);
    draw();
    return () => { model.off("change:step", draw); model.off("change:_data", draw); };
  },
};
