"""Exercises of chapter layernorm-gelu: the frozen LayerNorm's pull-back, the GELU MLP's one branch, and a GPT-2
MLP block with its bias share."""

from __future__ import annotations

import math

import torch

from ._core import F64, Exercise, Mistake, randn, vjp

CHAPTER = "layernorm-gelu"


def _Phi(s):  # the standard normal CDF: GELU(s) = s * Phi(s)
    return 0.5 * (1 + torch.erf(s / math.sqrt(2)))


def _phi(s):  # the standard normal density
    return torch.exp(-s ** 2 / 2) / math.sqrt(2 * math.pi)


def _scale_grad(x, mu):
    return mu * x + (1 - mu) * x.detach()


def _ln_pull(t_h, x, gamma, eps, centre=True, frozen=True, with_r=True):
    """J^T t_h of (eq-ln-backward), and the mistakes: no centring, the scale not frozen, r left out."""
    xc = x - x.mean(-1, keepdim=True)
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) if with_r else 1.0
    gt = gamma * t_h
    g = gt - gt.mean(-1, keepdim=True) if centre else gt
    if not frozen:  # the true gradient: differentiate 1/sigma too
        h = xc * r
        g = g - h * (h * gt).mean(-1, keepdim=True)
    return r * g


# -- 1. by hand: a 4-dimensional LayerNorm --------------------------------------------------------------------------
def _hand_case(gen=None) -> dict:
    v = lambda *a: torch.tensor(a, dtype=F64)  # noqa: E731
    return dict(x=v(4, 0, 4, 0), gamma=v(1, 2, 1, 0.5), beta=v(0.5, 0, 0, 1), t=v(1, 1, -1, 2))


def _hand(c, **how):
    g = _ln_pull(c["t"], c["x"], c["gamma"], 0.0, **how)
    return g, c["x"] @ g, c["beta"] @ c["t"]


Exercise(
    "ln_by_hand", CHAPTER, "eq-ln-backward", cases=_hand_case, n_cases=1, rtol=0, atol=5e-3,
    parts=("the pulled-back target J^T t", "the input's share x . J^T t", "beta's share beta . t"),
    part_equations=("eq-ln-backward", "eq-ln-split", "eq-ln-split"),
    oracle=_hand,
    mistakes=[
        Mistake("J^T t is missing the centring: r (gamma * t) is the RMSNorm rule; LayerNorm's pull-back subtracts "
                "the mean of gamma * t, r (gamma * t - mean(gamma * t)) (eq-ln-backward)",
                lambda c: (_hand(c, centre=False)[0], None, None)),
        Mistake("that is the true gradient of LayerNorm, which differentiates 1/sigma(x) too (and gives the input "
                "a share of 0: LayerNorm is scale-invariant); DPA freezes r = 1/sigma(x) = 1/2 (eq-ln-frozen)",
                lambda c: (_hand(c, frozen=False)[0], None, None)),
        Mistake("J^T t is missing the frozen scale r = 1/sigma(x) = 1/2 (eq-ln-backward)",
                lambda c: (_hand(c, with_r=False)[0], None, None)),
        Mistake("you centred t before multiplying by gamma; J^T = r C diag(gamma): gamma first, then the centring, "
                "r C (gamma * t) (eq-ln-backward)",
                lambda c: (0.5 * c["gamma"] * (c["t"] - c["t"].mean()), None, None)),
        Mistake("beta's share is beta . t: beta is added after the gain and the scale, so nothing multiplies it "
                "(eq-ln-split)", lambda c: (None, None, 0.5 * (c["gamma"] * c["beta"]) @ c["t"])),
        Mistake("beta's share is beta . t: beta is added after the gain and the scale, so nothing multiplies it "
                "(eq-ln-split)", lambda c: (None, None, 0.5 * c["beta"] @ c["t"])),
        Mistake("beta carries a share of its own, beta . t: it is an input of the model no position owns "
                "(eq-ln-split)", lambda c: (None, None, torch.zeros((), dtype=F64))),
    ],
)


# -- 2. implement: the GELU MLP's one branch -----------------------------------------------------------------------
def _mlp_case(gen: torch.Generator) -> dict:
    pos, d, d_mlp = 4, 6, 10
    mu = torch.rand(2, generator=gen, dtype=F64)
    return dict(t=randn(gen, pos, d), x=randn(gen, pos, d), W_1=randn(gen, d_mlp, d, scale=d**-0.5),
                b_1=randn(gen, d_mlp, scale=0.5), W_2=randn(gen, d, d_mlp, scale=d_mlp**-0.5),
                mu_gate=float(mu[0]), mu_up=float(mu[1]))


def _s(c):
    return c["x"] @ c["W_1"].T + c["b_1"]


def _mlp_oracle(c):
    """autograd through the MLP with Phi(s) frozen and mu_gate + mu_up of the gradient into W_1."""
    mu, ratio = c["mu_gate"] + c["mu_up"], _Phi(_s(c))
    return vjp(lambda x: (_scale_grad(x @ c["W_1"].T + c["b_1"], mu) * ratio) @ c["W_2"].T, c["x"], c["t"])


def _mlp_call(fn, c):
    return fn(c["t"], _s(c), c["W_1"], c["W_2"], c["mu_gate"], c["mu_up"])


def _mlp(c, coef=None, mu=None):
    s = _s(c)
    c_vec = (c["t"] @ c["W_2"]) * (_Phi(s) if coef is None else coef(s))
    return (c["mu_gate"] + c["mu_up"] if mu is None else mu) * c_vec @ c["W_1"]


def _tanh_factor(s):  # GPT-2's gelu_new factor
    return 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (s + 0.044715 * s ** 3)))


Exercise(
    "gelu_mlp_path", CHAPTER, "eq-gelu-path", cases=_mlp_case, oracle=_mlp_oracle, call=_mlp_call,
    signature="gelu_mlp_path(t, s, W_1, W_2, mu_gate, mu_up) -> g",
    mistakes=[
        Mistake("your coefficient is GELU'(s) = Phi(s) + s phi(s), the true gradient's; DPA freezes Phi(s) on "
                "both paths and each delivers c = lambda * Phi(s) (eq-gelu-path)",
                lambda c: _mlp(c, coef=lambda s: _Phi(s) + s * _phi(s))),
        Mistake("your coefficient is the activation GELU(s) = s Phi(s); what reaches s is lambda times the frozen "
                "factor, c = lambda * Phi(s) (eq-gelu-path)", lambda c: _mlp(c, coef=lambda s: s * _Phi(s))),
        Mistake("you used the tanh approximation's factor (GPT-2's gelu_new); this MLP's GELU is the exact one, "
                "s Phi(s) with Phi the normal CDF (eq-gelu-forward)", lambda c: _mlp(c, coef=_tanh_factor)),
        Mistake("only one path reaches W_1 in your answer; s is both the content and the control, and both paths "
                "deliver c to the one branch: pass (mu_gate + mu_up) c (eq-gelu-complete)",
                lambda c: _mlp(c, mu=c["mu_up"])),
        Mistake("only one path reaches W_1 in your answer; s is both the content and the control, and both paths "
                "deliver c to the one branch: pass (mu_gate + mu_up) c (eq-gelu-complete)",
                lambda c: _mlp(c, mu=c["mu_gate"])),
        Mistake("the path weights are missing: the branch W_1 passes (mu_gate + mu_up) c (eq-gelu-complete)",
                lambda c: _mlp(c, mu=1.0)),
        Mistake("the path weights are missing: the branch W_1 passes (mu_gate + mu_up) c (eq-gelu-complete)",
                lambda c: _mlp(c, mu=2.0)),
    ],
)


# -- 3. implement: a GPT-2 MLP block, LayerNorm to output, with its bias share ---------------------------------------
def _block_case(gen: torch.Generator) -> dict:
    c = _mlp_case(gen)
    d = c["x"].shape[-1]
    return dict(c, x=randn(gen, *c["x"].shape) + 1.0, gamma=1 + 0.3 * randn(gen, d), beta=randn(gen, d, scale=0.5),
                b_2=randn(gen, d, scale=0.5), eps=1e-5)


def _block_oracle(c):
    """autograd on the linearised block: 1/sigma detached, Phi(s) detached, mu_gate + mu_up into W_1; every bias a
    leaf, its share bias x gradient."""
    x, beta, b_1, b_2 = (c[k].clone().requires_grad_(True) for k in ("x", "beta", "b_1", "b_2"))
    with torch.enable_grad():
        xc = x - x.mean(-1, keepdim=True)
        h = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + c["eps"]).detach() * c["gamma"] + beta
        s = _scale_grad(h @ c["W_1"].T + b_1, c["mu_gate"] + c["mu_up"])
        out = (s * _Phi(s).detach()) @ c["W_2"].T + b_2
        grads = torch.autograd.grad((c["t"] * out).sum(), (x, beta, b_1, b_2))
    return grads[0], sum((b * g).sum() for b, g in zip((beta, b_1, b_2), grads[1:])).detach()


def _block_call(fn, c):
    return fn(c["t"], c["x"], c["gamma"], c["beta"], c["W_1"], c["b_1"], c["W_2"], c["b_2"], c["mu_gate"],
              c["mu_up"], c["eps"])


def _block(c, coef=_Phi, beta=1.0, b_1=1.0, b_2=1.0, mu_b1=True, **ln):
    xc = c["x"] - c["x"].mean(-1, keepdim=True)
    h = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + c["eps"]) * c["gamma"] + c["beta"]
    s, mu = h @ c["W_1"].T + c["b_1"], c["mu_gate"] + c["mu_up"]
    c_vec = (c["t"] @ c["W_2"]) * coef(s)
    t_h = mu * c_vec @ c["W_1"]
    share = (beta * (c["beta"] * t_h).sum() + b_1 * (mu if mu_b1 else 1.0) * (c["b_1"] * c_vec).sum()
             + b_2 * (c["b_2"] * c["t"]).sum())
    return _ln_pull(t_h, c["x"], c["gamma"], c["eps"], **ln), share


Exercise(
    "ln_gelu_block", CHAPTER, "eq-gelu-complete", cases=_block_case, oracle=_block_oracle, call=_block_call,
    signature="ln_gelu_block(t, x, gamma, beta, W_1, b_1, W_2, b_2, mu_gate, mu_up, eps) -> (g, bias_share)",
    parts=("g on the block's residual input", "the bias share"),
    mistakes=[
        Mistake("your g is missing the LayerNorm's centring: r (gamma * t - mean(gamma * t)), not r (gamma * t) "
                "(eq-ln-backward)", lambda c: (_block(c, centre=False)[0], None)),
        Mistake("your g differentiates the LayerNorm's 1/sigma(x); DPA freezes the scale r (eq-ln-frozen)",
                lambda c: (_block(c, frozen=False)[0], None)),
        Mistake("your MLP coefficient is GELU'(s), the true gradient's; DPA's is c = lambda * Phi(s) (eq-gelu-path)",
                lambda c: _block(c, coef=lambda s: _Phi(s) + s * _phi(s))),
        Mistake("the bias share is missing beta's part: the LayerNorm's beta carries beta . t_h, with t_h the "
                "target on the LayerNorm's output (eq-ln-split)", lambda c: (None, _block(c, beta=0.0)[1])),
        Mistake("the bias share is missing b_1's part: s includes b_1, which carries (mu_gate + mu_up) b_1 . c "
                "(eq-gelu-complete)", lambda c: (None, _block(c, b_1=0.0)[1])),
        Mistake("b_1's share is missing the path weights: b_1 sits inside the branch W_1, so it carries "
                "(mu_gate + mu_up) b_1 . c (eq-gelu-complete)", lambda c: (None, _block(c, mu_b1=False)[1])),
        Mistake("the bias share is missing b_2's part: the output bias carries b_2 . t (eq-pos-complete)",
                lambda c: (None, _block(c, b_2=0.0)[1])),
        Mistake("eps is missing from sigma(x): sigma(x) = (1/d |x - mean(x)|^2 + eps)^(1/2) (eq-ln-forward)",
                lambda c: _block(dict(c, eps=0.0))),
    ],
)
