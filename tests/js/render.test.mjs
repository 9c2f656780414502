// The whole view rendered into happy-dom with a fake model: clicks set traits, traits redraw.
import { test, describe, before, after } from "node:test";
import assert from "node:assert/strict";
import { Window } from "happy-dom";
import { fakeModel, traits, moePayload, payload, besidePayload } from "./fixture.mjs";

let window;
let widget;
let timing;

before(async () => {
  window = new Window();
  globalThis.document = window.document;
  globalThis.window = window;
  widget = (await import("../../dpa_widgets/static/src/main.js")).default;
  ({ timing } = await import("../../dpa_widgets/static/src/helpers.js"));
});

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const KERNEL_CONTROLS = ["select.dpa-target", "input.dpa-typed", "input.dpa-contrast", "select.dpa-preset",
  "input.dpa-p", "select.dpa-method", "button.dpa-verify"];

/** A view on a static page: saved state that says _live = true, and nothing answering "hello". */
async function mountStatic(overrides = {}) {
  const saved = timing.helloMs;
  timing.helloMs = 5;
  try {
    const mounted = mount(overrides, { kernel: false });
    await sleep(30);
    return mounted;
  } finally {
    timing.helloMs = saved;
  }
}

after(async () => {
  await window.happyDOM.close();
});

function mount(overrides = {}, options = {}) {
  const model = fakeModel(traits(overrides), options);
  const el = document.createElement("div");
  document.body.append(el);
  const cleanup = widget.render({ model, el });
  return { model, el, cleanup };
}

const tokenColours = (el) => [...el.querySelectorAll(".dpa-token")].map((t) => t.style.background);

describe("render", () => {
  test("draws every token, every head and the MLP bars", () => {
    const { el } = mount();
    assert.equal(el.querySelectorAll(".dpa-token").length, 4);
    assert.equal(el.querySelectorAll("rect.dpa-head").length, 8);
    assert.equal(el.querySelectorAll("rect.dpa-bar").length, 2);
    assert.ok(el.querySelector(".dpa-token.dpa-special"), "the BOS token is dimmed");
    assert.equal(el.querySelector(".dpa-target").value, " Mary");
  });

  test("clicking a head sets selected_head, writes the selection and locks the cell", () => {
    const { model, el } = mount();
    const cell = el.querySelector('rect.dpa-head[data-layer="1"][data-head="2"]');
    cell.dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_head"), [1, 2]);
    assert.equal(model.get("selection").head.score, 0.05);
    assert.ok(model.saves >= 2);
    assert.ok(el.querySelector('rect.dpa-head.dpa-locked[data-layer="1"][data-head="2"]'));
    el.querySelector('rect.dpa-head[data-layer="1"][data-head="2"]').dispatchEvent(new window.MouseEvent("click"));
    assert.equal(model.get("selected_head"), null, "a second click unlocks");
  });

  test("a head's details recolour the token strip by its per-key contribution", () => {
    const { model, el } = mount();
    const before = tokenColours(el);
    model.set("_details", { "head:0:1": { kind: "head", layer: 0, index: 1, score: -0.2,
      edges: [[1], [0, 0], [0, 0, 0], [0, 0, -3, 0]], by_key: [1, 0, -3, 0] } });
    model.set("selected_head", [0, 1]);
    const after = tokenColours(el);
    assert.notDeepEqual(after, before);
    assert.equal(after[1], "rgb(255, 255, 255)", "zero contribution is white");
    assert.ok(el.querySelector("canvas.dpa-edges"), "the edge grid is drawn");
  });

  test("selecting a token marks the heads and neurons that route it", () => {
    const { model, el } = mount();
    el.querySelectorAll(".dpa-token")[1].dispatchEvent(new window.MouseEvent("click"));
    assert.equal(model.get("selected_token"), 1);
    const routed = [...el.querySelectorAll("rect.dpa-head.dpa-routed")].map((r) => `${r.dataset.layer}.${r.dataset.head}`);
    assert.deepEqual(routed.sort(), ["0.2", "1.1"]);
    assert.ok(el.querySelector('.dpa-neuron.dpa-routed[data-layer="1"][data-neuron="1"]'));
  });

  test("new data from the kernel redraws the token colours", () => {
    const { model, el } = mount();
    const before = tokenColours(el);
    model.set("_data", { ...model.get("_data"), token_scores: [5, -2, 1, 0.5] });
    assert.notDeepEqual(tokenColours(el), before);
  });

  test("the target picker and Verify talk to the kernel; static views disable them", () => {
    const { model, el } = mount();
    const select = el.querySelector(".dpa-target");
    select.value = " the";
    select.dispatchEvent(new window.Event("change"));
    assert.equal(model.get("target"), " the");
    el.querySelector("button.dpa-verify").dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.sent, [{ action: "hello" }, { action: "verify", mode: "disrupt", units: "selection" }]);
    const offline = mount({ _live: false });
    assert.equal(offline.el.querySelector(".dpa-target").disabled, true);
    assert.equal(offline.el.querySelector("button.dpa-verify").disabled, true);
  });

  test("an input baseline recolours the tokens and shows its rank correlation", () => {
    const { model, el } = mount();
    const before = tokenColours(el);
    model.set("_comparison", { method: "tokens:gradient", level: "input", token_scores: [0, 1, 2, 3], rho: 0.4 });
    assert.notDeepEqual(tokenColours(el), before);
    assert.match(el.querySelector(".dpa-rho").textContent, /ρ = 0\.40/);
  });

  test("the view says hello on render and is live only once the kernel answers", async () => {
    const saved = timing.helloMs;
    timing.helloMs = 5;
    try {
      const { model, el } = mount({}, { kernel: false });
      assert.deepEqual(model.sent, [{ action: "hello" }]);
      for (const sel of KERNEL_CONTROLS) assert.equal(el.querySelector(sel).disabled, true, `${sel} off while connecting`);
      assert.match(el.querySelector(".dpa-offline").textContent, /connecting/);
      await sleep(30);
      assert.match(el.querySelector(".dpa-offline").textContent, /static page: changing the target, weights or method/);
      model.emit("msg:custom", { action: "hello", live: true });  // a late answer: a busy kernel, not a static page
      assert.equal(el.querySelector("select.dpa-target").disabled, false);
      assert.equal(el.querySelector("button.dpa-verify").disabled, false);
      assert.equal(el.querySelector(".dpa-offline").hidden, true);
    } finally {
      timing.helloMs = saved;
    }
  });

  test("a static page with saved _live = true: kernel controls off with the visible reason", async () => {
    const { el } = await mountStatic({ _live: true });
    const reason = el.querySelector(".dpa-offline");
    assert.equal(reason.hidden, false);
    assert.match(reason.textContent, /static page: .*needs? a running kernel — open the notebook in JupyterLab/);
    for (const sel of KERNEL_CONTROLS) {
      const control = el.querySelector(sel);
      assert.equal(control.disabled, true, `${sel} is off`);
      assert.match(control.getAttribute("title"), /static page/, `${sel} says why`);
    }
    assert.equal(el.querySelector("button.dpa-export-svg").disabled, false, "exports still work");
  });

  test("a head or neuron whose details were not exported says so on a static page", async () => {
    const { model, el } = await mountStatic();
    el.querySelector('rect.dpa-head[data-layer="1"][data-head="2"]').dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_head"), [1, 2], "selection still works offline");
    assert.match(el.querySelector(".dpa-detail").textContent, /details not exported for this head/);
    assert.doesNotMatch(el.querySelector(".dpa-detail").textContent, /loading/);
    el.querySelector('.dpa-neuron[data-layer="1"][data-neuron="1"]').dispatchEvent(new window.MouseEvent("click"));
    assert.match(el.querySelector(".dpa-detail").textContent, /details not exported for this neuron/);
    const live = mount();
    live.el.querySelector('rect.dpa-head[data-layer="1"][data-head="2"]').dispatchEvent(new window.MouseEvent("click"));
    assert.match(live.el.querySelector(".dpa-detail").textContent, /loading…/, "with a kernel the details are on their way");
  });

  test("a hybrid's mixer unit without exported details is named by its kind, not as a head", async () => {
    const data = { ...payload(), layer_kinds: ["scan", "head"], unit_letters: { scan: "S", head: "H" } };
    const { el } = await mountStatic({ _data: data });
    el.querySelector('rect.dpa-head[data-layer="0"][data-head="1"]').dispatchEvent(new window.MouseEvent("click"));
    assert.match(el.querySelector(".dpa-detail").textContent, /details not exported for this scan unit/);
    el.querySelector('rect.dpa-head[data-layer="1"][data-head="1"]').dispatchEvent(new window.MouseEvent("click"));
    assert.match(el.querySelector(".dpa-detail").textContent, /details not exported for this head/);
  });

  test("a model of scan layers alone and no MLP says so: units, not heads, and no neuron panel to fill", async () => {
    const base = payload();
    const data = { ...base, layer_kinds: base.head_scores.map(() => "scan"), unit_letters: { scan: "S", head: "H" },
      d_mlp: 0, neuron_scores: base.head_scores.map(() => []), mlp_totals: base.head_scores.map(() => 0) };
    const { el } = await mountStatic({ _data: data });
    const captions = [...el.querySelectorAll(".dpa-caption")].map((c) => c.textContent).join(" | ");
    assert.match(captions, /scan units \(layer × unit\)/);
    assert.doesNotMatch(captions, /heads and scan/);
    assert.match(el.querySelector(".dpa-no-mlp").textContent, /no MLP/);
    assert.equal(el.querySelectorAll(".dpa-neuron").length, 0);
  });

  test("the edge grid labels its query rows and key columns with the tokens", () => {
    const { model, el } = mount();
    model.set("_details", { "head:0:1": { kind: "head", layer: 0, index: 1, score: -0.2,
      edges: [[1], [0, 0], [0, 0, 0], [0, 0, -3, 0]], by_key: [1, 0, -3, 0] } });
    model.set("selected_head", [0, 1]);
    const label = (t) => t.childNodes[0].textContent;  // the text, less its <title> (the whole token)
    const queries = [...el.querySelectorAll(".dpa-edge-queries text")].map(label);
    const keys = [...el.querySelectorAll(".dpa-edge-keys text")].map(label);
    assert.deepEqual(queries, ["0 <s>", "1 ·Mary", "2 ·and", "3 ·John"]);
    assert.deepEqual(keys, queries);
    assert.equal(label(el.querySelector(".dpa-edge-queries .dpa-tick-target")), "3 ·John", "the target row stands out");
  });

  test("the head heatmap numbers its layers, heads and KV groups", () => {
    const { el } = mount();
    const labels = [...el.querySelectorAll("svg.dpa-heatmap text")].map((t) => t.childNodes[0].textContent);
    for (const l of ["L0", "L1", "0", "1", "2", "3", "kv0", "kv1"]) assert.ok(labels.includes(l), `${l} in ${labels}`);
  });

  test("the path weights are named", () => {
    const { el } = mount();
    assert.equal(el.querySelector(".dpa-weights").textContent,
      "μ: query 0.25 · key 0.25 · value 0.50 · gate 0.50 · up 0.50");
  });

  test("a dense model has no experts panel and plain neuron labels", () => {
    const { el } = mount();
    assert.equal(el.querySelector(".dpa-experts-panel"), null);
    assert.equal(el.querySelectorAll("rect.dpa-expert").length, 0);
    const labels = [...el.querySelectorAll(".dpa-neuron span:nth-child(2)")].map((s) => s.textContent);
    assert.ok(labels.includes("L1.N1") && labels.includes("L0.N7"), labels.join(" "));
  });

  test("a mixture of experts: the layer × expert heatmap, hover, click and details", () => {
    const { model, el } = mount({ _data: moePayload() });
    const panel = el.querySelector(".dpa-experts-panel");
    assert.ok(panel, "the experts panel is drawn");
    assert.match(panel.querySelector(".dpa-caption").textContent, /experts \(layer × expert\)/);
    assert.ok(panel.querySelector(".dpa-legend"), "with its colour legend");
    assert.equal(el.querySelectorAll("rect.dpa-expert").length, 2 * 4);
    assert.equal(el.querySelectorAll("rect.dpa-expert.dpa-shared").length, 2);
    const ticks = [...panel.querySelectorAll("svg.dpa-experts text")].map((t) => t.childNodes[0].textContent);
    for (const l of ["L0", "L1", "0", "1", "2", "S", "E"]) assert.ok(ticks.includes(l), `${l} in ${ticks}`);
    const cell = el.querySelector('rect.dpa-expert[data-layer="1"][data-expert="2"]');
    cell.dispatchEvent(new window.MouseEvent("mouseenter"));
    assert.equal(el.querySelector(".dpa-hover").textContent, "expert L1.E2: 0");
    el.querySelector('rect.dpa-expert[data-layer="0"][data-expert="3"]').dispatchEvent(new window.MouseEvent("mouseenter"));
    assert.equal(el.querySelector(".dpa-hover").textContent, "expert L0.shared: +0.100");
    el.querySelector('rect.dpa-expert[data-layer="1"][data-expert="0"]').dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_expert"), [1, 0]);
    assert.deepEqual(model.get("selection").expert, { layer: 1, slot: 0, name: "E0", score: 1.2 });
    assert.ok(el.querySelector('rect.dpa-expert.dpa-locked[data-layer="1"][data-expert="0"]'));
    assert.match(el.querySelector(".dpa-detail").textContent, /expert L1\.E0 · \+1\.20/);
    assert.match(el.querySelector(".dpa-detail").textContent, /loading…/, "its details come from the kernel");
    const before = tokenColours(el);
    model.set("_details", { "expert:1:0": { kind: "expert", layer: 1, index: 0, score: 1.2, by_pos: [0, 0.9, 0, 0.3] } });
    assert.notDeepEqual(tokenColours(el), before, "the token strip shows the expert's per-position scores");
    assert.match(el.querySelector(".dpa-tokens-panel .dpa-caption").textContent, /expert L1\.E0/);
    const at = [...el.querySelectorAll(".dpa-expert-positions code")].map((c) => c.textContent);
    assert.deepEqual(at, ["1 ·Mary +0.900", "3 ·John +0.300"], "the positions it is routed at, by |score|");
  });

  test("a mixture of experts: neurons are named by expert, and a token's routes list experts", () => {
    const { model, el } = mount({ _data: moePayload() });
    const labels = [...el.querySelectorAll(".dpa-neuron span:nth-child(2)")].map((s) => s.textContent);
    assert.deepEqual(labels.sort(), ["L0.E0.N0", "L0.E1.N1", "L0.S.N1", "L1.E0.N2", "L1.E2.N1"]);
    const shared = el.querySelector('.dpa-neuron[data-layer="0"][data-neuron="13"]');
    shared.dispatchEvent(new window.MouseEvent("mouseenter"));
    assert.equal(el.querySelector(".dpa-hover").textContent, "neuron L0.S.N1: −0.300");
    shared.dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_neuron"), [0, 13], "the trait keeps the layer's flat index");
    assert.match(el.querySelector(".dpa-detail").textContent, /neuron L0\.S\.N1/);
    model.set("selected_neuron", null);
    el.querySelectorAll(".dpa-token")[2].dispatchEvent(new window.MouseEvent("click"));
    assert.ok(el.querySelector('rect.dpa-expert.dpa-routed[data-layer="0"][data-expert="2"]'));
    assert.match(el.querySelector(".dpa-detail").textContent, /experts at it: L0\.E2 \+0\.300/);
  });

  test("a static page says which expert details it lacks", async () => {
    const { el } = await mountStatic({ _data: moePayload() });
    el.querySelector('rect.dpa-expert[data-layer="0"][data-expert="1"]').dispatchEvent(new window.MouseEvent("click"));
    assert.match(el.querySelector(".dpa-detail").textContent, /details not exported for this expert/);
  });

  test("Enter in the token and foil boxes submits them, as Tab does", () => {
    const { model, el } = mount();
    const typed = el.querySelector("input.dpa-typed");
    typed.value = " John";
    typed.dispatchEvent(new window.KeyboardEvent("keydown", { key: "Enter", bubbles: true }));
    assert.equal(model.get("target"), " John");
    const foil = el.querySelector("input.dpa-contrast");
    foil.value = " Mary";
    foil.dispatchEvent(new window.KeyboardEvent("keydown", { key: "Enter", bubbles: true }));
    assert.equal(model.get("contrast"), " Mary");
    typed.value = " Paul";
    typed.dispatchEvent(new window.KeyboardEvent("keydown", { key: "a", bubbles: true }));
    assert.equal(model.get("target"), " John", "another key submits nothing");
  });

  test("the keyboard: tokens and neurons are in the Tab order and Enter selects them; the focus survives the redraw", () => {
    const { model, el } = mount();
    const key = (node, k) => node.dispatchEvent(new window.KeyboardEvent("keydown", { key: k, bubbles: true }));
    const chip = el.querySelectorAll(".dpa-token")[2];
    assert.equal(chip.getAttribute("tabindex"), "0");
    chip.focus();
    key(chip, "Enter");
    assert.equal(model.get("selected_token"), 2);
    assert.equal(window.document.activeElement?.getAttribute("data-focus"), "token:2", "the focus stays on the token");
    const neuron = el.querySelector(".dpa-neuron");
    key(neuron, " ");
    assert.deepEqual(model.get("selected_neuron"), [Number(neuron.dataset.layer), Number(neuron.dataset.neuron)]);
    for (const c of ["select.dpa-target", "input.dpa-typed", "input.dpa-contrast", "select.dpa-preset", "select.dpa-method"]) {
      assert.ok(el.querySelector(c).getAttribute("tabindex") !== "-1", c);
    }
    const typed = el.querySelector("input.dpa-typed");
    typed.focus();
    model.set("selected_token", null);  // a redraw
    assert.ok(window.document.activeElement?.matches("input.dpa-typed"), "a control keeps the focus across a redraw");
  });

  test("the MLP bars from the keyboard: arrows move over the layers, Enter shows that layer's neurons", () => {
    const { el } = mount();
    const key = (node, k) => node.dispatchEvent(new window.KeyboardEvent("keydown", { key: k, bubbles: true }));
    const bars = el.querySelector("svg.dpa-bars");
    assert.equal(bars.getAttribute("tabindex"), "0");
    bars.focus();
    key(bars, "ArrowDown");
    assert.ok(el.querySelector('rect.dpa-bar.dpa-cursor[data-layer="1"]'));
    key(bars, "Enter");
    assert.match(el.textContent, /top neurons \(layer 1\)/);
    key(el.querySelector("svg.dpa-bars"), "Enter");
    assert.match(el.textContent, /top neurons \(all layers\)/);
  });

  test("the head heatmap from the keyboard: arrows move a cursor, Enter selects the head under it", () => {
    const { model, el } = mount();
    const key = (node, k) => node.dispatchEvent(new window.KeyboardEvent("keydown", { key: k, bubbles: true }));
    const heat = el.querySelector("svg.dpa-heatmap");
    assert.equal(heat.getAttribute("tabindex"), "0");
    heat.focus();
    key(heat, "ArrowRight");
    key(heat, "ArrowDown");
    assert.ok(el.querySelector('rect.dpa-head.dpa-cursor[data-layer="1"][data-head="1"]'), "the cursor moved");
    assert.match(el.querySelector(".dpa-hover").textContent, /head L1\.H1: .* summed over positions · Enter selects/);
    key(heat, "Enter");
    assert.deepEqual(model.get("selected_head"), [1, 1]);
    const again = el.querySelector("svg.dpa-heatmap");
    key(again, "Enter");
    assert.equal(model.get("selected_head"), null, "Enter again unselects");
  });

  test("beside attention (Falcon-H1's): 8 columns, heads then scan units past a rule, both kinds named", () => {
    const { el } = mount({ _data: besidePayload() });
    const heat = el.querySelector("svg.dpa-heatmap");
    assert.equal(heat.querySelectorAll("rect.dpa-head").length, 16);
    assert.equal(heat.querySelectorAll('rect.dpa-head[data-layer="0"]').length, 8);
    assert.deepEqual([...heat.querySelectorAll('rect.dpa-head[data-layer="0"]')].map((r) => r.getAttribute("data-kind")),
      ["head", "head", "head", "head", "scan", "scan", "scan", "scan"]);
    const rule = heat.querySelectorAll("line.dpa-beside-sep");
    assert.equal(rule.length, 1);
    const x = (/** @type {number} */ c) => Number(heat.querySelector(`rect.dpa-head[data-layer="0"][data-head="${c}"]`).getAttribute("x"));
    const at = Number(rule[0].getAttribute("x1"));
    assert.ok(x(3) + 14 < at && at < x(4), `the rule (${at}) between H3 (${x(3)}) and S0 (${x(4)})`);
    const text = (/** @type {string} */ sel) => [...heat.querySelectorAll(sel)].map((t) => t.childNodes[0].textContent);
    assert.deepEqual(text("text.dpa-kind"), ["H0–H3", "S0–S3"]);
    const kv = [...heat.querySelectorAll("text.dpa-tick")].filter((t) => /^kv/.test(t.childNodes[0].textContent));
    assert.deepEqual(kv.map((t) => t.childNodes[0].textContent), ["kv0", "kv1"], "KV groups over the heads only");
    assert.ok(kv.every((t) => Number(t.getAttribute("x")) < at));
    const numbers = text("text.dpa-tick").filter((t) => /^\d+$/.test(t));
    assert.deepEqual(numbers, ["0", "1", "2", "3", "0", "1", "2", "3"], "each kind numbered from 0");
    assert.match(heat.closest(".dpa-panel").querySelector(".dpa-caption").textContent, /^heads \| scan units \(layer × unit\) · summed/);
  });

  test("beside attention: hover, click, details and token colours name a scan unit L0.S1, a head L0.H1", () => {
    const { model, el } = mount({ _data: besidePayload() });
    const cell = (/** @type {number} */ l, /** @type {number} */ c) => el.querySelector(`rect.dpa-head[data-layer="${l}"][data-head="${c}"]`);
    cell(0, 5).dispatchEvent(new window.MouseEvent("mouseenter"));
    assert.equal(el.querySelector(".dpa-hover").textContent, "scan L0.S1: −0.900 summed over positions");
    assert.match(cell(0, 5).querySelector("title").textContent, /^L0\.S1: /);
    cell(0, 1).dispatchEvent(new window.MouseEvent("mouseenter"));
    assert.equal(el.querySelector(".dpa-hover").textContent, "head L0.H1 (KV group 0): −0.200 summed over positions");
    cell(0, 5).dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_head"), [0, 5], "the column: never the same key as head 1 of the layer");
    assert.deepEqual(model.get("selection").head, { layer: 0, head: 5, kind: "scan", index: 1, label: "L0.S1", score: -0.9 });
    assert.ok(el.querySelector('rect.dpa-head.dpa-locked[data-layer="0"][data-head="5"]'));
    assert.equal(el.querySelectorAll("rect.dpa-head.dpa-locked").length, 1);
    assert.match(el.querySelector(".dpa-detail-title").textContent, /^scan L0\.S1 · −0\.900/);
    const before = tokenColours(el);
    model.set("_details", { "head:0:5": { kind: "head", layer: 0, index: 5, score: -0.9, unit: "scan", unit_index: 1,
      label: "L0.S1", edges: [[0], [0, 0], [0, -1, 0], [0.2, 0, -0.1, 0]], by_key: [0.2, -1, -0.1, 0] } });
    assert.notDeepEqual(tokenColours(el), before);
    assert.equal(el.querySelector(".dpa-tokens-panel .dpa-caption").textContent,
      "tokens coloured by scan L0.S1 (its edges from each key)");
    assert.ok(el.querySelector("canvas.dpa-edges"), "its edges by query and key, as a head's");
    cell(0, 1).dispatchEvent(new window.MouseEvent("click"));
    assert.deepEqual(model.get("selected_head"), [0, 1]);
    assert.match(el.querySelector(".dpa-detail").textContent, /head L0\.H1 · .*loading…/);
  });

  test("beside attention: top lists per kind, a token's routes name both kinds, Verify offers no component ablation", () => {
    const { model, el } = mount({ _data: besidePayload() });
    const rows = [...el.querySelectorAll(".dpa-detail .dpa-vocab")].map((r) => r.textContent);
    const heads = rows.find((r) => r.startsWith("top heads: "));
    const scans = rows.find((r) => r.startsWith("top scan units: "));
    assert.ok(heads && scans, rows.join(" | "));
    assert.doesNotMatch(heads, /\.S\d/);
    assert.match(scans, /^top scan units: L0\.S1 −0\.900L1\.S2 −0\.700L1\.S0 \+0\.600/);
    assert.doesNotMatch(scans, /\.H\d/);
    el.querySelectorAll(".dpa-token")[1].dispatchEvent(new window.MouseEvent("click"));
    assert.match(el.querySelector(".dpa-detail").textContent, /units reading it: L0\.H2 \+0\.400L1\.H1 −0\.300L1\.S1 \+0\.200/);
    const routed = [...el.querySelectorAll("rect.dpa-head.dpa-routed")].map((r) => `${r.dataset.layer}.${r.dataset.head}`);
    assert.deepEqual(routed.sort(), ["0.2", "1.1", "1.5"]);
    const option = el.querySelector('select.dpa-verify-units option[value="top_components"]');
    assert.equal(option.disabled, true);
    assert.match(option.getAttribute("title"), /attention and a scan block side by side/);
    model.set("_comparison", { method: "components:gradient", level: "component", rho: 0.4,
      head_scores: [[0.2, -0.1, 0, 0.3, null, null, null, null], [0.5, 0, -0.2, 0.1, null, null, null, null]] });
    assert.equal(el.querySelectorAll("rect.dpa-head.dpa-unscored").length, 8);
    assert.match(el.querySelector('rect.dpa-head[data-layer="1"][data-head="6"] title').textContent,
      /^L1\.S2: not scored by components:gradient/);
  });

  test("cleanup removes every listener", () => {
    const { model, cleanup } = mount();
    assert.ok(model.listeners() > 0);
    cleanup();
    assert.equal(model.listeners(), 0);
  });
});
