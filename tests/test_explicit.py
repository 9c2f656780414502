"""The forward oracle: the explicit attention path and the hand rules, recombined, reproduce HF's logits."""

import pytest
import torch

import dpa
import dpa.linearise
from dpa import request
from dpa.errors import NonFiniteError
from dpa.instrument import instrument, logits_at
from dpa.rules.attention import attention_mask
from dpa.rules.norm import apply_norm, rms_scale

from .conftest import random_ids, tiny_model
from dpa.rules.hand import attention_forward, capture, glu_forward, layer_weights


def recompute_logits(model, ids):
    """Rebuild every layer with the hand rules from the captured residual inputs, layer by layer."""
    spec = dpa.spec_for(model)
    cap = capture(model, ids)
    t = len(ids)
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), torch.arange(t)[None])
    x = cap[("pre", 0)]
    for i in range(spec.n_layers):
        w = layer_weights(model, spec, i, torch.float64)
        torch.testing.assert_close(cap[("pre", i)], x)
        _, out = attention_forward(apply_norm(x, w.attn_norm, rms_scale(x, spec.rms_eps)), w.attn, cos, sin,
                                   attention_mask(torch.ones(1, t, dtype=torch.bool), spec.sliding_windows[i]))
        x = x + out
        torch.testing.assert_close(cap[("mid", i)], x)
        _, _, out = glu_forward(apply_norm(x, w.mlp_norm, rms_scale(x, spec.rms_eps)), w.mlp.gate, w.mlp.up,
                                w.mlp.down)
        x = x + out
    final = apply_norm(x, model.model.norm.weight, rms_scale(x, spec.rms_eps))
    return final @ model.lm_head.weight.T


class TestForwardOracle:
    def test_hand_rules_reproduce_hf(self, family_model):
        ids = random_ids(11)
        torch.testing.assert_close(recompute_logits(family_model, ids), family_model(ids[None]).logits,
                                   rtol=1e-6, atol=1e-6)

    def test_explicit_attention_reproduces_hf(self, family_model):
        ids = random_ids(11)
        req = request.build(family_model, None, ids)
        with torch.no_grad(), instrument(family_model, req, explicit=True) as session:
            hidden = session.forward()
        probs = session.recording.probs
        assert len(probs) == dpa.spec_for(family_model).n_layers
        torch.testing.assert_close(hidden, family_model.model(ids[None]).last_hidden_state, rtol=1e-10, atol=1e-10)
        for p in probs.values():
            assert p.triu(1).abs().max() == 0  # causal
            torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))

    def test_explicit_padded_batch_matches_hf(self, family_model):
        prompts = [random_ids(11, seed=1), random_ids(7, seed=2)]
        req = request.build(family_model, None, prompts)
        with torch.no_grad(), instrument(family_model, req, explicit=True) as session:
            ours = logits_at(family_model, req, session.forward())
        for b, p in enumerate(prompts):
            torch.testing.assert_close(ours[b], family_model(p[None]).logits[0, -1], rtol=1e-10, atol=1e-10)

    def test_linearised_explicit_equals_fused(self, family_model):
        """The explicit path and the model's own attention kernel give the same DPA scores."""
        ids = random_ids(9)
        req = request.build(family_model, None, ids, 5)
        out = {}
        for explicit in (False, True):
            scores = dpa.linearise.Scores.empty(req.spec, 1, 9, torch.float64, req.device, False)
            with instrument(family_model, req, weights=dpa.PathWeights(), scores=scores, explicit=explicit) as s:
                hidden = s.forward()
                value = hidden[0, -1] @ family_model.lm_head.weight[5]
                s.backward(value)
            scores.settle()
            out[explicit] = scores
        for name in ("tokens", "heads", "neurons", "bias"):
            torch.testing.assert_close(getattr(out[True], name), getattr(out[False], name), rtol=1e-9, atol=1e-10)

    def test_sliding_window_matters(self):
        # the oracle must see the window: with it removed the logits differ
        model = tiny_model("mistral", 2)
        ids = random_ids(12)[None]
        full = tiny_model("mistral", 2, sliding_window=None)
        assert not torch.allclose(model(ids).logits, full(ids).logits)


class TestNonFinite:
    def test_nan_weights_raise(self):
        model = tiny_model("llama", 2)
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
        with pytest.raises(NonFiniteError, match="layer 1"):
            dpa.attribute(model, None, random_ids(5), target=3)

    def test_inf_embedding_raises(self):
        model = tiny_model("llama", 2)
        ids = random_ids(5)
        with torch.no_grad():
            model.model.embed_tokens.weight[ids[2]] = float("inf")
        with pytest.raises(NonFiniteError, match="non-finite"):
            dpa.attribute(model, None, ids, target=3)

    def test_overflowing_weights_raise(self):
        model = tiny_model("llama", 2)
        with pytest.raises(NonFiniteError, match="scores"):
            dpa.attribute(model, None, random_ids(5), target=3, weights=dpa.PathWeights(1e300, 1e300, 1e300, 1, 1))
