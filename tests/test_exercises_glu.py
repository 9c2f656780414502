"""Chapter glu's exercises: the mistakes learners make, written as a learner would, each failing with its hint
(the reference solutions are the book's own, tests/test_exercises.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from dpa.exercises import check


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")


def silu_prime(s):
    sig = torch.sigmoid(s)
    return sig * (1 + s * (1 - sig))


@pytest.mark.parametrize("answer, hint", [
    (([0, -1.76, -0.72], [1, -1.09, -0.27]), "SiLU'(s)"),  # SiLU'(2) = 1.09, SiLU'(-2) = -0.09
    (([0, -1.76, -0.72], [0, -1.76, -0.72]), "SiLU(s) where the gate path has sigma(s)"),
    (([0, -1.76, -0.72], [1, -0.88, 0.12]), "missing the content u"),
    (([0, 1.76, -0.72], [1, -0.88, 0.36]), "missing lambda"),
])
def test_glu_by_hand_mistakes(answer, hint):
    verdict = check.glu_by_hand(answer)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def gate_with_silu_prime(t, s, u, W_G, W_U, W_D):
    lam = t @ W_D
    return (lam * F.silu(s)) @ W_U, (lam * silu_prime(s) * u) @ W_G  # autograd's derivative, not DPA's


def gate_without_sigma(t, s, u, W_G, W_U, W_D):
    lam = t @ W_D
    return (lam * F.silu(s)) @ W_U, (lam * u) @ W_G


def up_through_s(t, s, u, W_G, W_U, W_D):
    lam = t @ W_D
    return (lam * s) @ W_U, (lam * torch.sigmoid(s) * u) @ W_G


def swapped(t, s, u, W_G, W_U, W_D):
    lam = t @ W_D
    return (lam * torch.sigmoid(s) * u) @ W_G, (lam * F.silu(s)) @ W_U


@pytest.mark.parametrize("fn, hint", [
    (gate_with_silu_prime, "true gradient"),
    (gate_without_sigma, "missing the sigma(s) factor"),
    (up_through_s, "multiplies by s instead of the frozen activation"),
    (swapped, "swapped"),
])
def test_glu_paths_mistakes(fn, hint):
    verdict = check.glu_paths(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def rule(t, s, u, W_G, W_U, W_D, gamma, r, mu_up, mu_gate, gate_coef=torch.sigmoid):
    lam = t @ W_D
    return (mu_up * (lam * F.silu(s)) @ W_U + mu_gate * (lam * gate_coef(s) * u) @ W_G) * gamma * r


@pytest.mark.parametrize("fn, hint", [
    (lambda t, s, u, W_G, W_U, W_D, gamma, r, mu_up, mu_gate: rule(t, s, u, W_G, W_U, W_D, gamma, r, 1, 1),
     "path weights are missing"),
    (lambda t, s, u, W_G, W_U, W_D, gamma, r, mu_up, mu_gate: rule(t, s, u, W_G, W_U, W_D, gamma, r, mu_gate, mu_up),
     "swapped"),
    (lambda t, s, u, W_G, W_U, W_D, gamma, r, mu_up, mu_gate: rule(t, s, u, W_G, W_U, W_D, 1, 1, mu_up, mu_gate),
     "frozen norm is missing"),
    (lambda *a: rule(*a, gate_coef=silu_prime), "SiLU'(s)"),
])
def test_propagate_glu_mistakes(fn, hint):
    verdict = check.propagate_glu(fn)
    assert verdict.status == "wrong" and hint in verdict.message, verdict.message


def test_glu_by_hand_parts_swapped_are_named_so_not_a_gate_mistake():
    """(c_gate, S) for (S, c_gate): the second part is S, which the gate mistake "SiLU(s) where sigma(s)" also
    gives; the answer is two right parts in the wrong places."""
    verdict = check.glu_by_hand(([1, -0.88, 0.36], [0, -1.76, -0.72]))
    assert verdict.hint == "order" and "SiLU(s) where" not in verdict.message, verdict.message


def test_glu_by_hand_as_two_arguments():
    assert check.glu_by_hand([0, -1.76, -0.72], [1, -0.88, 0.36])


def test_glu_paths_a_wrong_gate_path_cites_the_gate_equation():
    from dpa.exercises._core import equation_numbers

    def gate_with_tanh(t, s, u, W_G, W_U, W_D):
        lam = t @ W_D
        return (lam * F.silu(s)) @ W_U, (lam * torch.tanh(s) * u) @ W_G

    verdict = check.glu_paths(gate_with_tanh)
    gate = equation_numbers()["eq-glu-gate"][1]
    assert verdict.status == "wrong" and f"re-read equation ({gate})" in verdict.message, verdict.message


def test_glu_paths_a_known_gate_mistake_with_a_wrong_up_path_says_both():
    def both_wrong(t, s, u, W_G, W_U, W_D):
        lam = t @ W_D
        return (lam * torch.relu(s)) @ W_U, (lam * F.silu(s) * u) @ W_G

    verdict = check.glu_paths(both_wrong)
    assert "SiLU(s) where it needs sigma(s)" in verdict.message and "g_up is wrong too" in verdict.message
