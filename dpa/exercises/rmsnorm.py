"""Exercises of chapter rmsnorm: the norm's scale r, its frozen pull-back, and the true gradient DPA avoids."""

from __future__ import annotations

import torch

from ._core import F64, Exercise, Mistake, norm_scale, randn, vjp

CHAPTER = "rmsnorm"


def _jacobian(t, x, gamma, r, *, d=None, dot_with="g", power=3, sign=-1):
    """The true gradient of t . norm(x) (eq-norm-jacobian), or one of the learners' variants of it."""
    g = gamma * t
    d = x.shape[-1] if d is None else d
    if dot_with == "all":  # one dot product for the whole sequence
        dot = (x * g).sum()
    else:
        dot = (x * (g if dot_with == "g" else t)).sum(-1, keepdim=True)
    return r * g + sign * r**power / d * dot * x


# -- 1. by hand: a 3-dimensional norm ----------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return {"x": torch.tensor([1.0, -1.0, 5.0], dtype=F64), "gamma": torch.tensor([3.0, 3.0, 0.6], dtype=F64),
                "t": torch.tensor([2.0, -1.0, 1.0], dtype=F64)}


def _r0(c):
    return norm_scale(c["x"], 0.0).squeeze()  # eps = 0 in the hand example


def _hand(c, r):
    """(r, norm(x), N^T t, true gradient) for a given scale r."""
    return r, c["gamma"] * c["x"] * r, c["gamma"] * r * c["t"], _jacobian(c["t"], c["x"], c["gamma"], r)


def _hand_oracle(c):
    x = c["x"]
    return (norm_scale(x, 0.0).squeeze(), c["gamma"] * x * norm_scale(x, 0.0),
            vjp(lambda y: c["gamma"] * y * norm_scale(x, 0.0), x, c["t"]),  # the frozen map (eq-norm-frozen)
            vjp(lambda y: c["gamma"] * y * norm_scale(y, 0.0), x, c["t"]))  # the norm itself


Exercise(
    "rms_by_hand", CHAPTER, "eq-norm-pullback", cases=_hand_case, oracle=_hand_oracle, n_cases=1, rtol=0, atol=5e-3,
    parts=("the scale r", "norm(x)", "the pulled-back target N_x^T t", "the true gradient"),
    part_equations=("eq-rmsnorm", "eq-rmsnorm", "eq-norm-pullback", "eq-norm-jacobian"),
    mistakes=[
        Mistake("r uses the sum of squares: r(x) is one over the root *mean* square, (1/d sum_k x_k^2)^(-1/2) "
                "(eq-rmsnorm)", lambda c: _hand(c, norm_scale(c["x"], 0.0, reduce="sum").squeeze())),
        Mistake("r is missing its square root: r(x) = (1/d sum_k x_k^2 + eps)^(-1/2) (eq-rmsnorm)",
                lambda c: _hand(c, norm_scale(c["x"], 0.0, root=False).squeeze())),
        Mistake("r is the root mean square itself; the norm *divides* by it, r = 1/sigma(x) (eq-rmsnorm)",
                lambda c: _hand(c, 1 / _r0(c))),
        Mistake("N_x^T t is missing gamma: the frozen map is diag(gamma r), so N_x^T t = gamma * r * t "
                "(eq-norm-pullback)", lambda c: (None, None, _r0(c) * c["t"], None)),
        Mistake("your pulled-back target is the true gradient; the frozen map holds r fixed, so N_x^T t = gamma * r "
                "* t (eq-norm-pullback)", lambda c: (None, None, _hand(c, _r0(c))[3], None)),
        Mistake("your true gradient is the frozen pull-back: the Jacobian also differentiates r(x), which removes "
                "the component along x (eq-norm-jacobian)",
                lambda c: (None, None, None, _hand(c, _r0(c))[2])),
        Mistake("your true gradient's second term is missing its 1/d: r^3/d (x . g) x (eq-norm-jacobian)",
                lambda c: (None, None, None, _jacobian(c["t"], c["x"], c["gamma"], _r0(c), d=1))),
        Mistake("your true gradient dots x with t; the second term has (x . g) with g = gamma * t "
                "(eq-norm-jacobian)", lambda c: (None, None, None, _jacobian(c["t"], c["x"], c["gamma"], _r0(c),
                                                                                dot_with="t"))),
    ],
)


# -- 2. implement: the frozen pull-back ------------------------------------------------------------------------------
def _norm_case(gen: torch.Generator) -> dict:
    pos, d = 4, 6
    return {"t": randn(gen, pos, d), "x": randn(gen, pos, d), "gamma": 1 + 0.5 * randn(gen, d), "eps": 0.05}


def _call(fn, c):
    return fn(c["t"], c["x"], c["gamma"], c["eps"])


def _pullback_oracle(c):
    """autograd through the frozen map N_x (eq-norm-frozen): r held at its forward value."""
    r = norm_scale(c["x"], c["eps"])
    return vjp(lambda y: c["gamma"] * y * r, c["x"], c["t"])


def _frozen(c, **kw):
    return c["t"] * c["gamma"] * norm_scale(c["x"], c["eps"], **kw)


def _true_gradient(c):
    return vjp(lambda y: c["gamma"] * y * norm_scale(y, c["eps"]), c["x"], c["t"])


Exercise(
    "norm_pullback", CHAPTER, "eq-norm-pullback", cases=_norm_case, oracle=_pullback_oracle, call=_call,
    signature="norm_pullback(t, x, gamma, eps) -> N_x^T t",
    mistakes=[
        Mistake("your pull-back differentiates r(x): that is the true gradient (eq-norm-jacobian); DPA holds the "
                "scale at its forward value, N_x^T t = gamma * r * t (eq-norm-pullback)", _true_gradient),
        Mistake("gamma is missing: the frozen map is diag(gamma r(x)) (eq-norm-frozen)",
                lambda c: c["t"] * norm_scale(c["x"], c["eps"])),
        Mistake("r uses the sum of squares; it is the root *mean* square's inverse (eq-rmsnorm)",
                lambda c: _frozen(c, reduce="sum")),
        Mistake("r is missing its square root: r(x) = (1/d sum_k x_k^2 + eps)^(-1/2) (eq-rmsnorm)",
                lambda c: _frozen(c, root=False)),
        Mistake("eps is missing from r: r(x) = (1/d sum_k x_k^2 + eps)^(-1/2) (eq-rmsnorm)",
                lambda c: c["t"] * c["gamma"] * norm_scale(c["x"], 0.0)),
        Mistake("your r is one number for the whole sequence: each position has its own scale, a mean over the "
                "last dimension only, r of shape [pos, 1] (eq-norm-frozen)", lambda c: _frozen(c, reduce="all")),
        Mistake("you divide by r: the norm multiplies by r = 1/sigma(x), and so does its pull-back "
                "(eq-norm-pullback)", lambda c: c["t"] * c["gamma"] / norm_scale(c["x"], c["eps"])),
    ],
)


# -- 3. implement: the true gradient, which DPA does not use ---------------------------------------------------------
def _jac(c, **kw):
    return _jacobian(c["t"], c["x"], c["gamma"], norm_scale(c["x"], c["eps"]), **kw)


Exercise(
    "norm_jacobian", CHAPTER, "eq-norm-jacobian", cases=_norm_case, oracle=_true_gradient, call=_call,
    signature="norm_jacobian(t, x, gamma, eps) -> the gradient of t . norm(x)",
    mistakes=[
        Mistake("that is the frozen pull-back gamma * r * t (eq-norm-pullback): the true gradient also "
                "differentiates r(x), - r^3/d (x . g) x with g = gamma * t (eq-norm-jacobian)", _frozen),
        Mistake("the second term is missing its 1/d: - r^3/d (x . g) x (eq-norm-jacobian)",
                lambda c: _jac(c, d=1)),
        Mistake("the second term dots x with t; it is (x . g) with g = gamma * t (eq-norm-jacobian)",
                lambda c: _jac(c, dot_with="t")),
        Mistake("the second term has r where it needs r^3: d r / d x = - r^3 x / d (eq-norm-jacobian)",
                lambda c: _jac(c, power=1)),
        Mistake("the second term is added; it is subtracted, r g - r^3/d (x . g) x (eq-norm-jacobian)",
                lambda c: _jac(c, sign=1)),
        Mistake("your (x . g) sums over every position: it is one number per position, a sum over the last "
                "dimension (keepdim) (eq-norm-jacobian)", lambda c: _jac(c, dot_with="all")),
    ],
)
