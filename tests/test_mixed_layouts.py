"""Mixtures of experts whose MLP layout differs by layer: Jamba's released models (experts on every other layer, by
``layers_num_experts``) and Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` (Qwen2-MoE, Qwen3-MoE, Qwen3-Next).

A dense layer is linearised as every dense MLP (gate: control, up: content), a sparse one as every mixture of experts
(router: control, experts: content); what is new is only the layout: one row of neuron scores per layer as wide as
the wider of the two (a dense layer's neurons its first columns, the rest zeros), a row of expert scores that is zero
on a dense layer (``Attribution.dense_layers`` names those), a circuit's units neurons on a dense layer and experts
on a sparse one. The tiny Jamba and Qwen3-Next of the parametrised suites (test_families_autograd, test_circuit,
test_mib) have this layout; here the other Qwen layouts, a dense MLP wider than the experts' row, every layer
dense, and what must never count, rank or select a unit a layer lacks.
"""

from __future__ import annotations

import json

import pytest
import torch

import dpa
from dpa.families import layer_modules

from .conftest import random_ids, tiny_model
from .test_families_autograd import PATHS, check_path_against_autograd, pre_cap_logits
from .test_hybrid import _state

TARGET = 5
CONSERVATIVE = dpa.PathWeights(0, 0, 1, 0.5, 0.5, router=0, expert=1)
MIXED = {  # name: (family, config overrides, the layers whose MLP is the sparse block)
    "jamba": ("jamba", {}, (0, 2)),
    "qwen3_next": ("qwen3_next", {}, (0, 2)),
    "qwen2_moe-step": ("qwen2_moe", dict(decoder_sparse_step=2), (1,)),
    "qwen3_moe-only": ("qwen3_moe", dict(mlp_only_layers=[0, 2]), (1,)),
    "qwen3_moe-first": ("qwen3_moe", dict(mlp_only_layers=[1], intermediate_size=20), (0, 2)),
}


def _model(name):
    family, overrides, _ = MIXED[name]
    return tiny_model(family, **overrides)


@pytest.mark.parametrize("name", MIXED)
def test_each_layer_has_the_mlp_its_config_gives_it(name):
    model = _model(name)
    spec = dpa.spec_for(model)
    sparse = MIXED[name][2]
    assert spec.expert_layers == sparse and spec.dense_layers == [i for i in range(3) if i not in sparse]
    mods = layer_modules(model, spec)
    for i, m in enumerate(mods):
        assert (m.experts is not None) == (i in sparse) and (m.neurons is None) == (i in sparse)
        assert spec.neuron_width(i) == (spec.n_experts * spec.d_expert + spec.d_shared if i in sparse else spec.d_dense)
    assert spec.d_mlp == max(spec.neuron_width(i) for i in range(3)) == spec.n_experts * spec.d_expert + spec.d_shared


@pytest.mark.parametrize("name", [n for n in MIXED if n not in ("jamba", "qwen3_next")])  # (those two: the suite)
@pytest.mark.parametrize("path", [p for p in PATHS if len(PATHS[p]) == 7])
def test_each_path_alone_equals_autograd(name, path):
    check_path_against_autograd(_model(name), path)


@pytest.mark.parametrize("name", MIXED)
def test_the_target_is_conserved_and_a_dense_layer_has_no_expert(name):
    model = _model(name)
    spec = dpa.spec_for(model)
    ids = random_ids(10)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE, neuron_positions=True)
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert res.target_logit == pytest.approx(logit, rel=1e-12, abs=1e-12)
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-8, abs=1e-10)
    assert res.dense_layers == spec.dense_layers and res.d_expert == spec.d_expert
    for i in res.dense_layers:
        assert not res.expert_scores[i].any() and not res.expert_position_scores[i].any()
        assert not res.neuron_scores[i, spec.d_dense:].any() and res.neuron_scores[i, :spec.d_dense].abs().sum() > 0
    for i in spec.expert_layers:  # an expert's score is its neurons' (no expert biases here)
        torch.testing.assert_close(res.expert_scores[i].sum(), res.neuron_scores[i].sum(), rtol=1e-9, atol=1e-12)
    top = res.top_components(200)
    assert all(c.index < spec.neuron_width(c.layer) for c in top["positive"] + top["negative"] if c.kind == "neuron")
    assert not any(c.layer in res.dense_layers for c in top["positive"] + top["negative"] if c.kind == "expert")


def test_every_layer_dense_is_a_dense_model():
    model = tiny_model("qwen3_moe", mlp_only_layers=[0, 1, 2])
    spec = dpa.spec_for(model)
    assert spec.n_experts == 0 and spec.d_dense == 0 and spec.dense_layers is None and spec.expert_layers == ()
    ids = random_ids(8)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert res.expert_scores is None and res.dense_layers is None and res.neuron_scores.shape == (3, 48)
    assert res.completeness_gap == pytest.approx(0, abs=1e-10)


def test_the_result_keeps_its_dense_layers_through_a_file(tmp_path):
    res = dpa.attribute(_model("jamba"), None, random_ids(7), target=TARGET)
    res.to_json(tmp_path / "r.json")
    back = dpa.Attribution.from_json(tmp_path / "r.json")
    assert back.dense_layers == [1] and back.d_expert == 48
    torch.testing.assert_close(back.neuron_scores, res.neuron_scores)
    saved = json.loads((tmp_path / "r.json").read_text())
    (tmp_path / "bad.json").write_text(json.dumps(dict(saved, dense_layers=[5])))
    with pytest.raises(dpa.InputError, match="dense_layers must name layers"):
        dpa.Attribution.from_json(tmp_path / "bad.json")


@pytest.mark.parametrize("family", ["mixtral", "jamba"])
def test_every_file_dpa_writes_reads_back(family, tmp_path):
    """A result kept with its top neurons only (the CLI's default), and a baseline's (no expert scores), read back;
    a file whose dense layers contradict its scores is refused by name."""
    from dpa.baselines import random_component

    model = tiny_model(family)
    ids = random_ids(7)
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True, neuron_positions=True)
    res.to_json(tmp_path / "top.json", top_neurons=4)
    back = dpa.Attribution.from_json(tmp_path / "top.json")
    assert back.neuron_scores is None and back.d_expert == res.d_expert and back.dense_layers == res.dense_layers
    rand = random_component(model, None, ids, target=TARGET)
    rand.to_json(tmp_path / "random.json")
    assert dpa.Attribution.from_json(tmp_path / "random.json").d_expert == res.d_expert
    if family != "jamba":
        return
    assert "(48 on the dense layer 1, without experts)" in res.summary()
    saved = json.loads(res.to_json())
    for edit, what in (({"expert_scores": [[0.0] * 4, [0.5, 0, 0, 0], [0.0] * 4]}, "an expert on a dense layer"),
                       ({"d_dense": 40}, "a neuron past its dense MLP's width"), ({"d_dense": None}, "with d_dense")):
        (tmp_path / "bad.json").write_text(json.dumps(dict(saved, **edit)))
        with pytest.raises(dpa.InputError, match=what):
            dpa.Attribution.from_json(tmp_path / "bad.json")


def test_the_view_shows_only_the_units_a_layer_has():
    from traitlets import TraitError

    from dpa_widgets import CircuitWidget, payload

    model = _model("qwen3_moe-first")  # layer 1 dense, 20 neurons in a row of 48
    res = dpa.attribute(model, None, random_ids(7), target=TARGET, edges=True, neuron_positions=True)
    data = payload.view_payload(res)
    assert data["dense_layers"] == [1] and data["d_dense"] == 20
    assert len(data["neurons"]["index"][1]) == 20 and max(data["neurons"]["index"][1]) < 20
    assert len(data["neurons"]["index"][0]) == 32
    for route in data["token_routes"]:
        assert all(layer != 1 for layer, _, _ in route["experts"])
        assert all(n < 20 for layer, n, _ in route["neurons"] if layer == 1)
    static = CircuitWidget(res, None, None)
    with pytest.raises(TraitError, match=r"layer 1's MLP is dense, with 20 neurons .* so no neuron 30"):
        static.selected_neuron = [1, 30]
    with pytest.raises(TraitError, match=r"so no expert"):
        static.selected_expert = [1, 0]
    static.selected_neuron = [1, 19]
    no_mlp = dpa.attribute(tiny_model("mamba2"), None, random_ids(5), target=TARGET, edges=True, neuron_positions=True)
    assert all(route["neurons"] == [] for route in payload.view_payload(no_mlp)["token_routes"])  # (no neuron)


def test_the_circuit_has_neurons_on_a_dense_layer_and_experts_elsewhere():
    model = _model("jamba")
    circ = dpa.circuit(model, None, random_ids(6), target=TARGET, nodes=None, positions=False)
    units = [n for n in circ.nodes if n.kind in ("neuron", "expert")]
    assert {n.layer for n in units if n.kind == "expert"} == {0, 2}
    assert {n.layer for n in units if n.kind == "neuron"} == {1}
    assert len([n for n in units if n.kind == "neuron"]) == 48 and len([n for n in units if n.kind == "expert"]) == 8
    assert all(n.label.startswith("L1.N") for n in units if n.kind == "neuron")


def test_units_a_layer_lacks_are_never_selected_counted_or_ablated():
    """The benchmark's units, the baselines, the widget's selection and a neuron's logit effect know that a dense
    layer has fewer neurons than the experts' row, and no expert."""
    from traitlets import TraitError

    from dpa.baselines import activation_patching, random_component
    from dpa.evaluate.curves import component_units, unit_layers
    from dpa.evaluate.prompts import Sample
    from dpa.lens import neuron_logit_effect
    from dpa_widgets import CircuitWidget

    model = _model("jamba")
    spec = dpa.spec_for(model)
    sample = Sample("x", [4, 20, 40, 60, 7, 9], [True] * 6, 5, None)
    layers = unit_layers(spec)
    assert layers[2] == (192, 48, 192)
    assert component_units(sample, 3, 4, 192, "neurons", layers=layers).n == 6 * (192 + 48 + 192)
    assert len(component_units(sample, 3, 4, 192, "coarse", layers=layers).neuron_index) == 192 + 48 + 192
    ids = random_ids(6)
    rand = random_component(model, None, ids, target=TARGET)
    assert not rand.neuron_scores[1, 48:].any() and rand.neuron_scores[1, :48].abs().sum() > 0
    qwen = _model("qwen3_moe-first")  # (attention layers: a Mamba block has no heads to ablate) a dense layer of 20
    patched = activation_patching(qwen, None, ids, target=TARGET, units="coarse", batch_size=256)  # neurons
    assert not patched.neuron_scores[1, 20:].any() and patched.neuron_scores[1, :20].abs().sum() > 0
    assert patched.neuron_scores[0].abs().sum() > 0
    res = dpa.attribute(model, None, ids, target=TARGET)
    before = _state(model)
    widget = CircuitWidget(res, model, None)
    with pytest.raises(TraitError, match=r"layer 1's MLP is dense .* so no expert"):
        widget.selected_expert = [1, 2]
    with pytest.raises(TraitError, match=r"layer 1's MLP is dense, with 48 neurons .* so no neuron 60"):
        widget.selected_neuron = [1, 60]
    widget.selected_neuron, widget.selected_expert = [1, 47], [2, 3]
    with pytest.raises(dpa.InputError, match=r"so no neuron 100"):
        neuron_logit_effect(model, 1, 100)
    torch.testing.assert_close(neuron_logit_effect(model, 1, 3), neuron_logit_effect(model, 1, 3))
    assert _state(model) == before


def test_a_config_that_disagrees_with_the_layers_modules_is_refused_by_name():
    model = _model("jamba")
    before = _state(model)
    model.config.expert_layer_offset = 1  # the layers were built with experts on 0 and 2
    with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[0\] .*config gives it a dense MLP"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    model.config.expert_layer_offset = 0
    assert _state(model) == before
    qwen = _model("qwen2_moe-step")
    qwen.config.decoder_sparse_step = 1  # every layer sparse, by the config; layers 0 and 2 hold a dense MLP
    with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[0\].*(sparse|mixture-of-experts)"):
        dpa.attribute(qwen, None, random_ids(5), target=TARGET)


def test_a_dense_mlp_wider_than_the_experts_row_is_refused_by_name():
    model = tiny_model("qwen2_moe", mlp_only_layers=[1], intermediate_size=96)  # 96 > 4 x 12 + 16
    with pytest.raises(dpa.UnsupportedModelError, match=r"the dense layers' MLPs \(1\) have 96 neurons, more than "
                                                        r"the 64 of the experts' layers"):
        dpa.spec_for(model)


def test_experts_of_different_sizes_are_refused_by_name():
    model = _model("jamba")
    experts = model.model.layers[2].feed_forward.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:3].clone())
    experts.down_proj = torch.nn.Parameter(experts.down_proj[:3].clone())
    experts.num_experts = 3
    model.model.layers[2].feed_forward.router.weight = torch.nn.Parameter(
        model.model.layers[2].feed_forward.router.weight[:3].clone())
    with pytest.raises(dpa.UnsupportedModelError, match="the layers' experts differ"):
        dpa.spec_for(model)
