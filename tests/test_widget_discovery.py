"""DiscoveryWidget (no browser): its payload against the Discovery it shows, f exact at the evaluated sizes and
evaluated on demand elsewhere, the checks of its inputs and traits. The view: tests/test_discovery_browser.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import traitlets

import dpa
from dpa.mib import SIZES, Graph, Pairs, discover, evaluate
from dpa.mib.discover import Discovery, load
from dpa_widgets import DiscoveryWidget
from dpa_widgets import discovery as module

from .conftest import tiny_model

RANKINGS = (("signed", False), ("absolute", True))


def random_pairs(n=5, length=6, seed=0) -> Pairs:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 96, (n, length), generator=g).tolist()
    counter = torch.randint(3, 96, (n, length), generator=g).tolist()
    return Pairs(clean, counter, [[5]] * n, [[7]] * n)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2)


@pytest.fixture(scope="module")
def pairs():
    return random_pairs()


@pytest.fixture(scope="module")
def found(model, pairs):
    return discover(model, None, pairs, method="dpa-cf", batch_size=5, progress=False)


@pytest.fixture(scope="module")
def unevaluated(model, pairs):
    return discover(model, None, pairs, method="eap", evaluate=False, batch_size=5, progress=False)


def curve_of(found: Discovery, ranking: str):
    return found.faithfulness.cpr_curve if ranking == "signed" else found.faithfulness.cmd_curve


def kept_edges(found: Discovery, size: float, absolute: bool) -> dict[tuple[int, int], float]:
    kept = found.circuit(size, absolute)
    return {(w, r): float(found.scores[w, r]) for w, r in kept.nonzero().tolist()}


def check_entry(entry: dict, found: Discovery, size: float, absolute: bool, cap: int) -> None:
    """A circuit of the payload is the discovery's circuit at that size: its kept edges (their count, the shown
    ones the strongest by |score|, strongest first), its writers, the edges asked for."""
    every = kept_edges(found, size, absolute)
    shown = {(w, r): s for w, r, s in entry["edges"]}
    assert entry["size"] == size and entry["kept"] == len(every)
    assert entry["asked"] == int(size * found.graph.n_edges)
    assert len(entry["edges"]) == len(shown) == min(cap, len(every))
    assert all(every[e] == s for e, s in shown.items()), "the shown edges are kept edges, with their scores"
    magnitudes = [abs(s) for _, _, s in entry["edges"]]
    assert magnitudes == sorted(magnitudes, reverse=True)
    rest = [abs(s) for e, s in every.items() if e not in shown]
    assert not rest or min(magnitudes) >= max(rest), "the capped list holds the strongest edges"
    assert entry["nodes"] == found.circuit(size, absolute).any(1).nonzero().flatten().tolist()


class TestPayload:
    def test_the_circuits_are_the_discoverys_at_every_size(self, found):
        w = DiscoveryWidget(found)
        data = w._data
        assert data["sizes"] == list(SIZES) and data["n_edges"] == found.graph.n_edges
        assert (data["method"], data["n_layers"], data["n_heads"], data["evaluated"]) == ("dpa-cf", 3, 4, True)
        assert data["cpr"] == found.faithfulness.cpr and data["cmd"] == found.faithfulness.cmd
        for ranking, absolute in RANKINGS:
            curve = curve_of(found, ranking)
            assert data["curves"][ranking] == {"sizes": list(curve.sizes), "edges": curve.edges, "kept": curve.kept,
                                               "f": curve.f.tolist()}
            for k, size in enumerate(SIZES):
                entry = data["circuits"][ranking][k]
                check_entry(entry, found, size, absolute, module.MAX_EDGES)
                assert entry["kept"] == curve.kept[k] and entry["asked"] == curve.edges[k]
                assert entry["f"] == float(curve.f[k])  # exact: the discovery's own number

    def test_nodes_and_readers_name_the_graph(self, found):
        data = DiscoveryWidget(found)._data
        graph = found.graph
        assert [n for n, _, _ in data["writers"]] == graph.writer_names
        assert data["writers"][0] == ["input", -1, -1] and data["writers"][graph.head(1, 2)] == ["a1.h2", 1, 2]
        assert data["writers"][graph.mlp(2)] == ["m2", 2, -1]
        assert [n for n, _, _ in data["readers"]] == graph.reader_names
        assert data["readers"][graph.reads(2, 1, 3)] == ["a2.h3<k>", graph.head(2, 3), "k"]
        assert data["readers"][graph.mlp_reader(0)] == ["m0", graph.mlp(0), ""]
        assert data["readers"][graph.logits] == ["logits", -1, ""]

    def test_at_most_max_edges_are_sent_the_strongest(self, found):
        w = DiscoveryWidget(found, max_edges=7)
        assert w._data["max_edges"] == 7
        for ranking, absolute in RANKINGS:
            for k, size in enumerate(SIZES):
                check_entry(w._data["circuits"][ranking][k], found, size, absolute, 7)

    def test_a_large_graph_sends_300_edges(self):
        """SmolLM2's graph (30 layers x 9 heads, 123211 edges) with random scores: thousands of edges kept, 300
        sent, the strongest; the payload stays small."""
        graph = Graph(30, 9)
        g = torch.Generator().manual_seed(1)
        scores = torch.randn(graph.exists.shape, generator=g, dtype=torch.float64) * graph.exists
        w = DiscoveryWidget(Discovery(graph, scores, "random", None))
        assert graph.n_edges == 123211
        for ranking, absolute in RANKINGS:
            for k in (5, 9):  # 5% and 100%
                entry = w._data["circuits"][ranking][k]
                assert entry["kept"] > 1000 and len(entry["edges"]) == 300
                check_entry(entry, Discovery(graph, scores, "random", None), SIZES[k], absolute, 300)
        assert len(json.dumps(w._data)) < 400_000

    def test_the_state_is_json(self, found):
        """Every synced trait serialises as strict JSON (no NaN: an f that is not finite is sent as null)."""
        w = DiscoveryWidget(found)
        state = {k: v for k, v in w.get_state().items() if k not in ("_esm", "_css")}
        json.dumps(state, allow_nan=False)
        nan = dataclass_replace(found, values=found.faithfulness.cpr_curve.values * float("nan"))
        w = DiscoveryWidget(nan)
        json.dumps({k: v for k, v in w.get_state().items() if k not in ("_esm", "_css")}, allow_nan=False)
        assert w._data["curves"]["signed"]["f"][0] is None and w._data["cpr"] is None
        assert w._data["circuits"]["signed"][3]["f"] is None


def dataclass_replace(found: Discovery, **curve_fields) -> Discovery:
    """``found`` with its signed curve's fields replaced (a copy)."""
    import dataclasses

    f = found.faithfulness
    return Discovery(found.graph, found.scores, found.method,
                     dataclasses.replace(f, cpr_curve=dataclasses.replace(f.cpr_curve, **curve_fields)))


class TestSize:
    def test_f_at_an_evaluated_size_is_the_discoverys(self, found):
        w = DiscoveryWidget(found)
        for ranking, absolute in RANKINGS:
            w.ranking = ranking
            for k, size in enumerate(SIZES):
                w.size = size
                assert w.f == float(curve_of(found, ranking).f[k])
                assert w.current["kept"] == int(found.circuit(size, absolute).sum())
                assert set(w.current["names"]) == {n for n, _ in found.edges(size, absolute)}
        assert w._points == [] and w._error == ""

    def test_the_default_size(self, found, unevaluated):
        for ranking in ("signed", "absolute"):
            curve = curve_of(found, ranking)
            good = [p for p, f in zip(curve.sizes, curve.f.tolist()) if f >= 0.8]
            assert DiscoveryWidget(found, ranking=ranking).size == (good[0] if good else 0.05)
        assert DiscoveryWidget(found, size=0.01).size == 0.01
        assert DiscoveryWidget(unevaluated).size == 0.05

    def test_a_size_within_rounding_of_an_evaluated_one_is_that_one(self, found):
        w = DiscoveryWidget(found)
        w.size = 0.05 * (1 + 1e-12)
        assert w.size == 0.05 and w.f == float(found.faithfulness.cpr_curve.f[5])

    def test_another_size_is_evaluated_with_the_model(self, found, model, pairs, monkeypatch):
        calls = []
        monkeypatch.setattr(module, "evaluate", lambda *a, **k: calls.append(k["sizes"]) or evaluate(*a, **k))
        w = DiscoveryWidget(found, model=model, pairs=pairs, batch_size=5)
        assert w._live and calls == []
        w.size = 0.03
        expected = evaluate(model, pairs, found.scores, sizes=(0.03,), batch_size=5)
        assert calls == [(0.03,)] and not w._busy and w._error == ""
        assert w.f == float(expected.cpr_curve.f[0])
        assert w.current["kept"] == expected.cpr_curve.kept[0] == int(found.circuit(0.03).sum())
        check_entry(w.current, found, 0.03, False, module.MAX_EDGES)
        w.ranking = "absolute"  # the other ranking came with the same evaluation
        assert w.f == float(expected.cmd_curve.f[0]) and calls == [(0.03,)]
        check_entry(w.current, found, 0.03, True, module.MAX_EDGES)
        w.size = 0.05
        assert w.f == float(found.faithfulness.cmd_curve.f[5])
        w.size = 0.03  # kept
        assert calls == [(0.03,)] and len(w._points) == 1 and w._points[0]["size"] == 0.03
        assert w._points[0]["signed"]["f"] == float(expected.cpr_curve.f[0])

    def test_another_size_is_refused_without_the_model(self, found):
        w = DiscoveryWidget(found)
        with pytest.raises(dpa.InputError, match=r"size 0\.03: f is known only at the evaluated sizes \(0\.001, "
                                                 r".*\); pass model= and pairs="):
            w.size = 0.03
        assert w.size != 0.03 and w._points == []
        with pytest.raises(traitlets.TraitError):  # also a TraitError, as traitlets' own checks are
            w.size = 0.03
        with pytest.raises(dpa.InputError, match="f is known only at the evaluated sizes"):
            DiscoveryWidget(found, size=0.25)

    @pytest.mark.parametrize("size", [0, -0.1, 1.5, float("nan"), float("inf")])
    def test_a_size_outside_0_1_is_refused(self, found, model, pairs, size):
        w = DiscoveryWidget(found, model=model, pairs=pairs)
        with pytest.raises(dpa.InputError, match=r"size is the share of edges kept, in \(0, 1\]"):
            w.size = size
        with pytest.raises(dpa.InputError, match=r"in \(0, 1\]"):
            DiscoveryWidget(found, size=size)

    def test_a_size_of_the_wrong_type_is_refused(self, found):
        w = DiscoveryWidget(found)
        with pytest.raises(dpa.InputTypeError, match="expected a float.*setting size = '5%'"):
            w.size = "5%"

    def test_a_bad_ranking_is_refused(self, found):
        w = DiscoveryWidget(found)
        with pytest.raises(dpa.InputError, match="ranking must be 'signed' .* or 'absolute' .*, got 'cpr'"):
            w.ranking = "cpr"
        assert w.ranking == "signed"
        with pytest.raises(dpa.InputError, match="ranking must be"):
            DiscoveryWidget(found, ranking="abs")

    def test_an_evaluation_that_fails_is_shown_not_raised(self, found, model, pairs, monkeypatch):
        def fails(*_a, **_k):
            raise dpa.InputError("pair 3: a token id is outside the vocabulary")

        w = DiscoveryWidget(found, model=model, pairs=pairs)
        monkeypatch.setattr(module, "evaluate", fails)
        w.size = 0.03  # from the view this runs in a comm handler: an exception there is lost in a log
        assert w._error == "InputError: pair 3: a token id is outside the vocabulary" and not w._busy
        assert w.f is None and w.current["kept"] == int(found.circuit(0.03).sum()), "the circuit is still shown"
        w.size = 0.05
        assert w._error == ""
        w.size = 0.03
        assert "outside the vocabulary" in w._error
        with pytest.raises(dpa.InputError, match="outside the vocabulary"):  # a size asked for at construction
            DiscoveryWidget(found, model=model, pairs=pairs, size=0.04)


class TestWithoutFaithfulness:
    def test_shown_with_f_unknown(self, unevaluated):
        w = DiscoveryWidget(unevaluated)
        data = w._data
        assert data["evaluated"] is False and data["curves"] is None and data["cpr"] is None and data["cmd"] is None
        assert w.f is None and w._error == ""
        for ranking, absolute in RANKINGS:
            for k, size in enumerate(SIZES):
                entry = data["circuits"][ranking][k]
                assert entry["f"] is None
                check_entry(entry, unevaluated, size, absolute, module.MAX_EDGES)
        w.size = 0.2
        assert w.f is None and w.current["kept"] == int(unevaluated.circuit(0.2).sum())
        with pytest.raises(dpa.InputError, match="size 0.03: the circuits are shown at MIB's sizes .* pass model="):
            w.size = 0.03

    def test_with_the_model_each_size_is_evaluated_as_it_is_chosen(self, unevaluated, model, pairs):
        w = DiscoveryWidget(unevaluated, model=model, pairs=pairs, batch_size=5)
        assert w.size == 0.05 and len(w._points) == 1  # the size on view, evaluated at once
        expected = evaluate(model, pairs, unevaluated.scores, sizes=(0.05,), batch_size=5)
        assert w.f == float(expected.cpr_curve.f[0])
        w.ranking = "absolute"
        assert w.f == float(expected.cmd_curve.f[0])


class TestArguments:
    def test_what_is_refused(self, found, model, pairs):
        with pytest.raises(dpa.InputTypeError, match="discovery must be a dpa.mib.Discovery"):
            DiscoveryWidget(found.scores)
        with pytest.raises(dpa.InputError, match="pass model and pairs together"):
            DiscoveryWidget(found, model=model)
        with pytest.raises(dpa.InputError, match="pass model and pairs together"):
            DiscoveryWidget(found, pairs=pairs)
        with pytest.raises(dpa.InputTypeError, match="pairs must be a dpa.mib.Pairs"):
            DiscoveryWidget(found, model=model, pairs=[pairs])
        other = Discovery(Graph(2, 4), torch.zeros(Graph(2, 4).exists.shape, dtype=torch.float64), "eap", None)
        with pytest.raises(dpa.InputError, match=r"the model's graph \(3 layers x 4 heads\) is not the discovery's "
                                                 r"\(2 x 4\)"):
            DiscoveryWidget(other, model=model, pairs=pairs)
        scores = found.scores.clone()
        scores[0, -1] = float("nan")
        with pytest.raises(dpa.NonFiniteError, match="NaN or infinite"):
            DiscoveryWidget(Discovery(found.graph, scores, "eap", None))
        with pytest.raises(dpa.InputError, match="max_edges must be at least 1"):
            DiscoveryWidget(found, max_edges=0)
        with pytest.raises(dpa.InputError, match="batch_size must be at least 1"):
            DiscoveryWidget(found, model=model, pairs=pairs, batch_size=0)
        with pytest.raises(dpa.InputTypeError, match="name must be a string"):
            DiscoveryWidget(found, name=3)

    def test_another_model_or_pairs_of_the_same_shape_is_refused(self, found, model, pairs, tmp_path):
        """Same-shaped weights of another seed, or other pairs, were taken: f at sizes typed into the view came from
        them and was drawn on the discovery's curve. A discovery read back from its folder knows what it was made on."""
        with pytest.raises(dpa.InputError, match="not the model the discovery was made on"):
            DiscoveryWidget(found, model=tiny_model("llama", kv_heads=2, seed=5), pairs=pairs)
        with pytest.raises(dpa.InputError, match="not the pairs the discovery was made on"):
            DiscoveryWidget(found, model=model, pairs=random_pairs(seed=9))
        discover(model, None, pairs, method="random", evaluate=False, out=tmp_path / "run", progress=False)
        loaded = load(tmp_path / "run")
        DiscoveryWidget(loaded, model=model, pairs=pairs)
        with pytest.raises(dpa.InputError, match="not the pairs the discovery was made on"):
            DiscoveryWidget(loaded, model=model, pairs=random_pairs(seed=9))

    def test_what_the_model_cannot_run_is_refused_at_once(self, found, model, pairs):
        """Pairs past the model's vocabulary, or a model whose attention has a forward of its own (MIB's graph run
        reads heads at o_proj's input, so it would miss the edit), failed only when a size was evaluated (an
        IndexError), or were evaluated as the unedited model."""
        from tests.test_model_state import state

        past = Pairs(pairs.clean, pairs.counter, [[500]] * len(pairs), pairs.wrong)
        with pytest.raises(dpa.InputError, match="pair 0: the answer holds the token id 500, outside the model's "
                                                 "vocabulary"):
            DiscoveryWidget(found, model=model, pairs=past)
        edited = tiny_model("llama", kv_heads=2)
        attention = edited.model.layers[2].self_attn

        class Halved(type(attention)):
            def forward(self, hidden_states, *args, **kwargs):
                out = super().forward(hidden_states, *args, **kwargs)
                return (out[0] / 2, *out[1:])
        attention.__class__ = Halved
        before = state(edited)
        with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[2\]'s attention is a Halved whose forward is "
                                                            "its own"):
            DiscoveryWidget(found, model=edited, pairs=pairs)
        assert state(edited) == before

    def test_evaluate_takes_a_share_of_the_edges(self, found, model, pairs):
        """``evaluate(size)`` went straight to the evaluation: -1 gave f = 0 for an empty circuit, 5 every edge, nan
        a ValueError from int()."""
        w = DiscoveryWidget(found, model=model, pairs=pairs)
        for size in (-1, 0, 5, float("nan")):
            with pytest.raises(dpa.InputError, match="size"):
                w.evaluate(size)
        assert not w._cache

    def test_the_model_name_is_shown(self, found, model, pairs):
        assert DiscoveryWidget(found)._data["model"] == ""
        assert DiscoveryWidget(found, name="SmolLM2-135M")._data["model"] == "SmolLM2-135M"
        model.config._name_or_path = "tiny/llama"
        try:
            assert DiscoveryWidget(found, model=model, pairs=pairs)._data["model"] == "tiny/llama"
        finally:
            model.config._name_or_path = ""

    def test_the_kernel_answers_the_views_hello(self, found, model, pairs):
        for kwargs, live in (({}, False), ({"model": model, "pairs": pairs}, True)):
            w = DiscoveryWidget(found, **kwargs)
            sent = []
            w.send = sent.append
            w._on_message(w, {"action": "hello"}, [])
            assert sent == [{"action": "hello", "live": live}] and w._live is live


def test_the_view_ships_with_the_package():
    """static/discovery.js and .css are the widget's _esm and _css, in the package data (static/*), and the module
    stands alone: no import, no network."""
    root = Path(__file__).parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    assert re.search(r'^dpa_widgets = \["static/\*"\]$', pyproject, re.MULTILINE)
    js = (root / "dpa_widgets" / "static" / "discovery.js").read_text()
    assert str(DiscoveryWidget._esm) == js, "the widget's _esm is static/discovery.js"
    assert str(DiscoveryWidget._css) == (root / "dpa_widgets" / "static" / "discovery.css").read_text()
    assert "export default { render }" in js
    assert not re.search(r"^\s*import\s", js, re.MULTILINE) and "import(" not in js
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", js) and "fetch(" not in js
    assert math.isclose(module.GOOD_F, 0.8)
