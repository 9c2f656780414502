// Pure helpers of the widget's view (dpa_widgets/static/src/): colour scale, ranking, layout, selection and SVG
// export.
import { test, describe } from "node:test";
import assert from "node:assert/strict";
import {
  DIVERGING, symmetricMax, divergingRgb, divergingColor, textColor, formatScore, topIndices, topHeads,
  topNeurons, headLayout, wrapRows, tokenLabel, axisTicks, shortLabel, weightsText, offlineReason, hasExperts,
  expertName, expertLabel, neuronInExpert, neuronLabel, isDense,
  topExperts, expertNeurons, expertLayout, headLabel, unitKind, unitIndex, unitKinds, topUnits, besideColumn,
} from "../../dpa_widgets/static/src/helpers.js";
import { selectionPayload, escapeXml, viewSvg } from "../../dpa_widgets/static/src/export.js";
import { payload, moePayload, besidePayload } from "./fixture.mjs";

describe("colour scale", () => {
  test("white at zero, the end colours at -max and +max, clipped beyond", () => {
    assert.deepEqual(divergingRgb(0, 2), [255, 255, 255]);
    assert.deepEqual(divergingRgb(2, 2), DIVERGING.at(-1));
    assert.deepEqual(divergingRgb(-2, 2), DIVERGING[0]);
    assert.deepEqual(divergingRgb(50, 2), DIVERGING.at(-1));
    assert.deepEqual(divergingRgb(-50, 2), DIVERGING[0]);
  });

  test("symmetric: v and -v are equally far from white, on opposite hues", () => {
    for (const v of [0.1, 0.5, 0.9]) {
      const [pr, pg, pb] = divergingRgb(v, 1);
      const [nr, ng, nb] = divergingRgb(-v, 1);
      assert.ok(pr > pb, `positive ${v} is red-ish`);
      assert.ok(nb > nr, `negative ${v} is blue-ish`);
    }
  });

  test("monotone: larger |v| is darker on each side", () => {
    const lum = ([r, g, b]) => 0.299 * r + 0.587 * g + 0.114 * b;
    for (const sign of [1, -1]) {
      const l = [0, 0.2, 0.4, 0.6, 0.8, 1].map((x) => lum(divergingRgb(sign * x, 1)));
      for (let i = 1; i < l.length; i++) assert.ok(l[i] < l[i - 1], `${sign} side at step ${i}`);
    }
  });

  test("halfway between anchors interpolates linearly", () => {
    const step = 2 / (DIVERGING.length - 1); // anchors evenly over [-1, 1]; white (zero) in the middle
    const white = (DIVERGING.length - 1) / 2;
    const mid = divergingRgb(step / 2, 1);
    assert.deepEqual(mid, DIVERGING[white].map((c, k) => Math.round((c + DIVERGING[white + 1][k]) / 2)));
  });

  test("non-finite values and a zero max are white, not NaN", () => {
    assert.equal(divergingColor(NaN, 1), "rgb(255, 255, 255)");
    assert.equal(divergingColor(1, 0), "rgb(255, 255, 255)");
  });

  test("symmetricMax skips special tokens unless nothing else is left", () => {
    assert.equal(symmetricMax([-3, 1, 2], [false, false, false]), 3);
    assert.equal(symmetricMax([-30, 1, -2], [true, false, false]), 2);
    assert.equal(symmetricMax([-30], [true]), 30);
    assert.equal(symmetricMax([0, 0]), 1);
  });

  test("text is dark on light colours and light on saturated ones", () => {
    assert.equal(textColor(0, 1), "#000");
    assert.equal(textColor(1, 1), "#fff");
    assert.equal(textColor(-1, 1), "#fff");
  });

  test("formatScore keeps the sign and three digits", () => {
    assert.equal(formatScore(0.12345), "+0.123");
    assert.equal(formatScore(-12.345), "−12.3");
    assert.equal(formatScore(0), "0");
    assert.equal(formatScore(-2e-5), "−2.00e-5");
    assert.equal(formatScore(NaN), "–");
  });
});

describe("ranking", () => {
  test("topIndices by |value| and by signed value, ties by index", () => {
    assert.deepEqual(topIndices([1, -5, 3, 5], 3), [1, 3, 2]);
    assert.deepEqual(topIndices([1, -5, 3, 5], 2, "signed"), [3, 2]);
    assert.deepEqual(topIndices([1, NaN, 2], 5), [2, 0]);
    assert.deepEqual(topIndices([1, 2], 0), []);
  });

  test("topHeads flattens [layer][head] and maps back", () => {
    const heads = topHeads([[0.1, -0.9], [0.5, 0.2]], 2);
    assert.deepEqual(heads, [{ layer: 0, head: 1, score: -0.9 }, { layer: 1, head: 0, score: 0.5 }]);
  });

  test("topNeurons merges the per-layer lists, optionally one layer", () => {
    const neurons = { index: [[7, 3], [1, 9]], score: [[0.5, -0.1], [-2, 0.3]] };
    assert.deepEqual(topNeurons(neurons, 2), [{ layer: 1, neuron: 1, score: -2 }, { layer: 0, neuron: 7, score: 0.5 }]);
    assert.deepEqual(topNeurons(neurons, 5, 0).map((c) => c.neuron), [7, 3]);
  });
});

describe("layout", () => {
  test("heads of one KV group are adjacent; groups are separated by the wider gap", () => {
    const lay = headLayout(2, 6, 2, { cell: 10, gap: 1, groupGap: 5, left: 0, top: 0 });
    assert.equal(lay.cells.length, 12);
    assert.equal(lay.groupSize, 3);
    const xs = [0, 1, 2, 3, 4, 5].map(lay.colX);
    assert.deepEqual(xs, [0, 11, 22, 38, 49, 60]);
    assert.deepEqual([0, 1, 2, 3, 4, 5].map(lay.group), [0, 0, 0, 1, 1, 1]);
    assert.equal(lay.rowY(1), 11);
    assert.equal(lay.width, 60 + 10 + 2);
  });

  test("MHA (n_kv = n_heads) and a bad n_kv fall back to one head per group", () => {
    assert.equal(headLayout(1, 4, 4).groupSize, 1);
    assert.equal(headLayout(1, 4, 3).groupSize, 1);
    assert.equal(headLayout(1, 4, 1).groupSize, 4);
  });

  test("no cells overlap", () => {
    const lay = headLayout(5, 9, 3, { cell: 8 });
    const seen = new Set(lay.cells.map((c) => `${c.x},${c.y}`));
    assert.equal(seen.size, lay.cells.length);
  });

  test("wrapRows never exceeds the width unless one item alone does", () => {
    const widths = [30, 40, 50, 20, 100, 10];
    const rows = wrapRows(widths, 100, 2);
    assert.deepEqual(rows, [0, 0, 1, 1, 2, 3]);
    const used = {};
    rows.forEach((r, i) => { used[r] = (used[r] ?? -2) + 2 + widths[i]; });
    for (const w of Object.values(used)) assert.ok(w <= 100);
  });

  test("tokenLabel shows whitespace", () => {
    assert.equal(tokenLabel(" Mary"), "·Mary");
    assert.equal(tokenLabel("\n"), "↵");
    assert.equal(tokenLabel(""), "∅");
  });
});

describe("labels", () => {
  test("axisTicks labels every position when they fit, else every step-th, and always the target", () => {
    assert.deepEqual(axisTicks(5, 16, 12), [0, 1, 2, 3, 4]);
    assert.deepEqual(axisTicks(10, 4, 12), [0, 3, 6, 9]);
    assert.deepEqual(axisTicks(10, 4, 12, 7), [0, 3, 7], "the target's close neighbours make way");
    assert.deepEqual(axisTicks(10, 4, 12, 9), [0, 3, 6, 9]);
    const long = axisTicks(300, 2, 12, 299);
    assert.ok(long.includes(299) && long.length <= 51);
    long.slice(1).forEach((t, i) => assert.ok((t - long[i]) * 2 >= 12, "no two labels closer than 12 px"));
    assert.deepEqual(axisTicks(0, 10, 12), []);
  });

  test("shortLabel cuts long tokens with an ellipsis", () => {
    assert.equal(shortLabel("·Mary", 8), "·Mary");
    assert.equal(shortLabel("·internationalisation", 8), "·intern…");
    assert.equal([...shortLabel("日本語のテキストです", 4)].length, 4);
  });

  test("weightsText names the five paths", () => {
    assert.equal(weightsText({ query: 0.25, key: 0.25, value: 0.5, gate: 0.5, up: 0.5 }),
      "query 0.25 · key 0.25 · value 0.50 · gate 0.50 · up 0.50");
    assert.equal(weightsText({ query: 0.25, key: 0.25, value: 0.5, gate: 0.5, up: 0.5, router: 0.5, expert: 0.5 }),
      "query 0.25 · key 0.25 · value 0.50 · gate 0.50 · up 0.50 · router 0.50 · expert 0.50");
  });

  test("offlineReason: connecting, static page, no model, vector target, or none", () => {
    assert.match(offlineReason("connecting", true, "token"), /connecting/);
    assert.match(offlineReason("none", true, "token"), /^static page: .*running kernel — open the notebook in JupyterLab/);
    assert.match(offlineReason("live", false, "token"), /no model attached/);
    assert.match(offlineReason("live", true, "vector"), /vector/);
    assert.equal(offlineReason("live", true, "token"), "");
  });
});

describe("a hybrid's units", () => {
  test("each row says its kind: attention heads H, convolution units C; a model without layer kinds is all heads", () => {
    const data = { ...payload, layer_kinds: ["conv", "head", "conv"], unit_letters: { conv: "C", head: "H" } };
    assert.equal(unitKind(data, 0), "conv");
    assert.equal(unitKind(data, 1), "head");
    assert.equal(headLabel(data, 0, 3), "L0.C3");
    assert.equal(headLabel(data, 1, 2), "L1.H2");
    assert.equal(headLabel(payload, 0, 3), "L0.H3");
    assert.equal(unitKind(payload, 0), "head");
  });
});

describe("units beside attention (Falcon-H1's: heads, then scan units, in every row)", () => {
  test("a unit's kind and name follow its column: L0.H2 before beside[1], L0.S1 at column 5", () => {
    const data = besidePayload();
    assert.equal(besideColumn(data), 4);
    assert.equal(besideColumn(payload()), null);
    assert.deepEqual([0, 3, 4, 7].map((c) => unitKind(data, 1, c)), ["head", "head", "scan", "scan"]);
    assert.equal(unitKind(data, 1), "head", "a row's own kind (without a column): its attention heads'");
    assert.deepEqual([2, 4, 5, 7].map((c) => unitIndex(data, c)), [2, 0, 1, 3]);
    assert.equal(headLabel(data, 0, 5), "L0.S1");
    assert.equal(headLabel(data, 1, 3), "L1.H3");
    assert.equal(headLabel(data, 1, 4), "L1.S0");
    assert.deepEqual(unitKinds(data), ["head", "scan"]);
    assert.deepEqual(unitKinds(payload()), ["head"]);
    assert.equal(unitIndex(payload(), 3), 3, "no beside: the column is the index");
  });

  test("each kind's top list ranks its own columns only", () => {
    const data = besidePayload();
    assert.deepEqual(topUnits(data, "scan", 3).map((c) => [c.layer, c.head]), [[0, 5], [1, 6], [1, 4]]);
    assert.deepEqual(topUnits(data, "head", 2).map((c) => [c.layer, c.head]), [[1, 0], [1, 1]]);
    assert.deepEqual(topHeads(data.head_scores, 2).map((c) => [c.layer, c.head]), [[1, 0], [0, 5]], "all columns");
  });

  test("the layout: KV groups of the attention heads, then a wider gap and the scan units, a rule in it", () => {
    const lay = headLayout(2, 8, 2, { cell: 10, gap: 1, groupGap: 5, besideGap: 11, left: 0, top: 0, beside: 4 });
    assert.equal(lay.cells.length, 16);
    assert.equal(lay.groupSize, 2, "2 KV groups over the 4 heads, not the 8 columns");
    assert.equal(lay.attention, 4);
    assert.deepEqual([0, 1, 2, 3, 4, 5, 6, 7].map(lay.colX), [0, 11, 27, 38, 60, 71, 82, 93]);
    assert.deepEqual([0, 1, 2, 3, 4, 7].map(lay.group), [0, 0, 1, 1, null, null]);
    assert.ok(lay.split > 38 + 10 && lay.split < 60, `the rule sits in the gap: ${lay.split}`);
    assert.equal(lay.width, 93 + 10 + 2);
    const seen = new Set(lay.cells.map((c) => `${c.x},${c.y}`));
    assert.equal(seen.size, lay.cells.length, "no cells overlap");
    const plain = headLayout(2, 8, 2, { cell: 10, left: 0, top: 0 });
    assert.equal(plain.split, null, "without beside: no rule, the groups over every column");
    assert.equal(plain.groupSize, 4);
    assert.deepEqual(headLayout(2, 8, 2, { beside: null }).cells, headLayout(2, 8, 2).cells);
  });

  test("the selection names the unit's kind, index and label; the KV group only for an attention head", () => {
    const data = besidePayload();
    assert.deepEqual(selectionPayload(data, { head: [0, 5], neuron: null, token: null }).head,
      { layer: 0, head: 5, kind: "scan", index: 1, label: "L0.S1", score: -0.9 });
    assert.deepEqual(selectionPayload(data, { head: [1, 2], neuron: null, token: null }).head,
      { layer: 1, head: 2, kind: "head", index: 2, label: "L1.H2", kv_group: 1, score: 0.05 });
  });

  test("the SVG export draws every column, the rule between the kinds, and says both kinds", () => {
    const data = besidePayload();
    const svg = viewSvg(data, { head: [0, 5] });
    assert.equal((svg.match(/<rect x="\d+(\.\d+)?" y="\d+(\.\d+)?" width="10" height="10"/g) || []).length, 16);
    assert.equal((svg.match(/<line /g) || []).length, 1);
    assert.match(svg, /heads \| scan units \(max/);
    assert.doesNotMatch(viewSvg(payload()), /<line |scan/);
  });
});

describe("selection and export", () => {
  test("selectionPayload carries the selected units and their scores", () => {
    const data = payload();
    const sel = selectionPayload(data, { head: [1, 2], neuron: [0, 7], token: 1 });
    assert.deepEqual(sel.head, { layer: 1, head: 2, kv_group: 1, score: data.head_scores[1][2] });
    assert.deepEqual(sel.neuron, { layer: 0, neuron: 7, score: 0.5 });
    assert.equal(sel.token.token, " Mary");
    assert.equal(sel.token.score, data.token_scores[1]);
    assert.deepEqual(sel.target, data.target);
    assert.deepEqual(Object.keys(selectionPayload(data, { head: null, neuron: null, token: null })).sort(),
      ["method", "model_name", "target"]);
  });

  test("escapeXml escapes markup", () => {
    assert.equal(escapeXml(`<a href="x">&`), "&lt;a href=&quot;x&quot;&gt;&amp;");
  });

  test("viewSvg draws one rect per token and per head, with escaped labels", () => {
    const data = payload();
    data.tokens[0] = "<b>";
    const svg = viewSvg(data, { head: [1, 2] });
    assert.ok(svg.startsWith("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert.ok(svg.endsWith("</svg>"));
    assert.ok(svg.includes("&lt;b&gt;") && !svg.includes("<b>"));
    const rects = svg.match(/<rect /g).length;
    // background + tokens + heads + MLP bars
    assert.equal(rects, 1 + data.tokens.length + data.n_layers * data.n_heads + data.n_layers);
    assert.equal(svg.match(/stroke="#000"/g).length, 1, "the selected head is outlined");
  });
});

describe("mixture of experts", () => {
  test("hasExperts: only a payload with expert scores", () => {
    assert.equal(hasExperts(payload()), false);
    assert.equal(hasExperts(moePayload()), true);
    assert.equal(hasExperts({ ...moePayload(), expert_scores: [] }), false);
  });

  test("experts are named E0.. and the shared one 'shared', with or without the names sent", () => {
    const data = moePayload();
    assert.deepEqual([0, 1, 2, 3].map((e) => expertName(data, e)), ["E0", "E1", "E2", "shared"]);
    assert.equal(expertLabel(data, 1, 2), "L1.E2");
    assert.equal(expertLabel(data, 0, 3), "L0.shared");
    const unnamed = { ...data, expert_names: undefined };
    assert.deepEqual([0, 3].map((e) => expertName(unnamed, e)), ["E0", "shared"]);
  });

  test("a neuron index is the expert's neurons expert by expert, then the shared expert's", () => {
    const data = moePayload();  // 3 experts x 4 neurons, then 6 shared
    assert.deepEqual(neuronInExpert(data, 0), { expert: 0, index: 0 });
    assert.deepEqual(neuronInExpert(data, 5), { expert: 1, index: 1 });
    assert.deepEqual(neuronInExpert(data, 11), { expert: 2, index: 3 });
    assert.deepEqual(neuronInExpert(data, 12), { expert: "shared", index: 0 });
    assert.deepEqual(neuronInExpert(data, 17), { expert: "shared", index: 5 });
    assert.equal(neuronLabel(data, 3, 5), "L3.E1.N1");
    assert.equal(neuronLabel(data, 3, 13), "L3.S.N1");
    assert.equal(neuronInExpert(payload(), 5), null, "dense");
    assert.equal(neuronLabel(payload(), 3, 101), "L3.N101");
    assert.equal(neuronLabel({ ...data, d_expert: null }, 3, 13), "L3.N13", "the experts' width unknown");
  });

  test("a dense layer of a mixed layout (Jamba's) names its neurons as a dense MLP's", () => {
    const data = { ...moePayload(), dense_layers: [0] };
    assert.equal(isDense(data, 0), true);
    assert.equal(isDense(data, 1), false);
    assert.equal(isDense(moePayload(), 0), false, "every layer sparse");
    assert.equal(neuronInExpert(data, 5, 0), null);
    assert.equal(neuronLabel(data, 0, 5), "L0.N5");
    assert.equal(neuronLabel(data, 1, 5), "L1.E1.N1");
  });

  test("routed experts only (Mixtral): no shared expert", () => {
    const data = { ...moePayload(), n_experts: 4, d_expert: 4, d_mlp: 16, expert_names: ["E0", "E1", "E2", "E3"] };
    assert.equal(neuronLabel(data, 0, 15), "L0.E3.N3");
    assert.equal(expertLabel(data, 0, 3), "L0.E3");
  });

  test("topExperts ranks layer x slot by |score|", () => {
    assert.deepEqual(topExperts(moePayload().expert_scores, 3), [
      { layer: 1, slot: 0, score: 1.2 }, { layer: 0, slot: 2, score: -0.5 }, { layer: 1, slot: 3, score: 0.4 }]);
  });

  test("expertNeurons: the expert's neurons among the layer's top ones, by |score|", () => {
    const data = moePayload();  // layer 0 top neurons 5 (E1.N1), 13 (S.N1), 0 (E0.N0)
    assert.deepEqual(expertNeurons(data, 0, 1), [{ neuron: 5, index: 1, score: 0.5 }]);
    assert.deepEqual(expertNeurons(data, 0, 3), [{ neuron: 13, index: 1, score: -0.3 }]);
    assert.deepEqual(expertNeurons(data, 0, 2), []);
    assert.deepEqual(expertNeurons({ ...data, d_expert: null }, 0, 1), []);
  });

  test("expertLayout: routed experts side by side, the shared one after a wider gap", () => {
    const lay = expertLayout(2, 4, 3, { cell: 10, gap: 1, sharedGap: 5, left: 0, top: 0 });
    assert.equal(lay.cells.length, 8);
    assert.deepEqual([0, 1, 2, 3].map(lay.colX), [0, 11, 22, 38]);
    assert.deepEqual(lay.cells.filter((c) => c.shared).map((c) => c.slot), [3, 3]);
    assert.equal(lay.rowY(1), 11);
    assert.equal(lay.width, 38 + 10 + 2);
    assert.equal(lay.height, 11 + 10 + 2);
    const routedOnly = expertLayout(1, 4, 4, { cell: 10, left: 0 });
    assert.deepEqual([0, 1, 2, 3].map(routedOnly.colX), [0, 11, 22, 33]);
    assert.equal(new Set(expertLayout(3, 9, 8).cells.map((c) => `${c.x},${c.y}`)).size, 27, "no cells overlap");
  });

  test("selectionPayload names the expert and the neuron's place in its expert", () => {
    const data = moePayload();
    const sel = selectionPayload(data, { head: null, neuron: [0, 13], expert: [1, 3], token: null });
    assert.deepEqual(sel.expert, { layer: 1, slot: 3, name: "shared", score: 0.4 });
    assert.deepEqual(sel.neuron, { layer: 0, neuron: 13, score: -0.3, expert: "shared", index_in_expert: 1,
      label: "L0.S.N1" });
    const dense = selectionPayload(payload(), { head: null, neuron: [0, 7], expert: null, token: null });
    assert.deepEqual(dense.neuron, { layer: 0, neuron: 7, score: 0.5 }, "dense neurons as before");
    assert.equal("expert" in dense, false);
  });

  test("viewSvg draws the expert heatmap below the heads", () => {
    const data = moePayload();
    const svg = viewSvg(data);
    const rects = svg.match(/<rect /g).length;
    assert.equal(rects, 1 + data.tokens.length + data.n_layers * data.n_heads + data.n_layers + data.n_layers * 4);
    assert.match(svg, /experts: layer × 3 routed \+ shared/);
    assert.doesNotMatch(viewSvg(payload()), /experts/);
  });
});
