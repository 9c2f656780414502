"""Chapter softmax-taylor's exercises: the mistakes learners make, written as a learner would, each failing with its
hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# alpha = (1/2, 1/4, 1/4), lambda . v = (2, -2, 4): lambda . z = 1.5, delta = (0.25, -0.875, 0.625), first order 0.17
@pytest.mark.parametrize("answer, hint", [
    ((1.5, [1.0, -0.5, 1.0], 0.35), "missing the subtraction of lambda . z"),  # alpha * lambda . v
    ((1.5, [0.5, -3.5, 2.5], 0.35), "missing the factor alpha_ij"),
    ((1.5, [0.5, -0.375, 0.75], 0.35), "only the diagonal of the softmax Jacobian"),  # alpha (1 - alpha) lambda . v
    ((1.33, [0.25, -0.875, 0.625], 0.17), "plain mean"),  # (2 - 2 + 4) / 3
    ((1.5, [0.25, -0.875, 0.625], 1.5), "not the head's output"),  # assumed the control paths complete
    ((1.5, [0.25, -0.875, 0.625], 0.0), "sum_j delta_j alone is zero"),
])
def test_attn_delta_by_hand_mistakes(answer, hint):
    verdict = check.attn_delta_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def no_mask(s, v, lam):
    alpha = torch.softmax(s, -1)  # every key, the later ones too
    lam_v = lam @ v.transpose(-1, -2)
    return alpha * (lam_v - (alpha * lam_v).sum(-1, keepdim=True))


def mask_after(s, v, lam):
    alpha = torch.softmax(s, -1) * causal(s.shape[-1])  # zeroed after the softmax: rows no longer add up to 1
    lam_v = lam @ v.transpose(-1, -2)
    return alpha * (lam_v - (alpha * lam_v).sum(-1, keepdim=True))


def no_subtraction(s, v, lam):
    alpha = torch.softmax(s.masked_fill(~causal(s.shape[-1]), float("-inf")), -1)
    return alpha * (lam @ v.transpose(-1, -2))


def swapped_indices(s, v, lam):
    alpha = torch.softmax(s.masked_fill(~causal(s.shape[-1]), float("-inf")), -1)
    lam_v = v @ lam.transpose(-1, -2)  # lambda_j . v_i
    return alpha * (lam_v - (alpha * lam_v).sum(-1, keepdim=True))


def diagonal_only(s, v, lam):
    alpha = torch.softmax(s.masked_fill(~causal(s.shape[-1]), float("-inf")), -1)
    return alpha * (1 - alpha) * (lam @ v.transpose(-1, -2))


def scaled_twice(s, v, lam):
    s = s / v.shape[-1] ** 0.5
    alpha = torch.softmax(s.masked_fill(~causal(s.shape[-1]), float("-inf")), -1)
    lam_v = lam @ v.transpose(-1, -2)
    return alpha * (lam_v - (alpha * lam_v).sum(-1, keepdim=True))


@pytest.mark.parametrize("fn, hint", [
    (no_mask, "causal mask is missing"),
    (mask_after, "applied after the softmax"),
    (no_subtraction, "missing the subtraction of lambda . z"),
    (swapped_indices, "indices swapped"),
    (diagonal_only, "only the diagonal"),
    (scaled_twice, "divided by sqrt(D_h) twice"),
])
def test_attn_delta_mistakes(fn, hint):
    verdict = check.attn_delta(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def join(y):
    return y.transpose(0, 1).flatten(1)


def paths(delta, q, k, W_Q, W_K, scale=True, dq=None, dk=None, for_q=None, for_k=None, joiner=join):
    a = q.shape[-1] ** -0.5 if scale else 1.0
    dq = delta if dq is None else dq
    dk = delta.transpose(-1, -2) if dk is None else dk
    for_q, for_k = (k if for_q is None else for_q), (q if for_k is None else for_k)
    return joiner(dq @ for_q * a) @ W_Q, joiner(dk @ for_k * a) @ W_K


@pytest.mark.parametrize("fn, hint", [
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K, scale=False), "1/sqrt(D_h) is missing"),
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K, dk=delta), "g_K sums over the wrong index"),
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K, dq=delta.transpose(-1, -2)),
     "g_Q sums over the wrong index"),
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K, for_q=q, for_k=k), "carries the keys"),
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K, joiner=lambda y: y.reshape(y.shape[1], -1)),
     "joined in the wrong order"),
    (lambda delta, q, k, W_Q, W_K: paths(delta, q, k, W_Q, W_K)[::-1], "swapped"),
])
def test_attn_query_key_mistakes(fn, hint):
    verdict = check.attn_query_key(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message
