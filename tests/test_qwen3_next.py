"""Qwen3-Next (``qwen3_next``): Gated DeltaNets (book: gated-delta-rule) on the layers ``layer_types`` marks
``linear_attention``, gated attention on the others (each head's output times a sigmoid of its own half of q_proj,
frozen), each followed by a sparse block with a gated shared expert (or a dense MLP: ``num_experts=0``).

The autograd suite (test_families_autograd: each path against the recurrence written from transformers' code,
completeness, edges summing to units, lean = full), the circuit suite (test_circuit) and MIB's (test_mib: one pass
against patching edge by edge, EAP exact on a linear model) run the tiny Qwen3-Next with the other families. Here: its
layout as dpa reads it, the dense layout, the edges against transformers' own delta rule run one key at a time, padded
batches and float32, the agreement check on a call's own input (a block changed only past the probe's positions is
refused; a large input whose float32 decays round more is not), and what the description does not read refused by
name with the model left as it was.
"""

from __future__ import annotations


import pytest
import torch

import dpa

from .conftest import check_batch_lean_and_float32, random_ids, tiny_model
from .test_hybrid import _lambda_at, _state

TARGET = 5
CONSERVATIVE = dpa.PathWeights(0, 0, 1, 0.5, 0.5, 0, 1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_next")


def test_the_layers_units_and_experts(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("delta", "attention", "delta") and spec.n_heads == 4 and spec.unit_width(0) == 8
    assert spec.n_experts == 4 and spec.d_shared == 16 and spec.parts.output_gate
    res = dpa.attribute(model, None, random_ids(9), target=TARGET, weights=CONSERVATIVE)
    assert res.layer_kinds == ["delta", "head", "delta"] and res.unit_kinds == ("delta", "head")
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-9, abs=1e-11)
    assert res.expert_scores.shape == (3, 5)  # four routed experts and the shared one
    top = res.top_components(6, kinds=("delta", "head"))
    assert {c.kind for c in top["positive"] + top["negative"]} == {"delta", "head"}


def test_the_dense_layout():
    model = tiny_model("qwen3_next", num_experts=0)
    spec = dpa.spec_for(model)
    assert spec.n_experts == 0 and spec.d_mlp == 48 and spec.layer_kinds == ("delta", "attention", "delta")
    res = dpa.attribute(model, None, random_ids(9), target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert res.neuron_scores.shape == (3, 48) and res.expert_scores is None
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-9, abs=1e-11)


def test_delta_edges_are_the_blocks_own_rule_run_one_key_at_a_time(model, monkeypatch):
    """Edge (query t, key s) of a value head of a Gated DeltaNet layer: lambda_t . o_t when only position s of the
    rule's values v reaches transformers' own delta rule (``torch_chunk_gated_delta_rule`` run on v zeroed elsewhere;
    the rule is linear in v), with lambda the target on the rule's output o (dpa's gradient at out_proj's input times
    the gated norm's gamma, its frozen scale and SiLU(z), read off the block's own forward). No arithmetic of dpa's
    copy."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    ids, layer = random_ids(9), 0
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True)
    block = model.model.layers[layer].linear_attn
    heads, width = block.num_v_heads, block.head_v_dim
    lam_n = _lambda_at(model, ids, block.out_proj, layer)  # [pos heads*width]
    seen = {}
    hooks = [block.register_forward_pre_hook(lambda _m, a, k: None if a else seen.__setitem__("h", k["hidden_states"]),
                                             with_kwargs=True),  # the model calls it with keywords
             block.norm.register_forward_pre_hook(lambda _m, a: seen.__setitem__("o", a))]  # (o, z) [pos*heads width]
    try:
        with torch.no_grad():
            model(ids[None], use_cache=False)
        o, z = (v.view(len(ids), heads, width) for v in seen["o"])
        r = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + block.norm.variance_epsilon)
        lam = lam_n.view(len(ids), heads, width) * block.norm.weight * r * torch.nn.functional.silu(z)
        rule, edges = qn.torch_chunk_gated_delta_rule, torch.zeros(heads, len(ids), len(ids), dtype=torch.float64)
        for key in range(len(ids)):
            only = torch.zeros(len(ids), dtype=torch.float64)
            only[key] = 1
            monkeypatch.setattr(qn, "torch_chunk_gated_delta_rule",
                                lambda q, k, v, *a, **kw: rule(q, k, v * only[None, :, None, None], *a, **kw))
            with torch.no_grad():
                block(seen["h"])
            monkeypatch.setattr(qn, "torch_chunk_gated_delta_rule", rule)
            o_key = seen["o"][0].view(len(ids), heads, width)
            edges[:, :, key] = (lam * o_key).sum(-1).T
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(res.edge_scores[layer], edges, rtol=1e-9, atol=1e-12)
    assert int((edges.abs() > 1e-6).sum()) > heads * len(ids)  # not the diagonal alone
    torch.testing.assert_close(res.edge_scores[layer].sum((-1, -2)), res.head_scores[layer], rtol=1e-9, atol=1e-12)


def test_a_padded_batch_float32_and_lean_memory(model):
    check_batch_lean_and_float32(model, TARGET)


def test_the_agreement_check_reads_the_call_and_allows_the_modules_own_rounding(monkeypatch):
    """A delta rule changed only past the probe's 7 positions, after a first call, passes the probe and is refused on
    the call's own input, also where one value head forgets fast (its decays' float32 sums are huge, and vanish:
    no slack for the other heads); a block whose input is 30 times larger (its decays' float32 sums round more: 1e-4
    of an output, measured) is attributed on 600 tokens, to its float32 rounding."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    model = tiny_model("qwen3_next", dtype=torch.float32, max_position_embeddings=1024)
    ids = random_ids(600)
    with torch.no_grad():
        for layer in (0, 2):
            model.model.layers[layer].input_layernorm.weight.mul_(30)
            model.model.layers[layer].linear_attn.A_log[0] = 10.0
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE)
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-3, abs=1e-3)
    rule = qn.torch_chunk_gated_delta_rule

    def late(q, k, v, *a, **kw):  # positions from 30 on written 1% stronger
        out, state = rule(q, k, v, *a, **kw)
        scale = torch.ones(out.shape[1], dtype=out.dtype)
        scale[30:] = 1.01
        return out * scale[None, :, None, None], state
    monkeypatch.setattr(qn, "torch_chunk_gated_delta_rule", late)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=r"linear_attn \(Qwen3NextGatedDeltaNet\) computed another "
                                                        r"output .* the Gated DeltaNet block"):
        dpa.attribute(model, None, random_ids(60), target=TARGET)
    assert _state(model) == before


@pytest.mark.parametrize("overrides, needle", [(dict(attention_bias=True), "attention_bias")])
def test_what_the_description_does_not_read_is_refused_by_name(overrides, needle):
    model = tiny_model("qwen3_next", **overrides)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=needle):
        dpa.attribute(model, None, random_ids(6), target=TARGET)
    assert _state(model) == before


def test_a_patched_rule_is_refused_by_name_at_the_probe(monkeypatch):
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    model = tiny_model("qwen3_next")
    rule = qn.torch_chunk_gated_delta_rule
    monkeypatch.setattr(qn, "torch_chunk_gated_delta_rule",
                        lambda q, k, v, *a, **kw: rule(q, k, torch.tanh(v), *a, **kw))
    with pytest.raises(dpa.UnsupportedModelError, match="does not compute the Gated DeltaNet block"):
        dpa.attribute(model, None, random_ids(6), target=TARGET)
