// The graph view in happy-dom: renderGraph on its own (the CLI's page) and inside the widget (traits, messages).
import { test, describe, before, after } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { Window } from "happy-dom";
import { fakeModel, traits } from "./fixture.mjs";

const FIXTURE = JSON.parse(readFileSync(new URL("./prune-fixture.json", import.meta.url), "utf8"));
const CIRCUIT = FIXTURE.cases[0].circuit;  // heads and neurons at positions, 8 tokens, 20 units
const UNITS = CIRCUIT.nodes.filter((n) => ["head", "neuron", "expert"].includes(n.kind));
const TOP = UNITS.reduce((a, b) => (Math.abs(b.score) > Math.abs(a.score) ? b : a));

let window, renderGraph, STATIC_VERIFY_REASON, widget, timing;
const teardown = [];  // destroy every drawing at the end: a drawing waits for its first layout on a timer

before(async () => {
  window = new Window();
  globalThis.document = window.document;
  globalThis.window = window;
  ({ renderGraph, STATIC_VERIFY_REASON } = await import("../../dpa_widgets/static/src/graph.js"));
  widget = (await import("../../dpa_widgets/static/src/main.js")).default;
  ({ timing } = await import("../../dpa_widgets/static/src/helpers.js"));
});

after(async () => {
  teardown.forEach((f) => f());
  await window.happyDOM.close();
});

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const fire = (el, type) => el.dispatchEvent(new window.MouseEvent(type, { bubbles: true }));
const node = (el, label) => el.querySelector(`.dpa-graph-node[data-label="${label}"]`);
const drawnUnits = (el) => el.querySelectorAll(".dpa-graph-node.dpa-graph-head, .dpa-graph-node.dpa-graph-neuron").length;

function mountGraph(options = {}, data = CIRCUIT) {
  const el = document.createElement("div");
  document.body.append(el);
  const calls = [];
  const on = (name) => (...args) => calls.push([name, ...args]);
  const handle = renderGraph(el, data, { onSelect: on("select"), onSelectEdge: on("edge"), onHover: on("hover"),
    onThreshold: on("threshold"), ...options });
  teardown.push(() => handle.destroy());
  return { el, handle, calls };
}

describe("renderGraph", () => {
  test("draws every token, unit and the target, edges and both legends", () => {
    const { el, handle } = mountGraph();
    assert.equal(el.querySelectorAll(".dpa-graph-node").length, CIRCUIT.nodes.filter((n) => n.kind !== "rest").length);
    assert.equal(drawnUnits(el), UNITS.length);
    assert.ok(el.querySelectorAll("path.dpa-graph-edge").length > 20);
    assert.equal(el.querySelectorAll(".dpa-graph-legend").length, 2);
    assert.match(el.querySelector(".dpa-graph-kept").textContent, new RegExp(`${UNITS.length} of ${UNITS.length} units`));
    assert.ok(handle.renderMs >= 0 && Number(el.querySelector(".dpa-graph").dataset.renderMs) >= 0);
    const target = node(el, "target");
    assert.match(target.textContent, /target/);
  });

  test("hovering a node lights it, its edges and its neighbours, and says what it is", () => {
    const { el, calls } = mountGraph();
    fire(node(el, TOP.label).querySelector("rect"), "mouseover");
    assert.ok(el.querySelector(".dpa-graph-svg").classList.contains("dpa-graph-focus"));
    assert.ok(node(el, TOP.label).classList.contains("dpa-graph-lit"));
    const lit = [...el.querySelectorAll("path.dpa-graph-edge.dpa-graph-lit")].map((p) => p.dataset.edge);
    assert.ok(lit.length > 0 && lit.every((k) => k.split("->").includes(TOP.label)), lit.join(" "));
    assert.ok(node(el, "target").classList.contains("dpa-graph-lit"), "a unit's edge to the target lights the target");
    assert.match(el.querySelector(".dpa-graph-hover").textContent, new RegExp(`^${TOP.label.replace(".", "\\.")}`));
    assert.deepEqual(calls.at(-1), ["hover", TOP.label]);
    fire(el.querySelector(".dpa-graph-scroll"), "mouseleave");
    assert.equal(el.querySelectorAll(".dpa-graph-lit").length, 0);
    assert.deepEqual(calls.at(-1), ["hover", null]);
  });

  test("a selected unit says where its in-flow is read (in_positions: [position, value] pairs, largest first)", () => {
    const { el } = mountGraph();
    fire(node(el, TOP.label), "click");
    const pairs = [...TOP.in_positions].sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]));
    const text = el.querySelector(".dpa-graph-reads").textContent;
    assert.ok(text.startsWith(`in-flow by the position read: ${pairs[0][0]} `), text);
  });

  test("clicking a node selects it: its in- and out-flows in the panel; again unselects", () => {
    const { el, calls } = mountGraph();
    fire(node(el, TOP.label), "click");
    assert.deepEqual(calls.at(-1), ["select", TOP.label]);
    assert.ok(node(el, TOP.label).classList.contains("dpa-graph-selected"));
    const panel = el.querySelector(".dpa-graph-panel").textContent;
    for (const term of ["score", "rest (units left out)", "control paths (in_gap)", "top inputs", "top outputs"]) {
      assert.ok(panel.includes(term), `${term} in ${panel}`);
    }
    assert.ok(el.querySelectorAll(".dpa-graph-flow").length > 1);
    fire(node(el, TOP.label), "click");
    assert.deepEqual(calls.at(-1), ["select", null]);
  });

  test("an entry of the flows selects its edge; the edge panel offers verify, off on a static page", () => {
    const { el, calls } = mountGraph();
    fire(node(el, TOP.label), "click");
    const row = el.querySelector(".dpa-graph-flow");
    const [s, d] = row.dataset.edge.split("->");
    fire(row, "click");
    assert.deepEqual(calls.at(-1), ["edge", [s, d]]);
    assert.equal(el.querySelector(".dpa-graph-halo").getAttribute("visibility"), "visible");
    const verify = el.querySelector("button.dpa-graph-verify");
    assert.equal(verify.disabled, true);
    assert.equal(el.querySelector(".dpa-graph-reason").textContent, STATIC_VERIFY_REASON);
  });

  test("clicking an edge selects it", () => {
    const { el, calls } = mountGraph();
    const hit = el.querySelector("path.dpa-graph-hit");
    fire(hit, "click");
    assert.deepEqual(calls.at(-1), ["edge", hit.dataset.edge.split("->")]);
    assert.match(el.querySelector(".dpa-graph-panel").textContent, /direct effect \(edge\)/);
  });

  test("the slider prunes live: fewer units drawn, the callback when let go", () => {
    const { el, calls, handle } = mountGraph();
    const slider = el.querySelector("input.dpa-graph-threshold");
    slider.value = "0.5";
    slider.dispatchEvent(new window.Event("input"));
    const kept = drawnUnits(el);
    assert.ok(kept < UNITS.length && kept > 0, `${kept} units`);
    assert.equal(kept, handle.graph.nodes.filter((n) => n.kind === "head" || n.kind === "neuron").length);
    assert.match(el.querySelector(".dpa-graph-kept").textContent, new RegExp(`50% .*: ${kept} of ${UNITS.length} units`));
    slider.dispatchEvent(new window.Event("change"));
    assert.deepEqual(calls.at(-1), ["threshold", 0.5]);
  });

  test("update: the selection and threshold from outside; verify on with a kernel, and its result shown", () => {
    const verified = [];
    const { el, handle } = mountGraph({ onVerify: (e) => verified.push(e) });
    const edge = [CIRCUIT.nodes[0].label, TOP.label];
    handle.update({ selected: TOP.label, selectedEdge: edge, threshold: 1 });
    assert.ok(node(el, TOP.label).classList.contains("dpa-graph-selected"));
    const button = el.querySelector("button.dpa-graph-verify");
    assert.equal(button.disabled, false);
    fire(button, "click");
    assert.deepEqual(verified, [edge]);
    handle.update({ verified: { [`${edge[0]}->${edge[1]}`]: { source: edge[0], destination: edge[1], edge: 0.2,
      first_order: 0.3, direct: 0.29, target: 0.1, ratio: 0.9667 } } });
    const result = el.querySelector(".dpa-graph-result").textContent;
    assert.match(result, /measured change: the destination's score S = z · G in the real model \(G held at its DPA value\)[^+−]*\+0\.290/);
    assert.match(result, /first-order prediction[^+−]*\+0\.300/);
    assert.match(result, /DPA's edge[^+−]*\+0\.200/);
    assert.match(result, /measured \/ predicted0\.967/);
    assert.match(el.querySelector(".dpa-graph-verdict").textContent, /agrees with the first-order prediction in sign and size/);
    handle.update({ verifyReason: "no model attached" });
    assert.equal(el.querySelector("button.dpa-graph-verify").disabled, true);
    handle.update({ threshold: 0.2 });
    assert.ok(drawnUnits(el) < UNITS.length);
    handle.destroy();
    assert.equal(el.children.length, 0);
  });

  test("a node pruned away says so in the panel", () => {
    const weakest = UNITS.reduce((a, b) => (b.influence < a.influence ? b : a));
    const { el } = mountGraph({ selected: weakest.label, threshold: 0.3 });
    assert.equal(node(el, weakest.label), null);
    assert.match(el.querySelector(".dpa-graph-panel").textContent, /pruned away at this threshold/);
  });
});

describe("the widget's graph view", () => {
  const graphTraits = (overrides = {}) => traits({ _graph: { ...CIRCUIT, verifiable: true }, _graph_verify: {},
    view: "graph", selected_node: "", selected_edge: null, graph_threshold: 1, ...overrides });

  function mount(overrides = {}, options = {}) {
    const model = fakeModel(graphTraits(overrides), options);
    const el = document.createElement("div");
    document.body.append(el);
    const cleanup = widget.render({ model, el });
    teardown.push(cleanup);
    return { model, el, cleanup };
  }

  test("tabs switch between the scores and the graph (the view trait)", () => {
    const { model, el } = mount({ view: "scores" });
    assert.equal(el.querySelector(".dpa-graph"), null);
    assert.ok(el.querySelector("rect.dpa-head"));
    fire(el.querySelector('button.dpa-tab[data-view="graph"]'), "click");
    assert.equal(model.get("view"), "graph");
    assert.ok(el.querySelector(".dpa-graph"));
    assert.equal(el.querySelector("rect.dpa-head"), null);
    assert.equal(el.querySelectorAll(".dpa-graph-node").length, CIRCUIT.nodes.filter((n) => n.kind !== "rest").length);
  });

  test("no circuit: no tabs, the scores view", () => {
    const { el } = mount({ _graph: {}, view: "graph" });
    assert.equal(el.querySelector(".dpa-tab"), null);
    assert.ok(el.querySelector("rect.dpa-head"));
  });

  test("clicks set selected_node, selected_edge and graph_threshold; Python's values redraw in place", () => {
    const { model, el } = mount();
    const svg = el.querySelector(".dpa-graph-svg");
    fire(node(el, TOP.label), "click");
    assert.equal(model.get("selected_node"), TOP.label);
    fire(el.querySelector(".dpa-graph-flow"), "click");
    assert.equal(model.get("selected_edge").length, 2);
    const slider = el.querySelector("input.dpa-graph-threshold");
    slider.value = "0.4";
    slider.dispatchEvent(new window.Event("input"));
    slider.dispatchEvent(new window.Event("change"));
    assert.equal(model.get("graph_threshold"), 0.4);
    model.set("selected_node", "target");  // from Python
    assert.ok(node(el, "target").classList.contains("dpa-graph-selected"));
    assert.match(el.querySelector(".dpa-graph-panel .dpa-graph-title").textContent, /^target/);
    model.set("graph_threshold", 1);
    assert.equal(drawnUnits(el), UNITS.length);
    model.set("selected_node", "");
    assert.equal(el.querySelector(".dpa-graph-selected.dpa-graph-node"), null);
    assert.ok(el.contains(el.querySelector(".dpa-graph")), "the same drawing, updated");
    assert.notEqual(svg, el.querySelector(".dpa-graph-svg"), "(a new threshold draws the SVG again)");
  });

  test("verify sends the edge to the kernel, and the result it sends back is shown", () => {
    const edge = [CIRCUIT.nodes[0].label, TOP.label];
    const { model, el } = mount({ selected_edge: edge });
    const button = el.querySelector("button.dpa-graph-verify");
    assert.equal(button.disabled, false);
    fire(button, "click");
    assert.deepEqual(model.sent.at(-1), { action: "verify_edge", edge });
    model.set("_graph_verify", { [`${edge[0]}->${edge[1]}`]: { source: edge[0], destination: edge[1], edge: 0.1,
      first_order: 0.2, direct: 0.19, target: 0.05, ratio: 0.95 } });
    assert.match(el.querySelector(".dpa-graph-result").textContent, /measured \/ predicted0\.950/);
  });

  test("a static page: the graph works, verify is off with the reason", async () => {
    const saved = timing.helloMs;
    timing.helloMs = 5;
    try {
      const { model, el } = mount({ selected_edge: [CIRCUIT.nodes[0].label, TOP.label] }, { kernel: false });
      await sleep(30);
      assert.equal(el.querySelector("button.dpa-graph-verify").disabled, true);
      assert.match(el.querySelector(".dpa-graph-reason").textContent, /static page: verifying an edge runs the model/);
      fire(node(el, TOP.label), "click");
      assert.equal(model.get("selected_node"), TOP.label, "selection works offline");
    } finally {
      timing.helloMs = saved;
    }
  });

  test("no model: verify off, saying so", () => {
    const { el } = mount({ _live: false, selected_edge: [CIRCUIT.nodes[0].label, TOP.label] });
    assert.match(el.querySelector(".dpa-graph-reason").textContent, /no model attached/);
  });

  test("cleanup removes every listener", () => {
    const { model, cleanup } = mount();
    cleanup();
    assert.equal(model.listeners(), 0);
  });
});
