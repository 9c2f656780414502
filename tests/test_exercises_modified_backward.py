"""Chapter modified-backward's exercises: the mistakes learners make, written as a learner would, each failing with
its hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# s = 2, u = 3, mu = 1/2: the model (3.27, 1.76), the linearised model (1.32, 0.88)
@pytest.mark.parametrize("answer, hint", [
    (([2.64, 1.76], [1.32, 0.88]), "treats sigma(s) as a constant"),  # sigma(s) u in the model too
    (([1.09, 1.76], [1.32, 0.88]), "missing u"),  # SiLU'(2) alone
    (([3.27, 1.76], [1.64, 0.88]), "uses SiLU'(s)"),  # 0.5 * 1.0908 * 3
    (([3.27, 1.76], [2.64, 1.76]), "path weights are missing"),
    (([3.27, 1.76], [0.88, 1.32]), "swapped"),
])
def test_linearised_by_hand_mistakes(answer, hint):
    verdict = check.linearised_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


@pytest.mark.parametrize("fn, hint", [
    (lambda x, mu: mu * x, "scales the forward value too"),
    (lambda x, mu: mu * x.detach() + (1 - mu) * x, "wrong terms"),
    (lambda x, mu: mu * x + (1 - mu) * x, "nothing is detached"),
    (lambda x, mu: x.detach(), "no gradient reaches x"),
    (lambda x, mu: (mu * x).detach() + (1 - mu) * x.detach(), "no gradient reaches x"),
])
def test_scale_grad_mistakes(fn, hint):
    verdict = check.scale_grad(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


@pytest.mark.parametrize("fn, hint", [
    (F.silu, "SiLU'(s), the model's own"),
    (lambda s: s * torch.sigmoid(s), "SiLU'(s), the model's own"),
    (lambda s: s.detach() * torch.sigmoid(s), "detached the wrong factor"),
    (lambda s: F.silu(s).detach(), "no gradient reaches s"),
    (lambda s: torch.sigmoid(s).detach(), "the value is sigma(s)"),
])
def test_linear_silu_mistakes(fn, hint):
    verdict = check.linear_silu(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def block(x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up, freeze=True, act=None, branch=None):
    r = ((x.detach() if freeze else x).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    h = gamma * x * r
    branch = branch or (lambda h, mu: mu * h + (1 - mu) * h.detach())
    s, u = branch(h, mu_gate) @ W_G.T, branch(h, mu_up) @ W_U.T
    act = act or (lambda s: s * torch.sigmoid(s).detach())
    return (act(s) * u) @ W_D.T


@pytest.mark.parametrize("kw, hint", [
    ({"freeze": False}, "scale is not frozen"),
    ({"act": F.silu}, "SiLU is not linearised"),
    ({"act": lambda s: s.detach() * torch.sigmoid(s)}, "wrong factor of SiLU"),
    ({"branch": lambda h, mu: h}, "path weights are missing"),
    ({"branch": lambda h, mu: mu * h}, "scale the forward value too"),
])
def test_linearised_glu_mistakes(kw, hint):
    verdict = check.linearised_glu(lambda *args: block(*args, **kw))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_linearised_glu_swapped_weights():
    verdict = check.linearised_glu(lambda x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up:
                                   block(x, gamma, eps, W_G, W_U, W_D, mu_up, mu_gate))
    assert verdict.status == "wrong" and "swapped" in verdict.message, verdict.message


def test_the_branch_may_sit_after_the_projection():
    """mu on the projection's output (where the chapter's hooks put it) is the same backward: it passes."""
    def after(x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up):
        h = gamma * x * (x.detach().pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        s, u = h @ W_G.T, h @ W_U.T
        s, u = mu_gate * s + (1 - mu_gate) * s.detach(), mu_up * u + (1 - mu_up) * u.detach()
        return (s * torch.sigmoid(s).detach() * u) @ W_D.T

    assert check.linearised_glu(after)


def test_linearised_glu_without_eps_is_named():
    """eps = 1e-6 left out of r moves the answer by about 1e-6 only: the known mistake names it, not "float32"."""
    def block(x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up):
        h = gamma * x * x.detach().pow(2).mean(-1, keepdim=True).rsqrt()
        s, u = (mu_gate * h + (1 - mu_gate) * h.detach()) @ W_G.T, (mu_up * h + (1 - mu_up) * h.detach()) @ W_U.T
        return (s * torch.sigmoid(s).detach() * u) @ W_D.T

    verdict = check.linearised_glu(block)
    assert verdict.status == "wrong" and "eps is missing" in verdict.message, verdict.message
