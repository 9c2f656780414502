"""The circuit widget's one ES module (its ``_esm``), assembled from the modules of ``static/src/``.

Each source is a plain ES module with real ``import ... from "./x.js"`` lines (Node's tests load them as they
are). The bundle puts every module after the modules it imports (else by name), takes out the import and
re-export lines and the ``// @ts-check`` line, and joins them: no bundler, no build step, nothing generated in
the repository. Two modules that declare the same top-level name, an import cycle or an import of a module
that is not there are errors that name the files.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

SRC = Path(__file__).parent / "static" / "src"
WHERE = "dpa_widgets/static/src"

_FROM = r"""\s*["']([^"']+)["'];?[^\n]*(?:\n|$)"""
IMPORT = re.compile(r"^import\s[^;]*?\sfrom" + _FROM, re.M)
REEXPORT = re.compile(r"^export\s*\{[^}]*\}\s*from" + _FROM, re.M)
# What stripping must leave none of: a side-effect import, ``export * from``, an import it did not recognise.
LEFT = re.compile(r"""^(?:import[\s{*"']|export\s*\*|export\s*\{[^}]*\}\s*from\b)""", re.M)
DECLARED = re.compile(r"^(?:export\s+)?(?:async\s+)?(?:function\*?|const|let|var|class)\s+([A-Za-z_$][\w$]*)", re.M)
DEFAULT = re.compile(r"^export\s+default\b", re.M)


class BundleError(Exception):
    """The widget's sources do not make one module (a cycle, a missing module, a name declared twice)."""


def imports(text: str) -> list[str]:
    """The specifiers a module imports or re-exports from, in order."""
    return [m.group(1) for pattern in (IMPORT, REEXPORT) for m in pattern.finditer(text)]


def strip(text: str) -> str:
    """A module without its imports, re-exports and ``// @ts-check`` line."""
    text = re.sub(r"^// @ts-check[^\n]*\n", "", text)
    return REEXPORT.sub("", IMPORT.sub("", text)).lstrip("\n")


def order(sources: dict[str, str], where: str = WHERE) -> list[str]:
    """The names of ``sources`` (file name -> text), each after the modules it imports, else by name."""
    deps = {}
    for name, text in sources.items():
        deps[name] = []
        for spec in imports(text):
            dep = spec.removeprefix("./")
            if not spec.startswith("./") or "/" in dep:
                raise BundleError(f"{where}/{name} imports {spec!r}: a module of the bundle imports only its "
                                  f"neighbours in {where} (\"./name.js\")")
            if dep not in sources:
                raise BundleError(f"{where}/{name} imports {spec!r}, but there is no {where}/{dep}")
            deps[name].append(dep)
    done: list[str] = []
    path: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise BundleError(f"import cycle in {where}: {' -> '.join(cycle)} (a bundle of concatenated modules "
                              "needs an order: move what both need into a module of its own)")
        path.append(name)
        for dep in sorted(deps[name]):
            visit(dep)
        path.pop()
        done.append(name)

    for name in sorted(sources):
        visit(name)
    return done


def assemble(sources: dict[str, str], where: str = WHERE) -> str:
    """One ES module of ``sources`` (file name -> text): see the module's docstring."""
    seen: dict[str, str] = {}
    parts = []
    for name in order(sources, where):
        text = strip(sources[name])
        left = LEFT.search(text)
        if left:
            line = text[left.start():].split("\n", 1)[0]
            raise BundleError(f"{where}/{name}: cannot take out {line!r} (write `import {{ ... }} from \"./x.js\";`)")
        declared = [m.group(1) for m in DECLARED.finditer(text)] + ["export default"] * len(DEFAULT.findall(text))
        for declared_name in declared:
            if declared_name in seen:
                first = f"{where}/{seen[declared_name]}"
                raise BundleError(f"{declared_name} is declared in both {first} and {where}/{name}: the bundle is "
                                  "one module, rename one")
            seen[declared_name] = name
        parts.append(f"// {'-' * 40} {name}\n\n{text.rstrip()}\n")
    return (f"// The dpa circuit widget: the modules of {where}/ in the order of their imports, assembled by\n"
            "// dpa_widgets/bundle.py (edit those; nothing here is a file of its own).\n\n" + "\n".join(parts))


@functools.cache
def bundle() -> str:
    """The widget's ES module, from the ``.js`` files of ``static/src/`` (read once per process)."""
    return assemble({p.name: p.read_text(encoding="utf-8") for p in sorted(SRC.glob("*.js"))})
