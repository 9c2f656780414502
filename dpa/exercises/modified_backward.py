"""Exercises of chapter modified-backward: the three changes of the linearised model (frozen norm scale, SiLU as
s * sigma(s) with sigma frozen, path weights on the branches) written as autograd code, and checked against the
hand rules of the earlier chapters."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from ._core import F64, Exercise, Mistake, randn

CHAPTER = "modified-backward"


def _scale_grad(x, mu):
    return mu * x + (1 - mu) * x.detach()


def _silu_prime(s):
    sig = torch.sigmoid(s)
    return sig * (1 + s * (1 - sig))


def _value_and_grad(fn, x: Tensor, w: Tensor, *args):
    """(value, gradient of w . value at x) of the learner's function: what its forward and its backward give."""
    x = x.clone().requires_grad_(True)
    out = fn(x, *args)
    if out is None or out is Ellipsis:
        return None
    if not isinstance(out, Tensor) or out.shape != w.shape:
        return out, torch.zeros_like(w)  # the checker names the value's type or shape
    out = out.to(x.device)  # a value computed on a GPU: the gradient still flows back to x
    grad = None
    if out.requires_grad:
        (grad,) = torch.autograd.grad((w * out).sum(), x, allow_unused=True)
    return out.detach(), torch.zeros_like(x) if grad is None else grad.detach()


# -- 1. by hand: one neuron, in the model and in the linearised model ----------------------------------------------
def _hand_case(gen=None) -> dict:
    return {"s": torch.tensor(2.0, dtype=F64), "u": torch.tensor(3.0, dtype=F64), "mu_gate": 0.5, "mu_up": 0.5}


def _hand_oracle(c):
    """autograd of a = SiLU(s) u at (s, u): in the model, and with changes 2 and 3."""
    s, u = c["s"].clone().requires_grad_(True), c["u"].clone().requires_grad_(True)
    model = torch.stack(torch.autograd.grad(F.silu(s) * u, (s, u)))
    sb, ub = _scale_grad(s, c["mu_gate"]), _scale_grad(u, c["mu_up"])
    linearised = torch.stack(torch.autograd.grad(sb * torch.sigmoid(sb).detach() * ub, (s, u)))
    return model, linearised


def _pair(a, b):
    return torch.stack([torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)])


Exercise(
    "linearised_by_hand", CHAPTER, "eq-identity-1", cases=_hand_case, oracle=_hand_oracle, n_cases=1, rtol=0,
    atol=5e-3, parts=("the model's (da/ds, da/du)", "the linearised model's (da/ds, da/du)"),
    part_equations=("eq-glu-grad", "eq-glu-mix"),
    mistakes=[
        Mistake("the model's da/ds treats sigma(s) as a constant; the model differentiates it too: "
                "da/ds = SiLU'(s) u (eq-glu-grad)",
                lambda c: (_pair(torch.sigmoid(c["s"]) * c["u"], F.silu(c["s"])), None)),
        Mistake("the model's da/ds is missing u: a = SiLU(s) u, so da/ds = SiLU'(s) u (eq-glu-grad)",
                lambda c: (_pair(_silu_prime(c["s"]), F.silu(c["s"])), None)),
        Mistake("your linearised da/ds uses SiLU'(s): change 2 computes SiLU(s) as s times a frozen sigma(s), so "
                "da/ds = mu_gate sigma(s) u (eq-glu-gate)",
                lambda c: (None, _pair(c["mu_gate"] * _silu_prime(c["s"]) * c["u"], c["mu_up"] * F.silu(c["s"])))),
        Mistake("the path weights are missing from the linearised model: change 3 multiplies the gradient entering "
                "each branch by its mu (eq-glu-mix)",
                lambda c: (None, _pair(torch.sigmoid(c["s"]) * c["u"], F.silu(c["s"])))),
        Mistake("your linearised pair is swapped: da/ds is the gate's, mu_gate sigma(s) u (eq-glu-gate); da/du the "
                "content's, mu_up SiLU(s) (eq-glu-up)",
                lambda c: (None, _pair(c["mu_up"] * F.silu(c["s"]), c["mu_gate"] * torch.sigmoid(c["s"]) * c["u"]))),
    ],
)


# -- 2. implement: a branch, identity forward and mu backward ---------------------------------------------------------
def _branch_case(gen: torch.Generator) -> dict:
    mu = 0.1 + 0.8 * float(torch.rand(1, generator=gen, dtype=F64))
    return {"x": randn(gen, 4, 5), "w": randn(gen, 4, 5), "mu": mu}


Exercise(
    "scale_grad", CHAPTER, "eq-identity-1", cases=_branch_case, parts=("the value", "the gradient"),
    call=lambda fn, c: _value_and_grad(fn, c["x"], c["w"], c["mu"]),
    oracle=lambda c: (c["x"], c["mu"] * c["w"]),
    signature="scale_grad(x, mu) -> a tensor with x's value",
    mistakes=[
        Mistake("your branch scales the forward value too: it must return x unchanged and scale only the gradient, "
                "mu x + (1 - mu) x.detach() (change 3)", lambda c: (c["mu"] * c["x"], None)),
        Mistake("mu and 1 - mu are on the wrong terms: the gradient flows through the term without detach, so "
                "that one carries mu (change 3)", lambda c: (None, (1 - c["mu"]) * c["w"])),
        Mistake("nothing is detached: the gradient passes unscaled, as through x itself (change 3)",
                lambda c: (None, c["w"])),
        Mistake("no gradient reaches x: everything is detached; keep mu x attached (change 3)",
                lambda c: (c["x"], torch.zeros_like(c["x"]))),
    ],
)


# -- 3. implement: SiLU with sigma frozen ---------------------------------------------------------------------------
def _silu_case(gen: torch.Generator) -> dict:
    return {"s": randn(gen, 4, 7, scale=2.0), "w": randn(gen, 4, 7)}


Exercise(
    "linear_silu", CHAPTER, "eq-glu-gate", cases=_silu_case, parts=("the value", "the gradient"),
    part_equations=("eq-glu-silu-over-s", "eq-glu-gate"),
    call=lambda fn, c: _value_and_grad(fn, c["s"], c["w"]),
    oracle=lambda c: (F.silu(c["s"]), c["w"] * torch.sigmoid(c["s"])),
    signature="linear_silu(s) -> a tensor with SiLU(s)'s value",
    mistakes=[
        Mistake("your gradient is SiLU'(s), the model's own (eq-glu-grad): change 2 freezes sigma(s), so the "
                "gradient is sigma(s) (eq-glu-gate)", lambda c: (None, c["w"] * _silu_prime(c["s"]))),
        Mistake("you detached the wrong factor: s * sigma(s) with s frozen differentiates sigma; freeze sigma(s) "
                "and keep s, SiLU(s) = s sigma(s) (eq-glu-silu-over-s)",
                lambda c: (None, c["w"] * c["s"] * torch.sigmoid(c["s"]) * (1 - torch.sigmoid(c["s"])))),
        Mistake("no gradient reaches s: freeze sigma(s) only, s * sigma(s).detach() (change 2)",
                lambda c: (F.silu(c["s"]), torch.zeros_like(c["s"]))),
        Mistake("the value is sigma(s); it must stay SiLU(s) = s sigma(s) (eq-glu-silu-over-s)",
                lambda c: (torch.sigmoid(c["s"]), None)),
    ],
)


# -- 4. implement: the linearised GLU block, its backward the hand rule ----------------------------------------------
def _glu_case(gen: torch.Generator) -> dict:
    pos, d, d_mlp = 4, 6, 10
    mu = torch.rand(2, generator=gen, dtype=F64)
    return {"x": randn(gen, pos, d), "t": randn(gen, pos, d), "gamma": 1 + 0.5 * randn(gen, d), "eps": 1e-6,
                "W_G": randn(gen, d_mlp, d, scale=d**-0.5), "W_U": randn(gen, d_mlp, d, scale=d**-0.5),
                "W_D": randn(gen, d, d_mlp, scale=d_mlp**-0.5), "mu_gate": float(mu[0]), "mu_up": float(mu[1])}


_ARGS = ("gamma", "eps", "W_G", "W_U", "W_D", "mu_gate", "mu_up")


def _glu_call(fn, c):
    return _value_and_grad(fn, c["x"], c["t"], *(c[k] for k in _ARGS))


def _glu_oracle(c):
    """The model's block output, and DPA's hand rule (chapter glu) for the target t on it."""
    r = (c["x"].pow(2).mean(-1, keepdim=True) + c["eps"]).rsqrt()
    h = c["gamma"] * c["x"] * r
    s, u = h @ c["W_G"].T, h @ c["W_U"].T
    lam = c["t"] @ c["W_D"]  # (eq-glu-lambda)
    g = c["mu_up"] * (lam * F.silu(s)) @ c["W_U"] + c["mu_gate"] * (lam * torch.sigmoid(s) * u) @ c["W_G"]
    return (F.silu(s) * u) @ c["W_D"].T, g * c["gamma"] * r  # (eq-glu-mix), (eq-norm-pullback)


def _variant(c, *, freeze=True, silu="linear", swap=False, branch=_scale_grad):
    """What a learner's linearised block gives, with one of the changes done wrong."""
    def block(x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up):
        xr = x.detach() if freeze else x
        h = gamma * x * (xr.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        m_gate, m_up = (mu_up, mu_gate) if swap else (mu_gate, mu_up)
        s, u = branch(h, m_gate) @ W_G.T, branch(h, m_up) @ W_U.T
        act = {"linear": s * torch.sigmoid(s).detach(), "true": F.silu(s),
               "wrong": s.detach() * torch.sigmoid(s)}[silu]
        return (act * u) @ W_D.T
    return _glu_call(block, c)


Exercise(
    "linearised_glu", CHAPTER, "eq-identity-1", cases=_glu_case, oracle=_glu_oracle, call=_glu_call,
    parts=("the block's output", "its backward (the target on x)"),
    signature="linearised_glu(x, gamma, eps, W_G, W_U, W_D, mu_gate, mu_up) -> the block's output",
    mistakes=[
        Mistake("the norm's scale is not frozen: autograd then adds the term along x of the true gradient "
                "(eq-norm-jacobian); hold r at its forward value, r computed from x.detach() (change 1)",
                lambda c: _variant(c, freeze=False)),
        Mistake("SiLU is not linearised: its backward is SiLU'(s), the model's (eq-glu-grad); compute it as "
                "s * sigma(s).detach() (change 2)", lambda c: _variant(c, silu="true")),
        Mistake("you detached the wrong factor of SiLU: freeze sigma(s), keep s (change 2); the gate path is "
                "lambda sigma(s) u (eq-glu-gate)",
                lambda c: _variant(c, silu="wrong")),
        Mistake("the path weights are missing: change 3 multiplies the gradient entering W_G by mu_gate and the "
                "one entering W_U by mu_up (eq-glu-mix)", lambda c: _variant(c, branch=lambda h, m: h)),
        Mistake("mu_gate and mu_up are swapped: mu_gate scales the branch into W_G, mu_up the one into W_U "
                "(eq-glu-mix)", lambda c: _variant(c, swap=True)),
        Mistake("your branches scale the forward value too: the linearised model's forward is the model's, "
                "mu h + (1 - mu) h.detach() (change 3)", lambda c: _variant(c, branch=lambda h, m: m * h)),
        Mistake("eps is missing from the norm's scale: r = (1/d sum_k x_k^2 + eps)^(-1/2) (eq-rmsnorm)",
                lambda c: _variant(dict(c, eps=0.0))),
    ],
)
