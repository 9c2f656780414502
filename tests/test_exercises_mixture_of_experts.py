"""Chapter mixture-of-experts' exercises: the mistakes learners make, written as a learner would, each failing with
its hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


TOPK = [0.75, -0.75, 0.0]
ALL = [20 / 27, -52 / 81, -8 / 81]


@pytest.mark.parametrize("answer, hint", [
    (([20 / 27, -52 / 81, 0], ALL), "unnormalised p"),  # p = (2/3, 2/9) in the top-k formula
    ((ALL, TOPK), "swapped"),
    ((TOPK, [20 / 27, -52 / 81, 1 / 9 * (5 - 8 / 9)]), "its own lambda . E does not enter"),
    ((TOPK, [20 / 27, -52 / 81, 0]), "every logit moves every weight"),
    ((TOPK, [2 / 3 * (2 - 1), 2 / 9 * (-2 - 1), 1 / 9 * (0 - 1)]), "not renormalised"),  # w in the sum
])
def test_moe_by_hand_mistakes(answer, hint):
    verdict = check.moe_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def routing(logits, k, norm_topk_prob):
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(k, dim=-1).indices, True)
    if norm_topk_prob:
        return logits.masked_fill(~chosen, float("-inf")).softmax(-1), chosen
    return logits.softmax(-1) * chosen, chosen


def router_path(lam, E, x, W_r, k, norm_topk_prob, always=None, indicator=True, left_out=True, over="chosen",
                renormalised_mean=False):
    logits = x @ W_r.T
    norm = norm_topk_prob if always is None else always
    chosen = routing(logits, k, False)[1]
    lam_E = (lam[:, None, :] * E).sum(-1)
    if norm:
        w = routing(logits, k, True)[0]
        delta = w * (lam_E - (w * lam_E).sum(-1, keepdim=True))
    else:
        p = logits.softmax(-1)
        weights = routing(logits, k, True)[0] if renormalised_mean else p
        mean = (weights * lam_E * (chosen if over == "chosen" else 1)).sum(-1, keepdim=True)
        delta = p * ((chosen if indicator else 1) * lam_E - mean)
        if not left_out:
            delta = delta * chosen
    return delta @ W_r


@pytest.mark.parametrize("how, hint", [
    (dict(always=True), "the other router"),  # norm_topk_prob ignored
    (dict(always=False), "the other router"),
    (dict(indicator=False), "its own lambda . E does not enter"),
    (dict(left_out=False), "the experts left out receive"),
    (dict(over="all"), "the chosen experts only"),
    (dict(renormalised_mean=True), "not renormalised"),
])
def test_moe_router_path_mistakes(how, hint):
    verdict = check.moe_router_path(lambda *args: router_path(*args, **how))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def experts_path(lam, x, W_r, W_g, W_u, W_d, k, norm_topk_prob, mu_gate, mu_up, router=False, other=False,
                 g_weighted=True, S_weighted=True, every=False, gate_coef=torch.sigmoid, mus=True):
    logits = x @ W_r.T
    w = routing(logits, k, norm_topk_prob != other)[0]
    if not mus:
        mu_gate = mu_up = 1.0
    g, S, E = torch.zeros_like(x), torch.zeros(W_r.shape[0], dtype=x.dtype), []
    for e in range(W_r.shape[0]):
        s, u = x @ W_g[e].T, x @ W_u[e].T
        lam_e = lam @ W_d[e]
        g_e = mu_up * (lam_e * F.silu(s)) @ W_u[e] + mu_gate * (lam_e * gate_coef(s) * u) @ W_g[e]
        g += (w[:, e, None] if g_weighted else (w[:, e, None] > 0)) * g_e
        weight = logits.softmax(-1)[:, e] if every else w[:, e] if S_weighted else (w[:, e] > 0).double()
        S[e] = (weight * (lam_e * F.silu(s) * u).sum(-1)).sum()
        E.append((F.silu(s) * u) @ W_d[e].T)
    if router:  # the router's delta added in
        g = g + router_path(lam, torch.stack(E, 1), x, W_r, k, norm_topk_prob)
    return g, S


def silu_prime(s):
    sig = torch.sigmoid(s)
    return sig * (1 + s * (1 - sig))


@pytest.mark.parametrize("how, hint", [
    (dict(router=True), "includes the router's delta"),
    (dict(other=True), "those of the other router"),
    (dict(g_weighted=False), "pull-back is missing its routing weight"),
    (dict(S_weighted=False), "score is missing its routing weight"),
    (dict(every=True), "experts left out a share"),
    (dict(gate_coef=silu_prime), "SiLU'(s)"),
    (dict(mus=False), "gate and up path weights are missing"),
])
def test_moe_experts_path_mistakes(how, hint):
    verdict = check.moe_experts_path(lambda *args: experts_path(*args, **how))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_moe_paths_a_k_written_in_as_two_fails():
    """The cases take k = 2 and k = 3 with each router: the learner's function must use its k."""
    assert check.moe_router_path(lambda lam, E, x, W_r, k, norm: router_path(lam, E, x, W_r, 2, norm)).status == \
        "wrong"
    assert check.moe_experts_path(lambda *args: experts_path(*args[:6], 2, *args[7:])).status == "wrong"
    assert check.moe_router_path(router_path) and check.moe_experts_path(experts_path)
