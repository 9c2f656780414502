// Pure parts of dpa_widgets/static/src/graph.js: influence and pruning (against dpa.Circuit.prune, prune-fixture.json),
// layout, edge geometry and colour.
import { test, describe } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import {
  influence, pruneUnits, pruneGraph, nodeFlows, graphLayout, edgePath, edgeMidpoint, edgeWidth, drawnEdges, rowOf,
  unitText, targetText, nodeName, isUnit, edgeKey, divergingColor, symmetricMax, GRAPH, shownPositions, edgeLabelBox,
  edgePoint, overlaps, verifyVerdict, scoreName,
} from "../../dpa_widgets/static/src/graph.js";

const FIXTURE = JSON.parse(readFileSync(new URL("./prune-fixture.json", import.meta.url), "utf8"));
const close = (a, b, what, tol = 1e-9) =>
  assert.ok(Math.abs(a - b) <= tol * Math.max(1, Math.abs(b)), `${what}: ${a} vs ${b}`);
const labelOf = (graph) => new Map(graph.nodes.map((n) => [n.id, n.label]));

/** small() with ``n`` tokens, each read by L0.H0@1 (``units``: and a head at each position, read by the target). */
function everyTokenRead(n, units = false) {
  const g = small();
  g.tokens = Array.from({ length: n }, (_, i) => ` word${i}`);
  const ids = 100;
  for (let p = 2; p < n; p++) {
    g.nodes.push({ id: ids + p, kind: "token", label: `tok${p}`, layer: null, index: p, position: p, of: null, score: 0.1,
      in_gap: 0, bias_in: 0, out_rest: 0 });
    g.edges.push([ids + p, 2, 0.5]);
    if (!units) continue;
    g.nodes.push({ id: 1000 + p, kind: "head", label: `L0.H0@${p}`, layer: 0, index: 0, position: p, of: null, score: 0.1,
      in_gap: 0, bias_in: 0, out_rest: 0 });
    g.edges.push([1000 + p, 5, 0.5]);
  }
  return g;
}

/** A graph by hand: two tokens, two heads and a neuron, the target; rests for the units and the target. */
function small() {
  const node = (id, kind, label, extra = {}) => ({ id, kind, label, layer: null, index: null, position: null, of: null,
    score: 0, in_gap: 0, bias_in: 0, out_rest: 0, ...extra });
  const nodes = [
    node(0, "token", "tok0", { index: 0, position: 0, score: 1 }), node(1, "token", "tok1", { index: 1, position: 1, score: -1 }),
    node(2, "head", "L0.H0@1", { layer: 0, index: 0, position: 1, score: 2 }),
    node(3, "head", "L0.H1@1", { layer: 0, index: 1, position: 1, score: 0.5 }),
    node(4, "neuron", "L1.N7@1", { layer: 1, index: 7, position: 1, score: -1 }),
    node(5, "target", "target", { position: 1, score: 3 }),
    node(6, "rest", "rest:L0.H0@1", { layer: 0, position: 1, of: 2 }), node(7, "rest", "rest:L0.H1@1", { layer: 0, position: 1, of: 3 }),
    node(8, "rest", "rest:L1.N7@1", { layer: 1, position: 1, of: 4 }), node(9, "rest", "rest:target", { position: 1, of: 5, score: 0.5 }),
  ];
  const edges = [[0, 2, 1], [1, 2, 1], [0, 3, 0.5], [2, 4, -1], [3, 4, 0], [2, 5, 2], [3, 5, 0.5], [4, 5, -1], [9, 5, 0.5]];
  return { tokens: ["a", " b"], target: { kind: "token", position: 1, token: " c", contrast: null }, positions: true, nodes, edges };
}

describe("influence", () => {
  test("the target's 1 split among its sources by |edge|, then down again", () => {
    const g = small();
    const infl = influence(g.nodes.map((n) => n.id), g.edges, 5);
    assert.equal(infl.get(5), 1);
    close(infl.get(2), 2 / 4 + (1 / 1) * (1 / 4), "L0.H0: direct 2/4, and all of the neuron's in-flow");
    close(infl.get(9), 0.5 / 4, "a rest node takes its share too");
    close(infl.get(0), (1 / 2) * infl.get(2) + 1 * infl.get(3), "a token through both heads");
  });

  test("as dpa.circuit.influence on real circuits (each node's influence in Circuit.to_json())", () => {
    for (const { name, circuit } of FIXTURE.cases) {
      const target = circuit.nodes.find((n) => n.kind === "target").id;
      const infl = influence(circuit.nodes.map((n) => n.id), circuit.edges, target);
      for (const n of circuit.nodes) close(infl.get(n.id), n.influence, `${name} ${n.label}`);
    }
  });
});

describe("pruning", () => {
  test("pruneUnits keeps the fewest units reaching the threshold, ties to the lower id", () => {
    const infl = new Map([[1, 0.5], [2, 0.25], [3, 0.25], [4, 0]]);
    assert.deepEqual(pruneUnits(infl, [1, 2, 3, 4], 0.5), [1]);
    assert.deepEqual(pruneUnits(infl, [1, 2, 3, 4], 0.6), [1, 2], "2 before 3: same influence, lower id");
    assert.deepEqual(pruneUnits(infl, [1, 2, 3, 4], 0.99), [1, 2, 3], "a unit of no influence is never needed");
    assert.deepEqual(pruneUnits(infl, [4, 1, 2, 3], 1), [1, 2, 3, 4], "1: nothing pruned, no influence or not");
    assert.deepEqual(pruneUnits(infl, [1, 2, 3, 4], 0), []);
    assert.deepEqual(pruneUnits(new Map([[1, 0]]), [1], 0.5), [], "no influence at all: nothing kept below 1");
    assert.deepEqual(pruneUnits(new Map([[1, 0]]), [1], 1), [1]);
  });

  for (const { name, circuit, pruned } of FIXTURE.cases) {
    test(`pruneGraph is Circuit.prune(t): ${name} (${circuit.nodes.filter(isUnit).length} units)`, () => {
      assert.equal(Object.keys(pruned).length, FIXTURE.thresholds.length);
      for (const [key, want] of Object.entries(pruned)) {
        const t = Number(key);
        const got = pruneGraph(circuit, t);
        const label = labelOf(got);
        assert.deepEqual(got.nodes.map((n) => n.label).sort(), Object.keys(want.nodes).sort(), `${name} @ ${t}: nodes`);
        for (const n of got.nodes) {
          for (const k of ["score", "out_rest", "influence"]) close(n[k] ?? 0, want.nodes[n.label][k] ?? 0, `${name} @ ${t}: ${n.label}.${k}`);
        }
        const edges = Object.fromEntries(got.edges.map(([s, d, e]) => [edgeKey(label.get(s), label.get(d)), e]));
        assert.deepEqual(Object.keys(edges).sort(), Object.keys(want.edges).sort(), `${name} @ ${t}: edges`);
        for (const [k, e] of Object.entries(edges)) close(e, want.edges[k], `${name} @ ${t}: ${k}`);
      }
    });
  }

  test("pruning keeps every node's books: score = in-flow + rest + bias + in_gap = out-flow + out_rest", () => {
    for (const { name, circuit } of FIXTURE.cases) {
      for (const t of [1, 0.5, 0.2]) {
        const g = pruneGraph(circuit, t);
        for (const n of g.nodes.filter((m) => isUnit(m) || m.kind === "target")) {
          const f = nodeFlows(g, n.id, 0);
          close(f.inSum + f.rest + n.bias_in + n.in_gap, n.score, `${name} @ ${t}: in-flow of ${n.label}`, 1e-7);
        }
        for (const n of g.nodes.filter((m) => isUnit(m) || m.kind === "token")) {
          close(nodeFlows(g, n.id, 0).outSum + n.out_rest, n.score, `${name} @ ${t}: out-flow of ${n.label}`, 1e-7);
        }
      }
    }
  });

  test("a lower threshold never keeps more units, and always the tokens and the target", () => {
    const circuit = FIXTURE.cases[0].circuit;
    let last = Infinity;
    for (const t of [1, 0.9, 0.7, 0.5, 0.3, 0.1, 0]) {
      const g = pruneGraph(circuit, t);
      const units = g.nodes.filter(isUnit).length;
      assert.ok(units <= last, `${units} units at ${t}`);
      last = units;
      assert.equal(g.nodes.filter((n) => n.kind === "token").length, circuit.tokens.length);
      assert.equal(g.nodes.filter((n) => n.kind === "target").length, 1);
    }
    assert.equal(last, 0);
  });

  test("nodeFlows: the top k in and out by |effect|, rest apart", () => {
    const f = nodeFlows(small(), 5, 2);
    assert.deepEqual(f.incoming.map((c) => c.source), [2, 4]);
    assert.equal(f.nIn, 3);
    assert.equal(f.rest, 0.5);
    close(f.inSum, 1.5, "sum of all incoming, not only the top ones");
  });
});

describe("layout", () => {
  const overlap = (a, b) => a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;

  test("rows: tokens at the bottom, each layer's attention under its MLP, the target at the top", () => {
    const g = small();
    const lay = graphLayout(g);
    const y = (id) => lay.boxes.get(id).y;
    assert.ok(y(0) > y(2) && y(2) === y(3) && y(3) > y(4) && y(4) > y(5));
    assert.deepEqual(lay.rows.map((r) => r.label), ["target", "L1 MLP", "L1 attn", "L0 MLP", "L0 attn", "tokens"]);
    assert.equal(lay.rows.find((r) => r.label === "L1 attn").h, GRAPH.emptyRow, "an empty row is a thin band");
    assert.equal(rowOf(g.nodes[4]), 3);
    assert.equal(lay.boxes.has(6), false, "rest nodes are not drawn");
  });

  test("columns: units sit over their position's token, side by side by index", () => {
    const lay = graphLayout(small());
    const mid = (id) => lay.boxes.get(id).x + lay.boxes.get(id).w / 2;
    const col1 = lay.columns.xs[1];
    for (const id of [1, 2, 3, 4]) {
      const b = lay.boxes.get(id);
      assert.ok(b.x >= col1 - 1e-9 && b.x + b.w <= col1 + lay.columns.widths[1] + 1e-9, `node ${id} in column 1`);
    }
    assert.ok(mid(2) < mid(3), "H0 left of H1");
    assert.ok(lay.columns.xs[0] + lay.columns.widths[0] <= col1);
  });

  test("no two boxes overlap, and all lie inside the picture (every fixture, and a 100-token prompt)", () => {
    const long = { ...FIXTURE.cases[0].circuit, tokens: Array.from({ length: 100 }, (_, i) => ` tok${i}`) };
    for (const graph of [...FIXTURE.cases.map((c) => c.circuit), long]) {
      const lay = graphLayout(graph);
      const boxes = [...lay.boxes.values()];
      for (let i = 0; i < boxes.length; i++) {
        const b = boxes[i];
        assert.ok(b.x >= 0 && b.y >= 0 && b.x + b.w <= lay.width && b.y + b.h <= lay.height, JSON.stringify(b));
        for (let j = i + 1; j < boxes.length; j++) assert.ok(!overlap(b, boxes[j]), `${JSON.stringify(b)} ${JSON.stringify(boxes[j])}`);
      }
      assert.equal(lay.boxes.size, graph.nodes.filter((n) => n.kind !== "rest").length);
    }
  });

  test("token labels stand level when they fit, else slant under narrow columns", () => {
    assert.equal(graphLayout(small()).level, true);
    const long = everyTokenRead(100, true);
    const lay = graphLayout(long);
    assert.equal(lay.level, false);
    assert.ok(lay.height > graphLayout(small()).height, "room below for the slanted labels");
    assert.equal(graphLayout(long, { maxWidth: 1e6 }).level, true);
    const last = lay.columns.xs[99] + lay.columns.widths[99] / 2;
    assert.ok(lay.width >= last + ("99 ·word99".length * GRAPH.charW + GRAPH.pad) * Math.SQRT1_2,
      "the picture holds the last slanted label");
  });

  test("a long prompt: positions with nothing drawn share one narrow column per run", () => {
    const g = { ...small(), tokens: Array.from({ length: 100 }, (_, i) => ` word${i}`) };
    g.target = { ...g.target, position: 99 };
    const lay = graphLayout(g);
    assert.equal(graphLayout(g, { maxWidth: 1e6 }).columns.gaps.length, 0, "a prompt that fits keeps every column");
    assert.deepEqual(lay.columns.shown.flatMap((on, p) => (on ? [p] : [])), [0, 1, 99], "units, read tokens, target");
    assert.deepEqual(lay.columns.gaps.map((r) => [r.from, r.to]), [[2, 98]]);
    assert.ok(lay.width < 300 && lay.level, `${lay.width} px`);
    assert.equal(lay.columns.gaps[0].tokens.length, 0, "no token of the run is read: a '⋯', no dot");
    assert.equal([...lay.boxes.keys()].filter((id) => g.nodes.find((n) => n.id === id).kind === "token").length, 2,
      "tok0 and tok1 (the graph has no other token node)");
    assert.equal(shownPositions({ ...g, target: { ...g.target, position: 3 } }, g.nodes.filter(isUnit))[2], true,
      "a lone position between shown ones keeps its column");
    const read = graphLayout(everyTokenRead(100));
    assert.deepEqual(read.columns.gaps.map((r) => [r.from, r.to, r.tokens.length]), [[2, 99, 98]], "read tokens: dots");
    assert.ok(read.width < 800 && read.level, `${read.width} px`);
    const dot = read.boxes.get(150);
    assert.ok(dot.w === GRAPH.mini && dot.x > read.columns.gaps[0].x, JSON.stringify(dot));
  });

  test("a cell of many units wraps into lines: the column stays narrow, the row grows", () => {
    const g = small();
    for (let k = 0; k < 30; k++) {
      g.nodes.push({ id: 200 + k, kind: "neuron", label: `L1.N${1000 + k}@1`, layer: 1, index: 1000 + k, position: 1, of: null,
        score: 0.1, in_gap: 0, bias_in: 0, out_rest: 0 });
      g.edges.push([200 + k, 5, 0.1]);
    }
    const lay = graphLayout(g);
    const boxes = g.nodes.filter((n) => n.kind === "neuron").map((n) => lay.boxes.get(n.id));
    assert.ok(lay.columns.widths[1] <= GRAPH.maxCell + 1e-9, `${lay.columns.widths[1]}`);
    assert.ok(new Set(boxes.map((b) => b.y)).size > 1, "several lines");
    const row = lay.rows.find((r) => r.label === "L1 MLP");
    assert.ok(boxes.every((b) => b.y >= row.y && b.y + b.h <= row.y + row.h), "inside their row");
  });

  test("the picture holds a target label wider than the columns", () => {
    const g = { ...small(), target: { kind: "token", position: 1, token: " a very long target", contrast: " another long one" } };
    const lay = graphLayout(g);
    const t = lay.boxes.get(5);
    assert.ok(t.x >= 0 && t.x + t.w <= lay.width, JSON.stringify([t, lay.width]));
  });

  test("components over all positions (positions=False): each row centred", () => {
    const lay = graphLayout(FIXTURE.cases[1].circuit);
    assert.ok(lay.boxes.size > 0 && lay.width > 0);
  });

  test("labels", () => {
    const g = small();
    assert.equal(unitText(g.nodes[2]), "H0");
    assert.equal(unitText(g.nodes[4]), "N7");
    assert.equal(unitText({ ...g.nodes[4], kind: "expert", index: 2 }), "E2");
    assert.equal(unitText({ ...g.nodes[2], label: "L0.C3@1", index: 3 }), "C3");  // a hybrid's convolution unit
    assert.equal(targetText(g), "·c");
    assert.equal(targetText({ ...g, target: { ...g.target, contrast: " d" } }), "·c − ·d");
    assert.equal(nodeName(g, g.nodes[2]), "L0.H0@1 ·b");
    assert.equal(nodeName(g, g.nodes[5]), "target ·c");
  });
});

describe("edges", () => {
  test("a path from the top middle of the source to the bottom middle of the destination, leaving vertically", () => {
    const from = { x: 10, y: 100, w: 20, h: 16 }, to = { x: 50, y: 20, w: 40, h: 16 };
    const d = edgePath(from, to);
    const nums = d.match(/-?[\d.]+/g).map(Number);
    assert.deepEqual(nums.slice(0, 2), [20, 100]);
    assert.deepEqual(nums.slice(-2), [70, 36]);
    assert.equal(nums[2], 20, "first control point straight above the start");
    assert.equal(nums[4], 70, "second control point straight below the end");
    assert.deepEqual(edgeMidpoint(from, to), { x: 45, y: 68 });
  });

  test("width grows with |effect| to the largest; colour on the diverging scale", () => {
    assert.ok(edgeWidth(0, 2) < edgeWidth(1, 2) && edgeWidth(1, 2) < edgeWidth(-2, 2));
    assert.equal(edgeWidth(-2, 2), edgeWidth(2, 2));
    assert.equal(edgeWidth(5, 2), edgeWidth(2, 2), "clipped at the largest");
    assert.equal(divergingColor(2, symmetricMax([2, -1])), "rgb(178, 24, 43)");
  });

  test("edgePoint follows the curve: the ends at 0 and 1, the midpoint at 1/2", () => {
    const a = { x: 0, y: 100, w: 20, h: 16 }, b = { x: 100, y: 0, w: 20, h: 16 };
    assert.deepEqual(edgePoint(a, b, 0), { x: 10, y: 100 });
    assert.deepEqual(edgePoint(a, b, 1), { x: 110, y: 16 });
    assert.deepEqual(edgePoint(a, b, 0.5), edgeMidpoint(a, b));
  });

  test("edgeLabelBox: beside the curve, clear of the boxes and inside the picture", () => {
    const a = { x: 0, y: 100, w: 20, h: 16 }, b = { x: 0, y: 0, w: 20, h: 16 };
    const free = edgeLabelBox(a, b, 40, 12, [], 200, 200);
    assert.ok(free.x >= 14 && free.x <= 15, JSON.stringify(free));  // right of the vertical curve at x = 10
    const blocker = { x: 10, y: 40, w: 100, h: 40 };  // over the middle of the curve, right of it
    const moved = edgeLabelBox(a, b, 40, 12, [blocker], 200, 200);
    assert.ok(!overlaps(moved, blocker) && moved.y + moved.h <= 200, JSON.stringify(moved));
    const edge = edgeLabelBox({ x: 170, y: 100, w: 20, h: 16 }, { x: 170, y: 0, w: 20, h: 16 }, 40, 12, [], 200, 200);
    assert.ok(edge.x + edge.w <= 200 && edge.x < 180, "at the right border: to the left of the curve");
  });

  test("drawnEdges: no rest edges, none under minEdge of the largest, weakest first", () => {
    const g = small();
    const { edges, max } = drawnEdges(g, 0.3);
    assert.equal(max, 2);
    assert.ok(edges.every(([s, , e]) => s !== 9 && Math.abs(e) >= 0.6), JSON.stringify(edges));
    const mags = edges.map((e) => Math.abs(e[2]));
    assert.deepEqual(mags, [...mags].sort((a, b) => a - b));
    assert.equal(drawnEdges(g, 0).edges.length, 7, "zero edges are not drawn either");
  });
});

describe("words", () => {
  test("verifyVerdict: agreement, a sign disagreement, a size disagreement, edge and prediction apart", () => {
    const base = { source: "a", destination: "b", target: 0.1 };
    assert.match(verifyVerdict({ ...base, edge: 0.2, first_order: 0.3, direct: 0.29, ratio: 0.97 }), /agrees .* in sign and size/);
    const flip = verifyVerdict({ ...base, edge: -0.124, first_order: -0.49, direct: 1.1, ratio: -2.26 });
    assert.match(flip, /^Sign disagreement: removing the source moves the destination the other way from the first-order prediction/);
    assert.match(flip, /beyond first order/);
    assert.match(flip, /Which tells more: the measured change is the causal answer/);
    assert.match(verifyVerdict({ ...base, edge: 0.1, first_order: 0.1, direct: 0.55, ratio: 5.5 }), /Same sign .* ×5\.50 its size/);
    assert.match(verifyVerdict({ ...base, edge: 0.1, first_order: 0.1, direct: 0.055, ratio: 0.55 }), /×0\.55 its size/);
    assert.match(verifyVerdict({ ...base, edge: -0.1, first_order: 0.3, direct: 0.3, ratio: 1 }), /DPA's edge and the prediction differ in sign/);
    assert.match(verifyVerdict({ ...base, edge: 0.1, direct: -0.1, ratio: -1 }), /other way from DPA's edge/);
    assert.match(verifyVerdict({ ...base, edge: 0.1, direct: 0.2, ratio: 2 }), /sizes do not compare/);
    const target = verifyVerdict({ source: "a", destination: "target", edge: 2.19, first_order: 2.19, direct: -1, target: -1, ratio: -0.46 });
    assert.match(target, /the target the other way .* final norm's scale/);
    assert.doesNotMatch(target, /target's change says/);
  });

  test("scoreName: a unit's score at its position, or summed over positions", () => {
    const g = small();
    assert.equal(scoreName(g, g.nodes[2]), "score at position 1 only");
    assert.equal(scoreName({ ...g, positions: false }, { ...g.nodes[2], position: null }), "score summed over positions");
    assert.match(scoreName(g, g.nodes[5]), /^value/);
  });
});
