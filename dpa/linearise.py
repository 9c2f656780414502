"""The linearised model's three changes and the score taps, as autograd Functions (book: modified-backward).

Each Function's forward returns the model's own value untouched; only its backward differs:

(a) ``FrozenNorm``: a norm with its scale frozen, ``g * gamma * r`` with r = 1/rms(x) at its forward value;
(b) ``LinearisedActivation``: SiLU(s) -> s * sigmoid(s) with sigmoid(s) frozen, ``g * sigmoid(s)``;
(c) ``Branch``: the gradient entering a branch times its mu (and, with a bias, the bias's share);
``Tap``: the identity that writes ``input . gradient`` (per token, head or neuron) as the gradient
passes and hands the gradient on, times a factor.

One tap carries each block's common factor (at the heads, the mu most attention branches share; at
the neurons, mu_up), so those branches need no Function of their own and the others get the ratio.
The gradient entering every branch is mu times the true one either way (tested path by path).
``linearise_layer`` installs them on one decoder layer, from the family description's modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from .families import LayerModules, ModelSpec, norm_scale

ACTIVATION_RATIO: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": torch.sigmoid,  # SiLU(s) = s * sigmoid(s)
}


# --- the three changes and the taps, as autograd Functions (forward: identity on the model's value) ---

class FrozenNorm(torch.autograd.Function):
    """Value: the norm's own output. Backward: the frozen diagonal map, g * gamma * r."""

    @staticmethod
    def forward(ctx, x, out, gamma, r):
        ctx.save_for_backward(gamma, r)
        return out

    @staticmethod
    def backward(ctx, g):
        gamma, r = ctx.saved_tensors
        return (g * gamma).mul_(r.to(g.dtype)), None, None, None


class LinearisedActivation(torch.autograd.Function):
    """Value: act(s). Backward: g * ratio(s) * factor, the gate path with ratio(s) = act(s)/s frozen."""

    @staticmethod
    def forward(ctx, s, out, ratio, factor):
        ctx.save_for_backward(s)
        ctx.ratio, ctx.factor = ratio, factor
        return out

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        c = ctx.ratio(s).mul_(g)
        return (c if ctx.factor == 1 else c.mul_(ctx.factor)), None, None, None


class Branch(torch.autograd.Function):
    """Value: x. Backward: g * factor; with a bias, writes bias . (gradient entering the branch)."""

    @staticmethod
    def forward(ctx, x, factor, bias, sink):
        ctx.factor, ctx.sink = factor, sink
        ctx.save_for_backward(bias)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g if ctx.factor == 1 else g * ctx.factor
        (bias,) = ctx.saved_tensors
        if bias is not None:
            ctx.sink(g.flatten(1, -2).sum(1) @ bias.to(g.dtype))
        return g, None, None, None


class Tap(torch.autograd.Function):
    """Value: x. Backward: writes reduce(x * g) through ``sink``, passes g * factor on.

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
            ctx.sink(ctx.reduce(x.to(wide) * g.to(wide)))
        if ctx.factor == 0:
            return None, None, None, None, None
        return (g if ctx.factor == 1 else g * ctx.factor), None, None, None, None


@dataclass
class Scores:
    """Scores the taps write during the backward, [batch ...] in ``dtype`` once ``settle`` has run.

    During the backward each tap only appends its part (no tensor arithmetic on the way down);
    ``settle`` stacks the parts into ``tokens`` [batch pos], ``heads`` [batch layer head], ``neurons``
    [batch layer d_mlp], ``neuron_positions`` [batch layer pos d_mlp] (when asked for) and ``bias``
    [batch], the share of inputs no token owns (projection biases)."""

    spec: ModelSpec
    shape: tuple[int, int]  # (batch, pos)
    dtype: torch.dtype
    device: torch.device
    positions: bool
    parts: dict = field(default_factory=dict)
    tokens: Tensor | None = None
    heads: Tensor | None = None
    neurons: Tensor | None = None
    neuron_positions: Tensor | None = None
    bias: Tensor | None = None

    @classmethod
    def empty(cls, spec: ModelSpec, batch: int, pos: int, dtype: torch.dtype, device, positions: bool) -> Scores:
        return cls(spec, (batch, pos), dtype, torch.device(device), positions)

    def sink(self, kind: str, layer: int | None = None) -> Callable[[Tensor], None]:
        parts = self.parts.setdefault((kind, layer), [])
        return parts.append

    def settle(self) -> None:
        """Turn the parts the backward appended into the score tensors."""
        b, t = self.shape
        spec = self.spec
        sizes = {"heads": (b, spec.n_heads), "neurons": (b, spec.d_mlp), "neuron_positions": (b, t, spec.d_mlp)}

        def total(kind, layer, shape):
            parts = self.parts.get((kind, layer))
            if not parts:
                return torch.zeros(shape, dtype=self.dtype, device=self.device)
            out = parts[0].to(self.device, self.dtype)
            for p in parts[1:]:
                out = out + p.to(self.device, self.dtype)
            return out

        self.tokens = total("tokens", None, (b, t))
        self.bias = total("bias", None, (b,))
        kinds = ["heads", "neuron_positions" if self.positions else "neurons"]
        for kind in kinds:
            setattr(self, kind, torch.stack([total(kind, i, sizes[kind]) for i in range(spec.n_layers)], dim=1))
        if self.positions:
            self.neurons = self.neuron_positions.sum(2)


def freeze_norm(norm: nn.Module, args, out: Tensor) -> Tensor:
    x = args[0]
    return FrozenNorm.apply(x, out.detach(), norm.weight.detach(), norm_scale(norm, x))


def keep_input(store: dict, key) -> Callable:
    def pre(_module, args):
        store[key] = args[0]
    return pre


def _common(*mus: float) -> float:
    """The factor a block's tap carries: the value most of its branches share, so that as few branches
    as possible need a Function of their own (q = k = 0.25, v = 0.5 -> 0.25; only v gets a factor)."""
    nonzero = [m for m in mus if m != 0]
    return max(nonzero, key=nonzero.count) if nonzero else 1.0


def _factor(mu: float, common: float) -> float | None:
    """The factor a branch's own Function applies: None when mu is 0 (the branch is cut)."""
    return None if mu == 0 else mu / common


def linearise_layer(session, i: int, mods: LayerModules, hook) -> None:
    spec, mu, scores, rec = session.spec, session.weights, session.scores, session.recording
    attn_common = _common(mu.query, mu.key, mu.value)  # carried by the head tap
    share = scores.sink("bias") if scores is not None else (lambda x: None)
    store = rec.branches if "branches" in session.record else None
    for name in ("query", "key", "value"):
        module, factor = mods.branches[name], _factor(getattr(mu, name), attn_common)
        if factor != 1 or store is not None or getattr(module, "bias", None) is not None:
            hook(module, _branch(factor, share, store, (name, i)))
    gate_factor = _factor(mu.gate, 1.0)
    ratio = ACTIVATION_RATIO[spec.parts.activation[1]]

    def act(_module, args, out):
        if store is not None:
            store[("gate", i)] = args[0].detach()
        if gate_factor is None:
            return out.detach()
        return LinearisedActivation.apply(args[0], out.detach(), ratio, gate_factor)

    hook(mods.activation, act)
    n_heads = spec.n_heads
    head_sink = scores.sink("heads", i) if scores is not None else None

    def heads(_module, args):
        x = args[0]
        b, t, _ = x.shape
        reduce = lambda p: p.view(b, t, n_heads, -1).sum((1, 3))  # noqa: E731
        y = Tap.apply(x, session.anchor, reduce, head_sink, attn_common)
        if "head_inputs" in session.record:
            rec.head_inputs[i] = y
        return (y, *args[1:])

    if scores is None:
        reduce, neuron_sink = None, None
    elif scores.positions:  # the per-neuron sums are taken from these afterwards
        reduce, neuron_sink = (lambda p: p), scores.sink("neuron_positions", i)
    else:
        reduce, neuron_sink = (lambda p: p.sum(1)), scores.sink("neurons", i)

    def up(module, _args, out):  # the neuron tap (see Family.neurons); it also carries mu_up
        if store is not None:
            store[("up", i)] = out.detach()
        return Tap.apply(out, session.anchor, reduce, neuron_sink, mu.up)

    hook(mods.heads, heads, pre=True)
    hook(mods.branches["up"], up)
    if "neuron_inputs" in session.record:
        hook(mods.neurons, keep_input(rec.neuron_inputs, i), pre=True)


def _branch(factor: float | None, share: Callable, store: dict | None, key) -> Callable:
    def post(module, _args, out):
        if store is not None:
            store[key] = out.detach()
        if factor is None:
            return out.detach()
        bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
        if factor == 1 and bias is None:
            return out
        return Branch.apply(out, factor, bias, share)
    return post
