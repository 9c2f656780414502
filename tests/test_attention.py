import pytest
import torch
from torch.func import vjp
from transformers.models.llama.modeling_llama import repeat_kv

from dpa.rules.hand import AttentionWeights, attention_forward, attention_internals, propagate_attention
from dpa.rules.attention import attention_mask
from dpa.rules.rope import apply_rope

from .test_rope import cos_sin

D, H, DH, T = 24, 4, 8, 7


def weights(kv: int, bias=False, qk_norm=False, seed=0) -> AttentionWeights:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return AttentionWeights(
        q=r(H * DH, D) / 4, k=r(kv * DH, D) / 4, v=r(kv * DH, D) / 4, o=r(D, H * DH) / 4, n_heads=H, n_kv_heads=kv,
        scaling=DH ** -0.5, q_bias=r(H * DH) if bias else None, k_bias=r(kv * DH) if bias else None,
        v_bias=r(kv * DH) if bias else None, q_norm=1 + r(DH) / 3 if qk_norm else None,
        k_norm=1 + r(DH) / 3 if qk_norm else None)


def reference(w: AttentionWeights, x, cos, sin, mask, mu=(1, 1, 1)):
    """Attention written with repeat_kv and explicit detaches: value, query, key branches scaled mu x."""
    b, t, _ = x.shape
    kv = w.n_kv_heads

    def branch(xx, m):  # identity forward, m x backward
        return m * xx + (1 - m) * xx.detach()

    def proj(xx, wt, bias):
        return xx @ wt.T + (0 if bias is None else bias)

    def norm(y, gamma):
        if gamma is None:
            return y
        return gamma * y * torch.rsqrt(y.detach().pow(2).mean(-1, keepdim=True) + w.qk_norm_eps)

    q = norm(proj(branch(x, mu[0]), w.q, w.q_bias).view(b, t, H, DH), w.q_norm).transpose(1, 2)
    k = norm(proj(branch(x, mu[1]), w.k, w.k_bias).view(b, t, kv, DH), w.k_norm).transpose(1, 2)
    v = proj(branch(x, mu[2]), w.v, w.v_bias).view(b, t, kv, DH).transpose(1, 2)
    q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    k, v = repeat_kv(k, H // kv), repeat_kv(v, H // kv)
    s = (q @ k.transpose(-1, -2) * w.scaling).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2).reshape(b, t, -1) @ w.o.T


LAYOUTS = [("mha", 4), ("gqa", 2), ("mqa", 1)]
VARIANTS = [dict(), dict(bias=True), dict(qk_norm=True)]


@pytest.fixture(params=[(l, v) for l in LAYOUTS for v in range(3)], ids=lambda p: f"{p[0][0]}-v{p[1]}")
def setup(request):
    (_, kv), variant = request.param
    w = weights(kv, **VARIANTS[variant])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    pad = torch.ones(2, T, dtype=torch.bool)
    pad[1, :2] = False  # left padding in the second sample
    cos, sin = cos_sin((pad.long().cumsum(-1) - 1).clamp(min=0), d_head=DH)
    target = torch.randn(2, T, D, generator=g, dtype=torch.float64) * pad[..., None]
    return w, x, cos, sin, attention_mask(pad, window=5), target


class TestAttentionForward:
    def test_matches_repeat_kv_reference(self, setup):
        w, x, cos, sin, mask, _ = setup
        _, out = attention_forward(x, w, cos, sin, mask)
        torch.testing.assert_close(out, reference(w, x, cos, sin, mask))

    def test_masked_pairs_have_zero_probability(self, setup):
        w, x, cos, sin, mask, _ = setup
        c, _ = attention_forward(x, w, cos, sin, mask)
        assert (c.probs.masked_select(~mask.expand_as(c.probs)) == 0).all()


class TestAttentionPaths:
    @pytest.mark.parametrize("mu", [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0.25, 0.25, 0.5)], ids=["q", "k", "v", "mix"])
    def test_matches_autograd(self, setup, mu):
        w, x, cos, sin, mask, target = setup
        c, _ = attention_forward(x, w, cos, sin, mask)
        prop = propagate_attention(target, c, w, cos, sin, query=mu[0], key=mu[1], value=mu[2])
        _, pull = vjp(lambda y: reference(w, y, cos, sin, mask, mu), x)
        torch.testing.assert_close(prop.target, pull(target)[0])

    def test_value_path_reproduces_output_and_scores_sum(self, setup):
        w, x, cos, sin, mask, target = setup
        c, out = attention_forward(x, w, cos, sin, mask)
        prop = propagate_attention(target, c, w, cos, sin, query=0, key=0, value=1, edges=True)
        total = (target * out).sum((1, 2))
        torch.testing.assert_close(prop.edge_scores.sum((1, 2, 3)), total)
        torch.testing.assert_close(prop.head_scores.sum(1), total)
        # value path: x . g_V + (bias share) = t . out
        torch.testing.assert_close((x * prop.target).sum((1, 2)) + prop.value_bias_share, total)

    def test_query_key_paths_break_completeness(self, setup):
        w, x, cos, sin, mask, target = setup
        c, out = attention_forward(x, w, cos, sin, mask)
        prop = propagate_attention(target, c, w, cos, sin, query=0.5, key=0.5, value=0)
        assert ((x * prop.target).sum() - (target * out).sum()).abs() > 1e-3

    def test_internals_from_projections(self, setup):
        w, x, cos, sin, mask, _ = setup
        c1, _ = attention_forward(x, w, cos, sin, mask)
        proj = lambda wt, b: x @ wt.T + (0 if b is None else b)  # noqa: E731
        c2 = attention_internals(proj(w.q, w.q_bias), proj(w.k, w.k_bias), proj(w.v, w.v_bias), w, cos, sin, mask)
        torch.testing.assert_close(c1.probs, c2.probs)
