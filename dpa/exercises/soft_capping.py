"""Exercises of chapter soft-capping: the attention cap on the control paths and the final cap under the
log-probability target."""

from __future__ import annotations

import math

import torch

from ._core import F64, Exercise, Mistake, randn

CHAPTER = "soft-capping"


# -- 1. by hand: one query, three keys ------------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return dict(s=torch.tensor([0.0, math.log(3), -math.log(3)], dtype=F64), cap=2.0,
                lam_v=torch.tensor([1.0, 2.0, -1.0], dtype=F64))


def _hand(c, capped=True, slope="hat"):
    """(alpha, delta) of (eq-cap-delta) for one query; the mistakes: the softmax of the uncapped scores, another
    factor in place of the cap's derivative."""
    s, cap = c["s"], c["cap"]
    s_hat = cap * torch.tanh(s / cap)
    alpha = (s_hat if capped else s).softmax(-1)
    delta_hat = alpha * (c["lam_v"] - alpha @ c["lam_v"])
    factor = {"hat": 1 - (s_hat / cap) ** 2, "none": torch.ones_like(s), "s": 1 - (s / cap) ** 2,
              "rho": torch.where(s == 0, torch.ones_like(s), s_hat / s)}[slope]
    return alpha, delta_hat * factor


Exercise(
    "cap_by_hand", CHAPTER, "eq-cap-delta", cases=_hand_case, n_cases=1, rtol=0, atol=5e-3,
    parts=("the attention weights alpha", "the sensitivity delta on the pre-cap scores"), oracle=_hand,
    part_equations=("eq-cap-attention", "eq-cap-delta"),
    mistakes=[
        Mistake("alpha is the softmax of the capped scores s_hat = (0, 1, -1), not of s: the cap acts before the "
                "softmax (eq-cap-attention)", lambda c: (_hand(c, capped=False)[0], None)),
        Mistake("your delta is delta_hat, the sensitivity on the capped score; on the pre-cap score s it is times "
                "the cap's derivative 1 - s_hat^2/c^2 (eq-cap-delta)", lambda c: (None, _hand(c, slope="none")[1])),
        Mistake("the cap's derivative is 1 - tanh^2(s/c) = 1 - s_hat^2/c^2, with the capped score s_hat, not "
                "1 - s^2/c^2 (eq-cap-delta)", lambda c: (None, _hand(c, slope="s")[1])),
        Mistake("you scaled delta_hat by the ratio s_hat/s: that frozen ratio is how DPA linearises the final cap "
                "(eq-cap-final); on the scores the control paths take the cap's derivative (eq-cap-delta)",
                lambda c: (None, _hand(c, slope="rho")[1])),
        Mistake("delta_hat is missing its alpha: delta_hat_j = alpha_j (lambda . v_j - lambda . z) (eq-cap-delta)",
                lambda c: (None, (c["lam_v"] - _hand(c)[0] @ c["lam_v"]) * (1 - torch.tanh(c["s"] / c["cap"]) ** 2))),
    ],
)


# -- 2. implement: the query and key paths of one capped head -------------------------------------------------------
def _head_case(gen: torch.Generator) -> dict:
    T, D = 5, 4
    return dict(lam=randn(gen, T, D), q=randn(gen, T, D, scale=1.5), k=randn(gen, T, D, scale=1.5),
                v=randn(gen, T, D), tau=D ** -0.5, cap=float(1 + torch.rand(1, generator=gen, dtype=F64)))


def _head(c, q, k, capped=True, masked=True):
    s = c["tau"] * q @ k.T
    s_hat = c["cap"] * torch.tanh(s / c["cap"]) if capped else s
    if masked:
        s_hat = s_hat.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
    return s_hat.softmax(-1) @ c["v"]


def _head_oracle(c, **how):
    """autograd of lambda . z through the capped scores, v fixed: the query and the key paths."""
    q, k = c["q"].clone().requires_grad_(True), c["k"].clone().requires_grad_(True)
    with torch.enable_grad():
        g_q, g_k = torch.autograd.grad((c["lam"] * _head(c, q, k, **how)).sum(), (q, k))
    return g_q, g_k


def _head_rule(c, slope="hat", transpose=True):
    """(eq-cap-delta) written out, with the mistakes' factors."""
    s = c["tau"] * c["q"] @ c["k"].T
    s_hat = c["cap"] * torch.tanh(s / c["cap"])
    alpha = s_hat.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    z = alpha @ c["v"]
    delta_hat = alpha * (c["lam"] @ c["v"].T - (c["lam"] * z).sum(-1, keepdim=True))
    factor = {"hat": 1 - (s_hat / c["cap"]) ** 2, "s": 1 - (s / c["cap"]) ** 2, "none": torch.ones_like(s),
              "rho": torch.where(s == 0, torch.ones_like(s), s_hat / s)}[slope]
    delta = delta_hat * factor
    return c["tau"] * delta @ c["k"], c["tau"] * (delta.T if transpose else delta) @ c["q"]


Exercise(
    "capped_qk_paths", CHAPTER, "eq-cap-delta", cases=_head_case, oracle=_head_oracle,
    call=lambda fn, c: fn(c["lam"], c["q"], c["k"], c["v"], c["tau"], c["cap"]),
    signature="capped_qk_paths(lam, q, k, v, tau, cap) -> (g_q, g_k)", parts=("g_q", "g_k"),
    mistakes=[
        Mistake("the cap's derivative is missing: delta_hat is the sensitivity on the capped score; the query and "
                "key paths need it on s, delta = delta_hat (1 - s_hat^2/c^2) (eq-cap-delta)",
                lambda c: _head_rule(c, slope="none")),
        Mistake("the cap's derivative is 1 - s_hat^2/c^2, with the capped score s_hat, not 1 - s^2/c^2 "
                "(eq-cap-delta)", lambda c: _head_rule(c, slope="s")),
        Mistake("you scaled delta_hat by the ratio s_hat/s: that frozen ratio is how DPA linearises the final cap "
                "(eq-cap-final); on the scores the control paths take the cap's derivative (eq-cap-delta)",
                lambda c: _head_rule(c, slope="rho")),
        Mistake("your head has no cap: the softmax reads s_hat = c tanh(s/c), and delta carries the cap's "
                "derivative (eq-cap-attention)", lambda c: _head_oracle(c, capped=False)),
        Mistake("the causal mask is missing: query i sees keys j <= i only, so alpha_ij = 0 above the diagonal "
                "(eq-cap-attention)", lambda c: _head_oracle(c, masked=False)),
        Mistake("g_k sums over the queries: g_k,j = tau sum_i delta_ij q_i, i.e. tau delta^T q (eq-cap-delta)",
                lambda c: (None, _head_rule(c, transpose=False)[1])),
    ],
)


# -- 3. implement: the log-probability target through the final cap -------------------------------------------------
def _logprob_case(gen: torch.Generator) -> dict:
    vocab, d = 7, 5
    return dict(W_U=randn(gen, vocab, d), x=randn(gen, d), y=int(torch.randint(vocab, (1,), generator=gen)),
                cap=float(1.5 + torch.rand(1, generator=gen, dtype=F64)))


def _logprob_oracle(c):
    """autograd of l_y - p . l with each ratio rho(z_v) frozen and p (after the cap) held fixed."""
    x = c["x"].clone().requires_grad_(True)
    with torch.enable_grad():
        z = c["W_U"] @ x
        logits = z * (c["cap"] * torch.tanh(z / c["cap"]) / z).detach()  # (eq-cap-final)
        value = logits[c["y"]] - logits.softmax(-1).detach() @ logits
        (u,) = torch.autograd.grad(value, x)
    return u, value.detach()


def _logprob(c, factor="rho", p_from="capped", expectation=True):
    """(eq-cap-logprob) written out, with the mistakes."""
    W, y, cap = c["W_U"], c["y"], c["cap"]
    z = W @ c["x"]
    logits = cap * torch.tanh(z / cap)
    rho = {"rho": logits / z, "slope": 1 - (logits / cap) ** 2, "none": torch.ones_like(z)}[factor]
    p = (logits if p_from == "capped" else z).softmax(-1) * expectation
    return rho[y] * W[y] - (p * rho) @ W, logits[y] - p @ logits


Exercise(
    "capped_logprob", CHAPTER, "eq-cap-logprob", cases=_logprob_case, oracle=_logprob_oracle,
    call=lambda fn, c: fn(c["W_U"], c["x"], c["y"], c["cap"]),
    signature="capped_logprob(W_U, x, y, cap) -> (u, value)", parts=("the direction u", "the attributed value"),
    mistakes=[
        Mistake("your u carries the cap's derivative 1 - l^2/c^2: that is the true gradient of log p_y, which does "
                "not reproduce the value; DPA freezes each ratio rho(z_v) = l_v / z_v (eq-cap-logprob)",
                lambda c: (_logprob(c, factor="slope")[0], None)),
        Mistake("your u ignores the cap: with the cap between the logits and x, each row W_U[v] comes with its "
                "frozen ratio rho(z_v) (eq-cap-logprob)", lambda c: (_logprob(c, factor="none")[0], None)),
        Mistake("the expectation is missing: the log-probability target subtracts sum_v p_v rho(z_v) W_U[v] from "
                "the direction and E_p[l] from the value (eq-cap-logprob)",
                lambda c: _logprob(c, expectation=False)),
        Mistake("p is the model's distribution, the softmax of the capped logits l, not of the pre-cap z "
                "(eq-cap-logprob)", lambda c: _logprob(c, p_from="z")),
        Mistake("the attributed value is the capped logit minus its expectation, l_y - E_p[l]; yours is the "
                "pre-cap z_y - E_p[z] (eq-cap-logprob)",
                lambda c: (None, (lambda z, p: z[c["y"]] - p @ z)(c["W_U"] @ c["x"], _probs(c)))),
        Mistake("the attributed value is the linearised l_y - E_p[l], not log p_y itself: the two differ by "
                "log sum exp(l) - E_p[l], which is not linear in x (eq-cap-logprob)",
                lambda c: (None, _probs(c).log()[c["y"]])),
    ],
)


def _probs(c):
    z = c["W_U"] @ c["x"]
    return (c["cap"] * torch.tanh(z / c["cap"])).softmax(-1)
