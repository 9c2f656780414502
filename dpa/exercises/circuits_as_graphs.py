"""Exercises of chapter circuits-as-graphs: direct effects (edges), the out-flow identity, a head's local pull-back
g_v and its in-flow gap."""

from __future__ import annotations

import torch

from ._core import F64, Exercise, Mistake, randn, vjp

CHAPTER = "circuits-as-graphs"


def _t(*rows):
    return torch.tensor(rows, dtype=F64)


# -- 1. by hand: the edges out of one unit, and its score ---------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return dict(out=_t(1.0, -2.0, 0.5), p=1, t_L=_t([0, 0, 0], [0, 0, 0], [1, 2, -1]),
                g_v1=_t([1, 1, 1], [2, 1, 2], [0, 1, 2]), g_v2=_t([3, 3, 3], [1, 0, 2], [0, 0, 0]))


def _hand(c):
    out, p = c["out"], c["p"]
    edges = [out @ c["t_L"][p], out @ c["g_v1"][p], out @ c["g_v2"][p]]
    return (*edges, sum(edges))


Exercise(
    "circuit_out_flow_by_hand", CHAPTER, "", cases=_hand_case, oracle=_hand, n_cases=1, rtol=0, atol=5e-3,
    parts=("E(u -> target)", "E(u -> v1)", "E(u -> v2)", "S_u"),
    mistakes=[
        Mistake("E(u -> target) reads t^(L) at the last position, but u writes at position 1 only, where t^(L) "
                "is zero: an edge is out_u . t^(L) at u's own position (Direct effect, at the top of the chapter)",
                lambda c: (c["out"] @ c["t_L"][2], None, None, None)),
        Mistake("E(u -> v1) reads g_v1 at v1's position 2; u writes at position 1 only, so the edge is "
                "out_u . g_v1[1], the row of the position u writes (Direct effect, at the top of the chapter)",
                lambda c: (None, c["out"] @ c["g_v1"][2], None, None)),
        Mistake("the edges add up g_v over every position; out_u is zero except at u's position, so an edge is one "
                "row, out_u . g_v[p_u] (Direct effect, at the top of the chapter)",
                lambda c: (None, c["out"] @ c["g_v1"].sum(0), c["out"] @ c["g_v2"].sum(0), None)),
        Mistake("S_u is only the edge into the target: u's effective target is t_u = t^(L) + sum of g_v over the "
                "units above (eq-effective-targets), so S_u = out_u . t_u adds up every outgoing edge "
                "(Flow identities, at the top of the chapter)", lambda c: (None, None, None, _hand(c)[0])),
    ],
)


# -- 2. implement: a head's local pull-back g_v ---------------------------------------------------------------------
def _head_case(gen: torch.Generator) -> dict:
    T, d, Dh = 5, 6, 3
    resid, eps = randn(gen, T, d), 1e-6
    r = torch.rsqrt(resid.pow(2).mean(-1, keepdim=True) + eps)
    gamma = 1 + 0.5 * randn(gen, d)
    mu = torch.rand(3, generator=gen, dtype=F64)
    return dict(G=randn(gen, Dh), resid=resid, r=r, gamma=gamma, h=gamma * resid * r, i=int(torch.randint(1, T, (1,),
                generator=gen)), W_Q=randn(gen, Dh, d, scale=d**-0.5), W_K=randn(gen, Dh, d, scale=d**-0.5),
                W_V=randn(gen, Dh, d, scale=d**-0.5), mu_q=float(mu[0]), mu_k=float(mu[1]), mu_v=float(mu[2]))


def _scale_grad(x, mu):
    return mu * x + (1 - mu) * x.detach()


def _head_score(c, h, mu_q=1.0, mu_k=1.0, mu_v=1.0):
    """S_v = z_i . G for the head's input h [T d], with the gradient into each projection scaled by its mu."""
    q, k = _scale_grad(h, mu_q) @ c["W_Q"].T, _scale_grad(h, mu_k) @ c["W_K"].T
    v = _scale_grad(h, mu_v) @ c["W_V"].T
    i = c["i"]
    alpha = torch.softmax(k[: i + 1] @ q[i] / q.shape[-1] ** 0.5, -1)  # the keys j <= i
    return alpha @ v[: i + 1] @ c["G"]


def _head_oracle(c):
    """autograd on the linearised block: frozen norm scale r, mu on each projection, G held fixed."""
    mu = dict(mu_q=c["mu_q"], mu_k=c["mu_k"], mu_v=c["mu_v"])
    one = torch.tensor(1.0, dtype=F64)
    return vjp(lambda resid: _head_score(c, c["gamma"] * resid * c["r"], **mu), c["resid"], one)


def _head_call(fn, c):
    return fn(c["G"], c["h"], c["gamma"], c["r"], c["W_Q"], c["W_K"], c["W_V"], c["i"], c["mu_q"], c["mu_k"], c["mu_v"])


def _parts(c):
    """alpha_i [T] (zero after i), delta_i [T] (eq-attn-delta), q, k [T Dh] and the scale 1/sqrt(D_h)."""
    h, i, G = c["h"], c["i"], c["G"]
    q, k, v = h @ c["W_Q"].T, h @ c["W_K"].T, h @ c["W_V"].T
    a = q.shape[-1] ** -0.5
    alpha = torch.zeros(len(h), dtype=F64)
    alpha[: i + 1] = torch.softmax(k[: i + 1] @ q[i] * a, -1)
    lam_v = v @ G
    return alpha, alpha * (lam_v - alpha @ lam_v), q, k, a


def _pullback(c, mus=None, with_alpha=True, norm=True, scale=True, subtract=True, query_at="i"):
    alpha, delta, q, k, a = _parts(c)
    if not subtract:
        delta = alpha * (c["h"] @ c["W_V"].T @ c["G"])
    a = a if scale else 1.0
    mu_q, mu_k, mu_v = mus or (c["mu_q"], c["mu_k"], c["mu_v"])
    i = c["i"]
    weight = alpha if with_alpha else (torch.arange(len(alpha)) <= i).to(F64)
    g = mu_v * weight[:, None] * (c["G"] @ c["W_V"])  # (eq-attn-value)
    if query_at == "i":
        g[i] += mu_q * a * (delta @ k) @ c["W_Q"]  # (eq-attn-query-key), at the query position
    else:
        g += mu_q * a * delta[:, None] * (k @ c["W_Q"])
    g += mu_k * a * delta[:, None] * (q[i] @ c["W_K"])  # at each key position
    return g * c["gamma"] * c["r"] if norm else g


Exercise(
    "circuit_head_pullback", CHAPTER, "eq-attn-query-key", cases=_head_case, oracle=_head_oracle, call=_head_call,
    signature="circuit_head_pullback(G, h, gamma, r, W_Q, W_K, W_V, i, mu_q, mu_k, mu_v) -> g_v",
    mistakes=[
        Mistake("the value path is missing alpha_ij: key position j passes G back through its value with weight "
                "alpha_ij (eq-attn-value)", lambda c: _pullback(c, with_alpha=False)),
        Mistake("the frozen norm is missing: the block reads gamma * r * x, so g_v on the residual stream ends "
                "with * gamma * r (eq-norm-pullback)", lambda c: _pullback(c, norm=False)),
        Mistake("the query path lands on every key position: it flows to the query position i only, "
                "W_Q^T sum_j delta_ij k_j / sqrt(D_h) (eq-attn-query-key)", lambda c: _pullback(c, query_at="j")),
        Mistake("the 1/sqrt(D_h) is missing from the query and key paths: the score is q . k / sqrt(D_h) "
                "(eq-attn-query-key)", lambda c: _pullback(c, scale=False)),
        Mistake("delta is missing the subtraction of G . z_i: delta_ij = alpha_ij (G . v_j - G . z_i) "
                "(eq-attn-delta)", lambda c: _pullback(c, subtract=False)),
        Mistake("the path weights are missing: each branch of the block counts with its mu, "
                "mu_Q g_Q + mu_K g_K + mu_V g_V (eq-attn-total)", lambda c: _pullback(c, mus=(1.0, 1.0, 1.0))),
        Mistake("mu_Q and mu_K are swapped: mu_Q weighs the path to the query position i, mu_K the paths to the key "
                "positions (eq-attn-total)", lambda c: _pullback(c, mus=(c["mu_k"], c["mu_q"], c["mu_v"]))),
    ],
)


# -- 3. implement: the in-flow gap of a head ------------------------------------------------------------------------
def _gap_oracle(c):
    """S_v minus its in-flow resid . g_v (every incoming edge, token and bias), g_v by autograd."""
    return _head_score(c, c["h"]).detach() - (c["resid"] * _head_oracle(c)).sum()


def _gap_parts(c, scale=True):
    alpha, delta, q, k, a = _parts(c)
    s = k @ q[c["i"]] * (a if scale else 1.0)
    return _head_score(c, c["h"]).detach(), (delta * s).sum()  # S_v and the first-order term (eq-attn-qk-value)


def _gap(c, value=None, control=None, scale=True):
    S, taylor = _gap_parts(c, scale)
    mu_v = c["mu_v"] if value is None else value
    control = c["mu_q"] + c["mu_k"] if control is None else control
    return S - mu_v * S - control * taylor


Exercise(
    "circuit_head_in_gap", CHAPTER, "eq-attn-total", cases=_head_case, oracle=_gap_oracle,
    call=lambda fn, c: fn(c["G"], c["h"], c["W_Q"], c["W_K"], c["W_V"], c["i"], c["mu_q"], c["mu_k"], c["mu_v"]),
    signature="circuit_head_in_gap(G, h, W_Q, W_K, W_V, i, mu_q, mu_k, mu_v) -> in_gap",
    mistakes=[
        Mistake("the query and key paths pass something on too: each passes the first-order term "
                "sum_j delta_ij s_ij (eq-attn-qk-value), weighted by its mu (eq-attn-total)",
                lambda c: _gap(c, control=0.0)),
        Mistake("the first-order term counts once per control path: weigh it by mu_Q + mu_K (eq-attn-total)",
                lambda c: _gap(c, control=1.0)),
        Mistake("the path weights need not add up to 1: the value path passes mu_V S_v, whatever mu_Q + mu_K is "
                "(eq-attn-total)", lambda c: _gap(c, value=1 - c["mu_q"] - c["mu_k"])),
        Mistake("that is the in-flow, what the incoming edges add up to; in_gap is S_v minus it (eq-attn-total)",
                lambda c: _gap_parts(c)[0] - _gap(c)),
        Mistake("the scores s_ij include the 1/sqrt(D_h): s_ij = q_i . k_j / sqrt(D_h) (eq-attn-forward)",
                lambda c: _gap(c, scale=False)),
    ],
)
