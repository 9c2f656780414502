"""Circuit discovery for users: pairs files, resumable runs, the EAP-IG JSON, the ``dpa mib`` command."""

from __future__ import annotations

import json

import pytest
import torch

from dpa.errors import InputError, InputTypeError
from dpa.mib.discover import discover, read_pairs
from dpa.mib.graph import Graph
from dpa.mib.pairs import Pairs
from dpa.request import check_model
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
    ("not json", "line 2 is not valid JSON"),
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
    assert len(pairs) == 2 and pairs.metric == "logit_diff" and pairs.names == ("pairs.jsonl line 1",
                                                                                  "pairs.jsonl line 3")
    path.write_text(json.dumps({"clean": "The capital of France is", "counterfactual": "The capital of Italy is",
                                "answers": [" Paris", " France"], "counterfactual_answers": [" Rome"]}))
    assert read_pairs(path, smol_tokenizer).metric == "prob_diff"
    path.write_text(_line() + "\n" + json.dumps({"clean": "a", "counterfactual": "b", "answers": [" a"],
                                                  "counterfactual_answers": [" b"]}))
    with pytest.raises(InputError, match="one metric per file"):
        read_pairs(path, smol_tokenizer)
    with pytest.raises(InputError, match="no pairs file"):
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
    with pytest.raises(InputError, match="metrics-00001.pt is damaged.* delete it"):
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


# --- a hostile review: what reaches discover is checked, a run folder holds one run ---------------------------------

def _same_state(model):
    from tests.test_model_state import state

    return state(model), {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, before):
    from tests.test_model_state import state

    after = state(model), model.state_dict()
    assert after[0] == before[0]
    assert after[1].keys() == before[1].keys() and all(torch.equal(after[1][k], v) for k, v in before[1].items())


def test_a_pairs_file_is_read_as_every_dpa_file(tmp_path, smol_tokenizer):
    """dpa's own text and JSON readers: a BOM dropped, a line ends only at a line end (a U+2028 inside a prompt is
    text, and later lines keep their numbers), a key twice, an unknown key, both answer forms, a folder: refused."""
    path = tmp_path / "pairs.jsonl"
    row = json.loads(_line())
    inside = json.dumps({**row, "clean": row["clean"].replace(" went", "\u2028 went"),
                         "counterfactual": row["counterfactual"].replace(" went", "\u2028 went")}, ensure_ascii=False)
    path.write_text("\ufeff" + _line() + "\n" + _line() + "\n", encoding="utf-8")
    assert len(read_pairs(path, smol_tokenizer)) == 2
    path.write_text(_line() + "\n" + inside + "\n" + _line(answer=" xylophone") + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 3: answer ' xylophone'"):
        read_pairs(path, smol_tokenizer)
    for line, message in [('{"clean": "a", ' + _line()[1:], "line 1 has the key 'clean' twice"),
                          (_line(note="x"), "line 1: unknown key.s. 'note'"),
                          (json.dumps({**json.loads(_line()), "answers": [" Mary"],
                                       "counterfactual_answers": [" John"]}), "line 1: .* not both"),
                          ("[" * 100000 + "]" * 100000, "line 1 cannot be read: lists or objects nested too deeply")]:
        path.write_text(line + "\n")
        with pytest.raises(InputError, match=message):
            read_pairs(path, smol_tokenizer)
    with pytest.raises(InputError, match="is a folder; give a pairs file"):
        read_pairs(tmp_path, smol_tokenizer)
    with pytest.raises(InputTypeError, match="must be a path"):
        read_pairs(["clean"], smol_tokenizer)


def test_pairs_that_measure_nothing_are_refused(tmp_path, smol_tokenizer):
    """An answer that is also the counterfactual answer, or a counterfactual equal to the clean prompt: the metric
    or the patch is zero, and f = 0 / 0 would come back as NaN."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(_line() + "\n" + _line(counterfactual_answer=" Mary") + "\n")
    with pytest.raises(InputError, match="line 2: token .* is both an answer and a counterfactual answer"):
        read_pairs(path, smol_tokenizer)
    path.write_text(_line(counterfactual=json.loads(_line())["clean"]) + "\n")
    with pytest.raises(InputError, match="line 1: the clean and counterfactual prompts are the same tokens"):
        read_pairs(path, smol_tokenizer)
    with pytest.raises(InputError, match="pair 0: token 7 is both"):
        Pairs([[1, 2, 3]], [[1, 2, 4]], [[5, 7]], [[7]], "prob_diff")


@pytest.mark.parametrize("edit,error,message", [
    ({"answers": [[-1]]}, InputError, "pair 0: the answers hold the token id -1"),
    ({"answers": [[5.0]]}, InputTypeError, "pair 0: the answers must be token ids .ints., got 5.0"),
    ({"wrong": [[True]]}, InputTypeError, "pair 0: the counterfactual answers must be token ids"),
    ({"clean": [[1, 2, 3.5]]}, InputTypeError, "pair 0: the clean prompt must be token ids"),
    ({"answers": [5]}, InputTypeError, "pair 0: the answers must be a list of token ids, got int"),
])
def test_pairs_hold_token_ids(edit, error, message):
    """A negative id would index the logits from the end (a silently wrong metric); the others broke inside torch."""
    row = {"clean": [[1, 2, 3]], "counter": [[1, 2, 4]], "answers": [[5]], "wrong": [[7]]} | edit
    with pytest.raises(error, match=message):
        Pairs(row["clean"], row["counter"], row["answers"], row["wrong"])


def test_pairs_cannot_change_after_their_check():
    """Pairs are checked once, when made: a list edited afterwards (the caller's, or the pairs' own) must not reach
    a run unchecked, so the pairs copy every row into tuples and refuse assignment."""
    from dataclasses import FrozenInstanceError

    clean, counter = [[1, 2, 3]], [[1, 2, 4]]
    pairs = Pairs(clean, counter, [[5]], [[7]])
    clean[0][2] = 4  # the caller's list, now the same as the counterfactual: the pairs keep what was checked
    assert pairs.clean == ((1, 2, 3),)
    with pytest.raises(FrozenInstanceError):
        pairs.counter = pairs.clean
    with pytest.raises(AttributeError):
        pairs.clean[0].append(9)
    assert pairs.subset([0]) == pairs
    made = Pairs((row for row in [[1, 2, 3]]), iter([[1, 2, 4]]), [[5]], [[7]])  # iterables: read once, kept
    assert made == pairs and len(made) == 1
    with pytest.raises(InputTypeError, match="clean must be a list with one entry per pair, got int"):
        Pairs(3, [[1, 2, 4]], [[5]], [[7]])


def test_pairs_are_checked_against_the_model():
    """Ids past the vocabulary and prompts past the context are refused by the pair's name, before anything runs,
    in discover, edge_scores and evaluate (whose metric reads the logits' width)."""
    from dpa.mib import edge_scores, evaluate

    model = tiny_model("llama", 2)
    before = _same_state(model)
    big = Pairs([[1, 2, 3]], [[1, 2, 4]], [[500]], [[7]], names=["mine.jsonl line 4"])
    with pytest.raises(InputError, match="mine.jsonl line 4: the answer holds the token id 500, outside the model's "
                                         "vocabulary .size 96."):
        discover(model, None, big, progress=False)
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        edge_scores(model, big, "eap")
    graph = Graph.of(check_model(model))
    with pytest.raises(InputError, match="mine.jsonl line 4: the answer holds the token id 500"):
        evaluate(model, big, torch.ones(graph.exists.shape, dtype=torch.float64), sizes=(0.5, 1.0))
    long = Pairs([[3] * 70], [[4] * 70], [[5]], [[7]])
    with pytest.raises(InputError, match="pair 0: the prompts are 70 tokens, more than the model's context of 64"):
        discover(model, None, long, progress=False)
    _assert_unchanged(model, before)


def test_sizes_are_shares_of_the_edges_in_increasing_order():
    """Unordered sizes gave a negative-width area (a wrong CPR, silently); nan, 0, 2, none raised inside torch."""
    model = tiny_model("llama", 1)
    found = discover(model, None, _pairs(2), method="dpa", evaluate=False, progress=False)
    for sizes, message in [((1.0, 0.1), "sizes must increase"), ((), "sizes is empty"),
                           ((0.1, 2.0), r"share of the edges, in \(0, 1\]; got 2.0"),
                           ((float("nan"),), "finite")]:
        with pytest.raises(InputError, match=message):
            discover(model, None, _pairs(2), method="dpa", sizes=sizes, progress=False)
    for size in (0, -0.5, 2, float("nan")):
        with pytest.raises(InputError, match="size"):
            found.circuit(size)
        with pytest.raises(InputError, match="size"):
            found.to_json(size)
    with pytest.raises(InputTypeError, match="size must be a number"):
        found.edges("0.1")


def test_arguments_of_the_wrong_kind_are_refused(tmp_path):
    model = tiny_model("llama", 1)
    for kw, message in [({"pairs": [[1, 2]]}, "pairs must be a dpa.mib.Pairs or a pairs file's path"),
                        ({"out": 5}, "out must be a folder"), ({"evaluate": "no"}, "evaluate must be True or False"),
                        ({"weights": {"query": 1}}, "weights must be a dpa.PathWeights")]:
        with pytest.raises(InputTypeError, match=message):
            discover(model, None, **{"pairs": _pairs(2), "progress": False, **kw})
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file; the results go into a folder"):
        discover(model, None, _pairs(2), out=tmp_path / "file", progress=False)


def test_a_bad_temperature_is_refused_before_the_folder_is_written(tmp_path):
    """It was checked only at the first batch, after run.json recorded temperature NaN: the folder then refused
    every later run, NaN included (NaN != NaN)."""
    model = tiny_model("llama", 1)
    for t in (float("nan"), 0, -1.0):
        with pytest.raises(InputError, match="temperature"):
            discover(model, None, _pairs(2), method="gim", temperature=t, out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    discover(model, None, _pairs(2), method="gim", temperature=3, out=tmp_path / "run", evaluate=False,
             progress=False)


def test_a_run_folder_holds_one_run_of_one_model(tmp_path):
    """Resuming with another model of the same name and shape (other weights, another dtype) mixed two models'
    batches silently; now it is refused, as is a second run writing the folder at once."""
    from dpa import locks
    from dpa.errors import OutputError

    pairs, out = _pairs(4), tmp_path / "run"
    model = tiny_model("llama", 2)
    discover(model, None, pairs, method="eap", batch_size=2, out=out, evaluate=False, progress=False)
    other = tiny_model("llama", 2)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(InputError, match="holds another run .weights_sha256"):
        discover(other, None, pairs, method="eap", batch_size=2, out=out, evaluate=False, progress=False)
    with pytest.raises(InputError, match="holds another run .dtype: 'float64' there"):
        discover(tiny_model("llama", 2).float(), None, pairs, method="eap", batch_size=2, out=out, evaluate=False,
                 progress=False)
    with locks.hold(out), pytest.raises(OutputError, match="another run is writing the folder"):
        discover(model, None, pairs, method="eap", batch_size=2, out=out, evaluate=False, progress=False)
    again = discover(model, None, pairs, method="eap", batch_size=2, out=out, progress=False)
    assert torch.equal(again.scores, discover(model, None, pairs, method="eap", batch_size=2, progress=False).scores)


def test_a_run_folder_of_an_older_dpa_goes_on(tmp_path):
    """run.json without the model's fingerprints (written before they were recorded) resumes, and records them."""
    pairs, out = _pairs(4), tmp_path / "run"
    model = tiny_model("llama", 1)
    first = discover(model, None, pairs, method="eap", batch_size=2, out=out, evaluate=False, progress=False)
    meta = json.loads((out / "run.json").read_text())
    old = {k: v for k, v in meta.items() if not k.endswith("_sha256") and k != "dtype"}
    (out / "run.json").write_text(json.dumps(old))
    assert torch.equal(discover(model, None, pairs, method="eap", batch_size=2, out=out, evaluate=False,
                                progress=False).scores, first.scores)
    assert json.loads((out / "run.json").read_text()) == meta


@pytest.mark.parametrize("damage", ["shape", "nan", "type", "metrics-shape", "metrics-keys", "bare",
                                    "run.json-list"])
def test_a_damaged_run_file_is_named(tmp_path, damage):
    """A batch file that loads but is not what its stage writes (another shape, NaN, another type) was summed in
    (a wrong CPR, silently) or broke inside torch; run.json that is not an object broke with AttributeError."""
    pairs, out = _pairs(4), tmp_path / "run"
    model = tiny_model("llama", 1)
    discover(model, None, pairs, method="eap", batch_size=2, out=out, progress=False)
    batch = out / "batches" / ("metrics-00001.pt" if damage.startswith("metrics") else "scores-00001.pt")
    saved = torch.load(batch, weights_only=True)
    value = saved["value"]
    if damage == "shape":
        torch.save({**saved, "value": value[:, :3]}, batch)
    elif damage == "nan":
        torch.save({**saved, "value": value * float("nan")}, batch)
    elif damage == "type":
        torch.save({**saved, "value": {"a": 1}}, batch)
    elif damage == "metrics-shape":
        torch.save({**saved, "value": {**value, "full": value["full"][:1]}}, batch)
    elif damage == "metrics-keys":
        torch.save({**saved, "value": {"full": value["full"]}}, batch)
    elif damage == "bare":  # the value without its stamp (as an older dpa wrote it)
        torch.save(value, batch)
    else:
        (out / "run.json").write_text("[1, 2]")
    named = "run.json is damaged" if damage == "run.json-list" else f"{batch.name} is damaged.* delete it"
    with pytest.raises(InputError, match=named):
        discover(model, None, pairs, method="eap", batch_size=2, out=out, progress=False)


def test_a_batch_file_of_another_run_or_batch_is_refused(tmp_path):
    """Batch files are stamped with their run, stage and pairs: one copied in from another folder (another model,
    method or pairs) or moved to another batch's name was summed in as this run's, a wrong CPR told as right."""
    pairs, model = _pairs(4), tiny_model("llama", 1)
    discover(model, None, pairs, method="eap", batch_size=2, out=tmp_path / "a", progress=False)
    discover(model, None, pairs, method="dpa", batch_size=2, out=tmp_path / "b", evaluate=False, progress=False)
    (tmp_path / "a" / "batches" / "scores-00001.pt").write_bytes((tmp_path / "b" / "batches" / "scores-00001.pt")
                                                                 .read_bytes())
    with pytest.raises(InputError, match="scores-00001.pt is not this run's scores of batch 1 .pairs 2..3.: it was "
                                         "written by another run"):
        discover(model, None, pairs, method="eap", batch_size=2, out=tmp_path / "a", progress=False)
    batches = tmp_path / "b" / "batches"
    (batches / "scores-00000.pt").replace(batches / "scores-00001.pt")
    with pytest.raises(InputError, match="scores-00001.pt is not this run's scores of batch 1"):
        discover(model, None, pairs, method="dpa", batch_size=2, out=tmp_path / "b", evaluate=False, progress=False)


def test_a_finished_run_loads_without_the_model_read_only(tmp_path):
    """``mib.load`` reads a finished folder back (scores, method, faithfulness) with no model, lock or write: a
    read-only copy (a results folder shared by others) reads too; an unfinished one is refused by what it lacks."""
    import os
    import stat

    from dpa.mib import load

    pairs, model, out = _pairs(4), tiny_model("llama", 1), tmp_path / "run"
    found = discover(model, None, pairs, method="eap", batch_size=2, out=out, progress=False)
    for path in [out, *out.rglob("*")]:
        path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        before = sorted(p.name for p in out.rglob("*"))
        back = load(out)
        assert sorted(p.name for p in out.rglob("*")) == before
    finally:
        for path in [out, *out.rglob("*")]:
            path.chmod(path.stat().st_mode | stat.S_IWUSR)
    assert back.method == "eap" and torch.equal(back.scores, found.scores) and back.d_model == found.d_model
    assert back.faithfulness.cpr == found.faithfulness.cpr and back.faithfulness.cmd == found.faithfulness.cmd
    assert back.edges(0.1) == found.edges(0.1)
    os.remove(out / "graph.json")
    with pytest.raises(InputError, match="holds no graph.json: the run did not finish"):
        load(out)
    with pytest.raises(InputError, match="is not a dpa mib run folder"):
        load(tmp_path)


def test_non_finite_scores_are_refused_not_stored(tmp_path, monkeypatch):
    import importlib

    from dpa.errors import NonFiniteError

    module = importlib.import_module("dpa.mib.discover")

    model = tiny_model("llama", 1)
    monkeypatch.setattr(module, "batch_scores", lambda *a, **k: torch.full(Graph.of(check_model(model)).exists.shape,
                                                                          float("inf"), dtype=torch.float64))
    with pytest.raises(NonFiniteError, match="edge scores of the pairs 0 .. 1 are not finite"):
        discover(model, None, _pairs(4), batch_size=2, out=tmp_path / "run", progress=False)
    assert not list((tmp_path / "run" / "batches").iterdir())


class _OwnForward:
    """Subclasses of a model's modules with a forward of their own, which MIB's graph run does not call."""

    @staticmethod
    def attention(model):
        module = model.model.layers[1].self_attn

        class Scaled(type(module)):
            def forward(self, hidden_states, *args, **kwargs):
                out = super().forward(hidden_states, *args, **kwargs)
                return (out[0] * 3, *out[1:])
        module.__class__ = Scaled
        return "layers.1.'s attention is a Scaled whose forward is its own"

    @staticmethod
    def layer(model):
        module = model.model.layers[0]

        class Doubled(type(module)):
            def forward(self, hidden_states, *args, **kwargs):
                return super().forward(hidden_states, *args, **kwargs) * 2
        module.__class__ = Doubled
        return r"layers\[0\] is a Doubled whose forward is its own"

    @staticmethod
    def stack(model):
        module = model.model

        class Shifted(type(module)):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.last_hidden_state = out.last_hidden_state + 1
                return out
        module.__class__ = Shifted
        return "the decoder stack is a Shifted whose forward is its own"


@pytest.mark.parametrize("where", ["attention", "layer", "stack"])
def test_a_forward_the_graph_run_skips_is_refused(where):
    """MIB's graph runs norms, attention (read at o_proj's input) and MLPs one by one: an attention, layer or decoder
    stack whose class has a forward of its own was accepted and measured as the unedited model (m(full) differed
    from the model's own forward by 0.4 to 5 logits)."""
    from dpa.errors import UnsupportedModelError
    from dpa.mib import edge_scores

    model = tiny_model("llama", 4)
    message = getattr(_OwnForward, where)(model)
    before = _same_state(model)
    with pytest.raises(UnsupportedModelError, match=message):
        discover(model, None, _pairs(2), progress=False)
    with pytest.raises(UnsupportedModelError, match=message):
        edge_scores(model, _pairs(2), "eap")
    _assert_unchanged(model, before)


def test_the_graph_json_is_read_back_or_refused_by_name():
    model = tiny_model("gpt_neox", 1)
    found = discover(model, None, _pairs(2), method="dpa", evaluate=False, progress=False)
    data = found.to_json(0.1)
    graph, scores, kept = Graph.from_json(json.loads(json.dumps(data)))
    assert graph == found.graph and torch.equal(scores, found.scores) and torch.equal(kept, found.circuit(0.1))
    edge = next(iter(data["edges"]))
    for bad in [{**data, "edges": list(data["edges"])}, {**data, "cfg": {**data["cfg"], "n_layers": 1.7}},
                {**data, "cfg": {**data["cfg"], "n_heads": "4"}},
                {**data, "edges": {edge: {"score": None, "in_graph": True}}},
                {**data, "edges": {edge: {"score": float("nan"), "in_graph": True}}},
                {**data, "edges": {edge: {"score": 1.0, "in_graph": "false"}}}, {**data, "edges": {edge: 1.0}}, []]:
        with pytest.raises(InputError, match="EAP-IG graph JSON|is not an edge's entry"):
            Graph.from_json(bad)


def test_the_command_reads_the_pairs_once_and_checks_them_before_loading(tmp_path, capsys, monkeypatch):
    """A pipe (``dpa mib <(make-pairs)``) can be read once: the command read the file again inside discover, and
    waited for ever. A prompt longer than the model's context was refused only after the weights loaded."""
    import os
    import signal
    import threading

    import dpa
    from dpa.cli import main
    from tests.test_cli import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    line = json.dumps({"clean": "the capital of france is", "counterfactual": "the capital of london is",
                       "answer": "paris", "counterfactual_answer": "london"})
    fifo = tmp_path / "pairs.jsonl"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:
            f.write(line + "\n")
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()

    class ReadTwice(Exception):
        pass

    def waited(*_):
        raise ReadTwice("the pipe was opened a second time, with no one left to write it")
    out, previous = tmp_path / "run", signal.signal(signal.SIGALRM, waited)
    signal.alarm(120)  # a second read waits for a writer that never comes: stopped here instead
    try:
        code = main(["mib", str(fifo), "--out", str(out), "--model", str(folder), "--quiet", "--method", "eap",
                     "--size", "0.5"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert code == 0, capsys.readouterr().err
    assert (out / "graph.json").exists() and (out / "circuit.json").exists()
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"clean": "the city " * 40 + "is", "counterfactual": "the river " * 40 + "is",
                                "answer": "paris", "counterfactual_answer": "london"}) + "\n")
    monkeypatch.setattr(dpa, "load_model", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    code = main(["mib", str(long), "--out", str(tmp_path / "long"), "--model", str(folder), "--quiet"])
    assert code == 2 and "long.jsonl line 1: the prompts are 82 tokens, more than the model's context of 64" in \
        capsys.readouterr().err
    code = main(["mib", str(long), "--out", str(tmp_path / "hot"), "--model", str(folder), "--method", "gim",
                 "--temperature", "nan"])
    assert code == 2 and "temperature" in capsys.readouterr().err and not (tmp_path / "hot").exists()


def test_the_graph_json_goes_through_dpas_one_writer(tmp_path):
    """save_json renamed a temporary file over whatever the path was: a symbolic link became a file, a folder gave a
    bare IsADirectoryError (and as root, /dev/stdout would have been replaced)."""
    from dpa.errors import OutputError

    found = discover(tiny_model("llama", 1), None, _pairs(2), method="dpa", evaluate=False, progress=False)
    with pytest.raises(OutputError, match="it is a directory"):
        found.save_json(tmp_path)
    target, link = tmp_path / "target.json", tmp_path / "graph.json"
    target.write_text("{}")
    link.symlink_to(target)
    found.save_json(link, 0.1)
    assert link.is_symlink() and Graph.from_json(json.loads(target.read_text()))[2].sum() > 0


def test_a_folder_of_other_files_is_not_written_into(tmp_path):
    """A folder holding a user's files (a hand-made graph.json, a model's) and no run.json is not a run's: a run
    would have overwritten them. An empty folder, or one a run stopped in at its start, is taken."""
    model = tiny_model("llama", 1)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "graph.json").write_text('{"my": "hand-made graph"}')
    with pytest.raises(InputError, match=r"holds files that are not a dpa run's \(graph.json; a run's folder has its "
                                         r"run.json\)"):
        discover(model, None, _pairs(2), method="dpa", out=precious, progress=False)
    assert (precious / "graph.json").read_text() == '{"my": "hand-made graph"}'
    started = tmp_path / "started"
    (started / "batches").mkdir(parents=True)
    (started / ".dpa.lock").write_text("")
    discover(model, None, _pairs(2), method="dpa", evaluate=False, out=started, progress=False)
    assert (started / "run.json").exists()


def test_one_size_has_no_area_and_a_nan_metric_is_refused(monkeypatch):
    """Over one size CPR and CMD were 0 (a perfect CMD); a model giving NaN gave CPR and CMD NaN with 'random'."""
    from dpa.errors import NonFiniteError
    from dpa.mib.evaluate import evaluate

    model = tiny_model("llama", 1)
    with pytest.raises(InputError, match="give two sizes or more"):
        discover(model, None, _pairs(2), method="random", sizes=(1.0,), progress=False)
    scores = discover(model, None, _pairs(2), method="random", evaluate=False, progress=False).scores
    one = evaluate(model, _pairs(2), scores, sizes=(0.5,))  # one size: its f, but no area
    assert one.cpr_curve.f.shape == (1,)
    with pytest.raises(InputError, match="CPR is an area over the sizes; this evaluation has 1"):
        one.cpr
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="the task metric is not finite"):
        discover(model, None, _pairs(2), method="random", progress=False)


def test_evaluate_checks_its_arguments_as_discover_does():
    from dpa.errors import NonFiniteError
    from dpa.mib.evaluate import evaluate

    model = tiny_model("llama", 1)
    scores = discover(model, None, _pairs(2), method="random", evaluate=False, progress=False).scores
    with pytest.raises(InputError, match="batch_size"):
        evaluate(model, _pairs(2), scores, batch_size=0)
    with pytest.raises(InputTypeError, match="scores must be a tensor"):
        evaluate(model, _pairs(2), scores.tolist())
    with pytest.raises(InputError, match="this model's graph has"):
        evaluate(model, _pairs(2), scores[:, :3])
    bad = scores.clone()
    bad[Graph.of(check_model(model)).exists.nonzero()[0].tolist()] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        evaluate(model, _pairs(2), bad)
    with pytest.raises(InputTypeError, match="pairs must be"):
        evaluate(model, [[1, 2]], scores)


def test_the_tasks_refuse_a_tokenizer_of_another_model(smol_tokenizer):
    from dpa.mib.tasks import task_pairs

    with pytest.raises(InputError, match="outside the model's vocabulary"):
        task_pairs(tiny_model("llama", 1), smol_tokenizer, "ioi", n=3)
