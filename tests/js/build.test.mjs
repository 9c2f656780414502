// The widget's bundle (dpa_widgets/static/circuit.js) is what its sources build: edit the sources, then run
// `node dpa_widgets/static/build.mjs`.
import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { build, strip, OUTPUT, SOURCES } from "../../dpa_widgets/static/build.mjs";

test("static/circuit.js is up to date with dpa/static/graph.js and dpa_widgets/static/src/", () => {
  assert.ok(readFileSync(OUTPUT, "utf8") === build(),
    "dpa_widgets/static/circuit.js is stale: run `node dpa_widgets/static/build.mjs` and commit the result");
});

test("the bundle is one module: no imports left, one default export, graph.js inside", () => {
  const text = build();
  assert.doesNotMatch(text, /^import\s/m);
  assert.equal(text.match(/^export default /gm).length, 1);
  assert.match(text, /^export function renderGraph\(/m);
  assert.ok(SOURCES.includes("dpa/static/graph.js"));
});

test("strip takes out single- and multi-line imports and re-exports, and nothing else", () => {
  const src = '// @ts-check\nimport { a } from "./a.js";\nimport {\n  b,\n  c,\n} from "./b.js";\n' +
    'export { d } from "./d.js";\nexport const e = 1;\nconst f = "import x from y";\n';
  assert.equal(strip(src), 'export const e = 1;\nconst f = "import x from y";\n');
});

test("every source module is small: no function over 80 lines", () => {
  for (const rel of SOURCES) {
    const lines = readFileSync(new URL(`../../${rel}`, import.meta.url), "utf8").split("\n");
    let start = -1, name = "";
    lines.forEach((line, i) => {
      const m = line.match(/^(?:export\s+)?(?:async\s+)?function\s+(\w+)/);
      if (m) { start = i; name = m[1]; }
      if (line === "}" && start >= 0) {
        assert.ok(i - start + 1 <= 80, `${rel}: ${name} is ${i - start + 1} lines`);
        start = -1;
      }
    });
  }
});
