"""Chapter rmsnorm's exercises: the mistakes learners make, written as a learner would, each failing with its hint
(the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# x = (1, -1, 5), gamma = (3, 3, 0.6), t = (2, -1, 1), eps = 0: r = 1/3, norm = (1, -1, 1), N^T t = (2, -1, 0.2),
# the true gradient (1.85, -0.85, -0.54)
@pytest.mark.parametrize("answer, hint", [
    ((0.19, [0.58, -0.58, 0.58], [1.15, -0.58, 0.12], [1.13, -0.55, -0.03]), "sum of squares"),  # r = 27 ** -0.5
    ((1 / 9, [1 / 3, -1 / 3, 1 / 3], [2 / 3, -1 / 3, 0.2 / 3], [0.66, -0.33, 0.04]), "missing its square root"),
    ((3, [9, -9, 9], [18, -9, 1.8], [-90, 99, -538.2]), "root mean square itself"),
    ((1 / 3, [1, -1, 1], [0.67, -0.33, 0.33], [1.85, -0.85, -0.54]), "missing gamma"),
    ((1 / 3, [1, -1, 1], [1.85, -0.85, -0.54], [1.85, -0.85, -0.54]), "pulled-back target is the true gradient"),
    ((1 / 3, [1, -1, 1], [2, -1, 0.2], [2, -1, 0.2]), "your true gradient is the frozen pull-back"),
    ((1 / 3, [1, -1, 1], [2, -1, 0.2], [1.56, -0.56, -2.02]), "missing its 1/d"),  # 12/27 instead of 12/81
    ((1 / 3, [1, -1, 1], [2, -1, 0.2], [1.90, -0.90, -0.29]), "dots x with t"),  # x . t = 8
])
def test_rms_by_hand_mistakes(answer, hint):
    verdict = check.rms_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def rms(x, eps):
    return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def true_gradient(t, x, gamma, eps):
    x = x.clone().requires_grad_(True)
    (t * gamma * x * rms(x, eps)).sum().backward()  # r(x) not detached
    return x.grad


@pytest.mark.parametrize("fn, hint", [
    (true_gradient, "differentiates r(x)"),
    (lambda t, x, gamma, eps: t * rms(x, eps), "gamma is missing"),
    (lambda t, x, gamma, eps: gamma * t * (x.pow(2).sum(-1, keepdim=True) + eps).rsqrt(), "sum of squares"),
    (lambda t, x, gamma, eps: gamma * t / (x.pow(2).mean(-1, keepdim=True) + eps), "missing its square root"),
    (lambda t, x, gamma, eps: gamma * t * x.pow(2).mean(-1, keepdim=True).rsqrt(), "eps is missing"),
    (lambda t, x, gamma, eps: gamma * t * (x.pow(2).mean() + eps).rsqrt(), "one number for the whole sequence"),
    (lambda t, x, gamma, eps: gamma * t * (x.pow(2).mean(-1, keepdim=True) + eps).sqrt(), "you divide by r"),
])
def test_norm_pullback_mistakes(fn, hint):
    verdict = check.norm_pullback(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def jacobian(t, x, gamma, eps, d=None, dot=None, power=3, sign=-1):
    r, g = rms(x, eps), gamma * t
    d = x.shape[-1] if d is None else d
    xg = (x * g).sum(-1, keepdim=True) if dot is None else dot(x, t, g)
    return r * g + sign * r**power / d * xg * x


@pytest.mark.parametrize("fn, hint", [
    (lambda t, x, gamma, eps: gamma * t * rms(x, eps), "that is the frozen pull-back"),
    (lambda t, x, gamma, eps: jacobian(t, x, gamma, eps, d=1), "missing its 1/d"),
    (lambda t, x, gamma, eps: jacobian(t, x, gamma, eps, dot=lambda x, t, g: (x * t).sum(-1, keepdim=True)),
     "dots x with t"),
    (lambda t, x, gamma, eps: jacobian(t, x, gamma, eps, power=1), "needs r^3"),
    (lambda t, x, gamma, eps: jacobian(t, x, gamma, eps, sign=1), "it is subtracted"),
    (lambda t, x, gamma, eps: jacobian(t, x, gamma, eps, dot=lambda x, t, g: (x * g).sum()),
     "sums over every position"),
])
def test_norm_jacobian_mistakes(fn, hint):
    verdict = check.norm_jacobian(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_the_frozen_pullback_and_the_jacobian_differ_only_along_x():
    """The two implement exercises' references, from autograd: (eq-norm-euler) on the checker's own kind of case."""
    t, x, gamma, eps = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64), \
        1 + 0.5 * torch.randn(6, dtype=torch.float64), 0.05
    assert check.norm_jacobian(true_gradient)
    value = (t * gamma * x * rms(x, eps)).sum(-1)
    torch.testing.assert_close((true_gradient(t, x, gamma, eps) * x).sum(-1), eps * rms(x, eps)[:, 0] ** 2 * value)
