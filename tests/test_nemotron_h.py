"""Nemotron-H (``nemotron_h``, dense: Nemotron-H 4B/8B/47B, Nemotron Nano 9B v2): ONE block per layer after one norm,
by the config's ``layers_block_type`` -- a Mamba-2 block (book: state-space-duality), attention without position
embeddings, or a non-gated MLP ``down(relu(up x)^2)`` (book: beyond-swiglu, the squared ReLU: s * relu(s) with the
ratio relu(s) frozen).

The autograd suite (test_families_autograd: each path against autograd through the model's own modules, the forward
oracle, completeness to 1e-10, lean = full), the circuit suite (test_circuit) and MIB's (test_mib: one pass against
patching edge by edge, EAP exact on a linear model) run the tiny Nemotron-H with the other families. Here: its layout
as dpa reads it (a layer without a token mixer has no units: a row of zeros, no circuit node, no MIB edge; a layer
without an MLP has no neurons), what a squared ReLU's rule is, the entry points (evaluation, verification, the
command line), and what the description does not read refused by name with the model left as it was.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import dpa
from dpa.families import layer_modules

from .conftest import check_batch_lean_and_float32, random_ids, tiny_model
from .test_hybrid import _state

TARGET = 5
CONSERVATIVE = dpa.PathWeights(0, 0, 1, 0.5, 0.5)
DENSE = dict(layers_block_type=["linear_attention", "mlp", "full_attention"], num_hidden_layers=3)  # (the tiny
# model of the parametrised suites adds a "moe" layer: test_nemotron_moe.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("nemotron_h", **DENSE)


def test_the_layers_and_their_blocks(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("scan", "mlp", "attention") and spec.mixing_layers == (0, 2)
    assert [spec.has_mlp(i) for i in range(3)] == [False, True, False] and spec.d_mlp == 48
    assert spec.activation == "relu2" and not spec.parts.gated
    mods = layer_modules(model, spec)
    layers = model.model.layers
    assert mods[0].attention is layers[0].mixer and mods[0].heads is layers[0].mixer.out_proj and mods[0].mlp is None
    assert mods[1].attention is None and mods[1].heads is None and mods[1].mlp is layers[1].mixer
    assert mods[1].block_inputs == (None, layers[1].norm) and mods[1].neurons is layers[1].mixer.down_proj
    assert mods[2].heads is layers[2].mixer.o_proj and mods[2].neurons is None


def test_a_layer_without_a_block_has_no_units_and_the_target_is_conserved(model):
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE, edges=True)
    assert res.layer_kinds == ["scan", "mlp", "head"] and res.unit_kinds == ("scan", "head")
    assert res.conserves and float(res.token_scores.sum()) + res.bias_share == pytest.approx(
        res.target_logit, rel=1e-9, abs=1e-11)
    assert not res.head_scores[1].any() and res.head_scores[0].abs().sum() > 0 and res.head_scores[2].abs().sum() > 0
    assert not res.neuron_scores[0].any() and not res.neuron_scores[2].any() and res.neuron_scores[1].abs().sum() > 0
    assert not res.edge_scores[1].any()
    torch.testing.assert_close(res.edge_scores.sum(-1).sum(-1), res.head_scores, rtol=1e-9, atol=1e-12)
    top = res.top_components(40)
    picked = top["positive"] + top["negative"]
    assert all(c.layer != 1 for c in picked if c.kind != "neuron") and all(c.layer == 1 for c in picked
                                                                          if c.kind == "neuron")
    with pytest.raises(dpa.InputError, match="kinds must hold"):
        res.top_components(3, kinds=("mlp",))


def test_the_squared_relu_is_linearised_with_its_ratio_frozen(model):
    """relu(s)^2 = s * relu(s): dpa freezes relu(s) (the ratio of every activation's value to its input), so a
    neuron's score is a . grad_a and the MLP's neurons add up to what the MLP writes onto the target; the gradient
    2 relu(s) would count the MLP twice (Euler: the square is homogeneous of degree 2)."""
    from dpa.functions import ACTIVATION_RATIO

    s = torch.linspace(-3, 3, 61, dtype=torch.float64)
    torch.testing.assert_close(s * ACTIVATION_RATIO["relu2"](s), torch.relu(s) ** 2, rtol=0, atol=0)
    ids = random_ids(9)
    only_mlp = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5),
                             neuron_positions=True)
    torch.testing.assert_close(only_mlp.neuron_position_scores.sum(1), only_mlp.neuron_scores, rtol=1e-12, atol=1e-14)
    # the MLP layer's neurons sum to its write's share of the target, the same for any split of gate and up
    other = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 1.0, 0.0))
    torch.testing.assert_close(other.neuron_scores, only_mlp.neuron_scores, rtol=1e-9, atol=1e-12)


def test_a_padded_batch_float32_and_lean_memory(model):
    check_batch_lean_and_float32(model, TARGET)


def test_the_circuit_and_mibs_graph_have_no_node_of_a_block_a_layer_lacks(model):
    from dpa.mib.graph import Graph

    circ = dpa.circuit(model, None, random_ids(7), target=TARGET, nodes=None)
    units = [n for n in circ.nodes if n.kind in ("head", "neuron")]
    assert {(n.layer, n.kind) for n in units} == {(0, "head"), (1, "neuron"), (2, "head")}
    assert len(units) == 7 * (4 + 48 + 4)
    graph = Graph.of(dpa.spec_for(model))
    assert graph.absent == {(1, 0), (0, 1), (2, 1)}
    heads_1 = [graph.head(1, h) for h in range(4)]
    assert not graph.exists[heads_1].any() and not graph.exists[:, graph.attention_readers(1)].any()
    assert not graph.exists[graph.mlp(0)].any() and not graph.exists[:, graph.mlp_reader(2)].any()
    assert graph.exists[graph.mlp(1), graph.reads(2, 0, 1)] and graph.exists[graph.head(0, 2), graph.mlp_reader(1)]


def test_the_benchmark_and_verification_run_what_the_model_has(model, tmp_path):
    from dpa.evaluate import Settings, evaluate
    from dpa_widgets.verify import run

    from .test_evaluate import tiny_dataset, word_tokenizer

    tok = word_tokenizer()
    tiny_dataset(model, tmp_path / "data", n=2)
    common = dict(dataset="known_1000", min_probability=0.0, data_dir=str(tmp_path / "data"))
    inputs = evaluate(model, tok, Settings(unit="input", methods=("dpa", "gradient"), **common), tmp_path / "in",
                      progress=False, figures=False)
    assert inputs["n_evaluated"] >= 1
    neurons = evaluate(model, tok, Settings(unit="component", component_units="neurons", methods=("dpa",), **common),
                       tmp_path / "neurons", progress=False, figures=False)
    assert neurons["n_evaluated"] == inputs["n_evaluated"]
    with pytest.raises(dpa.UnsupportedModelError,
                       match="scan layers and layers whose one block is an MLP, without attention probabilities"):
        evaluate(model, tok, Settings(unit="component", methods=("dpa",), **common), tmp_path / "heads",
                 progress=False, figures=False)
    res = dpa.attribute(model, None, random_ids(7), target=TARGET)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=r"L0\.S1 is a scan unit"):
        run(model, res, mode="disrupt", units="selection", k=1, head=[0, 1])
    with pytest.raises(dpa.InputError, match=r"layer 1 has no token mixer"):
        run(model, res, mode="disrupt", units="selection", k=1, head=[1, 1])
    assert _state(model) == before
    assert run(model, res, mode="disrupt", units="selection", k=1, head=[2, 1])["units"] == ["L2.H1"]
    out = run(model, res, mode="disrupt", units="top_components", k=4)
    assert all(u.startswith(("L2.H", "L1.N")) for u in out["units"])
    with pytest.raises(dpa.InputError, match=r"layer 0 has no MLP \(its one block is a token mixer\), so no neuron 5"):
        run(model, res, mode="disrupt", units="selection", k=1, neuron=[0, 5])
    assert _state(model) == before


def test_units_a_layer_lacks_are_never_selected_ranked_or_ablated(model):
    """The benchmark's units, the random baseline, the widget's selection and a neuron's logit effect know which
    layers have heads and which have neurons."""
    from traitlets import TraitError

    from dpa.baselines import random_component
    from dpa.evaluate.curves import component_units, unit_layers
    from dpa.evaluate.prompts import Sample
    from dpa.lens import neuron_logit_effect
    from dpa_widgets import CircuitWidget

    spec = dpa.spec_for(model)
    sample = Sample("x", [4, 20, 40, 60, 7, 9], [True] * 6, 5, None)
    assert unit_layers(spec) == ((0, 2), (1,))
    assert component_units(sample, 3, 4, 48, "neurons", layers=unit_layers(spec)).n == 6 * 48
    coarse = component_units(sample, 3, 4, 48, "coarse", layers=unit_layers(spec))
    assert (len(coarse.attn_index), len(coarse.neuron_index)) == (8, 48)
    rand = random_component(model, None, random_ids(6), target=TARGET)
    assert not rand.neuron_scores[[0, 2]].any() and not rand.head_scores[1].any()
    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    widget = CircuitWidget(res, model, None)
    with pytest.raises(TraitError, match=r"layer 1 has no token mixer"):
        widget.selected_head = [1, 1]
    with pytest.raises(TraitError, match=r"layer 0 has no MLP"):
        widget.selected_neuron = [0, 3]
    widget.selected_neuron = [1, 3]
    with pytest.raises(dpa.InputError, match=r"layer 2 has no MLP"):
        neuron_logit_effect(model, 2, 3)


def test_the_command_line_attributes_a_saved_model(tmp_path, capsys):
    from dpa.cli import main

    from .test_evaluate import word_tokenizer

    folder = tmp_path / "nemotron_h"
    tiny_model("nemotron_h", 2, dtype=torch.float32, **DENSE).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    out_json = tmp_path / "r.json"
    assert main(["attribute", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--json", str(out_json),
                 "--top", "40"]) == 0
    report = capsys.readouterr().out
    assert "scan L0" in report and "neuron L1" in report and "head L2" in report
    saved = json.loads(out_json.read_text())
    assert saved["layer_kinds"] == ["scan", "mlp", "head"]
    back = dpa.Attribution.from_json(out_json)
    assert back.unit_kinds == ("scan", "head")
    graph = tmp_path / "g.json"
    assert main(["circuit", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--nodes", "200",
                 "--json", str(graph)]) == 0
    labels = [n["label"] for n in json.loads(graph.read_text())["nodes"]]
    assert any(".S" in x for x in labels) and not any(x.startswith(("L1.H", "L1.S", "L0.N", "L2.N")) for x in labels)


@pytest.mark.parametrize("overrides, needle", [
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(use_bias=True), "use_bias"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
])
def test_what_the_description_does_not_read_is_refused_by_name(overrides, needle):
    model = tiny_model("nemotron_h", **{**DENSE, **overrides})
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=needle):
        dpa.attribute(model, None, random_ids(6), target=TARGET)
    assert _state(model) == before


@pytest.mark.parametrize("edit, needle", [
    ("relu activation", r"layers\[1\]\.mixer\.act_fn is a ReLU.* does not compute relu2"),
    ("kinds swapped", r"layers\[1\] does not have the modules .* makes it an attention layer"),
    ("mlp where the config says attention", r"layers\[2\] does not have the modules .*q_proj"),
    ("block_type edited", r"layers\[0\]\.block_type is 'full_attention', while the config's layer_types\[0\]"),
])
def test_an_edited_model_is_refused_by_name(edit, needle):
    model = tiny_model("nemotron_h", **DENSE)
    layers = model.model.layers
    if edit == "relu activation":
        layers[1].mixer.act_fn = torch.nn.ReLU()
    elif edit == "block_type edited":  # what the layer's forward dispatches on (two prompts: it would run attention
        layers[0].block_type = "full_attention"  # on the Mamba-2 block and unpack the batch as its output)
    elif edit == "kinds swapped":  # the config edited after loading: dpa reads each layer's kind there
        model.config.layers_block_type = ["linear_attention", "full_attention", "mlp"]
    else:
        layers[2].mixer = copy.deepcopy(layers[1].mixer)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=needle):
        dpa.attribute(model, None, random_ids(6), target=TARGET)
    assert _state(model) == before


@pytest.mark.parametrize("pattern", [["full_attention"], ["mlp", "mlp"], ["linear_attention", "mlp", "full_attention"],
                                     ["full_attention", "mlp"]])
def test_each_baseline_runs_exactly_what_the_layers_have_or_is_refused_by_name(pattern):
    """Every baseline either runs or refuses by name on any pattern of layers of one block; a run never scores a unit
    a layer lacks (activation patching ablates only the units that exist)."""
    from dpa import baselines

    model = tiny_model("nemotron_h", layers_block_type=pattern, num_hidden_layers=len(pattern))
    spec = dpa.spec_for(model)
    for fn in (*baselines.INPUT_METHODS.values(), *baselines.COMPONENT_METHODS.values()):
        before = _state(model)
        try:
            res = fn(model, None, random_ids(5), target=TARGET)
        except dpa.DPAError:
            assert _state(model) == before
            continue
        for i in range(len(pattern)):
            assert spec.mixes(i) or not res.head_scores[i].any(), (fn, i)
            assert spec.has_mlp(i) or not res.neuron_scores[i].any(), (fn, i)
