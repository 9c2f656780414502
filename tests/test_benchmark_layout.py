"""The benchmark scripts and the one-off studies stay apart: a benchmark (``benchmarks/*.py``) never imports a
study (``benchmarks/studies/*.py``), so a study can be left behind as the code changes without breaking the
benchmarks the project keeps running (``benchmarks/studies/README.md``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
STUDIES = BENCHMARKS / "studies"
LOADERS = ("import_module", "__import__", "spec_from_file_location", "run_path")  # imports by a name or a path


def studies() -> set[str]:
    return {p.stem for p in STUDIES.glob("*.py") if p.stem != "__init__"}


def study_named(name: str) -> str | None:
    """The study a module name or a path names (``squad_diagnosis``, ``benchmarks.studies.x``, ``.../studies/x.py``),
    else None."""
    parts = [part for part in name.replace("\\", "/").replace("/", ".").split(".") if part]
    if parts and parts[-1] == "py":
        parts = parts[:-1]
    if "studies" in parts:
        return ".".join(parts[parts.index("studies"):])
    return name if name in studies() else None


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every module a script imports: import statements anywhere in it (functions included), and
    the string arguments of importlib's loaders."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if fn in LOADERS:
                out += [(node.lineno, arg.value) for arg in node.args
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
    return out


def study_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imported(tree) if study_named(name)]


def test_the_studies_are_apart():
    assert STUDIES.is_dir() and studies(), "benchmarks/studies/ holds the one-off studies"
    assert not {p.stem for p in BENCHMARKS.glob("*.py")} & studies(), "a script is both a benchmark and a study"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_no_benchmark_imports_a_study(path):
    """Whatever a benchmark shares with a study lives in ``benchmarks/common.py`` (``run_config``, ...)."""
    assert not study_imports(path)


def test_the_check_sees_a_study_import(tmp_path):
    """The check above is not vacuous: each way a script could import a study is caught."""
    name = sorted(studies())[0]
    for line in (f"from {name} import main", f"import {name}", f"from benchmarks.studies.{name} import main",
                 "from benchmarks.studies import x", f"def f():\n    import {name}",
                 f"importlib.import_module('{name}')", f"spec_from_file_location('x', 'benchmarks/studies/{name}.py')"):
        script = tmp_path / "bench_x.py"
        script.write_text(line + "\n", encoding="utf-8")
        assert [(n, s) for n, s in imported(ast.parse(script.read_text())) if study_named(s)], line
    assert not study_named("common") and not study_named("benchmarks.bench_mib") and not study_named("torch")


def test_every_study_is_listed():
    """benchmarks/studies/README.md has one line per study: the question it answered and where its results are."""
    readme = (STUDIES / "README.md").read_text(encoding="utf-8")
    missing = [name for name in sorted(studies()) if f"`{name}.py`" not in readme]
    assert not missing, missing
