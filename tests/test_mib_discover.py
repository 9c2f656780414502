"""Circuit discovery for users: pairs files, resumable runs, the EAP-IG JSON, the ``dpa mib`` command."""

from __future__ import annotations

import json

import pytest
import torch

from dpa.errors import InputError
from dpa.mib.discover import discover, read_pairs
from dpa.mib.graph import Graph
from dpa.mib.pairs import Pairs
from tests.conftest import tiny_model


def _pairs(n=5):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 96, (n, 6), generator=g).tolist()
    counter = torch.randint(3, 96, (n, 6), generator=g).tolist()
    return Pairs(clean, counter, [[5]] * n, [[7]] * n)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from dpa.models import read_tokenizer_and_config, resolve

    return read_tokenizer_and_config(resolve(None), quick=True)[0]


def _line(**kw):
    row = {"clean": "When Mary and John went to the store, John gave a drink to",
           "counterfactual": "When Mary and John went to the store, Anne gave a drink to",
           "answer": " Mary", "counterfactual_answer": " John"}
    row.update(kw)
    return json.dumps({k: v for k, v in row.items() if v is not None})


@pytest.mark.parametrize("line,message", [
    ("not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: a pair is a JSON object"),
    (_line(clean=None), "line 2: 'clean' is missing"),
    (_line(counterfactual="When Mary and John went to the store, Anne Smith gave a drink to"), "line 2: the clean "
     "prompt is 14 tokens and the counterfactual 15"),
    (_line(answer=" xylophone"), "line 2: answer ' xylophone' is not a single token"),
    (_line(answer=None), "line 2: give 'answer' and 'counterfactual_answer'"),
])
def test_a_bad_line_is_refused_by_its_number(tmp_path, smol_tokenizer, line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(_line() + "\n" + line + "\n")
    with pytest.raises(InputError, match=message):
        read_pairs(path, smol_tokenizer)


def test_pairs_files_read_both_metrics(tmp_path, smol_tokenizer):
    path = tmp_path / "pairs.jsonl"
    path.write_text(_line() + "\n\n" + _line() + "\n")
    pairs = read_pairs(path, smol_tokenizer)
    assert len(pairs) == 2 and pairs.metric == "logit_diff" and pairs.names == ["pairs.jsonl line 1",
                                                                                  "pairs.jsonl line 3"]
    path.write_text(json.dumps({"clean": "The capital of France is", "counterfactual": "The capital of Italy is",
                                "answers": [" Paris", " France"], "counterfactual_answers": [" Rome"]}))
    assert read_pairs(path, smol_tokenizer).metric == "prob_diff"
    path.write_text(_line() + "\n" + json.dumps({"clean": "a", "counterfactual": "b", "answers": [" a"],
                                                  "counterfactual_answers": [" b"]}))
    with pytest.raises(InputError, match="one metric per file"):
        read_pairs(path, smol_tokenizer)
    with pytest.raises(InputError, match="cannot read"):
        read_pairs(tmp_path / "missing.jsonl", smol_tokenizer)


def test_an_interrupted_run_goes_on_where_it_stopped(tmp_path, monkeypatch):
    model = tiny_model("llama", 2)
    pairs = _pairs()
    whole = discover(model, None, pairs, method="eap", batch_size=2, progress=False)
    from dpa.mib.evaluate import Plan

    calls = {"n": 0}
    own = Plan.metrics

    def flaky(self, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return own(self, batch)
    monkeypatch.setattr(Plan, "metrics", flaky)
    with pytest.raises(KeyboardInterrupt):
        discover(model, None, pairs, method="eap", batch_size=2, out=tmp_path / "run", progress=False)
    monkeypatch.setattr(Plan, "metrics", own)
    done = sorted(p.name for p in (tmp_path / "run" / "batches").iterdir())
    assert done == ["metrics-00000.pt", "scores-00000.pt", "scores-00001.pt", "scores-00002.pt"]
    again = discover(model, None, pairs, method="eap", batch_size=2, out=tmp_path / "run", progress=False)
    assert torch.equal(again.scores, whole.scores)
    assert again.faithfulness.cpr == whole.faithfulness.cpr and again.faithfulness.cmd == whole.faithfulness.cmd
    saved = json.loads((tmp_path / "run" / "graph.json").read_text())
    graph, scores, kept = Graph.from_json(saved)
    assert torch.equal(scores, whole.scores) and bool(kept.all() == graph.exists.all())
    assert json.loads((tmp_path / "run" / "faithfulness.json").read_text())["cpr"] == whole.faithfulness.cpr
    with pytest.raises(InputError, match="another run .method: 'eap' there, 'dpa' now"):
        discover(model, None, pairs, method="dpa", batch_size=2, out=tmp_path / "run", progress=False)
    (tmp_path / "run" / "batches" / "metrics-00001.pt").write_bytes(b"half a file")
    with pytest.raises(InputError, match="metrics-00001.pt is damaged: delete it"):
        discover(model, None, pairs, method="eap", batch_size=2, out=tmp_path / "run", progress=False)


def test_a_circuit_is_its_top_edges_pruned_and_exported():
    model = tiny_model("qwen3", 1)
    found = discover(model, None, _pairs(3), method="dpa", evaluate=False, progress=False)
    kept = found.circuit(0.05)
    assert 0 < int(kept.sum()) <= int(0.05 * found.graph.n_edges)
    assert torch.equal(found.graph.prune(kept), kept)
    edges = found.edges(0.05)
    assert len(edges) == int(kept.sum()) and edges[0][1] >= edges[-1][1]
    data = found.to_json(0.05)
    assert sum(e["in_graph"] for e in data["edges"].values()) == int(kept.sum())
    assert data["cfg"] == {"n_layers": 3, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32}
    with pytest.raises(InputError, match="not evaluated"):
        found.plot()
