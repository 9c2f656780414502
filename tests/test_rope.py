import pytest
import torch
from torch.func import vjp
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from dpa.rules.rope import apply_rope, rotate_half

from dpa.rules.hand import apply_rope_transpose


def cos_sin(positions, rope_parameters=None, d_head=16):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=d_head, max_position_embeddings=64,
                      rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    rotary = LlamaRotaryEmbedding(cfg)
    return rotary(torch.zeros(1, dtype=torch.float64), positions)


SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 10000.0},
]


class TestRope:
    @pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
    def test_matches_hf(self, scaling):
        pos = torch.arange(7)[None]
        cos, sin = cos_sin(pos, scaling)
        q, k = torch.randn(2, 1, 4, 7, 16, dtype=torch.float64).unbind(0)
        hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None]), hq)
        torch.testing.assert_close(apply_rope(k, cos[:, None], sin[:, None]), hk)

    @pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
    def test_transpose_is_vjp(self, scaling):
        cos, sin = cos_sin(torch.arange(7)[None], scaling)
        x, a = torch.randn(2, 4, 7, 16, dtype=torch.float64).unbind(0)
        _, pull = vjp(lambda y: apply_rope(y, cos, sin), x)
        torch.testing.assert_close(apply_rope_transpose(a, cos, sin), pull(a)[0])

    def test_transpose_is_inverse(self):
        cos, sin = cos_sin(torch.arange(9)[None])
        x = torch.randn(4, 9, 16, dtype=torch.float64)
        torch.testing.assert_close(apply_rope_transpose(apply_rope(x, cos, sin), cos, sin), x)

    def test_relative_position(self):
        # <R_i q, R_j k> depends only on i - j
        q, k = torch.randn(2, 16, dtype=torch.float64).unbind(0)
        cos, sin = cos_sin(torch.arange(20)[None])

        def dot(i, j):
            return (apply_rope(q, cos[0, i], sin[0, i]) * apply_rope(k, cos[0, j], sin[0, j])).sum()

        torch.testing.assert_close(dot(5, 2), dot(15, 12))
        assert not torch.allclose(dot(5, 2), dot(5, 3))

    def test_rotate_half_antisymmetric(self):
        a, b = torch.randn(2, 16, dtype=torch.float64).unbind(0)
        torch.testing.assert_close((rotate_half(a) * b).sum(), -(a * rotate_half(b)).sum())
