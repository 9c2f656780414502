"""Ablations against a hand-written forward pass: each one changes exactly the units it should."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from dpa.evaluate.ablation import (component_ablation_prob, component_ablation_probs, input_ablation_prob,
                                   input_ablation_probs)
from dpa.tiny import FAMILIES as ALL_FAMILIES
from tests.conftest import FAMILIES, LAYOUTS, edited_run, random_ids, tiny_model

T = 7


@torch.no_grad()
def manual_probs(model, ids, *, zero_embed=(), zero_edges=(), zero_neurons=(), position=-1):
    """Llama forward written out by hand: zero embeddings, post-softmax probabilities and SiLU(s)."""
    cfg = model.config
    h_q, h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    x = model.model.embed_tokens(ids[None]).clone()
    for p in zero_embed:
        x[0, p] = 0
    t = len(ids)
    pos = torch.arange(t)[None]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for l, layer in enumerate(model.model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(1, t, h_q, -1).transpose(1, 2)
        k = a.k_proj(h).view(1, t, h_kv, -1).transpose(1, 2)
        v = a.v_proj(h).view(1, t, h_kv, -1).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = (z.repeat_interleave(h_q // h_kv, dim=1) for z in (k, v))
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        for (ll, hh, qq, kk) in zero_edges:
            if ll == l:
                probs[0, hh, qq, kk] = 0
        z = (probs @ v).transpose(1, 2).reshape(1, t, -1)
        x = x + a.o_proj(z)
        h = layer.post_attention_layernorm(x)
        gate = F.silu(layer.mlp.gate_proj(h))
        for (ll, pp, nn_) in zero_neurons:
            if ll == l:
                gate[0, pp, nn_] = 0
        x = x + layer.mlp.down_proj(gate * layer.mlp.up_proj(h))
    logits = model.lm_head(model.model.norm(x))[0, position]
    return logits.softmax(-1)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", kv_heads=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_instrumented_forward_without_edits_is_the_model(family, layout):
    model = tiny_model(family, LAYOUTS[layout])
    ids = random_ids(9)[None].expand(2, -1)
    expected = model.model(ids).last_hidden_state
    got, rec = edited_run(model, ids)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert rec.probs[0].shape == (2, 4, 9, 9) and rec.neuron_inputs[2].shape == (2, 9, 48)
    torch.testing.assert_close(rec.probs[1].sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
    assert "forward" not in model.model.layers[0].self_attn.__dict__  # restored


def test_manual_forward_reproduces_hf(llama):
    ids = random_ids(T)
    expected = llama(ids[None]).logits[0, -1].softmax(-1)
    torch.testing.assert_close(manual_probs(llama, ids), expected, rtol=1e-10, atol=1e-12)


class TestInputAblation:
    def test_zero_embeddings_match_manual(self, llama):
        ids = random_ids(T)
        target = 5
        for zeros in ([], [0], [2, 3], list(range(T))):
            got = input_ablation_prob(llama, ids, zeros, T - 1, target)
            assert math.isclose(got, float(manual_probs(llama, ids, zero_embed=zeros)[target]), rel_tol=1e-9)

    def test_batched_rows_are_independent(self, llama):
        ids = random_ids(T)
        keep = torch.ones(5, T)
        keep[1, 0] = keep[2, [1, 4]] = keep[3] = 0
        probs = input_ablation_probs(llama, ids, keep, T - 1, 7, batch_size=2)
        singles = [input_ablation_prob(llama, ids, (keep[r] == 0).nonzero().flatten().tolist(), T - 1, 7)
                   for r in range(5)]
        torch.testing.assert_close(probs, torch.tensor(singles, dtype=probs.dtype), rtol=1e-6, atol=0)
        assert probs[0] != probs[1]  # zeroing one embedding changes the prediction

    def test_earlier_target_position_ignores_later_tokens(self, llama):
        ids = random_ids(T)
        clean = input_ablation_prob(llama, ids, [], 3, 11)
        assert math.isclose(input_ablation_prob(llama, ids, [5, 6], 3, 11), clean, rel_tol=1e-12)


class TestComponentAblation:
    def test_edges_and_neurons_match_manual(self, llama):
        ids = random_ids(T)
        edges = [(0, 1, 4, 2), (1, 3, 6, 0), (2, 0, 6, 6)]
        neurons = [(0, 3, 10), (2, 6, 47), (1, 6, 0)]
        got = component_ablation_prob(llama, ids, edges, neurons, T - 1, 9)
        expected = manual_probs(llama, ids, zero_edges=edges, zero_neurons=neurons)[9]
        assert math.isclose(got, float(expected), rel_tol=1e-9)
        assert not math.isclose(got, float(manual_probs(llama, ids)[9]), rel_tol=1e-6)

    def test_each_unit_alone_matches_manual(self, llama):
        ids = random_ids(T)
        for edge in [(0, 0, 3, 1), (2, 2, 6, 5)]:
            got = component_ablation_prob(llama, ids, [edge], [], T - 1, 4)
            assert math.isclose(got, float(manual_probs(llama, ids, zero_edges=[edge])[4]), rel_tol=1e-9)
        for neuron in [(0, 0, 0), (1, 6, 12)]:
            got = component_ablation_prob(llama, ids, [], [neuron], T - 1, 4)
            assert math.isclose(got, float(manual_probs(llama, ids, zero_neurons=[neuron])[4]), rel_tol=1e-9)

    def test_non_causal_edges_and_later_positions_change_nothing(self, llama):
        ids = random_ids(T)
        clean = component_ablation_prob(llama, ids, [], [], T - 1, 4)
        assert math.isclose(clean, float(manual_probs(llama, ids)[4]), rel_tol=1e-9)
        noop = component_ablation_prob(llama, ids, [(0, 1, 2, 5), (1, 0, 0, 6)], [], T - 1, 4)
        assert math.isclose(noop, clean, rel_tol=1e-12)
        later = component_ablation_prob(llama, ids, [(1, 0, 5, 2)], [(0, 6, 3)], 4, 4)
        assert math.isclose(later, component_ablation_prob(llama, ids, [], [], 4, 4), rel_tol=1e-12)

    def test_coarse_masks_zero_whole_heads_and_neurons(self, llama):
        ids = random_ids(T)
        spec_layers, heads, d_mlp = 3, 4, 48
        attn = torch.ones(2, spec_layers, heads, 1, 1, dtype=torch.bool)
        neurons = torch.ones(2, spec_layers, 1, d_mlp, dtype=torch.bool)
        attn[1, 1, 2] = False
        neurons[1, 0, 0, 5] = False
        probs = component_ablation_probs(llama, ids, attn, neurons, T - 1, 3)
        edges = [(1, 2, q, k) for q in range(T) for k in range(q + 1)]
        expected = manual_probs(llama, ids, zero_edges=edges, zero_neurons=[(0, p, 5) for p in range(T)])[3]
        assert math.isclose(float(probs[1]), float(expected), rel_tol=1e-9)
        assert math.isclose(float(probs[0]), float(manual_probs(llama, ids)[3]), rel_tol=1e-9)

    def test_rejects_a_batch_of_prompts(self, llama):
        with pytest.raises(ValueError, match="one prompt"):
            component_ablation_prob(llama, torch.zeros(2, T, dtype=torch.long), [], [], T - 1, 0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_nothing_ablated_is_the_models_own_probability(family):
    """With nothing zeroed, both ablation passes give the model's own p(target): its logits as it computes them,
    Gemma 2's final soft-cap included (the softmax of uncapped logits is another distribution)."""
    model = tiny_model(family, 2)
    ids = random_ids(7)
    with torch.no_grad():
        own = model(ids[None]).logits[0, -1].softmax(-1)
    target = int(own.argmax())
    want = float(own[target])
    assert input_ablation_prob(model, ids, [], 6, target) == pytest.approx(want, rel=1e-9)
    assert component_ablation_prob(model, ids, [], [], 6, target) == pytest.approx(want, rel=1e-9)
