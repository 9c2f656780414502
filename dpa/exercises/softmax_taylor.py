"""Exercises of chapter softmax-taylor: the softmax's first-order step delta and the query and key paths."""

from __future__ import annotations

import math

import torch

from ._core import F64, Exercise, Mistake, randn, vjp

CHAPTER = "softmax-taylor"


# -- 1. by hand: one query, three keys ----------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return dict(s=torch.tensor([math.log(2), 0.0, 0.0], dtype=F64), lam_v=torch.tensor([2.0, -2.0, 4.0], dtype=F64))


def _hand(c):
    alpha = torch.softmax(c["s"], -1)  # (1/2, 1/4, 1/4)
    lam_z = (alpha * c["lam_v"]).sum()
    delta = alpha * (c["lam_v"] - lam_z)
    return lam_z, delta, (delta * c["s"]).sum()


def _hand_alpha(c):
    return torch.softmax(c["s"], -1)


Exercise(
    "attn_delta_by_hand", CHAPTER, "eq-attn-delta", cases=_hand_case, oracle=_hand, n_cases=1, rtol=0, atol=5e-3,
    parts=("lambda . z", "delta", "the first-order term sum_j delta_j s_j"),
    part_equations=("eq-attn-output", "eq-attn-delta", "eq-attn-qk-value"),
    mistakes=[
        Mistake("delta is missing the subtraction of lambda . z: delta_ij = alpha_ij (lambda_i . v_j - lambda_i . "
                "z_i), and its row adds up to zero (eq-attn-delta)",
                lambda c: (None, _hand_alpha(c) * c["lam_v"], None)),
        Mistake("delta is missing the factor alpha_ij: the softmax Jacobian is alpha_ij' (1[j' = j] - alpha_ij), so "
                "delta_ij = alpha_ij (lambda_i . v_j - lambda_i . z_i) (eq-attn-delta)",
                lambda c: (None, c["lam_v"] - _hand(c)[0], None)),
        Mistake("delta keeps only the diagonal of the softmax Jacobian, alpha_j (1 - alpha_j) lambda . v_j; the "
                "off-diagonal terms -alpha_j alpha_j' give the - lambda . z (eq-attn-delta)",
                lambda c: (None, _hand_alpha(c) * (1 - _hand_alpha(c)) * c["lam_v"], None)),
        Mistake("lambda . z is the plain mean of lambda . v_j; z_i = sum_j alpha_ij v_j is weighted by the attention "
                "(eq-attn-output)", lambda c: (c["lam_v"].mean(), None, None)),
        Mistake("the first-order term is not the head's output lambda . z: it is sum_j delta_j s_j, the covariance "
                "of lambda . v_j and s_j under alpha (eq-attn-qk-value)",
                lambda c: (None, None, _hand(c)[0])),
        Mistake("sum_j delta_j alone is zero; the first-order term weighs each delta_j by its score s_j "
                "(eq-attn-qk-value)", lambda c: (None, None, torch.tensor(0.0, dtype=F64))),
    ],
)


# -- 2. implement: delta for every head and query -----------------------------------------------------------------
def _delta_case(gen: torch.Generator) -> dict:
    H, T, Dh = 2, 5, 3
    return dict(s=randn(gen, H, T, T), v=randn(gen, H, T, Dh), lam=randn(gen, H, T, Dh))


def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def _delta_oracle(c):
    """autograd of the heads' target sum_{h,i} lambda_{h,i} . z_{h,i} with respect to the scores."""
    causal = _causal(c["s"].shape[-1])
    return vjp(lambda s: (c["lam"] * (torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ c["v"])).sum(),
               c["s"], torch.tensor(1.0, dtype=F64))


def _delta(s, v, lam, mask=True, subtract=True, transposed=False, after=False, diagonal=False):
    causal = _causal(s.shape[-1])
    alpha = torch.softmax(s.masked_fill(~causal, float("-inf")) if mask and not after else s, -1)
    if after:
        alpha = alpha * causal
    lam_v = v @ lam.transpose(-1, -2) if transposed else lam @ v.transpose(-1, -2)
    if diagonal:
        return alpha * (1 - alpha) * lam_v
    lam_z = (alpha * lam_v).sum(-1, keepdim=True)
    return alpha * (lam_v - lam_z) if subtract else alpha * lam_v


def _d(c, **kw):
    return _delta(c["s"], c["v"], c["lam"], **kw)


Exercise(
    "attn_delta", CHAPTER, "eq-attn-delta", cases=_delta_case, oracle=_delta_oracle,
    call=lambda fn, c: fn(c["s"], c["v"], c["lam"]), signature="attn_delta(s, v, lam) -> delta",
    mistakes=[
        Mistake("the causal mask is missing: alpha is a softmax over j <= i only (eq-attn-forward); fill the scores "
                "of later keys with -inf before the softmax", lambda c: _d(c, mask=False)),
        Mistake("the mask is applied after the softmax, so each row of alpha no longer adds up to 1: fill the scores "
                "of later keys with -inf before the softmax (eq-attn-forward)", lambda c: _d(c, after=True)),
        Mistake("delta is missing the subtraction of lambda . z: delta_ij = alpha_ij (lambda_i . v_j - lambda_i . "
                "z_i), whose rows add up to zero (eq-attn-delta)", lambda c: _d(c, subtract=False)),
        Mistake("lambda . v has its indices swapped: entry (i, j) is lambda_{h,i} . v_{h,j}, the query's target "
                "against the key's value, lam @ v^T (eq-attn-delta)", lambda c: _d(c, transposed=True)),
        Mistake("delta keeps only the diagonal of the softmax Jacobian, alpha (1 - alpha) lambda . v; the "
                "off-diagonal terms give the - lambda . z (eq-attn-delta)", lambda c: _d(c, diagonal=True)),
        Mistake("the scores are divided by sqrt(D_h) twice: s already includes the 1/sqrt(D_h) of (eq-attn-forward)",
                lambda c: _delta(c["s"] / c["v"].shape[-1] ** 0.5, c["v"], c["lam"])),
    ],
)


# -- 3. implement: the query and key paths ------------------------------------------------------------------------
def _qk_case(gen: torch.Generator) -> dict:
    H, T, Dh, d = 2, 5, 3, 6
    return dict(x=randn(gen, T, d), t=randn(gen, T, d), W_Q=randn(gen, H * Dh, d, scale=d**-0.5),
                W_K=randn(gen, H * Dh, d, scale=d**-0.5), W_V=randn(gen, H * Dh, d, scale=d**-0.5),
                W_O=randn(gen, d, H * Dh, scale=(H * Dh) ** -0.5), H=H)


def _split(y, H):  # [T H*Dh] -> [H T Dh]
    return y.unflatten(-1, (H, -1)).transpose(0, 1)


def _join(y):  # [H T Dh] -> [T H*Dh]
    return y.transpose(0, 1).flatten(1)


def _attention(c, x_q, x_k, x_v):
    H = c["H"]
    q, k, v = _split(x_q @ c["W_Q"].T, H), _split(x_k @ c["W_K"].T, H), _split(x_v @ c["W_V"].T, H)
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~_causal(len(x_q)), float("-inf"))
    return _join(torch.softmax(s, -1) @ v) @ c["W_O"].T


def _qk_oracle(c):
    """autograd through the query input alone and through the key input alone."""
    x = c["x"]
    return (vjp(lambda y: _attention(c, y, x, x), x, c["t"]), vjp(lambda y: _attention(c, x, y, x), x, c["t"]))


def _qkd(c):
    """q, k [H T Dh] and delta [H T T] of the case."""
    H, x = c["H"], c["x"]
    q, k, v = _split(x @ c["W_Q"].T, H), _split(x @ c["W_K"].T, H), _split(x @ c["W_V"].T, H)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return q, k, _delta(s, v, _split(c["t"] @ c["W_O"], H))


def _qk_call(fn, c):
    q, k, delta = _qkd(c)
    return fn(delta, q, k, c["W_Q"], c["W_K"])


def _qk(c, scale=True, q_index="i", k_index="j", carries="kq", join=_join):
    q, k, delta = _qkd(c)
    a = q.shape[-1] ** -0.5 if scale else 1.0
    for_q, for_k = (k, q) if carries == "kq" else (q, k)
    dq = delta if q_index == "i" else delta.transpose(-1, -2)
    dk = delta.transpose(-1, -2) if k_index == "j" else delta
    return join(dq @ for_q * a) @ c["W_Q"], join(dk @ for_k * a) @ c["W_K"]


Exercise(
    "attn_query_key", CHAPTER, "eq-attn-query-key", cases=_qk_case, oracle=_qk_oracle, call=_qk_call,
    signature="attn_query_key(delta, q, k, W_Q, W_K) -> (g_Q, g_K)", parts=("g_Q", "g_K"),
    mistakes=[
        Mistake("the 1/sqrt(D_h) is missing: the score is q . k / sqrt(D_h) (eq-attn-forward), so both control "
                "paths carry it (eq-attn-query-key)", lambda c: _qk(c, scale=False)),
        Mistake("g_K sums over the wrong index: key position j collects delta_ij q_i from the queries i >= j that "
                "read it, delta^T @ q (eq-attn-query-key)", lambda c: (None, _qk(c, k_index="i")[1])),
        Mistake("g_Q sums over the wrong index: query position i collects delta_ij k_j from the keys j <= i it "
                "reads, delta @ k (eq-attn-query-key)", lambda c: (_qk(c, q_index="j")[0], None)),
        Mistake("the query path carries the keys and the key path the queries: the derivative of q_i . k_j with "
                "respect to q_i is k_j (eq-attn-query-key)", lambda c: _qk(c, carries="qk")),
        Mistake("the heads are joined in the wrong order: [H, T, D_h] -> [T, H*D_h] transposes first, so that "
                "position i's row holds every head's D_h coordinates, head by head (as W_Q's rows are)",
                lambda c: (_qk(c, join=lambda y: y.reshape(y.shape[1], -1))[0], None)),
        Mistake("the two paths are swapped: return (g_Q, g_K), the query path first (eq-attn-query-key)",
                lambda c: tuple(reversed(_qk_oracle(c)))),
    ],
)
