"""The circuit widget's ES module, assembled from ``dpa_widgets/static/src/*.js`` at import (dpa_widgets.bundle):
every module after the ones it imports, no import left, one default export, and the errors that name the files
(a name declared twice, a cycle, a missing module)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from dpa_widgets import CircuitWidget
from dpa_widgets.bundle import SRC, BundleError, assemble, bundle, imports, order, strip

SOURCES = {p.name: p.read_text(encoding="utf-8") for p in sorted(SRC.glob("*.js"))}
node = pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")


def test_the_order_respects_every_import():
    names = order(SOURCES)
    assert sorted(names) == sorted(SOURCES)
    for name in names:
        for spec in imports(SOURCES[name]):
            assert names.index(spec.removeprefix("./")) < names.index(name), (name, spec)
    assert "graph.js" in SOURCES and imports(SOURCES["helpers.js"]).count("./graph.js") == 1  # a re-export counts


def test_the_bundle_is_one_module_and_the_widgets_esm():
    text = bundle()
    assert bundle() is text, "assembled once per process"
    assert CircuitWidget._esm == text
    assert not re.search(r"^import\s", text, re.M) and not re.search(r"^export\s*\{", text, re.M)
    assert "// @ts-check" not in text
    assert len(re.findall(r"^export default ", text, re.M)) == 1
    assert len(re.findall(r"^export function renderGraph\(", text, re.M)) == 1
    parts = re.findall(r"^// -{40} (\S+)$", text, re.M)
    assert parts == order(SOURCES)


def test_strip_takes_out_imports_and_reexports_and_nothing_else():
    src = ('// @ts-check\nimport { a } from "./a.js";\nimport {\n  b,\n  c,\n} from "./b.js";\n'
           'export { d } from "./d.js";\nexport const e = 1;\nconst f = "import x from y";\n')
    assert strip(src) == 'export const e = 1;\nconst f = "import x from y";\n'
    assert imports(src) == ["./a.js", "./b.js", "./d.js"]


def test_a_name_declared_twice_is_an_error_naming_both_files():
    sources = {"a.js": "export function twice() {}\n", "b.js": 'import { x } from "./c.js";\nconst twice = 2;\n',
               "c.js": "export const x = 1;\n"}
    with pytest.raises(BundleError, match=r"twice is declared in both src/a\.js and src/b\.js"):
        assemble(sources, "src")
    with pytest.raises(BundleError, match=r"export default is declared in both src/a\.js and src/b\.js"):
        assemble({"a.js": "export default {};\n", "b.js": "export default { b: 1 };\n"}, "src")


def test_a_cycle_is_an_error_naming_the_files():
    sources = {"a.js": 'import { b } from "./b.js";\nexport const a = 1;\n',
               "b.js": 'import { c } from "./c.js";\nexport const b = 1;\n',
               "c.js": 'import { a } from "./a.js";\nexport const c = 1;\n', "d.js": "export const d = 1;\n"}
    with pytest.raises(BundleError, match=r"import cycle in src: a\.js -> b\.js -> c\.js -> a\.js"):
        order(sources, "src")


def test_a_missing_or_foreign_module_is_an_error_naming_the_files():
    with pytest.raises(BundleError, match=r"src/a\.js imports '\./gone\.js', but there is no src/gone\.js"):
        assemble({"a.js": 'import { g } from "./gone.js";\n'}, "src")
    with pytest.raises(BundleError, match=r"src/a\.js imports '\.\./x\.js'"):
        assemble({"a.js": 'export { x } from "../x.js";\n'}, "src")
    with pytest.raises(BundleError, match=r"src/a\.js: cannot take out 'import \"\./b\.js\";'"):
        assemble({"a.js": 'import "./b.js";\n', "b.js": ""}, "src")


def test_graph_js_imports_nothing():
    """dpa circuit --html inlines it as it is (dpa_widgets.page)."""
    assert imports(SOURCES["graph.js"]) == [] and not re.search(r"^import\s", SOURCES["graph.js"], re.M)


def test_every_source_function_is_short():
    """No function over 80 lines in a module of the view (top-level functions, closed by a "}" in column 0)."""
    long = []
    for name, text in SOURCES.items():
        start, fn = -1, ""
        for i, line in enumerate(text.split("\n")):
            m = re.match(r"^(?:export\s+)?(?:async\s+)?function\s+(\w+)", line)
            if m:
                start, fn = i, m.group(1)
            if line == "}" and start >= 0:
                if i - start + 1 > 80:
                    long.append(f"{name}: {fn} is {i - start + 1} lines")
                start = -1
    assert not long, long


@node
def test_the_assembled_text_parses_and_loads_in_node(tmp_path):
    path = tmp_path / "circuit.mjs"
    path.write_text(bundle(), encoding="utf-8")
    check = subprocess.run(["node", "--check", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    script = (f"const m = await import({str(path.as_uri())!r});\n"
              "console.log(typeof m.default.render, typeof m.renderGraph, typeof m.viewSvg);")
    loaded = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["function", "function", "function"]
