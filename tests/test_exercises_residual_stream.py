"""Chapter residual-stream-and-targets' exercises: the mistakes learners make, written as a learner would, each
failing with its hint (the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


# x^(1)_p = (1, 5, -1), gamma_f = (1, 5, 2), W_U[y] = (3, 0.6, -3): r_f = 1/3, t = (1, 1, -2), direct = (3, 6, -1)
@pytest.mark.parametrize("answer, hint", [
    ((0.33, [1, 0.2, -1], [1.4, 3.2, -1.6]), "missing the final norm's weight"),  # t = W_U[y] * r_f
    ((0.33, [3, 3, -6], [9, 18, -3]), "missing the final norm's scale r_f"),  # t = W_U[y] * gamma_f
    ((0.19, [0.58, 0.58, -1.15], [1.73, 3.46, -0.58]), "sum of squares"),  # r_f = 27 ** -0.5
    ((3, [9, 9, -18], [27, 54, -9]), "root mean square itself"),
    ((0.33, [1, 1, -2], [4.2, 9.6, -4.8]), "dotted with W_U[y]"),
])
def test_dla_by_hand_mistakes(answer, hint):
    verdict = check.dla_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def rms(x, eps):
    return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def at_last(x_L, row):
    t = torch.zeros_like(x_L)
    t[-1] = row
    return t


def everywhere(x_L, W_U, y, gamma_f, eps):
    return W_U[y] * gamma_f * rms(x_L, eps)  # every position gets the token's direction


def through_autograd(x_L, W_U, y, gamma_f, eps):
    x = x_L.clone().requires_grad_(True)
    logits = (gamma_f * x * rms(x, eps)) @ W_U.T  # the norm as the model computes it, r not frozen
    logits[-1, y].backward()
    return x.grad


@pytest.mark.parametrize("fn, hint", [
    (lambda x_L, W_U, y, gamma_f, eps: at_last(x_L, W_U[y] * rms(x_L[-1], eps)), "weight is missing"),
    (lambda x_L, W_U, y, gamma_f, eps: at_last(x_L, W_U[y] * gamma_f), "scale r_f is missing"),
    (everywhere, "at every position"),
    (lambda x_L, W_U, y, gamma_f, eps: (W_U[y] * gamma_f * rms(x_L[-1], eps)).expand_as(x_L).clone(),
     "at every position"),
    (lambda x_L, W_U, y, gamma_f, eps: torch.cat([(W_U[y] * gamma_f * rms(x_L[0], eps))[None],
                                                  torch.zeros_like(x_L[1:])]), "position 0"),
    (lambda x_L, W_U, y, gamma_f, eps: at_last(x_L, W_U[y] * gamma_f * (x_L.pow(2).mean() + eps).rsqrt()),
     "whole sequence"),
    (through_autograd, "differentiates r_f"),
    (lambda x_L, W_U, y, gamma_f, eps: at_last(x_L, W_U[y] * gamma_f * x_L[-1].pow(2).mean().rsqrt()),
     "eps is missing"),
])
def test_initial_target_mistakes(fn, hint):
    verdict = check.initial_target(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def walk(t_L, layers, residual=True, glu_first=True, top_down=True, attn_reads_mid=True):
    targets, t = [t_L], t_L
    for g_mhsa, g_glu in (reversed(layers) if top_down else layers):
        first, second = (g_glu, g_mhsa) if glu_first else (g_mhsa, g_glu)
        t_mid = (t if residual else 0) + first(t)
        t = (t_mid if residual else 0) + second(t_mid if attn_reads_mid else t)
        targets.insert(0, t)
    return targets


@pytest.mark.parametrize("fn, hint", [
    (lambda t_L, layers: walk(t_L, layers, residual=False), "residual connection is missing"),
    (lambda t_L, layers: walk(t_L, layers, glu_first=False), "GLU comes after attention"),
    (lambda t_L, layers: walk(t_L, layers, top_down=False), "bottom-up"),
    (lambda t_L, layers: walk(t_L, layers, attn_reads_mid=False), "reads t_mid"),
    (lambda t_L, layers: walk(t_L, layers)[::-1], "wrong order"),
    (lambda t_L, layers: walk(t_L, layers)[1:], "return 3 things"),  # t^(L) left out
])
def test_effective_targets_mistakes(fn, hint):
    verdict = check.effective_targets(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_a_stacked_tensor_is_accepted_too():
    assert check.effective_targets(lambda t_L, layers: torch.stack(walk(t_L, layers)))
