"""Every autograd Function dpa installs, each with its rule (book: modified-backward). The forward of each gives
the model's own value; only its backward differs:

(a) ``FrozenNorm``: a norm with its scale frozen, ``g * gamma * r`` with r = 1/rms(x) at its forward value;
(b) ``LinearisedActivation``: act(s) -> s * ratio(s) with ratio(s) frozen (SiLU: sigmoid; GELU: Phi), ``g * ratio(s)``;
(c) ``Branch``: the gradient entering a branch times its mu (and, with a bias, the bias's share);
``Tap``: the identity that writes ``input . gradient`` (per token, head or neuron) as the gradient passes and hands
it on, times a factor; ``TemperedSoftmax``: GIM's softmax rule (book: circuit-discovery).

``linearise.py`` installs them on a decoder layer (and ``experts.py`` on a sparse block); ``linearise.layer_factors``
says which factor each carries.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .errors import UnsupportedModelError
from .rules.norm import rms_scale


def _gelu_tanh_ratio(s: Tensor) -> Tensor:
    """GELU with the tanh approximation is s * 0.5 * (1 + tanh(sqrt(2/pi) * (s + 0.044715 s^3)))."""
    return 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (s + 0.044715 * s.pow(3))))


def _gelu_ratio(s: Tensor) -> Tensor:
    """The exact GELU is s * Phi(s), Phi the standard normal CDF."""
    return 0.5 * (1 + torch.erf(s * math.sqrt(0.5)))


# act(s) = s * ratio(s): the linearisation keeps the value and freezes ratio(s) (the control factor).
ACTIVATION_RATIO: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": torch.sigmoid,  # SiLU(s) = s * sigmoid(s)
    "gelu_tanh": _gelu_tanh_ratio,  # Gemma's GeGLU, GPT-2's gelu_new
    "gelu": _gelu_ratio,  # GPT-NeoX
    "relu2": torch.relu,  # Nemotron-H's squared ReLU: relu(s)^2 = s * relu(s), the ratio relu(s) frozen (book:
    # beyond-swiglu), not the gradient 2 relu(s), which counts the block twice (Euler: degree 2)
}


def agreeing(own: Callable[[Tensor], Tensor], rule: Callable[[Tensor], Tensor],
             what: str) -> Callable[[Tensor], Tensor]:
    """``own`` (a module's forward whose code is not transformers': a class of someone else's, a patch), checked on
    every call's own input against ``rule``, the arithmetic dpa's frozen backward is derived for, elementwise to the
    rounding of the dtype or of float32, the coarser: a module that agrees on the model check's probe but not on this
    input (an activation or a norm clamped beyond the probe's range) is refused by name, never linearised with
    another function's rule. ``what`` names it in the refusal."""
    def run(x: Tensor) -> Tensor:
        out = own(x)
        with torch.no_grad():
            want = rule(x)
            eps = max(torch.finfo(out.dtype).eps, torch.finfo(torch.float32).eps)  # (float64 models' norms: float32)
            scale = want.abs() + want.abs().mean(-1, keepdim=True) + x.abs()
            miss = (out.to(want.dtype) - want).abs() - 64 * eps * scale
            if bool((miss > 0).any()):
                at = int(miss.flatten().argmax())
                raise UnsupportedModelError(
                    f"unsupported module: {what} computed {float(out.flatten()[at]):.6g} where the arithmetic dpa's "
                    f"rule is derived for gives {float(want.flatten()[at]):.6g}, on this call's input "
                    f"({float(x.flatten()[at]):.6g}); "
                    "it agreed on the model check's probe but not here (a clamp beyond the probe's range?): dpa "
                    "refuses rather than linearise another function with this rule")
        return out
    return run


# --- the three changes and the taps, as autograd Functions (forward: identity on the model's value) ---

class FrozenNorm(torch.autograd.Function):
    """Value: the norm's output. Backward: the frozen linear map, g * gamma * r (times a block's mu:
    ``pull``, free here), and for a LayerNorm the mean-centring after it (a linear map too). It replaces
    the norm's forward: one Function, no hook, no graph of the norm.

    ``value(x) -> (out, r)`` is the kind's arithmetic (``NORM_KINDS``), used where it gives the module's
    own output bit for bit (``replicates``), so r comes for free; otherwise ``own``, the module's own
    forward, gives the value and r is computed beside it. Either way r is in float32, or float64 for a
    float64 model (HF's RMSNorm rounds to float32 there; the backward keeps float64). A LayerNorm's
    bias beta is an input no token owns: ``sink`` receives beta . (the gradient at the output, times the
    block's mu)."""

    @staticmethod
    def forward(ctx, x, pull, value, own, eps, centre, bias, sink):
        out, r = value(x) if own is None else (own(x), None)
        wide = torch.promote_types(x.dtype, torch.float32)
        if r is None or r.dtype != wide:
            r = rms_scale(x - x.mean(-1, keepdim=True) if centre else x, eps)  # in float32 or wider
        ctx.save_for_backward(pull, r, bias)
        ctx.centre, ctx.sink = centre, sink
        return out

    @staticmethod
    def backward(ctx, g):
        pull, r, bias = ctx.saved_tensors
        if bias is not None and ctx.sink is not None:
            ctx.sink(g.flatten(1, -2).sum(1) @ bias.to(g.dtype))  # bias: beta times the block's mu
        out = (g * pull).mul_(r.to(g.dtype))
        if ctx.centre:
            out = out - out.mean(-1, keepdim=True)
        return out, None, None, None, None, None, None, None


class LinearisedActivation(torch.autograd.Function):
    """Value: the activation module's own forward, act(s) (run inside the Function, so it records no
    graph). Backward: g * ratio(s) * factor, the gate path with ratio(s) = act(s)/s frozen."""

    @staticmethod
    def forward(ctx, s, act, ratio, factor):
        ctx.save_for_backward(s)
        ctx.ratio, ctx.factor = ratio, factor
        return act(s)

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        c = ctx.ratio(s).mul_(g)
        return (c if ctx.factor == 1 else c.mul_(ctx.factor)), None, None, None


class Branch(torch.autograd.Function):
    """Value: x. Backward: g * factor (a float, or one per output feature where a fused projection holds
    several branches); with a bias, writes bias . (gradient entering the branch)."""

    @staticmethod
    def forward(ctx, x, factor, bias, sink):
        ctx.factor, ctx.sink = factor, sink
        ctx.save_for_backward(bias)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g if is_one(ctx.factor) else g * ctx.factor
        (bias,) = ctx.saved_tensors
        if bias is not None:
            ctx.sink(g.flatten(1, -2).sum(1) @ bias.to(g.dtype))
        return g, None, None, None


class Tap(torch.autograd.Function):
    """Value: x. Backward: writes reduce(x, g) (x . g per token, head or neuron) through ``sink``, passes
    g * factor on.

    ``anchor`` is one scalar leaf shared by every tap: it keeps each tap in the graph even where its
    input needs no gradient (a block whose branches all have mu = 0)."""

    @staticmethod
    def forward(ctx, x, anchor, reduce, sink, factor):
        ctx.save_for_backward(x)
        ctx.reduce, ctx.sink, ctx.factor = reduce, sink, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if ctx.sink is not None:
            wide = torch.promote_types(x.dtype, torch.float32)
            ctx.sink(ctx.reduce(x.to(wide), g.to(wide)))
        if not isinstance(ctx.factor, Tensor) and ctx.factor == 0:
            return None, None, None, None, None
        return (g if is_one(ctx.factor) else g * ctx.factor), None, None, None, None


def is_one(factor) -> bool:
    """A factor of one (a float), not a per-feature factor (a tensor: the branches of a fused projection)."""
    return not isinstance(factor, Tensor) and factor == 1


class TemperedSoftmax(torch.autograd.Function):
    """GIM's softmax rule (book: circuit-discovery). Value: softmax(x) over the last dimension. Backward: the exact
    Jacobian with s_T = softmax(x / T) in place of s, grad_x = s_T * (grad_s - sum(grad_s * s_T)), no 1/T factor
    (T = 1: the exact backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, temperature: float) -> Tensor:
        ctx.save_for_backward(torch.softmax(x / temperature, -1).nan_to_num(0.0))
        return torch.softmax(x, -1)

    @staticmethod
    def backward(ctx, g: Tensor):
        (s_t,) = ctx.saved_tensors
        g = g.nan_to_num(0.0)
        return s_t * (g - (g * s_t).sum(-1, keepdim=True)), None
