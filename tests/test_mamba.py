"""The Mamba families: every layer one block and no MLP -- Mamba-2's (``mamba2``, Bamba's block, book:
state-space-duality), Mamba's (``mamba``) and Falcon-Mamba's (``falcon_mamba``, book: selective-scan).

The autograd suite (test_families_autograd), the circuit suite (test_circuit) and MIB's (test_mib) run
the tiny models with the other families: each path against the plain recurrence, completeness, the flow identities, the
one-pass evaluation against patching edge by edge. Here: what a model without attention and without an MLP changes
around them -- no prompt is too long (the model reads no position), the layers' second block is absent everywhere
(no neurons, no MIB MLP nodes with edges), what needs an MLP or attention probabilities refused by name with the model
left as it was, the config's float32 residual on a float32 model, and the command line on a saved folder.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import dpa
from dpa.mib.graph import Graph

from .conftest import hf_logits, random_ids, tiny_model
from .test_hybrid import _state

TARGET = 5
UNITS = {"mamba2": (4, 16), "mamba": (64, 1), "falcon_mamba": (64, 1)}  # units per layer and their channels
FAMILIES = tuple(UNITS)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def test_the_layers_are_scan_blocks_without_an_mlp(model):
    spec = dpa.spec_for(model)
    units, width = UNITS[spec.family]
    assert spec.layer_kinds == ("scan",) * 3 and spec.n_heads == units and spec.unit_width(0) == width
    assert spec.d_mlp == 0 and spec.n_experts == 0
    res = dpa.attribute(model, None, random_ids(9), target=TARGET)
    assert res.head_scores.shape == (3, units) and res.neuron_scores.shape == (3, 0)
    assert res.top_components(3)["positive"][0].kind == "scan"
    assert "no MLP" in res.summary() and "MLP neurons" not in res.summary()


def test_no_prompt_is_too_long_for_a_model_that_reads_no_position(model):
    """These configs have no max_position_embeddings: a prompt longer than any tiny model's context attributes,
    and completes under conservative weights."""
    ids = random_ids(150)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    total = float(res.token_scores.sum()) + res.bias_share
    assert total == pytest.approx(res.target_logit, rel=1e-8, abs=1e-10)
    assert res.target_logit == pytest.approx(float(hf_logits(model, ids[None])[0, -1, TARGET]), rel=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_float32_residual_on_a_float32_model_is_the_models_own(family):
    """The released configs keep the residual in float32 (``residual_in_fp32``): on a float32 model that is the
    model as it is, and dpa's target is its logit."""
    model = tiny_model(family, dtype=torch.float32, residual_in_fp32=True)
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert res.target_logit == pytest.approx(float(hf_logits(model, ids[None])[0, -1, TARGET]), rel=1e-5)
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-4, abs=1e-5)


def test_mibs_graph_has_no_mlp_edges(model):
    spec = dpa.spec_for(model)
    from dpa.mib.forward import check_graph_run

    check_graph_run(model, spec)  # (a Mamba block's readers are fed apart through dpa's copy: ssd.readers_value)
    graph = Graph.of(spec)
    mlp_readers = [graph.mlp_reader(i) for i in range(3)]
    mlp_writers = [graph.mlp(i) for i in range(3)]
    assert not graph.exists[:, mlp_readers].any() and not graph.exists[mlp_writers].any()
    assert graph.exists[:, graph.logits].sum() == 1 + 3 * UNITS[spec.family][0]  # the input and every unit


def _refused(model, call, *needles, error=dpa.UnsupportedModelError):
    before = _state(model)
    with pytest.raises(error) as info:
        call()
    assert all(n in str(info.value) for n in needles), str(info.value)
    assert _state(model) == before


def test_what_needs_an_mlp_or_attention_is_refused_by_name(model, tmp_path):
    from dpa.evaluate import Settings, evaluate
    from dpa_widgets.verify import run

    from .test_evaluate import tiny_dataset, word_tokenizer

    ids = random_ids(7)
    family = dpa.spec_for(model).family
    _refused(model, lambda: dpa.attribute(model, None, ids, target=TARGET, neuron_target="mid"),
             "neuron_target='mid'", f"{family}'s layers have no MLP")
    res = dpa.attribute(model, None, ids, target=TARGET)
    _refused(model, lambda: run(model, res, mode="disrupt", units="selection", k=1, head=[0, 1]),
             r"L0.S1 is a scan unit")
    tiny_dataset(model, tmp_path / "data", n=2)
    common = dict(dataset="known_1000", min_probability=0.0, data_dir=str(tmp_path / "data"))
    tok = word_tokenizer()
    inputs = evaluate(model, tok, Settings(unit="input", methods=("dpa", "gradient"), **common), tmp_path / "in",
                      progress=False, figures=False)
    assert set(inputs["methods"]) == {"dpa", "gradient"} and inputs["n_evaluated"] >= 1
    for units, needle in [("neurons", "layers have no MLP"), ("fine", "scan layers, without attention")]:
        settings = Settings(unit="component", component_units=units, methods=("dpa",), **common)
        _refused(model, lambda s=settings: evaluate(model, tok, s, tmp_path / units, progress=False, figures=False),
                 needle, "the input benchmark (unit='input') runs on it")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bias_inside_the_block_is_refused_by_name(family):
    model = tiny_model(family, use_bias=True)
    _refused(model, lambda: dpa.attribute(model, None, random_ids(6), target=TARGET), "use_bias=True")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_command_line_attributes_a_saved_model(family, tmp_path, capsys):
    from dpa.cli import main

    from .test_evaluate import word_tokenizer

    folder = tmp_path / family
    tiny_model(family, dtype=torch.float32).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    out_json = tmp_path / "r.json"
    assert main(["attribute", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--json", str(out_json)]) == 0
    report = capsys.readouterr().out
    assert f"{UNITS[family][0]} scan units per layer, no MLP" in report and "(scan units ranked together)" in report
    assert json.loads(out_json.read_text())["layer_kinds"] == ["scan"] * 3
    graph = tmp_path / "g.json"
    assert main(["circuit", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--nodes", "20",
                 "--json", str(graph)]) == 0
    nodes = json.loads(graph.read_text())["nodes"]
    assert any(".S" in n["label"] for n in nodes) and not any(".N" in n["label"] for n in nodes)


def test_an_edge_between_two_scan_units_verifies(model):
    """A unit -> unit edge runs its destination's block again on its recorded input (there is no mid-layer residual
    on these layers); its first-order value is the edge, under weights that keep every path."""
    circ = dpa.circuit(model, None, random_ids(6), target=TARGET, nodes=10)
    pairs = [(u, d) for u in circ.units for d in circ.units if abs(float(circ.edges[u, d])) > 0]
    u, d = max(pairs, key=lambda p: abs(float(circ.edges[p])))
    out = circ.verify(model, None, (circ.nodes[u].label, circ.nodes[d].label))
    assert all(math.isfinite(out[k]) for k in ("edge", "first_order", "direct", "target"))


def test_edits_of_the_blocks_are_refused_by_name(model):
    """A setting of the blocks edited after a circuit (a tuple: Mamba-2's time_step_limit; a number: Mamba's
    time_step_rank) makes verifying it refused; the config's unit count must be the blocks' own; a wrapped
    convolution is not the block described."""
    family = dpa.spec_for(model).family
    circ = dpa.circuit(model, None, random_ids(6), target=TARGET, nodes=6)
    edited = copy.deepcopy(model)
    circ_edited = dpa.circuit(edited, None, random_ids(6), target=TARGET, nodes=6)
    setting, value = ("time_step_limit", (0.01, 0.02)) if family == "mamba2" else ("use_conv_bias", False)
    for layer in edited.backbone.layers:
        setattr(layer.mixer, setting, value)
    _refused(edited, lambda: circ_edited.verify(edited, None, (circ.units[0], "target")),
             setting, error=dpa.ModelStateError)
    edited = copy.deepcopy(model)
    key = "num_heads" if family == "mamba2" else "intermediate_size"
    units = getattr(edited.config, key)
    setattr(edited.config, key, units // 2)
    _refused(edited, lambda: dpa.attribute(edited, None, random_ids(6), target=TARGET),
             f"has {units} state-space units", f"while the config's {key} is {units // 2}")
    edited = copy.deepcopy(model)
    edited.backbone.layers[1].mixer.conv1d = torch.nn.Sequential(edited.backbone.layers[1].mixer.conv1d)
    _refused(edited, lambda: dpa.attribute(edited, None, random_ids(6), target=TARGET),
             "layers[1].mixer.conv1d is Sequential")
    from dpa.baselines import component_gradient

    _refused(model, lambda: component_gradient(model, None, random_ids(6), target=TARGET),
             "needs MLP neurons", f"{family}'s layers have no MLP")


def test_the_widget_compares_what_applies(model):
    from dpa_widgets import live

    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    offered = live.baseline_methods(dpa.spec_for(model))
    assert "components:random" in offered and "components:dpa_mid" not in offered
    out = live.compare(model, None, res, "components:random")
    assert math.isfinite(out["rho"]) and "rho_neurons" not in out


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
def test_a_scan_off_by_a_little_at_one_position_is_refused(family, monkeypatch):
    """transformers' scan changed by 5e-5 of the block's largest output at the last position only (ten times the
    rounding dpa's copy is allowed there, far below the largest output's): refused by name, since the target would
    count what the copy does not (the completeness gap was 1e-2 of the logit on this model). On the probe of the block
or on the call's own input, whichever sees it first."""
    from transformers.models.falcon_mamba import modeling_falcon_mamba
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2

    module, name = {"mamba": (modeling_mamba, "mamba_selective_scan"),
                    "falcon_mamba": (modeling_falcon_mamba, "mamba_selective_scan"),
                    "mamba2": (modeling_mamba2, "mamba2_chunk_scan")}[family]
    model = tiny_model(family, dtype=torch.float32)
    ids = random_ids(12)
    res = dpa.attribute(model, None, ids, target=TARGET)  # before the patch: the model's own logit
    assert res.target_logit == pytest.approx(float(hf_logits(model, ids[None])[0, -1, TARGET]), rel=1e-6)
    original = getattr(module, name)

    def slipped(*args, **kwargs):
        out = original(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        last = out.clone()
        if family == "mamba2":  # [b t heads head_dim]
            last[:, -1] += 5e-5 * out.abs().max()
        else:  # [b channels t]
            last[..., -1] += 5e-5 * out.abs().max()
        return last

    monkeypatch.setattr(module, name, slipped)
    _refused(model, lambda: dpa.attribute(model, None, ids, target=TARGET), "block dpa linearises")


def test_what_is_not_the_block_described_is_refused_by_name():
    """Falcon-Mamba's norm of B replaced by something that is not an RMS norm; a weight that is NaN (the message
    names the block and the weight, not the dtype); the widget's verification of top components on a model with
    neither heads nor neurons."""
    from dpa_widgets.verify import run

    model = tiny_model("falcon_mamba", dtype=torch.float32)
    edited = copy.deepcopy(model)
    edited.backbone.layers[1].mixer.b_layernorm = torch.nn.Identity()
    _refused(edited, lambda: dpa.attribute(edited, None, random_ids(6), target=TARGET),
             "layers[1].mixer.b_layernorm is Identity")
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.backbone.layers[1].mixer.A_log[3] = float("nan")
    with pytest.raises(dpa.NonFiniteError) as info:
        dpa.attribute(edited, None, random_ids(6), target=TARGET)
    assert "Mamba block" in str(info.value) and "try float32" not in str(info.value), str(info.value)
    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    _refused(model, lambda: run(model, res, mode="disrupt", units="top_components", k=3),
             "this model has neither (its units: scan)", error=dpa.InputError)


def test_a_mib_graph_too_large_to_build_is_refused_by_name(model):
    """A unit per channel makes MIB's graph of a real Mamba (1536 units a layer, 24 layers) 4e9 writer x reader
    cells: refused by name before anything is allocated (here: the tiny model's spec with Mamba-130m's sizes)."""
    from dataclasses import replace

    from dpa.mib.forward import check_graph_run

    spec = replace(dpa.spec_for(model), n_layers=24, n_heads=1536)
    _refused(model, lambda: check_graph_run(model, spec), "36,889 writers and 110,617 readers", "dpa.circuit")


def test_a_result_without_neurons_round_trips_through_json(model, tmp_path):
    """What ``dpa attribute --json`` writes (the top 16 neurons of each layer) on a model whose layers have no MLP:
    the empty neuron rows are written as they are, and the file reads back."""
    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    res.to_json(tmp_path / "r.json", top_neurons=16)
    back = dpa.Attribution.from_json(tmp_path / "r.json")
    assert back.neuron_scores.shape == (3, 0) and back.layer_kinds == res.layer_kinds
    torch.testing.assert_close(back.head_scores.double(), res.head_scores.double(), rtol=1e-6, atol=1e-7)
