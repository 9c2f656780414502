"""Jamba (``jamba``): Mamba's blocks (book: selective-scan; their step's input, B and C RMS-normalised with gains)
on the layers ``layer_types`` marks ``linear_attention``, attention without any position embedding on the others,
each followed by a SwiGLU MLP.

The autograd suite (test_families_autograd), the circuit suite (test_circuit) and MIB's (test_mib) run the tiny Jamba
with the other families. Here: its layout as dpa reads it, and what it refuses by name -- experts (every other layer
of the released models: dpa reads one MLP layout per model), a bias inside the block.
"""

from __future__ import annotations

import pytest

import dpa

from .conftest import random_ids, tiny_model
from .test_mamba import _refused

TARGET = 5


def test_the_layers_are_scan_attention_scan_each_with_an_mlp():
    model = tiny_model("jamba", num_experts=1)  # (num_experts 1: every layer dense; experts: test_mixed_layouts.py)
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("scan", "attention", "scan") and spec.n_heads == 4 and spec.unit_width(0) == 16
    assert spec.d_mlp == 48 and spec.n_experts == 0 and not spec.rotary_layers
    res = dpa.attribute(model, None, random_ids(9), target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert res.head_scores.shape == (3, 4) and res.neuron_scores.shape == (3, 48)
    assert res.expert_scores is None and res.dense_layers is None
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-9, abs=1e-11)


@pytest.mark.parametrize("overrides, needle", [(dict(mamba_proj_bias=True), "mamba_proj_bias=True")])
def test_what_the_description_does_not_read_is_refused_by_name(overrides, needle):
    model = tiny_model("jamba", **overrides)
    _refused(model, lambda: dpa.attribute(model, None, random_ids(6), target=TARGET), needle)


def test_a_nan_weight_is_named_and_a_selection_out_of_range_refused():
    """A NaN weight that only the backward meets (attention's query, under sdpa) is named in the error; a Mamba
    block's own; the widget's verification of a head, neuron or token the result does not have is an InputError."""
    import copy

    import torch
    from dpa_widgets.verify import run

    model = tiny_model("jamba")
    for name, needle in [("model.layers.1.self_attn.q_proj.weight", "parameter model.layers.1.self_attn.q_proj"),
                         ("model.layers.0.mamba.A_log", "block layers[0].mamba: its parameter A_log")]:
        edited = copy.deepcopy(model)
        with torch.no_grad():
            edited.get_parameter(name).view(-1)[0] = float("nan")
        with pytest.raises(dpa.NonFiniteError) as info:
            dpa.attribute(edited, None, random_ids(6), target=TARGET)
        assert needle in str(info.value), str(info.value)
    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    for selection, needle in [(dict(head=[1, 9]), "the selected head [1, 9]"),
                              (dict(neuron=[7, 0]), "the selected neuron [7, 0]"),
                              (dict(token=99), "the selected token 99")]:
        _refused(model, lambda s=selection: run(model, res, mode="disrupt", units="selection", k=1, **s), needle,
                 error=dpa.InputError)
