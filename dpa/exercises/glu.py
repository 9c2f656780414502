"""Exercises of chapter glu: the content (up) and control (gate) paths of a SwiGLU block."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ._core import Exercise, Mistake, randn, vjp

CHAPTER = "glu"


# -- 1. by hand: three neurons ------------------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    f64 = {"dtype": torch.float64}
    return {"s": torch.tensor([0.0, 2.0, -2.0], **f64), "u": torch.tensor([1.0, 1.0, 3.0], **f64),
            "lam": torch.tensor([2.0, -1.0, 1.0], **f64)}


def _silu_prime(s):
    sig = torch.sigmoid(s)
    return sig * (1 + s * (1 - sig))


Exercise(
    "glu_by_hand", CHAPTER, "eq-glu-gate", cases=_hand_case, n_cases=1, rtol=0, atol=5e-3,
    parts=("the neuron scores S", "the gate coefficients c_gate"),
    part_equations=("eq-glu-lambda", "eq-glu-gate"),
    oracle=lambda c: (c["lam"] * F.silu(c["s"]) * c["u"], c["lam"] * torch.sigmoid(c["s"]) * c["u"]),
    mistakes=[
        Mistake("c_gate uses the derivative SiLU'(s) -- that is the true gradient's coefficient (eq-glu-grad); "
                "DPA's gate path freezes sigma(s): c_gate = lambda sigma(s) u (eq-glu-gate)",
                lambda c: (None, c["lam"] * _silu_prime(c["s"]) * c["u"])),
        Mistake("c_gate uses SiLU(s) where the gate path has sigma(s) = SiLU(s)/s (eq-glu-silu-over-s)",
                lambda c: (None, c["lam"] * F.silu(c["s"]) * c["u"])),
        Mistake("c_gate is missing the content u: the gate path freezes u too, c_gate = lambda sigma(s) u "
                "(eq-glu-gate)", lambda c: (None, c["lam"] * torch.sigmoid(c["s"]))),
        Mistake("the scores are missing lambda: a neuron's score is its activation times lambda = t W_D, "
                "S = a lambda (eq-glu-lambda)", lambda c: (F.silu(c["s"]) * c["u"], None)),
        Mistake("sigma(0) is 1/2, and SiLU(0) = 0: the first neuron scores 0 but passes lambda u / 2 to its gate "
                "(eq-glu-silu-over-s)",
                lambda c: (None, c["lam"] * torch.sigmoid(c["s"]) * c["u"] * torch.tensor([0.0, 1, 1]).double())),
    ],
)


# -- 2. implement: the two paths ----------------------------------------------------------------------------------
def _glu_case(gen: torch.Generator) -> dict:
    pos, d, d_mlp = 4, 6, 10
    return dict(t=randn(gen, pos, d), x=randn(gen, pos, d), W_G=randn(gen, d_mlp, d, scale=d**-0.5),
                W_U=randn(gen, d_mlp, d, scale=d**-0.5), W_D=randn(gen, d, d_mlp, scale=d_mlp**-0.5))


def _su(c):
    return c["x"] @ c["W_G"].T, c["x"] @ c["W_U"].T


def _paths_oracle(c):
    """autograd through the block with SiLU(s) frozen (up path) and with sigma(s), u frozen (gate path)."""
    s, u = _su(c)
    up = vjp(lambda x: (F.silu(s) * (x @ c["W_U"].T)) @ c["W_D"].T, c["x"], c["t"])
    gate = vjp(lambda x: ((x @ c["W_G"].T) * torch.sigmoid(s) * u) @ c["W_D"].T, c["x"], c["t"])
    return up, gate


def _paths_call(fn, c):
    s, u = _su(c)
    return fn(c["t"], s, u, c["W_G"], c["W_U"], c["W_D"])


def _lam(c):
    return c["t"] @ c["W_D"]


Exercise(
    "glu_paths", CHAPTER, "eq-glu-up", cases=_glu_case, oracle=_paths_oracle, call=_paths_call,
    signature="glu_paths(t, s, u, W_G, W_U, W_D) -> (g_up, g_gate)", parts=("g_up", "g_gate"),
    part_equations=("eq-glu-up", "eq-glu-gate"),
    mistakes=[
        Mistake("your gate path uses the derivative SiLU'(s): that is the true gradient (eq-glu-grad); DPA's "
                "gate path freezes sigma(s) and u, c_gate = lambda sigma(s) u (eq-glu-gate)",
                lambda c: (None, (_lam(c) * _silu_prime(_su(c)[0]) * _su(c)[1]) @ c["W_G"])),
        Mistake("your gate path is missing the sigma(s) factor: freeze sigma(s) and u, c_gate = lambda sigma(s) u, "
                "see equation (eq-glu-gate)", lambda c: (None, (_lam(c) * _su(c)[1]) @ c["W_G"])),
        Mistake("your gate path has SiLU(s) where it needs sigma(s) = SiLU(s)/s (eq-glu-silu-over-s)",
                lambda c: (None, (_lam(c) * F.silu(_su(c)[0]) * _su(c)[1]) @ c["W_G"])),
        Mistake("your up path multiplies by s instead of the frozen activation SiLU(s): c_up = lambda SiLU(s) "
                "(eq-glu-up)", lambda c: ((_lam(c) * _su(c)[0]) @ c["W_U"], None)),
        Mistake("your two paths are swapped: return (g_up, g_gate), the content path first (eq-glu-up, "
                "eq-glu-gate)", lambda c: tuple(reversed(_paths_oracle(c)))),
    ],
)


# -- 3. implement: the whole rule, mixed and through the frozen norm -----------------------------------------------
def _rule_case(gen: torch.Generator) -> dict:
    c = _glu_case(gen)
    mu = torch.rand(2, generator=gen, dtype=torch.float64)
    return dict(c, resid=randn(gen, *c["x"].shape), gamma=1 + 0.5 * randn(gen, c["x"].shape[-1]),
                mu_up=float(mu[0]), mu_gate=float(mu[1]), eps=1e-6)


def _norm_parts(c):
    r = torch.rsqrt(c["resid"].pow(2).mean(-1, keepdim=True) + c["eps"])
    h = c["gamma"] * c["resid"] * r
    return r, h, h @ c["W_G"].T, h @ c["W_U"].T


def _scale_grad(x, mu):
    return mu * x + (1 - mu) * x.detach()


def _rule_oracle(c):
    """autograd on the modified block: frozen norm scale, SiLU as s * detach(sigma(s)), mu on each projection."""
    r = _norm_parts(c)[0]

    def block(resid):
        h = c["gamma"] * resid * r
        s = _scale_grad(h, c["mu_gate"]) @ c["W_G"].T
        u = _scale_grad(h, c["mu_up"]) @ c["W_U"].T
        return (s * torch.sigmoid(s).detach() * u) @ c["W_D"].T

    return vjp(block, c["resid"], c["t"])


def _rule_call(fn, c):
    r, _, s, u = _norm_parts(c)
    return fn(c["t"], s, u, c["W_G"], c["W_U"], c["W_D"], c["gamma"], r, c["mu_up"], c["mu_gate"])


def _rule_parts(c, up, gate, norm=True, silu_prime=False):
    r, _, s, u = _norm_parts(c)
    lam = c["t"] @ c["W_D"]
    gate_coef = _silu_prime(s) if silu_prime else torch.sigmoid(s)
    g = up * (lam * F.silu(s)) @ c["W_U"] + gate * (lam * gate_coef * u) @ c["W_G"]
    return g * c["gamma"] * r if norm else g


Exercise(
    "propagate_glu", CHAPTER, "eq-glu-mix", cases=_rule_case, oracle=_rule_oracle, call=_rule_call,
    signature="propagate_glu(t, s, u, W_G, W_U, W_D, gamma, r, mu_up, mu_gate) -> g",
    mistakes=[
        Mistake("the path weights are missing: weigh each path by its mu, g = mu_up g_up + mu_gate g_gate "
                "(eq-glu-mix)", lambda c: _rule_parts(c, 1.0, 1.0)),
        Mistake("mu_up and mu_gate are swapped: mu_up weighs the content (up) path (eq-glu-mix)",
                lambda c: _rule_parts(c, c["mu_gate"], c["mu_up"])),
        Mistake("the frozen norm is missing: the block reads gamma * r * x, so its pull-back ends with "
                "* gamma * r (eq-norm-pullback)",
                lambda c: _rule_parts(c, c["mu_up"], c["mu_gate"], norm=False)),
        Mistake("your gate path uses SiLU'(s), the true gradient's coefficient; DPA's is sigma(s) (eq-glu-gate)",
                lambda c: _rule_parts(c, c["mu_up"], c["mu_gate"], silu_prime=True)),
    ],
)
