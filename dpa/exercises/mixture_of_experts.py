"""Exercises of chapter mixture-of-experts: the router's delta for the two routers in use, the router (control)
path, and the experts' (content) path with the expert scores."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from ._core import F64, Exercise, Mistake, randn

CHAPTER = "mixture-of-experts"


def _scale_grad(x, mu):
    return mu * x + (1 - mu) * x.detach()


def _delta(logits, lam_E, k, renormalise, indicator=True, leftout=True, sum_over="chosen"):
    """The router's delta on the logits, [..., n]: (eq-moe-delta-topk) or (eq-moe-delta-all); the switches are the
    mistakes (no indicator 1[f in K], nothing for the experts left out, the sum over every expert)."""
    index = logits.topk(k, dim=-1).indices
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, index, True)
    if renormalise:
        w = logits.masked_fill(~chosen, float("-inf")).softmax(-1)  # the softmax over the top k
        return w * (lam_E - (w * lam_E).sum(-1, keepdim=True))
    p = logits.softmax(-1)
    q = p.masked_fill(~chosen, 0) / (p * chosen).sum(-1, keepdim=True) if sum_over == "renormalised" else p
    mean = (q * lam_E * (1 if sum_over == "all" else chosen)).sum(-1, keepdim=True)
    delta = p * ((chosen if indicator else 1) * lam_E - mean)
    return delta if leftout else delta * chosen


# -- 1. by hand: three experts, two chosen ---------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return dict(logits=torch.tensor([math.log(3), 0.0, -math.log(2)], dtype=F64),
                lam_E=torch.tensor([2.0, -2.0, 5.0], dtype=F64))


def _hand(c, **how):
    return _delta(c["logits"], c["lam_E"], 2, True), _delta(c["logits"], c["lam_E"], 2, False, **how)


Exercise(
    "moe_by_hand", CHAPTER, "eq-moe-delta-topk", cases=_hand_case, n_cases=1, rtol=0, atol=5e-3,
    parts=("delta for the softmax over the top k", "delta for the softmax over all experts"), oracle=_hand,
    part_equations=("eq-moe-delta-topk", "eq-moe-delta-all"),
    mistakes=[
        Mistake("your top-k delta uses the unnormalised p = softmax(l); over the top k the weights are renormalised, "
                "w = (3/4, 1/4) (eq-moe-delta-topk)",
                lambda c: (_delta(c["logits"], c["lam_E"], 2, False, leftout=False), None)),
        Mistake("your two deltas are swapped: over the top k the expert left out gets delta = 0, its logit enters "
                "no weight (eq-moe-delta-topk); over all experts it gets -p_f sum_e p_e lambda . E_e "
                "(eq-moe-delta-all)", lambda c: tuple(reversed(_hand(c)))),
        Mistake("in the softmax over all experts the left-out expert writes nothing, so its own lambda . E does "
                "not enter: 1[f in K] lambda . E_f (eq-moe-delta-all)", lambda c: (None, _hand(c, indicator=False)[1])),
        Mistake("in the softmax over all experts every logit moves every weight: the expert left out receives "
                "-p_f sum_e p_e lambda . E_e (eq-moe-delta-all)", lambda c: (None, _hand(c, leftout=False)[1])),
        Mistake("in the softmax over all experts the sum runs over the chosen experts only, sum_{e in K} p_e "
                "lambda . E_e (eq-moe-delta-all)", lambda c: (None, _hand(c, sum_over="all")[1])),
        Mistake("in the softmax over all experts the weights are p_e as they are, not renormalised over the top k: "
                "sum_{e in K} p_e lambda . E_e (eq-moe-delta-all)",
                lambda c: (None, _hand(c, sum_over="renormalised")[1])),
    ],
)


def _k(gen: torch.Generator) -> int:
    """k = 2, 2, 3, 3 on the four cases (each router with each k): a k written in as 2 cannot pass."""
    return 2 + (gen.initial_seed() // 2) % 2


# -- 2. implement: the router's path ---------------------------------------------------------------------------------
def _router_case(gen: torch.Generator) -> dict:
    pos, d, n = 4, 6, 5
    return dict(lam=randn(gen, pos, d), E=randn(gen, pos, n, d), x=randn(gen, pos, d), W_r=randn(gen, n, d),
                k=_k(gen), norm=gen.initial_seed() % 2 == 0)  # the cases alternate between the two routers


def _router_oracle(c):
    """autograd of lambda . y with the experts' outputs E fixed, through the router's logits l = W_r x."""
    x = c["x"].clone().requires_grad_(True)
    with torch.enable_grad():
        logits = x @ c["W_r"].T
        index = logits.topk(c["k"], dim=-1).indices  # K frozen
        if c["norm"]:
            w = logits.gather(-1, index).softmax(-1)
        else:
            w = logits.softmax(-1).gather(-1, index)
        y = (w[..., None] * c["E"].gather(1, index[..., None].expand(-1, -1, c["E"].shape[-1]))).sum(1)
        (g,) = torch.autograd.grad((c["lam"] * y).sum(), x)
    return g


def _router(c, **how):
    norm = how.pop("norm", c["norm"])
    logits = c["x"] @ c["W_r"].T
    lam_E = (c["E"] * c["lam"][:, None]).sum(-1)
    return _delta(logits, lam_E, c["k"], norm, **how) @ c["W_r"]


Exercise(
    "moe_router_path", CHAPTER, "eq-moe-delta-all", cases=_router_case, oracle=_router_oracle, n_cases=4,
    call=lambda fn, c: fn(c["lam"], c["E"], c["x"], c["W_r"], c["k"], c["norm"]),
    signature="moe_router_path(lam, E, x, W_r, k, norm_topk_prob) -> g_router",
    mistakes=[
        Mistake("you used the other router: norm_topk_prob=True is the softmax over the top k (eq-moe-delta-topk); "
                "False is the softmax over all experts with its top k kept as they are (eq-moe-delta-all)",
                lambda c: _router(c, norm=not c["norm"])),
        Mistake("with the softmax over all experts, an expert left out writes nothing: its own lambda . E does not "
                "enter, 1[f in K] lambda . E_f (eq-moe-delta-all)", lambda c: _router(c, indicator=False)),
        Mistake("with the softmax over all experts, every logit moves every weight: the experts left out receive "
                "-p_f sum_e p_e lambda . E_e too (eq-moe-delta-all)", lambda c: _router(c, leftout=False)),
        Mistake("with the softmax over all experts, the sum runs over the chosen experts only (eq-moe-delta-all)",
                lambda c: _router(c, sum_over="all")),
        Mistake("with the softmax over all experts, the weights are p_e as they are, not renormalised over the top "
                "k (eq-moe-delta-all)", lambda c: _router(c, sum_over="renormalised")),
    ],
)


# -- 3. implement: the experts' path and the expert scores -----------------------------------------------------------
def _experts_case(gen: torch.Generator) -> dict:
    pos, d, n, m = 4, 6, 5, 3
    mu = torch.rand(2, generator=gen, dtype=F64)
    return dict(lam=randn(gen, pos, d), x=randn(gen, pos, d), W_r=randn(gen, n, d),
                W_g=randn(gen, n, m, d, scale=d**-0.5), W_u=randn(gen, n, m, d, scale=d**-0.5),
                W_d=randn(gen, n, d, m, scale=m**-0.5), k=_k(gen), norm=gen.initial_seed() % 2 == 0,
                mu_gate=float(mu[0]), mu_up=float(mu[1]))


def _weights(c, norm=None, every=False):
    """The routing weights, dense [pos, n] with zeros for the experts left out (every=True: p for all)."""
    logits = c["x"] @ c["W_r"].T
    if every:
        return logits.softmax(-1)
    index = logits.topk(c["k"], dim=-1).indices
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, index, True)
    if c["norm"] if norm is None else norm:
        return logits.masked_fill(~chosen, float("-inf")).softmax(-1)
    return logits.softmax(-1) * chosen


def _experts_oracle(c):
    """autograd on the linearised block: routing weights frozen (a leaf of their own, for the scores), each expert
    a GLU with sigma frozen and mu_gate, mu_up on its gate and up; the expert scores are w x its gradient."""
    x, w = c["x"].clone().requires_grad_(True), _weights(c).requires_grad_(True)
    with torch.enable_grad():
        s = _scale_grad(torch.einsum("pd,nmd->pnm", x, c["W_g"]), c["mu_gate"])
        u = _scale_grad(torch.einsum("pd,nmd->pnm", x, c["W_u"]), c["mu_up"])
        E = torch.einsum("pnm,ndm->pnd", s * torch.sigmoid(s).detach() * u, c["W_d"])
        y = (w[..., None] * E).sum(1)
        g, g_w = torch.autograd.grad((c["lam"] * y).sum(), (x, w))
    return g, (w * g_w).sum(0).detach()


def _experts(c, w=None, gate_coef=torch.sigmoid, mu=None, router=False):
    """The experts' path written out, (g, S); the arguments are the mistakes."""
    w = _weights(c) if w is None else w
    mu_gate, mu_up = (c["mu_gate"], c["mu_up"]) if mu is None else mu
    s, u = (torch.einsum("pd,nmd->pnm", c["x"], c[W]) for W in ("W_g", "W_u"))
    lam_n = torch.einsum("pd,ndm->pnm", c["lam"], c["W_d"])  # the target on each expert's neurons
    g_e = (mu_up * torch.einsum("pnm,nmd->pnd", lam_n * F.silu(s), c["W_u"])
           + mu_gate * torch.einsum("pnm,nmd->pnd", lam_n * gate_coef(s) * u, c["W_g"]))
    g = (w[..., None] * g_e).sum(1)
    if router:
        g = g + _router(dict(c, E=torch.einsum("pnm,ndm->pnd", F.silu(s) * u, c["W_d"])))
    return g, (w * (lam_n * F.silu(s) * u).sum(-1)).sum(0)


def _silu_prime(s):
    sig = torch.sigmoid(s)
    return sig * (1 + s * (1 - sig))


Exercise(
    "moe_experts_path", CHAPTER, "eq-moe-complete", cases=_experts_case, oracle=_experts_oracle, n_cases=4,
    call=lambda fn, c: fn(c["lam"], c["x"], c["W_r"], c["W_g"], c["W_u"], c["W_d"], c["k"], c["norm"],
                          c["mu_gate"], c["mu_up"]),
    signature="moe_experts_path(lam, x, W_r, W_g, W_u, W_d, k, norm_topk_prob, mu_gate, mu_up) -> (g, S)",
    parts=("g, the experts' path", "the expert scores S"),
    part_equations=("eq-moe-complete", "eq-moe-expert-score"),
    mistakes=[
        Mistake("your g includes the router's delta: the experts' path freezes the routing weights, and the "
                "router's path W_r^T delta is the control path, weighted apart (eq-moe-complete)",
                lambda c: (_experts(c, router=True)[0], None)),
        Mistake("your routing weights are those of the other router: norm_topk_prob=True renormalises over the top "
                "k (eq-moe-delta-topk), False keeps p = softmax(l) as it is (eq-moe-delta-all)",
                lambda c: _experts(c, w=_weights(c, norm=not c["norm"]))),
        Mistake("each expert's pull-back is missing its routing weight: y = sum_e w_e E_e (eq-moe-block)",
                lambda c: (_experts(c, w=(_weights(c) > 0).to(F64))[0], None)),
        Mistake("an expert's score is missing its routing weight: S_e = sum_i w_e,i lambda_i . E_e "
                "(eq-moe-expert-score)",
                lambda c: (None, _experts(c, w=(_weights(c) > 0).to(F64))[1])),
        Mistake("your scores give the experts left out a share: an expert not chosen at a position writes nothing "
                "there and scores exactly zero (eq-moe-expert-score)",
                lambda c: (None, _experts(c, w=_weights(c, every=True))[1])),
        Mistake("your experts' gate path uses SiLU'(s), the true gradient's; inside each expert DPA's gate "
                "coefficient is sigma(s) (eq-glu-gate)", lambda c: (_experts(c, gate_coef=_silu_prime)[0], None)),
        Mistake("the gate and up path weights are missing inside the experts: mu_gate and mu_up split each "
                "expert's target (eq-glu-mix)", lambda c: (_experts(c, mu=(1.0, 1.0))[0], None)),
    ],
)
