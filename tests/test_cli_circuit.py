"""``dpa circuit``: the circuit graph from the command line, on the tiny Llama of test_cli (no network)."""

from __future__ import annotations

import json
import re

import pytest

import dpa
from dpa.cli import main

from .test_cli import PROMPT, run, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-circuit"))


def test_circuit_writes_json_and_an_offline_page(capsys, tiny_dir, tmp_path):
    page, data = tmp_path / "g.html", tmp_path / "g.json"
    code, out, _ = run(capsys, "circuit", PROMPT, "--target", "paris", "--model", str(tiny_dir), "--nodes", "8",
                       "--json", str(data), "--html", str(page))
    assert code == 0
    assert "8 units" in out and "top 10 direct effects" in out and f"wrote {page}" in out
    graph = json.loads(data.read_text())
    assert graph["kind"] == "circuit" and graph["target"]["token"] == "paris"
    assert sum(n["kind"] in ("head", "neuron") for n in graph["nodes"]) == 8
    model, tok = dpa.load_model(str(tiny_dir), device="cpu")
    same = dpa.circuit(model, tok, PROMPT, "paris", nodes=8)
    assert [n["label"] for n in graph["nodes"]] == [n.label for n in same.nodes]
    for s, d, e in graph["edges"]:
        assert e == pytest.approx(float(same.edges[s, d]), rel=1e-5, abs=1e-7)
    text = page.read_text()
    assert "renderGraph(document.getElementById(\"graph\")" in text and '"kind": "circuit"' in text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)  # nothing fetched: renders offline


def test_circuit_options(capsys, tiny_dir):
    code, out, _ = run(capsys, "circuit", PROMPT, "--target", "paris", "--model", str(tiny_dir), "--nodes", "12",
                       "--components", "--json", "-")
    graph = json.loads(out)
    assert code == 0 and graph["positions"] is False
    assert all("@" not in n["label"] for n in graph["nodes"] if n["kind"] in ("head", "neuron"))
    code, out, _ = run(capsys, "circuit", PROMPT, "--target", "paris", "--model", str(tiny_dir), "--nodes", "12",
                       "--prune", "0.5", "--json", "-")
    pruned = json.loads(out)
    assert code == 0 and 0 < sum(n["kind"] in ("head", "neuron") for n in pruned["nodes"]) < 12


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "0"], "--nodes must be at least 1"),
    (["--prune", "2"], "--prune takes a share"),
    (["--logprob", "--contrast", "london"], "--logprob takes no --contrast"),
])
def test_circuit_refuses_bad_options(capsys, tiny_dir, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["circuit", PROMPT, "--model", str(tiny_dir), *argv])
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_circuit_reports_input_errors_in_one_line(capsys, tiny_dir):
    code, _, err = run(capsys, "circuit", "   ", "--model", str(tiny_dir))
    assert code == 2 and "error: the prompt is empty" in err
    code, _, err = run(capsys, "circuit", PROMPT, "--target", "paris london", "--model", str(tiny_dir))
    assert code == 2 and err.startswith("error:") and "token" in err
