"""The forward oracle: what the capture records, recombined by dpa's own code, reproduces HF."""

import pytest
import torch

import dpa
from dpa.adapters import layer_weights
from dpa.attention import attention_internals, attention_output
from dpa.capture import NonFiniteError, capture
from dpa.glu import glu_forward
from dpa.norm import apply_norm, rms_scale

from .conftest import random_ids, tiny_model


def recompute_logits(model, cap):
    """Rebuild every layer from the captured residual inputs and compare layer by layer."""
    spec = dpa.spec_for(model)
    rotary = model.model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float64), cap.position_ids)
    from dpa.capture import attention_mask

    x = cap.embeddings
    for i, lc in enumerate(cap.layers):
        w = layer_weights(model, spec, i, torch.float64)
        torch.testing.assert_close(lc.resid_pre, x)
        xn = apply_norm(x, w.attn_norm, rms_scale(x, spec.rms_eps))
        proj = lambda wt, b: xn @ wt.T + (0 if b is None else b)  # noqa: E731
        c = attention_internals(proj(w.attn.q, w.attn.q_bias), proj(w.attn.k, w.attn.k_bias),
                                proj(w.attn.v, w.attn.v_bias), w.attn, cos, sin,
                                attention_mask(cap.mask, spec.sliding_windows[i]))
        x = x + attention_output(c, w.attn)
        torch.testing.assert_close(lc.resid_mid, x)
        _, _, out = glu_forward(apply_norm(x, w.mlp_norm, rms_scale(x, spec.rms_eps)), w.mlp.gate, w.mlp.up,
                                w.mlp.down)
        x = x + out
    final = apply_norm(x, model.model.norm.weight, rms_scale(x, spec.rms_eps))
    return final @ model.lm_head.weight.T


class TestForwardOracle:
    def test_recomputed_logits_match_hf(self, family_model):
        ids = random_ids(11)[None]
        mask = torch.ones_like(ids, dtype=torch.bool)
        cap = capture(family_model, dpa.spec_for(family_model), ids, mask)
        torch.testing.assert_close(recompute_logits(family_model, cap), family_model(ids).logits,
                                   rtol=1e-6, atol=1e-6)

    def test_left_padding_matches_hf(self, family_model):
        ids = random_ids(11)[None].repeat(2, 1)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[1, :3] = False
        cap = capture(family_model, dpa.spec_for(family_model), ids, mask)
        hf = family_model(ids, attention_mask=mask.long(), position_ids=cap.position_ids).logits
        ours = recompute_logits(family_model, cap)
        torch.testing.assert_close(ours[mask], hf[mask])

    def test_projection_captures_match_recomputation(self):
        model = tiny_model("qwen2", 2)
        ids = random_ids(6)[None]
        cap = capture(model, dpa.spec_for(model), ids, torch.ones_like(ids, dtype=torch.bool))
        lc = cap.layers[1]
        w = layer_weights(model, dpa.spec_for(model), 1, torch.float64)
        xn = apply_norm(lc.resid_pre, w.attn_norm, rms_scale(lc.resid_pre, model.config.rms_norm_eps))
        torch.testing.assert_close(lc.q, xn @ w.attn.q.T + w.attn.q_bias)

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
