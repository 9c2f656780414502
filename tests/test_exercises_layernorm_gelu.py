"""Chapter layernorm-gelu's exercises: the mistakes learners make, written as a learner would, each failing with
its hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


def Phi(s):
    return 0.5 * (1 + torch.erf(s / math.sqrt(2)))


def gelu_prime(s):
    return Phi(s) + s * torch.exp(-s ** 2 / 2) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("answer, hint", [
    (([0.5, 1, -0.5, 0.5], 0, 2.5), "missing the centring"),  # r gamma t, the RMSNorm rule
    (([0.5, 0.25, -0.5, -0.25], 0, 2.5), "true gradient of LayerNorm"),
    (([0.25, 1.25, -1.75, 0.25], -6, 2.5), "missing the frozen scale"),
    (([0.125, 0.25, -0.875, 0.3125], -3, 2.5), "centred t before multiplying by gamma"),
    (([0.125, 0.625, -0.875, 0.125], -3, 0.75), "nothing multiplies it"),  # r gamma beta . t
    (([0.125, 0.625, -0.875, 0.125], -3, 1.25), "nothing multiplies it"),  # r beta . t
    (([0.125, 0.625, -0.875, 0.125], -3, 0), "a share of its own"),
])
def test_ln_by_hand_mistakes(answer, hint):
    verdict = check.ln_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def mlp(t, s, W_1, W_2, mu, coef):
    return mu * ((t @ W_2) * coef(s)) @ W_1


@pytest.mark.parametrize("fn, hint", [
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, mu_gate + mu_up, gelu_prime), "GELU'(s)"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, mu_gate + mu_up, F.gelu), "the activation GELU(s)"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, mu_gate + mu_up,
                                                lambda s: F.gelu(s, approximate="tanh") / s), "tanh approximation"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, mu_up, Phi), "only one path"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, mu_gate, Phi), "only one path"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, 1, Phi), "path weights are missing"),
    (lambda t, s, W_1, W_2, mu_gate, mu_up: mlp(t, s, W_1, W_2, 2, Phi), "path weights are missing"),
])
def test_gelu_mlp_path_mistakes(fn, hint):
    verdict = check.gelu_mlp_path(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def block(t, x, gamma, beta, W_1, b_1, W_2, b_2, mu_gate, mu_up, eps, centre=True, frozen=True, coef=Phi,
          shares=("beta", "b_1", "b_2"), mu_on_b1=True):
    mu = mu_gate + mu_up
    centred = x - x.mean(-1, keepdim=True)
    r = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    s = (r * gamma * centred + beta) @ W_1.T + b_1
    c = (t @ W_2) * coef(s)
    t_ln = mu * c @ W_1
    g = gamma * t_ln - (gamma * t_ln).mean(-1, keepdim=True) if centre else gamma * t_ln
    if not frozen:  # differentiates 1/sigma too: autograd through LayerNorm
        h = centred * r
        g = g - h * (h * gamma * t_ln).mean(-1, keepdim=True)
    share = {"beta": (beta * t_ln).sum(), "b_1": (mu if mu_on_b1 else 1) * (b_1 * c).sum(), "b_2": (b_2 * t).sum()}
    return r * g, sum(share[name] for name in shares)


@pytest.mark.parametrize("how, hint", [
    (dict(centre=False), "missing the LayerNorm's centring"),
    (dict(frozen=False), "differentiates the LayerNorm's 1/sigma"),
    (dict(coef=gelu_prime), "GELU'(s)"),
    (dict(shares=("b_1", "b_2")), "missing beta's part"),
    (dict(shares=("beta", "b_2")), "missing b_1's part"),
    (dict(mu_on_b1=False), "b_1's share is missing the path weights"),
    (dict(shares=("beta", "b_1")), "missing b_2's part"),
])
def test_ln_gelu_block_mistakes(how, hint):
    verdict = check.ln_gelu_block(lambda *args: block(*args, **how))
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_ln_gelu_block_true_layernorm_gradient():
    """Autograd through torch's own LayerNorm (the scale not frozen) is caught, as a learner might try it."""

    def through_layer_norm(t, x, gamma, beta, W_1, b_1, W_2, b_2, mu_gate, mu_up, eps):
        x = x.clone().requires_grad_(True)
        s = F.layer_norm(x, x.shape[-1:], gamma, beta, eps) @ W_1.T + b_1
        a = s * Phi(s).detach()
        ((mu_gate + mu_up) * ((a @ W_2.T) * t).sum()).backward()
        return x.grad, block(t, x.detach(), gamma, beta, W_1, b_1, W_2, b_2, mu_gate, mu_up, eps)[1]

    verdict = check.ln_gelu_block(through_layer_norm)
    assert verdict.status == "wrong" and "1/sigma" in verdict.message, verdict.message


def test_ln_gelu_block_without_eps_is_named():
    """eps = 1e-5 left out of sigma(x) moves the answer by about 1e-5 only: the known mistake names it."""
    verdict = check.ln_gelu_block(lambda *args: block(*args[:-1], 0.0))
    assert verdict.status == "wrong" and "eps is missing" in verdict.message, verdict.message
