"""Chapter circuits-as-graphs' exercises: the mistakes learners make, written as a learner would, each failing with
its hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# out_u = (1, -2, 0.5) at position 1: E(u -> target) = 0, E(u -> v1) = 1, E(u -> v2) = 2, S_u = 3
@pytest.mark.parametrize("answer, hint", [
    ((-3.5, 1, 2, -0.5), "reads t^(L) at the last position"),  # out_u . t^(L)[2]
    ((0, -1, 2, 1), "reads g_v1 at v1's position 2"),  # out_u . g_v1[2]
    ((0, -0.5, 0.5, 0), "add up g_v over every position"),  # out_u . (sum of the rows)
    ((0, 1, 2, 0), "only the edge into the target"),  # S_u = E(u -> target)
])
def test_circuit_out_flow_by_hand_mistakes(answer, hint):
    verdict = check.circuit_out_flow_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def pullback(G, h, gamma, r, W_Q, W_K, W_V, i, mu_q, mu_k, mu_v, use_alpha=True, norm=True, scale=True,
             subtract=True, query_everywhere=False):
    q, k, v = h @ W_Q.T, h @ W_K.T, h @ W_V.T
    a = q.shape[-1] ** -0.5 if scale else 1.0
    alpha = torch.zeros(len(h), dtype=h.dtype)
    alpha[: i + 1] = torch.softmax(k[: i + 1] @ q[i] * q.shape[-1] ** -0.5, -1)
    lam_v = v @ G
    delta = alpha * (lam_v - alpha @ lam_v) if subtract else alpha * lam_v
    reads = alpha if use_alpha else (torch.arange(len(h)) <= i).to(h.dtype)
    g = mu_v * reads[:, None] * (G @ W_V)
    if query_everywhere:
        g = g + mu_q * a * delta[:, None] * (k @ W_Q)
    else:
        g[i] += mu_q * a * (delta @ k) @ W_Q
    g = g + mu_k * a * delta[:, None] * (q[i] @ W_K)
    return g * gamma * r if norm else g


@pytest.mark.parametrize("kw, hint", [
    (dict(use_alpha=False), "value path is missing alpha_ij"),
    (dict(norm=False), "frozen norm is missing"),
    (dict(query_everywhere=True), "query path lands on every key position"),
    (dict(scale=False), "1/sqrt(D_h) is missing"),
    (dict(subtract=False), "missing the subtraction of G . z_i"),
])
def test_circuit_head_pullback_mistakes(kw, hint):
    verdict = check.circuit_head_pullback(lambda *args: pullback(*args, **kw))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


@pytest.mark.parametrize("weights, hint", [
    (lambda mu_q, mu_k, mu_v: (1.0, 1.0, 1.0), "path weights are missing"),
    (lambda mu_q, mu_k, mu_v: (mu_k, mu_q, mu_v), "mu_Q and mu_K are swapped"),
])
def test_circuit_head_pullback_weights(weights, hint):
    def fn(G, h, gamma, r, W_Q, W_K, W_V, i, mu_q, mu_k, mu_v):
        return pullback(G, h, gamma, r, W_Q, W_K, W_V, i, *weights(mu_q, mu_k, mu_v))

    verdict = check.circuit_head_pullback(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def in_gap(G, h, W_Q, W_K, W_V, i, mu_q, mu_k, mu_v, rule):
    q, k, v = h @ W_Q.T, h @ W_K.T, h @ W_V.T
    qk = k[: i + 1] @ q[i]
    s = qk / q.shape[-1] ** 0.5
    alpha = torch.softmax(s, -1)
    lam_v = v[: i + 1] @ G
    S = alpha @ lam_v
    delta = alpha * (lam_v - S)
    return rule(S, (delta * s).sum(), (delta * qk).sum(), mu_q, mu_k, mu_v)


@pytest.mark.parametrize("rule, hint", [
    (lambda S, taylor, unscaled, mu_q, mu_k, mu_v: (1 - mu_v) * S, "query and key paths pass something on too"),
    (lambda S, taylor, unscaled, mu_q, mu_k, mu_v: S - mu_v * S - taylor, "counts once per control path"),
    (lambda S, taylor, unscaled, mu_q, mu_k, mu_v: (mu_q + mu_k) * (S - taylor), "need not add up to 1"),
    (lambda S, taylor, unscaled, mu_q, mu_k, mu_v: mu_v * S + (mu_q + mu_k) * taylor, "that is the in-flow"),
    (lambda S, taylor, unscaled, mu_q, mu_k, mu_v: S - mu_v * S - (mu_q + mu_k) * unscaled, "include the 1/sqrt(D_h)"),
])
def test_circuit_head_in_gap_mistakes(rule, hint):
    verdict = check.circuit_head_in_gap(lambda *args: in_gap(*args, rule=rule))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message
