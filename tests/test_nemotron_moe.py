"""Nemotron-H's "moe" layers (Nemotron 3 Nano and later): the sparse block as a layer's one block. Its router is
DeepSeek-V3's -- sigmoid scores, a correction bias and groups that only choose (no gradient), the chosen scores
renormalised and scaled -- a control path like every router (mu_router on the routing weights' gradient, book:
mixture-of-experts); its experts are non-gated squared-ReLU MLPs working in a latent space (fc1_latent_proj in,
fc2_latent_proj out: linear, content), beside a non-gated shared expert inside the block.

The tiny Nemotron-H of the parametrised suites has such a layer (layer 3, after a Mamba-2 block, a dense MLP and an
attention layer): each path alone against autograd, completeness to 1e-10, the router's and the experts' paths,
the experts' implementations, the neuron ablations (test_families_autograd), circuit edges, flows and verification
into an expert (test_circuit), MIB's one pass against patching (test_mib). Here: its layout as dpa reads it, what
the latent space changes (a neuron's write), the layouts around it, and what is refused by name.
"""

from __future__ import annotations

import pytest
import torch

import dpa
from dpa.families import layer_modules
from dpa.spec import neuron_direction

from .conftest import check_batch_lean_and_float32, random_ids, tiny_model
from .test_families_autograd import pre_cap_logits
from .test_hybrid import _state

TARGET = 5
CONSERVATIVE = dpa.PathWeights(0, 0, 1, 0.5, 0.5, router=0, expert=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("nemotron_h")


def test_the_moe_layer_is_the_sparse_block_alone(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("scan", "mlp", "attention", "mlp") and spec.expert_layers == (3,)
    assert (spec.n_experts, spec.d_expert, spec.d_shared, spec.d_mlp, spec.d_dense) == (4, 12, 16, 64, 48)
    assert spec.dense_layers == [1] and not spec.parts.gated
    block = model.model.layers[3].mixer
    m = layer_modules(model, spec)[3]
    assert m.attention is None and m.heads is None and m.mlp is block and m.branches == {}
    assert m.router is block.gate and m.experts is block.experts and m.shared is block.shared_experts
    assert m.latent_out is block.fc2_latent_proj and m.shared_gate is None and not m.shared_beside
    assert m.block_inputs == (None, model.model.layers[3].norm)


def test_the_target_is_conserved_and_every_unit_is_where_it_is(model):
    ids = random_ids(10)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE, neuron_positions=True)
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-9, abs=1e-11)
    assert res.layer_kinds == ["scan", "mlp", "head", "mlp"] and res.dense_layers == [1] and res.d_dense == 48
    assert not res.expert_scores[[0, 1, 2]].any() and res.expert_scores[3].abs().sum() > 0
    assert not res.neuron_scores[[0, 2]].any() and not res.neuron_scores[1, 48:].any()
    torch.testing.assert_close(res.expert_scores[3].sum(), res.neuron_scores[3].sum(), rtol=1e-9, atol=1e-12)
    chosen = (res.expert_position_scores[3, :, :4] != 0).sum(-1)  # two routed experts per position, from one group
    assert int(chosen.max()) <= 2


def test_a_neuron_writes_through_the_projection_out_of_the_latent_space(model):
    """A routed expert's neuron writes fc2_latent_proj of its down-projection column; the shared expert's, its
    own column (the shared expert reads and writes the residual stream)."""
    from dpa.lens import neuron_logit_effect

    spec = dpa.spec_for(model)
    m = layer_modules(model, spec)[3]
    e, j = 2, 5
    want = m.latent_out.weight @ m.experts.down_proj[e][:, j]
    torch.testing.assert_close(neuron_direction(m, spec, e * spec.d_expert + j), want)
    torch.testing.assert_close(neuron_direction(m, spec, 4 * 12 + 3), m.shared.down_proj.weight[:, 3])
    assert neuron_logit_effect(model, 3, e * spec.d_expert + j).shape == (model.config.vocab_size,)


def test_a_padded_batch_float32_and_lean_memory(model):
    check_batch_lean_and_float32(model, TARGET)


@pytest.mark.parametrize("overrides", [dict(moe_latent_size=None), dict(n_group=1, topk_group=1, norm_topk_prob=False),
                                       dict(layers_block_type=["full_attention", "moe", "moe"], num_hidden_layers=3),
                                       dict(layers_block_type=["moe", "full_attention", "moe", "mlp"])])
def test_other_layouts_conserve_the_target(overrides):
    """No latent space (the projections the identity), one group and the scores not renormalised, two moe layers in a
    row, moe layers among the others: the conservative weights conserve the target."""
    model = tiny_model("nemotron_h", **overrides)
    ids = random_ids(8)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE)
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-9, abs=1e-11)
    assert res.dense_layers == dpa.spec_for(model).dense_layers


@pytest.mark.parametrize("edit, needle", [
    ("a latent projection with a bias", r"layers\[3\]\.mixer\.fc1_latent_proj is a Linear with a bias"),
    ("a gate added to the experts", r"has_gate is True"),
    ("the experts' layout flag flipped", r"is_transposed is True"),  # (the model's loop ignores it; dpa's reads it)
    ("a forward of the experts' own", r"layers\[3\]'s experts is a .*whose forward is its own"),
    ("the moe block where the config says mlp", r"layers\[1\] .*(does not have the modules|mixture-of-experts)"),
])
def test_an_edited_block_is_refused_by_name(edit, needle):
    model = tiny_model("nemotron_h")
    block = model.model.layers[3].mixer
    if edit == "a latent projection with a bias":
        old = block.fc1_latent_proj
        block.fc1_latent_proj = torch.nn.Linear(old.in_features, old.out_features, dtype=torch.float64)
    elif edit == "a gate added to the experts":
        block.experts.has_gate = True
    elif edit == "the experts' layout flag flipped":
        block.experts.is_transposed = True
    elif edit == "a forward of the experts' own":  # a subclass doubling the experts' output: dpa runs the experts
        class Doubled(type(block.experts)):  # from their weights, so it would never see it
            def forward(self, *args):
                return 2 * super().forward(*args)
        block.experts.__class__ = Doubled
    else:
        model.config.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp"]
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=needle):
        dpa.attribute(model, None, random_ids(6), target=TARGET)
    assert _state(model) == before


def test_a_shared_expert_as_wide_as_a_routed_one_is_named_from_the_result():
    """The result records how many experts are routed: a page without the model names the last slot "shared" even
    where the shared expert is exactly as wide as a routed one (the shapes alone cannot tell)."""
    from dpa_widgets import payload

    model = tiny_model("nemotron_h", moe_shared_expert_intermediate_size=12)
    res = dpa.attribute(model, None, random_ids(6), target=TARGET)
    back = dpa.Attribution.from_json(res.to_json())
    assert back.n_experts == 4 and back.expert_scores.shape[1] == 5
    data = payload.view_payload(back)
    assert data["expert_names"] == ["E0", "E1", "E2", "E3", "shared"] and data["n_experts"] == 4


def test_recovering_a_selection_ablates_only_the_units_that_exist():
    """Verification by recovery ablates every unit but the selection: a layer without a token mixer has no head to
    ablate (it was refused as an attention ablation before)."""
    from dpa_widgets.verify import run

    model = tiny_model("nemotron_h", layers_block_type=["full_attention", "moe", "mlp"], num_hidden_layers=3)
    res = dpa.attribute(model, None, random_ids(8), target=TARGET)
    before = _state(model)
    out = run(model, res, mode="recover", units="selection", k=1, neuron=[1, 50])
    assert out["units"] == ["L1.N50"] and 0 <= out["p_after"] <= 1
    assert run(model, res, mode="recover", units="top_components", k=3)["p_after"] >= 0
    assert _state(model) == before
    spec = dpa.spec_for(tiny_model("nemotron_h"))
    assert spec.lacks("expert", 0, 2) == "layer 0 has no MLP (its one block is a token mixer), so no expert 2"
    assert spec.lacks("expert", 1, 2) == "layer 1's MLP is dense (the experts are on other layers), so no expert 2"
