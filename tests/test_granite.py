"""Granite 4.0-H (``granitemoehybrid``): Bamba's Mamba-2 blocks beside attention, with Granite's multipliers.

The autograd suite (test_families_autograd) and the circuit suite (test_circuit) run the tiny Granite with every other
family: with experts (Granite 4.0-H Tiny's layout: the sparse block and the dense MLP beside it, an ungated shared
expert), its multipliers away from one (embeddings 1.7, each block's output 0.6, the logits divided by 2.5,
attention's scale 0.3), so a sum of writes or a logit that dpa computes itself without them fails there. Here: the
dense models (Granite 4.0-H Micro: the MLP alone) against autograd, the neuron readout in the middle of the layer,
the logit lens, MIB's graph on a Granite of attention layers only (the sums of writes it runs), RoPE switched on, and
every setting or edit that would make dpa's reading of the multipliers or the experts differ from what the model
runs refused by name, the model left as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dpa
from dpa.families import layer_modules
from dpa.lens import neuron_logit_effect

from .conftest import random_ids, tiny_model
from .test_families_autograd import check_path_against_autograd, linearised, pre_cap_logits
from .test_hybrid import _state

TARGET = 5
MU = (0.25, 0.25, 0.5, 0.5, 0.5)


DENSE = dict(num_local_experts=0, intermediate_size=48, shared_intermediate_size=48)  # Granite 4.0-H Micro's layout


@pytest.fixture(scope="module")
def model():
    return tiny_model("granitemoehybrid", 2)


@pytest.fixture(scope="module")
def dense():
    return tiny_model("granitemoehybrid", 2, **DENSE)


@pytest.mark.parametrize("path", ["query", "key", "value", "gate", "up", "default"])
def test_the_dense_models_equal_autograd(path):
    """Without experts the layer runs its shared MLP alone: dpa's description is the dense one (neurons, no expert
    slots), each path against autograd."""
    model = tiny_model("granitemoehybrid", 2, **DENSE)
    spec = dpa.spec_for(model)
    assert spec.n_experts == 0 and spec.parts.moe is None and spec.d_mlp == 48
    check_path_against_autograd(model, path)


def test_the_multipliers_are_read_from_the_config(model):
    spec = dpa.spec_for(model)
    assert (spec.embedding_multiplier, spec.residual_multiplier, spec.logits_scaling) == (1.7, 0.6, 2.5)
    assert spec.layer_kinds == ("scan", "attention", "scan") and spec.parts.rotary is None  # NoPE, as released
    res = dpa.attribute(model, None, random_ids(9), target=TARGET)
    with torch.no_grad():
        logit = model(random_ids(9)[None]).logits[0, -1, TARGET]
    assert res.target_logit == pytest.approx(float(logit), rel=1e-12)  # the model's logit: divided by logits_scaling


def test_every_target_reads_the_models_divided_logits(model):
    """A contrast is the difference of the model's logits, a log-probability's direction the logit minus its
    expectation under the model's distribution (both divided by logits_scaling); a direction target is dotted with
    the final residual as given."""
    ids = random_ids(9)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, -1].double()
    contrast = dpa.attribute(model, None, ids, target=TARGET, contrast=7)
    assert contrast.target_logit == pytest.approx(float(logits[TARGET] - logits[7]), rel=1e-12)
    logprob = dpa.attribute(model, None, ids, target=TARGET, kind="logprob")
    expected = float(logits[TARGET] - logits.softmax(-1) @ logits)
    assert logprob.target_logit == pytest.approx(expected, rel=1e-10)
    row = model.lm_head.weight[TARGET].detach().clone()
    vector = dpa.attribute(model, None, ids, target=row)
    assert vector.target_logit == pytest.approx(float(logits[TARGET]) * 2.5, rel=1e-12)  # not divided


def test_mid_neurons_read_the_write_the_layer_adds(dense):
    """Scored in the middle of their layer (``neuron_target="mid"``), a layer's neurons sum to t_mid . (what its MLP
    adds to the residual stream): the MLP's output times the residual multiplier."""
    model, ids = dense, random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, neuron_positions=True, neuron_target="mid",
                        weights=dpa.PathWeights(*MU))
    spec = dpa.spec_for(model)
    mods = layer_modules(model, spec)
    seen = {}
    hooks = [m.mid.register_forward_pre_hook(lambda _m, a, i=i: seen.__setitem__(("mid", i), a[0]))
             for i, m in enumerate(mods)]
    hooks += [m.layer.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(("out", i), out))
              for i, m in enumerate(mods)]
    try:
        with torch.enable_grad(), linearised(model, MU):
            emb = spec.embed(model)(ids[None]).detach().requires_grad_(True)
            logits = pre_cap_logits(model, inputs_embeds=emb)
            mids = [seen[("mid", i)] for i in range(spec.n_layers)]
            grads = torch.autograd.grad(logits[0, -1, TARGET], mids)
    finally:
        for h in hooks:
            h.remove()
    for i in range(spec.n_layers):
        write = (seen[("out", i)] - seen[("mid", i)]).detach()  # residual + 0.6 * mlp, minus the residual
        torch.testing.assert_close(res.neuron_position_scores[i].sum(), (grads[i] * write).sum(), rtol=1e-9,
                                   atol=1e-11)


def test_the_logit_lens_of_a_neuron_scales_with_the_multipliers(dense):
    model, plain = dense, copy.deepcopy(dense)
    plain.config.residual_multiplier = plain.config.logits_scaling = 1.0
    for layer in plain.model.layers:
        layer.residual_multiplier = 1.0
    scaled = neuron_logit_effect(model, 1, 7)
    torch.testing.assert_close(scaled, neuron_logit_effect(plain, 1, 7) * 0.6 / 2.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kv", [4, 1])
def test_mibs_graph_runs_the_model_on_attention_layers(kv):
    """On a Granite of attention layers only, MIB's graph (which sums each writer's output into the residual stream
    itself) runs the model: the full circuit is the clean run, the empty one the counterfactual."""
    from dpa.mib.evaluate import evaluate
    from dpa.mib.graph import Graph
    from dpa.request import check_model

    from .test_mib import _hf_metric, _pairs

    model = tiny_model("granitemoehybrid", kv, layer_types=["attention"] * 3)
    pairs = _pairs()
    scores = torch.randn(Graph.of(check_model(model)).exists.shape, dtype=torch.float64)
    curve = evaluate(model, pairs, scores, sizes=(0.0, 1.0), batch_size=2).cpr_curve
    torch.testing.assert_close(curve.full, _hf_metric(model, pairs, pairs.clean), rtol=0, atol=1e-10)
    torch.testing.assert_close(curve.empty, _hf_metric(model, pairs, pairs.counter), rtol=0, atol=1e-10)


@pytest.mark.parametrize("path", ["query", "key", "value", "default"])
def test_rope_switched_on_equals_autograd(path):
    model = tiny_model("granitemoehybrid", 2, position_embedding_type="rope")
    assert dpa.spec_for(model).parts.rotary == "model.rotary_emb" and dpa.spec_for(model).rotates(1)
    check_path_against_autograd(model, path)


def _refused(model, *needles):
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError) as info:
        dpa.attribute(model, None, random_ids(6), target=TARGET)
    assert all(n in str(info.value) for n in needles), str(info.value)
    assert _state(model) == before


@pytest.mark.parametrize("key, value", [("logits_scaling", 0), ("logits_scaling", float("nan")),
                                        ("embedding_multiplier", float("inf")), ("residual_multiplier", None)])
def test_a_multiplier_that_is_not_a_finite_number_is_refused_by_name(key, value):
    model = tiny_model("granitemoehybrid", 2)
    setattr(model.config, key, value)
    _refused(model, key, "finite number")


@pytest.mark.parametrize("where", ["embedding", "residual"])
def test_a_modules_own_copy_edited_alone_is_refused_by_name(model, where):
    """The forward multiplies by the modules' copies (the decoder stack's, each layer's), dpa by the config's: an
    edit to one alone, before or after a first call, is refused, never summed with the other's value."""
    edited = copy.deepcopy(model)
    dpa.attribute(edited, None, random_ids(6), target=TARGET)
    if where == "embedding":
        edited.model.embedding_multiplier = 3.0
        _refused(edited, "model.embedding_multiplier is 3.0", "1.7")
    else:
        edited.model.layers[2].residual_multiplier = 1.0
        _refused(edited, "layers[2].residual_multiplier is 1.0", "0.6")


@pytest.mark.parametrize("where", ["embedding", "residual"])
def test_a_modules_copy_held_as_a_tensor_is_refused_by_name(model, where):
    """A tensor copy equal to the config's would be accepted once and then unseen when changed in place (the checks'
    cache keys on numbers): refused from the start."""
    edited = copy.deepcopy(model)
    if where == "embedding":
        edited.model.embedding_multiplier = torch.tensor(1.7, dtype=torch.float64)
        _refused(edited, "model.embedding_multiplier is a Tensor, not a number")
    else:
        edited.model.layers[0].residual_multiplier = torch.tensor(0.6, dtype=torch.float64)
        _refused(edited, "layers[0].residual_multiplier is a Tensor, not a number")


def test_expert_layers_behind_a_config_that_says_none_are_refused_by_name(model):
    """The layers run their experts on a flag of their own (``has_experts``), whatever the config says after loading:
    a layer holding parameters the description does not read is refused, never attributed without them."""
    edited = copy.deepcopy(model)
    edited.config.num_local_experts = 0
    _refused(edited, "layers[0] holds parameters outside the modules", "block_sparse_moe.router.weight")


def test_a_dense_model_behind_a_config_that_says_experts_is_refused_by_name(dense):
    edited = copy.deepcopy(dense)
    edited.config.num_local_experts = 4
    _refused(edited, "layers[0] has no mixture-of-experts block")


def test_rope_asked_for_by_a_config_the_model_was_not_built_with_is_refused(model):
    edited = copy.deepcopy(model)
    edited.config.position_embedding_type = "rope"
    _refused(edited, "position_embedding_type='rope'", "model.rotary_emb is None")


def test_experts_told_to_skip_some_are_refused_by_name(model):
    """The experts' forward skips every index at or above its own ``num_experts`` (expert parallelism's sentinel);
    dpa runs every expert whose weights it holds, so the two must agree."""
    edited = copy.deepcopy(model)
    edited.model.layers[0].block_sparse_moe.experts.num_experts = 3
    _refused(edited, "num_experts is 3 while it holds 4 experts' weights")


@pytest.mark.parametrize("where", ["model.layers.1.shared_mlp.output_linear.weight", "model.embed_tokens.weight"])
def test_a_nan_before_a_scan_layer_is_a_non_finite_error(model, where):
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.get_parameter(where).fill_(float("nan"))
    before = _state(edited)
    with pytest.raises(dpa.NonFiniteError, match=r"reach layers\[[02]\]\.mamba from its input"):
        dpa.attribute(edited, None, random_ids(6), target=TARGET)
    assert _state(edited) == before
