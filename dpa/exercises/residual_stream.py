"""Exercises of chapter residual-stream-and-targets: the initial target through the frozen final norm, direct logit
attribution, and the top-down walk of the effective targets."""

from __future__ import annotations

import torch

from ._core import F64, Exercise, Mistake, norm_scale, randn, vjp

CHAPTER = "residual-stream-and-targets"


# -- 1. by hand: a logit split into direct contributions ------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    return {"x0": torch.tensor([1.0, 2.0, 0.0], dtype=F64), "attn": torch.tensor([1.0, 1.0, -2.0], dtype=F64),
                "mlp": torch.tensor([-1.0, 2.0, 1.0], dtype=F64), "w": torch.tensor([3.0, 0.6, -3.0], dtype=F64),
                "gamma": torch.tensor([1.0, 5.0, 2.0], dtype=F64)}


def _hand(c, r=None, t=None):
    """(r_f, t^(L)_p, the direct contributions) for a scale r_f (or a target t) of the learner's."""
    x_L = c["x0"] + c["attn"] + c["mlp"]  # (eq-resid-blocks)
    r = norm_scale(x_L, 0.0).squeeze() if r is None else r
    t = c["w"] * c["gamma"] * r if t is None else t
    return r, t, torch.stack([t @ c["x0"], t @ c["attn"], t @ c["mlp"]])


def _hand_oracle(c):
    x_L = c["x0"] + c["attn"] + c["mlp"]
    r = norm_scale(x_L, 0.0)
    t = vjp(lambda x: c["gamma"] * x * r, x_L, c["w"])  # W_U[y] pulled back through the frozen final norm
    return r.squeeze(), t, torch.stack([t @ c["x0"], t @ c["attn"], t @ c["mlp"]])


def _x_L(c):
    return c["x0"] + c["attn"] + c["mlp"]


Exercise(
    "dla_by_hand", CHAPTER, "eq-dla", cases=_hand_case, oracle=_hand_oracle, n_cases=1, rtol=0, atol=5e-3,
    parts=("the scale r_f", "the initial target t^(L)_p", "the direct contributions (x^(0), attention, GLU)"),
    part_equations=("eq-rmsnorm", "eq-initial-target", "eq-dla"),
    mistakes=[
        Mistake("t^(L)_p is missing the final norm's weight: t^(L)_p = W_U[y] * gamma_f * r_f (eq-initial-target)",
                lambda c: (None, *_hand(c, t=c["w"] * norm_scale(_x_L(c), 0.0).squeeze())[1:])),
        Mistake("t^(L)_p is missing the final norm's scale r_f: the norm multiplies by r_f, and so does the "
                "target, t^(L)_p = W_U[y] * gamma_f * r_f (eq-initial-target)",
                lambda c: (None, *_hand(c, t=c["w"] * c["gamma"])[1:])),
        Mistake("r_f uses the sum of squares: it is one over the root *mean* square of x^(L)_p (eq-rmsnorm)",
                lambda c: _hand(c, r=norm_scale(_x_L(c), 0.0, reduce="sum").squeeze())),
        Mistake("r_f is the root mean square itself; the norm divides by it, r_f = 1/sigma(x^(L)_p) (eq-rmsnorm)",
                lambda c: _hand(c, r=1 / norm_scale(_x_L(c), 0.0).squeeze())),
        Mistake("the contributions are dotted with W_U[y]; each component is read by the target t^(L), which "
                "carries gamma_f r_f (eq-dla)",
                lambda c: (None, None, torch.stack([c["w"] @ c[k] for k in ("x0", "attn", "mlp")]))),
    ],
)


# -- 2. implement: the initial target -------------------------------------------------------------------------------
def _target_case(gen: torch.Generator) -> dict:
    T, d, vocab = 5, 6, 11
    return {"x_L": randn(gen, T, d), "W_U": randn(gen, vocab, d), "gamma_f": 1 + 0.5 * randn(gen, d), "eps": 0.05,
                "y": int(torch.randint(vocab, (1,), generator=gen))}


def _target_call(fn, c):
    return fn(c["x_L"], c["W_U"], c["y"], c["gamma_f"], c["eps"])


def _logits(c, x, r):
    """The logits at every position, the final norm's scale r given: [T, vocab]."""
    return (c["gamma_f"] * x * r) @ c["W_U"].T


def _target_oracle(c):
    """autograd: the gradient of logit_y at the last position, through the final norm with r_f frozen."""
    pick = torch.zeros(c["x_L"].shape[0], c["W_U"].shape[0], dtype=F64)
    pick[-1, c["y"]] = 1
    return vjp(lambda x: _logits(c, x, norm_scale(c["x_L"], c["eps"])), c["x_L"], pick)


def _at(c, row, p=-1):
    t = torch.zeros_like(c["x_L"])
    t[p] = row if row.dim() == 1 else row[p]
    return t


def _true_target(c):
    pick = torch.zeros(c["x_L"].shape[0], c["W_U"].shape[0], dtype=F64)
    pick[-1, c["y"]] = 1
    return vjp(lambda x: _logits(c, x, norm_scale(x, c["eps"])), c["x_L"], pick)


Exercise(
    "initial_target", CHAPTER, "eq-initial-target", cases=_target_case, oracle=_target_oracle, call=_target_call,
    signature="initial_target(x_L, W_U, y, gamma_f, eps) -> t^(L)",
    mistakes=[
        Mistake("the final norm's weight is missing: t^(L)_p = W_U[y] * gamma_f * r_f (eq-initial-target)",
                lambda c: _at(c, c["W_U"][c["y"]] * norm_scale(c["x_L"], c["eps"]))),
        Mistake("the final norm's scale r_f is missing: t^(L)_p = W_U[y] * gamma_f * r_f (eq-initial-target)",
                lambda c: _at(c, c["W_U"][c["y"]] * c["gamma_f"])),
        Mistake("your target is at every position; the logit is read at the last position p only, and t^(L)_i = 0 "
                "for i != p (eq-initial-target)",
                lambda c: c["W_U"][c["y"]] * c["gamma_f"] * norm_scale(c["x_L"], c["eps"])),
        Mistake("your target is at every position; the logit is read at the last position p only, and t^(L)_i = 0 "
                "for i != p (eq-initial-target)",
                lambda c: (c["W_U"][c["y"]] * c["gamma_f"] * norm_scale(c["x_L"], c["eps"])[-1]).expand_as(c["x_L"])),
        Mistake("your target sits at position 0; the logit is read at the last position, p = T - 1 "
                "(eq-initial-target)", lambda c: _at(c, c["W_U"][c["y"]] * c["gamma_f"]
                                                       * norm_scale(c["x_L"], c["eps"])[0], p=0)),
        Mistake("r_f is taken over the whole sequence: the final norm has one scale per position, that of "
                "x^(L)_p (eq-initial-target)",
                lambda c: _at(c, c["W_U"][c["y"]] * c["gamma_f"] * norm_scale(c["x_L"], c["eps"], reduce="all"))),
        Mistake("your target differentiates r_f: DPA freezes the final norm's scale too (eq-norm-pullback), "
                "which is what makes the logit t^(L) . x^(L) exactly (eq-initial-target)", _true_target),
        Mistake("eps is missing from r_f (eq-rmsnorm)",
                lambda c: _at(c, c["W_U"][c["y"]] * c["gamma_f"] * norm_scale(c["x_L"], 0.0))),
    ],
)


# -- 3. implement: the effective targets, top-down --------------------------------------------------------------------
L = 2


def _walk_case(gen: torch.Generator) -> dict:
    T, d = 4, 5
    case = {"t_L": randn(gen, T, d)}
    for k in range(1, L + 1):  # linear stand-ins for the linearised blocks: attention mixes positions
        case[f"A{k}"] = randn(gen, T, T, scale=0.5).tril()
        case[f"W_attn{k}"] = randn(gen, d, d, scale=0.5 * d**-0.5)
        case[f"W_glu{k}"] = randn(gen, d, d, scale=0.5 * d**-0.5)
    return case


def _blocks(c, k):
    """Layer k's (MHSA, GLU) forward maps; the linearised blocks' are linear."""
    return (lambda x: c[f"A{k}"] @ x @ c[f"W_attn{k}"].T), (lambda x: x @ c[f"W_glu{k}"].T)


def _pullbacks(c):
    """[(g_MHSA, g_GLU) of layer l for l = 1 .. L]: each block's transpose, what the learner is given."""
    return [((lambda t, k=k: c[f"A{k}"].T @ t @ c[f"W_attn{k}"]), (lambda t, k=k: t @ c[f"W_glu{k}"]))
            for k in range(1, L + 1)]


def _walk_call(fn, c):
    out = fn(c["t_L"], _pullbacks(c))
    return tuple(out) if isinstance(out, list) or (torch.is_tensor(out) and out.dim() == 3) else out


def _walk_oracle(c):
    """autograd through the residual stream (eq-resid-blocks): t^(k) is the gradient of t^(L) . x^(L) at x^(k)."""
    xs = [torch.zeros_like(c["t_L"]).requires_grad_(True)]  # any x^(0): the model is linear
    for k in range(1, L + 1):
        attn, glu = _blocks(c, k)
        x_mid = xs[-1] + attn(xs[-1])
        x = x_mid + glu(x_mid)
        x.retain_grad()
        xs.append(x)
    (c["t_L"] * xs[-1]).sum().backward()
    return tuple(x.grad.detach() for x in xs)


def _walk(c, *, residual=True, glu_first=True, top_down=True, attn_reads_mid=True):
    """The walk of (eq-effective-targets), or one of the learners' variants of it."""
    t, out = c["t_L"], [c["t_L"]]
    layers = _pullbacks(c)
    for g_mhsa, g_glu in (reversed(layers) if top_down else layers):
        first, second = (g_glu, g_mhsa) if glu_first else (g_mhsa, g_glu)
        t_mid = (t if residual else 0) + first(t)
        t = (t_mid if residual else 0) + second(t_mid if attn_reads_mid else t)
        out.append(t)
    return tuple(reversed(out))


Exercise(
    "effective_targets", CHAPTER, "eq-effective-targets", cases=_walk_case, oracle=_walk_oracle, call=_walk_call,
    signature="effective_targets(t_L, layers) -> [t^(0), ..., t^(L)]",
    parts=tuple(f"t^({k})" for k in range(L + 1)),
    mistakes=[
        Mistake("the residual connection is missing: it passes the target on unchanged, t_mid = t + g_GLU(t) "
                "and t^(l-1) = t_mid + g_MHSA(t_mid) (eq-effective-targets)", lambda c: _walk(c, residual=False)),
        Mistake("within a layer the GLU comes after attention (eq-resid-blocks), so walking down its pull-back "
                "comes first: t_mid = t + g_GLU(t), then attention (eq-effective-targets)",
                lambda c: _walk(c, glu_first=False)),
        Mistake("your walk goes bottom-up: start from t^(L) at the top layer L and go down to layer 1 "
                "(eq-effective-targets)", lambda c: _walk(c, top_down=False)),
        Mistake("attention's pull-back reads t_mid, the target at its own output, not t^(l): "
                "t^(l-1) = t_mid + g_MHSA(t_mid) (eq-effective-targets)", lambda c: _walk(c, attn_reads_mid=False)),
        Mistake("your list is in the wrong order: return [t^(0), ..., t^(L)], indexed by the layer boundary, "
                "t^(L) last (eq-effective-targets)", lambda c: tuple(reversed(_walk(c)))),
    ],
)
