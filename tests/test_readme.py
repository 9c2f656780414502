"""Every code block of README.md runs, as written, on the default model (and its sample output is what the
command prints). The two set-up commands are the ones CI itself runs: `.ci/test` starts with `.ci/install`
and `.ci/run` is `.ci/test`; the test runs the attribution the first one ends with.

The benchmark commands read their data from ``$DPA_DATA``; here that is one Known 1000 record the default
model gets right, written by the test (a fresh clone has no ../shared/data), so they run in about a minute.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
# A Known 1000 record (known_id 6) that SmolLM2-135M-Instruct answers (p = 0.79), so the filter keeps it.
KNOWN = [{"known_id": 6, "subject": "Catalonia", "attribute": "Europe", "template": "{} belongs to the continent of",
          "prompt": "Catalonia belongs to the continent of", "relation_id": "P30"}]


def blocks(kind: str | None = None) -> list[tuple[str, str]]:
    found = [(m.group(1), m.group(2)) for m in BLOCK.finditer((ROOT / "README.md").read_text())]
    return [(k, text) for k, text in found if kind is None or k == kind]


def commands(text: str) -> list[str]:
    """The command lines of a bash block (continuation lines joined), without trailing comments."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def run_dpa(line: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """One README command line, run by bash as written, with this interpreter's python and torchrun first on
    the PATH."""
    assert shlex.split(line)[0] in ("python", "torchrun", "printf"), f"README command of an unknown kind: {line}"
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(["bash", "-c", line], cwd=cwd, env={**env, "PATH": path, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{line}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    data = tmp_path_factory.mktemp("data")
    (data / "known_1000.json").write_text(json.dumps(KNOWN))
    return {**os.environ, "DPA_DATA": str(data), "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


def test_the_blocks_are_the_ones_this_test_knows():
    kinds = [k for k, _ in blocks()]
    assert set(kinds) <= {"bash", "python", "text"}, kinds
    assert kinds.count("bash") == 7 and kinds.count("text") == 1, kinds


def test_the_two_setup_commands_are_what_ci_runs(env, tmp_path):
    """The first command ends with the attribution it runs here, as written; every line of README's sample
    output (but the '...') appears, as printed, in its output (``NO_COLOR``: no colour codes, as ``--color
    never``)."""
    (_, install), (_, test) = blocks("bash")[:2]
    first, = commands(install)
    assert first.startswith("bash .ci/install && python -m dpa attribute ")
    assert commands(test) == ["bash .ci/test"]
    assert "bash .ci/test" in (ROOT / ".ci" / "run").read_text()
    ci_test = (ROOT / ".ci" / "test").read_text()
    steps = re.findall(r'^phase "[^"]*" (.*)$', ci_test, re.M)  # each phase: phase "what it does" command...
    assert steps and steps[0] == "bash .ci/install", "the test command installs first"
    assert env["NO_COLOR"] == "1"
    out = run_dpa(first.split(" && ", 1)[1], tmp_path, env).stdout
    assert "predicted" in out and "top 10 components" in out and "\x1b[" not in out
    (_, sample), = blocks("text")
    printed = [o.rstrip() for o in out.splitlines()]
    for line in sample.splitlines():
        if line.strip() and line.strip() != "...":
            assert line.rstrip() in printed, f"README shows {line!r}; the command prints:\n{out}"


def test_python_blocks_run_in_order(env, tmp_path, monkeypatch):
    """The python blocks, one after another in one namespace, as in a notebook (after the bash block that
    makes the prompt file and its results, which one of them reads)."""
    for block in (4, 6):  # the prompt file and its results; the MIB run the discovery widget opens
        for line in commands(blocks("bash")[block][1]):
            run_dpa(line, tmp_path, env)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for n, (_, code) in enumerate(blocks("python")):
        exec(compile(code, f"README.md python block {n}", "exec"), namespace)  # noqa: S102
    assert (tmp_path / "paris.json").is_file()
    assert type(namespace["widget"]).__name__ == "CircuitWidget"
    assert namespace["res"].tokens[0] == "The"
    assert type(namespace["circ"]).__name__ == "Circuit" and len(namespace["circ"].units) == 64
    assert 0 < len(namespace["small"].units) < 64
    assert len(namespace["results"]) == 2 and namespace["results"][1].target.contrast == " John"
    errors = (tmp_path / "runs" / "prompts" / "errors.jsonl").read_text()
    assert '"line": 3' in errors and "empty" in errors
    assert (tmp_path / "runs" / "prompts" / "results.jsonl").read_text() == \
        (tmp_path / "runs" / "prompts-2" / "results.jsonl").read_text()
    _check_mib_run(tmp_path / "runs" / "mib")
    found, shown = namespace["found"], namespace["discovery_widget"]
    assert found.faithfulness.cpr == json.loads((tmp_path / "runs" / "mib" / "faithfulness.json").read_text())["cpr"]
    assert type(shown).__name__ == "DiscoveryWidget" and shown.f == shown.current["f"]


def _check_mib_run(run: Path) -> None:
    """The MIB block's folder: f(100%) = 1 on SmolLM2's 123211 edges, the EAP-IG graph, the circuit at 5%."""
    found = json.loads((run / "faithfulness.json").read_text())
    assert found["cpr_curve"]["f"][-1] == 1 and found["n_edges"] == 123211
    circuit = json.loads((run / "circuit.json").read_text())
    assert sum(e["in_graph"] for e in circuit["edges"].values()) <= 0.05 * 123211
    assert (run / "graph.json").is_file() and (run / "faithfulness.png").is_file()


@pytest.mark.parametrize("which", ["circuit", "command line", "benchmark"])  # the MIB block: in the python test
def test_bash_blocks_run(env, tmp_path, which):
    _, text = blocks("bash")[{"circuit": 2, "command line": 3, "benchmark": 5}[which]]
    for line in commands(text):
        run_dpa(line, tmp_path, env)
    if which == "circuit":
        assert json.loads((tmp_path / "ioi.json").read_text())["kind"] == "circuit"
        assert "renderGraph" in (tmp_path / "ioi.html").read_text()
    elif which == "command line":
        assert (tmp_path / "paris.html").is_file() and (tmp_path / "paris.json").is_file()
    else:
        summary = json.loads((tmp_path / "runs" / "known-input" / "results.json").read_text())
        assert summary["n_evaluated"] == 1, summary.get("n_evaluated")
        assert (tmp_path / "runs" / "sweep" / "sweep.csv").is_file()
