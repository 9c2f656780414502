"""Exercises of chapter rope: the rotation, its transpose, and the query and key paths with grouped KV heads."""

from __future__ import annotations

import torch

from ..rules.rope import apply_rope, rotate_half
from ._core import F64, Exercise, Mistake, randn, vjp

CHAPTER = "rope"


def _pairs(x, cos, sin, sign=1.0):
    """The rotation with adjacent coordinates paired, (x_0, x_1), (x_2, x_3), ...: the wrong pairing for this book's
    (and transformers') RoPE; ``sign=-1`` rotates backwards."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sign * sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], -1).flatten(-2)


def _transpose(a, cos, sin):
    """R^T a (eq-rope-transpose)."""
    return a * cos - rotate_half(a * sin)


# -- 1. by hand: one 4-dimensional head vector --------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return dict(x=torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64), a=torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64),
                cos=torch.tensor([0.6, 0.0, 0.6, 0.0], dtype=F64), sin=torch.tensor([0.8, 1.0, 0.8, 1.0], dtype=F64))


def _hand(c):
    return apply_rope(c["x"], c["cos"], c["sin"]), vjp(lambda y: apply_rope(y, c["cos"], c["sin"]), c["x"], c["a"])


Exercise(
    "rope_by_hand", CHAPTER, "eq-rope-matrix", cases=_hand_case, oracle=_hand, n_cases=1, rtol=0, atol=5e-3,
    parts=("R_m x", "R_m^T a"), part_equations=("eq-rope-matrix", "eq-rope-transpose"),
    mistakes=[
        Mistake("R_m^T a is rotated the wrong way: that is R_m a; the transpose rotates by -m, a cos - "
                "rotate_half(a) sin (eq-rope-transpose)",
                lambda c: (None, apply_rope(c["a"], c["cos"], c["sin"]))),
        Mistake("R_m x is rotated the wrong way: rotate_half([x1, x2]) = [-x2, x1], so the first half becomes "
                "x1 cos - x2 sin and the second x2 cos + x1 sin (eq-rope-matrix)",
                lambda c: (_transpose(c["x"], c["cos"], c["sin"]), None)),
        Mistake("R_m x pairs neighbouring coordinates: RoPE here pairs coordinate k of the first half with "
                "coordinate k of the second, (x1_k, x2_k) (eq-rope-matrix)",
                lambda c: (_pairs(c["x"], c["cos"], c["sin"]), None)),
        Mistake("R_m^T a pairs neighbouring coordinates: RoPE here pairs coordinate k of the first half with "
                "coordinate k of the second (eq-rope-matrix), and R_m^T = R_-m (eq-rope-transpose)",
                lambda c: (None, _pairs(c["a"], c["cos"], c["sin"], sign=-1.0))),
    ],
)


# -- 2. implement: the pull-back through the rotation -------------------------------------------------------------
def _cos_sin(gen, T, Dh):
    theta = 10000.0 ** (-torch.arange(0, Dh, 2, dtype=F64) / Dh)
    start = int(torch.randint(0, 20, (1,), generator=gen))
    angles = torch.arange(start, start + T, dtype=F64)[:, None] * theta
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def _transpose_case(gen: torch.Generator) -> dict:
    H, T, Dh = 2, 5, 6
    cos, sin = _cos_sin(gen, T, Dh)
    return dict(a=randn(gen, H, T, Dh), cos=cos, sin=sin, x=randn(gen, H, T, Dh))


Exercise(
    "rope_transpose", CHAPTER, "eq-rope-transpose", cases=_transpose_case,
    oracle=lambda c: vjp(lambda y: apply_rope(y, c["cos"], c["sin"]), c["x"], c["a"]),
    call=lambda fn, c: fn(c["a"], c["cos"], c["sin"]), signature="rope_transpose(a, cos, sin) -> R^T a",
    mistakes=[
        Mistake("rotated the wrong way: a cos + rotate_half(a) sin is R_m a; the pull-back is the transpose, "
                "R_m^T a = a cos - rotate_half(a) sin = R_-m a (eq-rope-transpose)",
                lambda c: apply_rope(c["a"], c["cos"], c["sin"])),
        Mistake("the rotation is missing: the scores read the rotated vector, so the target on it pulls back "
                "through R_m^T (eq-rope-transpose)", lambda c: c["a"]),
        Mistake("neighbouring coordinates are paired: RoPE here pairs coordinate k of the first half with "
                "coordinate k of the second, rotate_half([x1, x2]) = [-x2, x1] (eq-rope-matrix)",
                lambda c: _pairs(c["a"], c["cos"], c["sin"], sign=-1.0)),
        Mistake("cos and sin are swapped: R_m x = x cos + rotate_half(x) sin, so R_m^T a = a cos - "
                "rotate_half(a) sin (eq-rope-transpose)", lambda c: _transpose(c["a"], c["sin"], c["cos"])),
    ],
)


# -- 3. implement: the query and key paths with rotation and grouped KV heads -------------------------------------
def _gqa_case(gen: torch.Generator) -> dict:
    # G = 3 differs from H_kv = 2, and sqrt(D_h) from both: grouping heads as [G, H_kv], or a 1/G or 1/H_kv in
    # place of 1/sqrt(D_h), cannot pass by coincidence
    H, H_kv, T, Dh, d = 6, 2, 5, 6, 8
    cos, sin = _cos_sin(gen, T, Dh)
    return dict(x=randn(gen, T, d), t=randn(gen, T, d), W_Q=randn(gen, H * Dh, d, scale=d**-0.5),
                W_K=randn(gen, H_kv * Dh, d, scale=d**-0.5), W_V=randn(gen, H_kv * Dh, d, scale=d**-0.5),
                W_O=randn(gen, d, H * Dh, scale=(H * Dh) ** -0.5), cos=cos, sin=sin, H=H, H_kv=H_kv)


def _split(y, n):  # [T n*Dh] -> [n T Dh]
    return y.unflatten(-1, (n, -1)).transpose(0, 1)


def _join(y):  # [n T Dh] -> [T n*Dh]
    return y.transpose(0, 1).flatten(1)


def _qkv(c, x_q, x_k, x_v):
    """Rotated queries [H T Dh], rotated keys and values [H_kv T Dh]."""
    q, k = _split(x_q @ c["W_Q"].T, c["H"]), _split(x_k @ c["W_K"].T, c["H_kv"])
    return apply_rope(q, c["cos"], c["sin"]), apply_rope(k, c["cos"], c["sin"]), _split(x_v @ c["W_V"].T, c["H_kv"])


def _alpha(q, k):
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    return torch.softmax((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~causal, float("-inf")), -1)


def _attention(c, x_q, x_k, x_v):
    q, k, v = _qkv(c, x_q, x_k, x_v)
    G = c["H"] // c["H_kv"]
    k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)  # (eq-gqa-map), as repeat_kv
    return _join(_alpha(q, k) @ v) @ c["W_O"].T


def _gqa_oracle(c):
    """autograd through the query input alone and through the key input alone."""
    x = c["x"]
    return vjp(lambda y: _attention(c, y, x, x), x, c["t"]), vjp(lambda y: _attention(c, x, y, x), x, c["t"])


def _delta(c):
    q, k, v = _qkv(c, c["x"], c["x"], c["x"])
    G = c["H"] // c["H_kv"]
    alpha, lam = _alpha(q, k.repeat_interleave(G, 0)), _split(c["t"] @ c["W_O"], c["H"])
    lam_v = lam @ v.repeat_interleave(G, 0).transpose(-1, -2)
    return alpha * (lam_v - (alpha * lam_v).sum(-1, keepdim=True)), q, k  # (eq-attn-delta)


def _gqa_call(fn, c):
    delta, q, k = _delta(c)
    return fn(delta, q, k, c["cos"], c["sin"], c["W_Q"], c["W_K"])


def _gqa(c, expand="interleave", group="sum", pull=_transpose, scale=True, k_index="j"):
    delta, q, k = _delta(c)
    G, H_kv, a = c["H"] // c["H_kv"], c["H_kv"], q.shape[-1] ** -0.5 if scale else 1.0
    k_exp = k.repeat_interleave(G, 0) if expand == "interleave" else k.repeat(G, 1, 1)
    per_head = (delta.transpose(-1, -2) if k_index == "j" else delta) @ q * a  # [H T Dh]
    g_k = {"sum": lambda y: y.unflatten(0, (H_kv, G)).sum(1), "mean": lambda y: y.unflatten(0, (H_kv, G)).mean(1),
           "first": lambda y: y[::G], "mod": lambda y: y.unflatten(0, (G, H_kv)).sum(0)}[group](per_head)
    return (_join(pull(delta @ k_exp * a, c["cos"], c["sin"])) @ c["W_Q"],
            _join(pull(g_k, c["cos"], c["sin"])) @ c["W_K"])


Exercise(
    "rope_gqa_query_key", CHAPTER, "eq-rope-query-key", cases=_gqa_case, oracle=_gqa_oracle, call=_gqa_call,
    signature="rope_gqa_query_key(delta, q_hat, k_hat, cos, sin, W_Q, W_K) -> (g_Q, g_K)", parts=("g_Q", "g_K"),
    mistakes=[
        Mistake("the pull-back rotates the wrong way: the target on a rotated vector goes back through R^T, "
                "a cos - rotate_half(a sin) (eq-rope-transpose), at the position it flows to (eq-rope-query-key)",
                lambda c: _gqa(c, pull=apply_rope)),
        Mistake("g_Q rotates the wrong way: pull it back through R_i^T (eq-rope-query-key), not R_i",
                lambda c: (_gqa(c, pull=apply_rope)[0], None)),
        Mistake("g_K rotates the wrong way: pull it back through R_j^T (eq-rope-query-key), not R_j",
                lambda c: (None, _gqa(c, pull=apply_rope)[1])),
        Mistake("the rotation is missing from the pull-back: the scores read R_i q_i and R_j k_j, so each path ends "
                "with R^T at its own position (eq-rope-query-key)", lambda c: _gqa(c, pull=lambda y, cos, sin: y)),
        Mistake("the 1/sqrt(D_h) is missing: the score is q . k / sqrt(D_h), so both control paths carry it "
                "(eq-rope-query-key)", lambda c: _gqa(c, scale=False)),
        Mistake("the key heads are matched to query heads as h mod H_kv (torch's repeat); consecutive query heads "
                "share a KV head, kv(h) = floor(h / G), as repeat_interleave does (eq-gqa-map)",
                lambda c: (_gqa(c, expand="tile")[0], None)),
        Mistake("the group of a KV head is taken as h mod H_kv; consecutive query heads share a KV head, kv(h) = "
                "floor(h / G): add up heads G kv ... G kv + G - 1 (eq-gqa-map)",
                lambda c: (None, _gqa(c, group="mod")[1])),
        Mistake("g_K averages the targets of a group: a key is read by all G query heads of its group, so their "
                "targets add up before the pull-back through W_K (eq-gqa-map)",
                lambda c: (None, _gqa(c, group="mean")[1])),
        Mistake("g_K keeps only the first query head of each group: a key is read by all G heads of its group, "
                "so their targets add up (eq-gqa-map)", lambda c: (None, _gqa(c, group="first")[1])),
        Mistake("g_K sums over the wrong index: key position j collects delta_ij q_i from the queries i >= j that "
                "read it, delta^T @ q (eq-rope-query-key)", lambda c: (None, _gqa(c, k_index="i")[1])),
    ],
)
