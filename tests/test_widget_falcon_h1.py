"""The widget on Falcon-H1, whose every layer runs attention and a Mamba-2 block side by side: a row of head scores
is the layer's 4 attention heads, then its 4 SSM heads ("scan" units, ``beside == ("scan", 4)``). The payload says
which column is which, names and indexes each unit by its kind (L0.H2, L0.S1), ranks each kind's own top units;
the live widget fits the model's rows (heads + the units beside them) and draws its circuit graph, and what dpa
refuses on this family (component ablations) the widget says in words instead of failing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import dpa
from dpa_widgets import CircuitWidget, generation, live, payload, save_html

from .conftest import random_ids, tiny_model

IDS = random_ids(9).tolist()
TARGET = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("falcon_h1")


@pytest.fixture(scope="module")
def result(model):
    return dpa.attribute(model, None, IDS, target=TARGET, edges=True, neuron_positions=True)


def close(a, b, tol=1e-4):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.as_tensor(b).double(), rtol=tol,
                               atol=tol * 1e-2)


def test_the_payload_says_which_columns_are_heads_and_which_scan_units(result):
    assert result.beside == ("scan", 4) and result.head_scores.shape == (3, 8)
    data = payload.view_payload(result)
    json.dumps(data, allow_nan=False)
    assert data["beside"] == ["scan", 4] and data["unit_kinds"] == ["head", "scan"]
    assert data["unit_letters"] == {"head": "H", "scan": "S"}
    assert (data["n_heads"], data["n_kv_heads"]) == (8, 2)  # the row's width; the KV heads are attention's
    assert "layer_kinds" not in data and "unit_widths" not in data  # (every layer has attention)
    close(data["head_scores"], result.head_scores)
    plain = payload.view_payload(dpa.attribute(tiny_model("llama"), None, IDS, target=TARGET))
    assert not {"beside", "unit_kinds", "unit_letters"} & set(plain)


def test_each_column_is_named_and_indexed_by_its_kind(result):
    assert [payload.unit_at(result, 0, c) for c in (0, 3, 4, 5, 7)] == [
        ("head", 0), ("head", 3), ("scan", 0), ("scan", 1), ("scan", 3)]
    assert [payload.unit_label(result, 2, c) for c in (2, 5)] == ["L2.H2", "L2.S1"]
    for layer, column in ((0, 8), (3, 0), (-1, 2)):
        with pytest.raises(IndexError, match="outside"):
            payload.unit_at(result, layer, column)
    detail = payload.head_detail(result, 0, 5)
    assert (detail["unit"], detail["unit_index"], detail["label"], detail["index"]) == ("scan", 1, "L0.S1", 5)
    close(detail["edges"], result.edge_scores[0, 5])  # a scan unit's edges by query and key, as a head's
    close(detail["by_key"], result.edge_scores[0, 5].sum(0))
    assert payload.head_detail(result, 1, 2)["label"] == "L1.H2"
    with pytest.raises(IndexError, match="outside"):
        payload.head_detail(result, 0, 8)


def test_each_kinds_top_units_rank_its_own_columns_as_top_components_does(result):
    scores = result.head_scores.double()
    for kind, columns in (("head", range(4)), ("scan", range(4, 8))):
        top = payload.top_heads(result, 5, kind)
        assert all(c in columns for _, c in top)
        expected = sorted(((i, c) for i in range(3) for c in columns), key=lambda lc: -abs(float(scores[lc])))[:5]
        assert top == expected
        ranked = result.top_components(12, kinds=(kind,))  # dpa's own ranking names the same units, by index in kind
        named = {(c.layer, c.index + (4 if kind == "scan" else 0)) for side in ranked.values() for c in side}
        assert set(top) <= named
    assert payload.top_units(result, 2) == payload.top_heads(result, 2, "head") + payload.top_heads(result, 2, "scan")
    assert len(payload.top_heads(result, 99, "scan")) == 12
    with pytest.raises(ValueError, match="no conv units"):
        payload.top_heads(result, 3, "conv")


def test_token_routes_rank_every_column_of_the_row(result):
    routes = payload.token_routes(result, k=4)
    by_key = result.edge_scores.sum(2)  # [layer column key]
    for j, route in enumerate(routes):
        assert [i * 8 + c for i, c, _ in route["heads"]] == by_key[:, :, j].abs().flatten().topk(4).indices.tolist()
    assert any(c >= 4 for route in routes for _, c, _ in route["heads"]), "scan units route tokens too"


def test_the_live_widget_fits_the_models_rows_and_sends_each_kinds_details(model, result):
    live.check_fits(model, result)  # 3 x (4 heads + 4 scan units): the model's spec.row_width
    w = CircuitWidget(result, model, None)
    assert w._data["beside"] == ["scan", 4]
    for kind in ("head", "scan"):  # each kind's top units' details are there up front (a static page keeps them)
        for layer, column in payload.top_heads(result, w._static_heads(result), kind):
            assert w._details[f"head:{layer}:{column}"]["unit"] == kind
    w.selected_head = [1, 6]
    assert w._details["head:1:6"]["label"] == "L1.S2"
    with pytest.raises(dpa.InputError, match="selected_head"):
        w.selected_head = [0, 8]
    neuron = next(d for k, d in w._details.items() if k.startswith("neuron:"))
    assert neuron["promotes"] and not neuron.get("no_vocab")  # the lens reads it (the MLP's down multiplier)
    w.weights_preset = "attention"  # a recompute keeps the layout
    assert not w._error and w._data["beside"] == ["scan", 4]


def test_a_result_that_does_not_fit_the_rows_is_refused_by_name(model, result):
    flat = dataclasses.replace(result, beside=None)  # the same widths, read as 8 heads
    with pytest.raises(dpa.InputError, match=r"8 heads.*\(4 heads \+ 4 scan units\)"):
        live.check_fits(model, flat)
    llama = tiny_model("llama")
    with pytest.raises(dpa.InputError, match=r"\(4 heads \+ 4 scan units\).*the model 3 x 4 heads"):
        live.check_fits(llama, result)
    with pytest.raises(dpa.InputError, match="does not fit"):
        CircuitWidget(result, llama, None)


def test_what_dpa_refuses_on_this_family_the_widget_says_in_words(model, result):
    w = CircuitWidget(result, model, None, selected_head=[0, 5])
    with pytest.raises(dpa.UnsupportedModelError, match=r"side by side.*\(L0\.S1\); verify neurons or tokens"):
        w.verify("disrupt", "selection")
    w._on_message(w, {"action": "verify", "mode": "disrupt", "units": "top_components"}, [])  # the view's Verify
    assert w._error.startswith("UnsupportedModelError: verification by ablation is not yet supported here")
    w.selected_head = None
    w.selected_neuron = [1, 7]  # a neuron is ablated as on any model
    assert 0 <= w.verify("disrupt", "selection")["p_after"] <= 1
    w.selected_neuron = None
    w.selected_token = 2
    out = w.verify("disrupt", "selection")  # tokens are ablated at the input: that runs
    assert out["units"] == [f"token 2 {result.tokens[2]!r}"] and 0 <= out["p_after"] <= 1
    assert w.verify("disrupt", "top_tokens")["p_before"] == pytest.approx(out["p_before"])
    with_graph = CircuitWidget(result, model, None, circuit=True)  # the circuit graph: heads and SSM heads as nodes
    labels = {n["label"].split("@")[0] for n in with_graph._graph["nodes"]}
    assert any(".S" in x for x in labels) and any(".H" in x for x in labels) and not with_graph._error


def test_a_baseline_of_the_attention_heads_alone_is_ranked_on_them(model, result):
    out = live.compare(model, None, result, "components:gradient")
    rows = out["head_scores"]
    assert len(rows) == 3 and all(len(r) == 8 and r[4:] == [None] * 4 for r in rows)
    assert all(v is not None for r in rows for v in r[:4])
    expected = payload.spearman(result.head_scores[:, :4], torch.tensor([r[:4] for r in rows], dtype=torch.float64))
    assert out["rho"] == pytest.approx(expected)
    full = live.compare(model, None, result, "components:dpa_mid")  # one that scores every column
    assert all(None not in r for r in full["head_scores"])


def test_save_html_and_the_generation_view_carry_the_layout(model, result, tmp_path):
    page = save_html(CircuitWidget(result), tmp_path / "falcon_h1.html").read_text()
    assert '"beside": ["scan", 4]' in page
    gen = dpa.attribute_generation(model, None, IDS[:6], max_new_tokens=2)
    data = generation.payload(gen)
    assert data["beside"] == ["scan", 4] and data["n_heads"] == 8


def test_a_baselines_unscored_units_are_never_ranked(model):
    """A baseline of the attention heads alone leaves the SSM heads NaN (not scored): the view's top units are its
    heads, and it has no top scan units."""
    from dpa import baselines

    other = baselines.COMPONENT_METHODS["gradient"](model, None, random_ids(8), target=5)
    assert all(column < 4 for _, column in payload.top_heads(other, 6))
    assert payload.top_heads(other, 3, "scan") == []
