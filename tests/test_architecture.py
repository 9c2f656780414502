"""The house rules of ``dpa/``, measured on its source: no module reaches into another's private names; no
function over 80 lines and no module over 500, except those listed here (which may only leave the lists); no
import cycle beyond the ones listed (counting imports inside functions, not those for annotations only, under
``if TYPE_CHECKING:``); the core never imports the widget."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dpa"
LONG_FUNCTION, BIG_MODULE = 80, 500

# Still over the limits: each entry is work left; a test fails when one is fixed, so that it leaves the list.
LONG_FUNCTIONS: set[str] = set()
BIG_MODULES: set[str] = set()
CYCLES: list[set[str]] = []


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _nodes(tree: ast.AST, runtime: bool):
    """Every node of ``tree``; ``runtime``: not those under ``if TYPE_CHECKING:`` (imports for annotations only, which
    never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if runtime and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports(name: str, path: Path, known: dict, runtime: bool = False) -> list[tuple[str, str]]:
    """(module, name) for every ``from dpa... import name`` and ``import dpa...`` in the module, at any depth
    (``runtime``: leaving out those under ``if TYPE_CHECKING:``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in _nodes(ast.parse(path.read_text()), runtime):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found += [(base, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(m, n) for m, n in found if m == "dpa" or m.startswith(("dpa.", "dpa_widgets"))]


def test_no_module_imports_another_modules_private_names():
    known = modules()
    private = [f"{name} imports {base}.{n}" for name, path in known.items() for base, n in imports(name, path, known)
               if n.startswith("_") and not n.startswith("__") and f"{base}.{n}" not in known and base != name]
    assert not private, private


def test_no_module_reads_another_modules_private_names_through_its_module():
    """``from . import request`` then ``request._canonical(...)``: the same reach into another module's privates."""
    known = modules()
    found = []
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = (".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module or "")
                aliases.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names
                                if f"{base}.{a.name}" in known})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != name):
                found.append(f"{name} reads {aliases[node.value.id]}.{node.attr}")
    assert not found, found


def test_the_core_never_imports_the_widget():
    known = modules()
    assert not [(name, base) for name, path in known.items() for base, _ in imports(name, path, known)
                if base.startswith("dpa_widgets")]


ENGINE = ("dpa.instrument", "dpa.families", "dpa.linearise", "dpa.functions", "dpa.rules", "dpa.explicit",
          "dpa.experts", "dpa.backward")


def test_the_widget_uses_no_engine_internals():
    """dpa_widgets reads results and public helpers (dpa.lens, dpa.request, ...), never the engine's modules."""
    found = []
    for path in sorted((ROOT / "dpa_widgets").rglob("*.py")):
        for base, n in imports("dpa_widgets." + path.stem, path, {}):
            if any(base == e or base.startswith(e + ".") for e in ENGINE):
                found.append(f"{path.name} imports {base}.{n}")
    assert not found, found


def test_function_and_module_sizes():
    long, big = set(), set()
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > BIG_MODULE:
            big.add(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > LONG_FUNCTION:
                long.add(f"{name}.{node.name}")
    assert long <= LONG_FUNCTIONS, f"functions over {LONG_FUNCTION} lines: {sorted(long - LONG_FUNCTIONS)}"
    assert big <= BIG_MODULES, f"modules over {BIG_MODULE} lines: {sorted(big - BIG_MODULES)}"
    assert LONG_FUNCTIONS <= long, f"no longer over the limit (take them off the list): {sorted(LONG_FUNCTIONS - long)}"
    assert BIG_MODULES <= big, f"no longer over the limit (take them off the list): {sorted(BIG_MODULES - big)}"


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_import_cycles():
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        for base, n in imports(name, path, known, runtime=True):
            target = f"{base}.{n}" if f"{base}.{n}" in known else base
            if target in known and target != name and not name.startswith(target + "."):
                edges.setdefault(name, set()).add(target)
    cycles = strongly_connected(edges)
    unexpected = [sorted(c) for c in cycles if not any(c <= known_cycle for known_cycle in CYCLES)]
    assert not unexpected, unexpected
    for known_cycle in CYCLES:  # a listed cycle that shrank or went: update the list
        assert any(c == known_cycle for c in cycles), (sorted(known_cycle), [sorted(c) for c in cycles])


@pytest.mark.parametrize("name", ["dpa.backward", "dpa.circuit_graph", "dpa.rules.hand", "dpa.functions", "dpa.linearise",
                                  "dpa.guard", "dpa.instrument", "dpa.state_checks"])
def test_the_new_homes_stay_small(name):
    assert len(modules()[name].read_text().splitlines()) <= BIG_MODULE


def test_the_core_holds_no_javascript():
    """The views' JavaScript lives in dpa_widgets (the CLI's --html page comes through the dpa.views entry point)."""
    assert not (PACKAGE / "static").exists()
    assert not sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.suffix in (".js", ".mjs", ".cjs"))


def _read_by(cls) -> dict[str, str]:
    """Each field of a class in the family table -> the text of its ``#   read by:`` comment (with continuations)."""
    import inspect

    out, name = {}, None
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"^    (\w+): ", line)
        if field and not line.lstrip().startswith("#"):
            name = field.group(1)
        elif line.startswith("    #   read by: "):
            out[name] = line.removeprefix("    #   read by: ")
        elif line.startswith("    #            ") and name in out:
            out[name] += " " + line.strip("# ")
    return out


def _mentions(module: str, attribute: str, known: dict) -> bool:
    return re.search(rf"\.{attribute}\b", known["dpa." + module].read_text()) is not None


@pytest.mark.parametrize("cls", ["Family", "Experts"])
def test_every_fact_in_the_family_table_says_who_reads_it(cls):
    """Under every fact of ``registry.Family``/``Experts`` a ``read by:`` comment names the modules that read it:
    each named module must read the fact (``.fact``), and each module named after ``LayerModules.x:`` or
    ``ModelSpec.x:`` must read that field, so that a name left behind by a change fails here."""
    import dataclasses

    from dpa import registry

    known, klass = modules(), getattr(registry, cls)
    said = _read_by(klass)
    assert set(said) == {f.name for f in dataclasses.fields(klass)}, sorted({f.name for f in dataclasses.fields(klass)} - set(said))
    wrong = []
    for fact, text in said.items():
        for item in re.finditer(r"([\w.]+)(?:'s)?(?: \(([^)]*)\))?(?:,|$)", text):
            module, inside = item.group(1), item.group(2) or ""
            if "dpa." + module not in known or not _mentions(module, fact, known):
                wrong.append(f"{cls}.{fact}: {module} does not read it")
            via = re.match(r"(?:LayerModules|ModelSpec)\.(\w+)(?:: (.*))?", inside)
            for reader in (via.group(2) or "").split(", ") if via and via.group(2) else []:
                reader = re.match(r"[\w.]+", reader).group(0).removesuffix("'s")
                if "dpa." + reader not in known or not _mentions(reader, via.group(1), known):
                    wrong.append(f"{cls}.{fact}: {reader} does not read {via.group(0).split(':')[0]}")
    assert not wrong, wrong
