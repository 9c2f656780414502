"""Chapter soft-capping's exercises: the mistakes learners make, written as a learner would, each failing with its
hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


ALPHA = [0.2447, 0.6652, 0.0900]  # softmax(0, 1, -1)
DELTA_HAT = [-0.1187, 0.3425, -0.2237]


@pytest.mark.parametrize("answer, hint", [
    (([3 / 13, 9 / 13, 1 / 13], [-0.1187, 0.2569, -0.1678]), "softmax of the capped scores"),  # softmax(s)
    ((ALPHA, DELTA_HAT), "your delta is delta_hat"),
    ((ALPHA, [d * f for d, f in zip(DELTA_HAT, (1, 0.6983, 0.6983))]), "not 1 - s^2/c^2"),  # 1 - (ln 3 / 2)^2
    ((ALPHA, [d * f for d, f in zip(DELTA_HAT, (1, 0.9102, 0.9102))]), "ratio s_hat/s"),  # 1 / ln 3
    ((ALPHA, [-0.4852, 0.5148 * 0.75, -2.4852 * 0.75]), "missing its alpha"),
])
def test_cap_by_hand_mistakes(answer, hint):
    verdict = check.cap_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def head_paths(lam, q, k, v, tau, cap, slope="derivative", capped=True, masked=True, transpose=True):
    T = q.shape[0]
    s = tau * q @ k.T
    s_hat = cap * torch.tanh(s / cap) if capped else s
    scores = s_hat.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")) if masked else s_hat
    alpha = scores.softmax(-1)
    z = alpha @ v
    delta = alpha * (lam @ v.T - (lam * z).sum(-1, keepdim=True))
    if capped:
        delta = delta * {"derivative": 1 - (s_hat / cap) ** 2, "none": 1, "of s": 1 - (s / cap) ** 2,
                         "ratio": s_hat / s}[slope]
    return tau * delta @ k, tau * (delta.T if transpose else delta) @ q


@pytest.mark.parametrize("how, hint", [
    (dict(slope="none"), "the cap's derivative is missing"),
    (dict(slope="of s"), "not 1 - s^2/c^2"),
    (dict(slope="ratio"), "ratio s_hat/s"),
    (dict(capped=False), "your head has no cap"),
    (dict(masked=False), "causal mask is missing"),
    (dict(transpose=False), "g_k sums over the queries"),
])
def test_capped_qk_paths_mistakes(how, hint):
    verdict = check.capped_qk_paths(lambda *args: head_paths(*args, **how))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def logprob(W_U, x, y, cap, factor="ratio", p_of="capped", expectation=True, value_of="capped"):
    z = W_U @ x
    logits = cap * torch.tanh(z / cap)
    rho = {"ratio": logits / z, "derivative": 1 - (logits / cap) ** 2, "none": torch.ones_like(z)}[factor]
    p = (logits if p_of == "capped" else z).softmax(-1)
    if not expectation:
        p = torch.zeros_like(p)
    u = rho[y] * W_U[y] - (p * rho) @ W_U
    value = {"capped": logits[y] - p @ logits, "pre-cap": z[y] - p @ z,
             "log p": torch.log_softmax(logits, -1)[y]}[value_of]
    return u, value


@pytest.mark.parametrize("how, hint", [
    (dict(factor="derivative"), "cap's derivative 1 - l^2/c^2"),
    (dict(factor="none"), "ignores the cap"),
    (dict(expectation=False), "expectation is missing"),
    (dict(p_of="pre-cap"), "softmax of the capped logits"),
    (dict(value_of="pre-cap"), "pre-cap z_y - E_p[z]"),
    (dict(value_of="log p"), "not log p_y itself"),
])
def test_capped_logprob_mistakes(how, hint):
    verdict = check.capped_logprob(lambda *args: logprob(*args, **how))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_capped_logprob_true_gradient_by_autograd():
    """A learner who lets autograd differentiate the cap (p held fixed) gets the true gradient: caught."""

    def by_autograd(W_U, x, y, cap):
        x = x.clone().requires_grad_(True)
        logits = cap * torch.tanh(W_U @ x / cap)
        value = logits[y] - logits.softmax(-1).detach() @ logits
        value.backward()
        return x.grad, value.detach()

    verdict = check.capped_logprob(by_autograd)
    assert verdict.status == "wrong" and "true gradient" in verdict.message, verdict.message
