"""The linearised model as a context manager: DPA is the gradient of it (method.md section 5, identity 1).

Inside ``instrument(model, request, weights=...)`` the model's own modules and attention kernel run
unchanged in the forward pass -- every value is the model's -- while the backward pass is that of
the linearised copy:

(a) every norm's scale is frozen: its backward is ``g * gamma * r`` with r = 1/rms(x) at its forward value;
(b) the gated activation is linearised: SiLU(s) -> s * sigmoid(s) with sigmoid(s) frozen, so its
    backward is ``g * sigmoid(s)``;
(c) the gradient entering each branch (query, key, value, gate, up) is multiplied by its mu.

Each change is an autograd Function whose forward returns the module's output untouched. Scores are
read by *taps* on the way down: a tap is the identity in the forward; in the backward it writes
``input . gradient`` (per token, head or neuron) into the score buffers and passes the gradient on.
One tap carries each block's common factor (at the heads, the mu most attention branches share; at
the neurons, mu_up), so those branches need no Function of their own and the others get the ratio.
The gradient entering every branch is mu times the true one either way (tested path by path).

Other modes of the same context: ``explicit=True`` runs attention through dpa's readable
recomputation (``explicit.py``) so that alpha is a tensor that can be recorded or masked (the edge
ablations, gradient baselines, verify); ``neuron_keep`` masks the GLU activations; ``record=True``
keeps each layer's boundary tensors for the decomposition baselines; ``lean=True`` recomputes one
decoder layer at a time in the backward (checkpointing at layer boundaries, eval mode kept).

Whatever happens inside -- an error, KeyboardInterrupt -- the model leaves with the same modules,
hooks, ``requires_grad`` flags, train/eval mode and attention implementation. One lock per model
serialises calls from several threads.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .errors import ModelStateError
from .families import LayerModules, ModelSpec, layer_modules, norm_scale
from .request import Request
from .weights import PathWeights

ACTIVATION_RATIO: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": torch.sigmoid,  # SiLU(s) = s * sigmoid(s)
}


# --- the three changes and the taps, as autograd Functions (forward: identity on the model's value) ---

class _FrozenNorm(torch.autograd.Function):
    """Value: the norm's own output. Backward: the frozen diagonal map, g * gamma * r."""

    @staticmethod
    def forward(ctx, x, out, gamma, r):
        ctx.save_for_backward(gamma, r)
        return out

    @staticmethod
    def backward(ctx, g):
        gamma, r = ctx.saved_tensors
        return (g * gamma).mul_(r.to(g.dtype)), None, None, None


class _LinearisedActivation(torch.autograd.Function):
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


class _Branch(torch.autograd.Function):
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


class _Tap(torch.autograd.Function):
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


# --- what a session records ---

@dataclass
class Scores:
    """Score buffers the taps write during the backward, [batch ...] in ``dtype``."""

    tokens: Tensor  # [batch pos]
    heads: Tensor  # [batch layer head]
    neurons: Tensor  # [batch layer d_mlp]
    neuron_positions: Tensor | None  # [batch layer pos d_mlp]
    bias: Tensor  # [batch]: the share of inputs no token owns (projection biases)

    @classmethod
    def empty(cls, spec: ModelSpec, batch: int, pos: int, dtype: torch.dtype, device, positions: bool) -> Scores:
        z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(tokens=z(batch, pos), heads=z(batch, spec.n_layers, spec.n_heads),
                   neurons=z(batch, spec.n_layers, spec.d_mlp),
                   neuron_positions=z(batch, spec.n_layers, pos, spec.d_mlp) if positions else None, bias=z(batch))


@dataclass
class Recording:
    """Tensors seen in the forward pass, by layer. ``resid[l]`` is layer l's input (``resid[n_layers]`` the
    final norm's), ``mid[l]`` the residual after attention, ``head_inputs[l]`` / ``neuron_inputs[l]`` the
    tapped inputs (with their graph, for gradients); ``branches[(name, l)]`` the branch outputs, detached;
    ``probs[l]`` alpha from the explicit path (with its graph); ``rope`` the rotary (cos, sin)."""

    resid: dict[int, Tensor] = field(default_factory=dict)
    mid: dict[int, Tensor] = field(default_factory=dict)
    head_inputs: dict[int, Tensor] = field(default_factory=dict)
    neuron_inputs: dict[int, Tensor] = field(default_factory=dict)
    branches: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    probs: dict[int, Tensor] = field(default_factory=dict)
    rope: tuple[Tensor, Tensor] | None = None


# --- one lock per model, and the model's state to restore ---

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
_ACTIVE = threading.local()


def _lock(model: nn.Module) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.Lock()
        return lock


@contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """Hold the model's lock (other threads wait); the same thread re-entering is an error."""
    active = getattr(_ACTIVE, "models", None)
    if active is None:
        active = _ACTIVE.models = set()
    if id(model) in active:
        raise ModelStateError("dpa is already running on this model in this thread (a call from inside a hook "
                              "or callback of another dpa call); make the calls one after another")
    with _lock(model):
        active.add(id(model))
        try:
            yield
        finally:
            active.discard(id(model))


@contextmanager
def _model_state(model: nn.Module) -> Iterator[Callable[[nn.Module, Callable], None]]:
    """Eval mode and no parameter gradients inside; yields ``override(module, forward)`` for instance
    forwards. Mode, flags and forwards are restored on exit, whatever happened inside."""
    training = [m for m in model.modules() if m.training]
    grads = [p for p in model.parameters() if p.requires_grad]
    overridden: list[tuple[nn.Module, object]] = []
    missing = object()

    def override(module: nn.Module, forward: Callable) -> None:
        overridden.append((module, module.__dict__.get("forward", missing)))
        module.forward = forward

    try:
        for m in training:
            m.training = False
        for p in grads:
            p.requires_grad_(False)
        yield override
    finally:
        for module, previous in reversed(overridden):
            if previous is missing:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        for p in grads:
            p.requires_grad_(True)
        for m in training:
            m.training = True


# --- the session ---

class Session:
    """One instrumented forward (and backward): ``forward`` runs the decoder stack, ``backward`` the
    linearised gradient, filling ``scores``; ``recording`` holds what was seen on the way."""

    def __init__(self, model: nn.Module, request: Request, weights: PathWeights | None, scores: Scores | None,
                 recording: Recording, record: set[str]):
        self.model, self.request, self.spec = model, request, request.spec
        self.weights, self.scores, self.recording, self.record = weights, scores, recording, record
        self.anchor = torch.zeros((), requires_grad=True, device=request.device)

    def forward(self, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None) -> Tensor:
        """The decoder stack's last hidden state [rows pos d_model] (after the final norm): the request's
        prompts, or ``input_ids`` / ``inputs_embeds`` rows (copies of a one-prompt request, edited)."""
        req = self.request
        padded = not bool(req.mask.all())
        rows = (inputs_embeds if inputs_embeds is not None else input_ids if input_ids is not None
                else req.input_ids).shape[0]
        if padded and rows != req.batch:
            raise ValueError("edited copies of a padded batch are not supported; use one prompt")
        position_ids = req.position_ids if rows == req.batch else req.position_ids.expand(rows, -1)
        args = dict(attention_mask=req.mask.long() if padded else None, position_ids=position_ids, use_cache=False)
        if inputs_embeds is not None:
            args["inputs_embeds"] = inputs_embeds
        else:
            args["input_ids"] = req.input_ids if input_ids is None else input_ids
        return self.spec.base(self.model)(**args).last_hidden_state

    def embed(self, input_ids: Tensor | None = None) -> Tensor:
        """Token embeddings [rows pos d_model] (what the input ablation zeroes)."""
        return self.spec.embed(self.model)(self.request.input_ids if input_ids is None else input_ids)

    def backward(self, value: Tensor, extra: list[Tensor] = ()) -> list[Tensor | None]:
        """Run the linearised backward from the scalar ``value``; returns the gradients of ``extra``."""
        grads = torch.autograd.grad(value, [self.anchor, *extra], allow_unused=True)
        return list(grads[1:])


def _sink(buffer: Tensor, index) -> Callable[[Tensor], None]:
    def write(x: Tensor) -> None:
        buffer[index] += x.to(device=buffer.device, dtype=buffer.dtype)
    return write


RECORDABLE = frozenset({"resid", "mid", "branches", "head_inputs", "neuron_inputs", "rope"})


@contextmanager
def instrument(model: nn.Module, request: Request, *, weights: PathWeights | None = None,
               scores: Scores | None = None, record: frozenset[str] | set[str] = frozenset(),
               explicit: bool = False, attn_keep: dict[int, Tensor | None] | None = None,
               neuron_keep: dict[int, Tensor] | None = None, lean: bool = False,
               grad: bool | None = None) -> Iterator[Session]:
    """The model instrumented for one request; see the module docstring.

    weights: linearise (norms, activation, mu) with these path weights; None leaves the backward the
    model's own (the gradient baselines). scores: buffers for the taps (needs weights). record: which
    of ``RECORDABLE`` to keep in ``session.recording`` (only what is asked for stays in memory).
    explicit: attention through ``explicit.py``; attn_keep: layer -> keep multiplier on alpha
    [batch head query key] (None: explicit, nothing masked); neuron_keep: layer -> keep multiplier on
    the GLU activation [batch pos d_mlp]. lean: checkpoint each decoder layer. grad: build the autograd
    graph (default: when linearising); otherwise the forward runs without one.
    """
    unknown = set(record) - RECORDABLE
    if unknown:
        raise ValueError(f"cannot record {sorted(unknown)}; choose from {sorted(RECORDABLE)}")
    if scores is not None and weights is None:
        raise ValueError("score taps need path weights (the linearised model)")
    spec, parts = request.spec, request.spec.parts
    recording = Recording()
    with ExitStack() as stack:
        stack.enter_context(exclusive(model))
        override = stack.enter_context(_model_state(model))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if (weights is not None if grad is None else grad) else torch.no_grad())
        session = Session(model, request, weights, scores, recording, set(record))
        handles: list = []
        stack.callback(lambda: [h.remove() for h in handles])
        hook = lambda module, fn, pre=False: handles.append(  # noqa: E731
            module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn))
        layers = layer_modules(model, spec)

        if scores is not None:
            hook(spec.embed(model), lambda m, a, out: _Tap.apply(
                out, session.anchor, lambda p: p.sum(-1), _sink(scores.tokens, slice(None)), 1))
        if weights is not None:
            norms = [spec.final_norm(model)] + [n for mods in layers for n in (*mods.norms, *mods.head_norms)]
            for norm in norms:
                hook(norm, _freeze_norm)
        if "resid" in record:
            hook(spec.final_norm(model), _keep(recording.resid, spec.n_layers), pre=True)
        if "rope" in record or explicit or attn_keep is not None:
            hook(spec.rotary(model), lambda m, a, out: setattr(recording, "rope", tuple(out)))
        for i, mods in enumerate(layers):
            if "resid" in record:
                hook(mods.norms[0], _keep(recording.resid, i), pre=True)
            if "mid" in record:
                hook(mods.mid, _keep(recording.mid, i), pre=True)
            if weights is not None:
                _linearise_layer(session, i, mods, hook)
            else:
                if "branches" in record:
                    for name, module in mods.branches.items():
                        hook(module, _keep_output(recording.branches, (name, i)))
                if "neuron_inputs" in record:
                    hook(mods.neurons, _keep(recording.neuron_inputs, i), pre=True)
            if neuron_keep and neuron_keep.get(i) is not None:
                hook(mods.neurons, _mask_input(neuron_keep[i]), pre=True)
            if explicit or attn_keep is not None:
                from .explicit import attention_forward

                keep = (attn_keep or {}).get(i)
                override(mods.attention, attention_forward(spec, request, mods, i, keep, recording))
            if lean:
                override(mods.layer, functools.partial(checkpoint, mods.layer.forward, use_reentrant=False))
        yield session


def _freeze_norm(norm: nn.Module, args, out: Tensor) -> Tensor:
    x = args[0]
    return _FrozenNorm.apply(x, out.detach(), norm.weight.detach(), norm_scale(norm, x))


def _keep(store: dict, key) -> Callable:
    def pre(_module, args):
        store[key] = args[0]
    return pre


def _keep_output(store: dict, key) -> Callable:
    def post(_module, _args, out):
        store[key] = out.detach()
    return post


def _mask_input(keep: Tensor) -> Callable:
    def pre(_module, args):
        return (args[0] * keep.to(args[0].dtype), *args[1:])
    return pre


def _common(*mus: float) -> float:
    """The factor a block's tap carries: the value most of its branches share, so that as few branches
    as possible need a Function of their own (q = k = 0.25, v = 0.5 -> 0.25; only v gets a factor)."""
    nonzero = [m for m in mus if m != 0]
    return max(nonzero, key=nonzero.count) if nonzero else 1.0


def _factor(mu: float, common: float) -> float | None:
    """The factor a branch's own Function applies: None when mu is 0 (the branch is cut)."""
    return None if mu == 0 else mu / common


def _linearise_layer(session: Session, i: int, mods: LayerModules, hook) -> None:
    spec, mu, scores, rec = session.spec, session.weights, session.scores, session.recording
    attn_common = _common(mu.query, mu.key, mu.value)  # carried by the head tap
    share = _sink(scores.bias, slice(None)) if scores is not None else (lambda x: None)
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
        return _LinearisedActivation.apply(args[0], out.detach(), ratio, gate_factor)

    hook(mods.activation, act)
    n_heads = spec.n_heads
    head_sink = _sink(scores.heads, (slice(None), i)) if scores is not None else None

    def heads(_module, args):
        x = args[0]
        b, t, _ = x.shape
        reduce = lambda p: p.view(b, t, n_heads, -1).sum((1, 3))  # noqa: E731
        y = _Tap.apply(x, session.anchor, reduce, head_sink, attn_common)
        if "head_inputs" in session.record:
            rec.head_inputs[i] = y
        return (y, *args[1:])

    if scores is None:
        reduce, neuron_sink = None, None
    elif scores.neuron_positions is not None:  # the per-neuron sums are taken from these afterwards
        reduce, neuron_sink = (lambda p: p), _sink(scores.neuron_positions, (slice(None), i))
    else:
        reduce, neuron_sink = (lambda p: p.sum(1)), _sink(scores.neurons, (slice(None), i))
    up_bias = getattr(mods.branches["up"], "bias", None)

    def up(module, _args, out):  # the neuron tap (see Family.neurons); it also carries mu_up
        if store is not None:
            store[("up", i)] = out.detach()
        y = _Tap.apply(out, session.anchor, reduce, neuron_sink, mu.up)
        return y if up_bias is None else _Branch.apply(y, 1, up_bias.detach(), share)

    hook(mods.heads, heads, pre=True)
    hook(mods.branches["up"], up)
    if "neuron_inputs" in session.record:
        hook(mods.neurons, _keep(rec.neuron_inputs, i), pre=True)


def _branch(factor: float | None, share: Callable, store: dict | None, key) -> Callable:
    def post(module, _args, out):
        if store is not None:
            store[key] = out.detach()
        if factor is None:
            return out.detach()
        bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
        if factor == 1 and bias is None:
            return out
        return _Branch.apply(out, factor, bias, share)
    return post


def logits_at(model: nn.Module, request: Request, hidden: Tensor, positions: Tensor | int | None = None) -> Tensor:
    """Next-token logits [rows vocab] from a last hidden state [rows pos d_model] at the target
    positions (one per row, or ``positions``), in float32 or better: only those rows are unembedded."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pos = request.positions if positions is None else positions
    if isinstance(pos, Tensor) and pos.numel() == 1:
        pos = int(pos)
    final = hidden[:, pos] if isinstance(pos, int) else hidden[rows, pos]
    logits = request.spec.unembed(model)(final)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def clean_logits(model: nn.Module, request: Request) -> Tensor:
    """One plain forward pass (under the model's lock): logits [batch vocab] at the target positions."""
    with instrument(model, request) as session:
        return logits_at(model, request, session.forward())
