// The whole view rendered into happy-dom with a fake model: clicks set traits, traits redraw.
import { test, describe, before, after } from "node:test";
import assert from "node:assert/strict";
import { Window } from "happy-dom";
import { fakeModel, traits } from "./fixture.mjs";

let window;
let widget;

before(async () => {
  window = new Window();
  globalThis.document = window.document;
  globalThis.window = window;
  widget = (await import("../../dpa_widgets/static/circuit.js")).default;
});

after(async () => {
  await window.happyDOM.close();
});

function mount(overrides = {}) {
  const model = fakeModel(traits(overrides));
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
    assert.deepEqual(model.sent, [{ action: "verify", mode: "disrupt", units: "selection" }]);
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

  test("cleanup removes every listener", () => {
    const { model, cleanup } = mount();
    assert.ok(model.listeners() > 0);
    cleanup();
    assert.equal(model.listeners(), 0);
  });
});
