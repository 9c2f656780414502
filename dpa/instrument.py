"""The linearised model as a context manager: DPA is the gradient of it (book: modified-backward, identity 1).

Inside ``instrument(model, request, weights=...)`` the model's own modules and attention kernel run
unchanged in the forward pass -- every value is the model's -- while the backward pass is that of
the linearised copy:

(a) every norm's scale is frozen: its backward is ``g * gamma * r`` with r = 1/rms(x) at its forward value;
(b) the gated activation is linearised: act(s) -> s * c(s) with c(s) frozen (SiLU: c = sigmoid; tanh GELU:
    c = 0.5 (1 + tanh(...))), so its backward is ``g * c(s)``;
(c) the gradient entering each branch (query, key, value, gate, up) is multiplied by its mu.

Each change is an autograd Function whose forward returns the module's output untouched. Scores are
read by *taps* on the way down: a tap is the identity in the forward; in the backward it writes
``input . gradient`` (per token, head or neuron) into the score buffers and passes the gradient on.
The Functions, the taps and how they are placed on a layer are in ``linearise.py``.

Other modes of the same context: ``explicit=True`` runs attention through dpa's readable
recomputation (``explicit.py``) so that alpha is a tensor that can be recorded or masked (the edge
ablations, gradient baselines, verify); ``neuron_keep`` masks the GLU activations; ``record`` keeps
the tensors asked for (residual streams, branch outputs, tapped inputs) for the baselines and the
finer scores; ``lean=True`` recomputes one decoder layer at a time in the backward (checkpointing at
layer boundaries, eval mode kept).

Whatever happens inside -- an error, KeyboardInterrupt -- the model leaves with the same modules,
hooks, ``requires_grad`` flags, train/eval mode and attention implementation. Calls from several threads
are serialised module by module (two models sharing modules are one to this), and another thread's plain forward
of a model being attributed is refused.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .errors import UnsupportedModelError
from .families import ModelSpec, check_experts, get, layer_modules, rope_depends_on_length, spec_for
from .guard import (check_all_ran, hold, model_state, owned, put_config, release_memory, release_memory_hook, run_all,
                    wrap)
from .linearise import BANDED_FROM, Scores, Tap, band, freeze_norm, keep_input, linearise_layer, temper
from .request import Request
from .rotary import each_prompt_alone
from .weights import PathWeights

# --- what a session records ---

@dataclass
class Recording:
    """Tensors seen in the forward pass, by layer. ``resid[l]`` is layer l's input (``resid[n_layers]`` the
    final norm's), ``mid[l]`` the residual after attention, ``head_inputs[l]`` / ``neuron_inputs[l]`` the
    tapped inputs (with their graph, for gradients); ``branches[(name, l)]`` the branch outputs, detached;
    ``probs[l]`` alpha from the explicit path (with its graph); ``rope[l]`` the rotary (cos, sin) layer l's
    attention was given (per layer: Gemma's local and global layers rotate with different bases); ``calls[l]``
    the arguments layer l's attention was called with besides its input (to run the block again: circuit.py)."""

    resid: dict[int, Tensor] = field(default_factory=dict)
    mid: dict[int, Tensor] = field(default_factory=dict)
    head_inputs: dict[int, Tensor] = field(default_factory=dict)
    neuron_inputs: dict[int, Tensor] = field(default_factory=dict)
    branches: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    probs: dict[int, Tensor] = field(default_factory=dict)
    rope: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    calls: dict[int, tuple[tuple, dict]] = field(default_factory=dict)  # attention's other arguments, by layer


# --- the session ---

class Session:
    """One instrumented forward (and backward): ``forward`` runs the decoder stack, ``backward`` the
    linearised gradient, filling ``scores``; ``recording`` holds what was seen on the way."""

    def __init__(self, model: nn.Module, request: Request, weights: PathWeights | None, scores: Scores | None,
                 recording: Recording, record: set[str]):
        self.model, self.request, self.spec = model, request, request.spec
        self.weights, self.scores, self.recording, self.record = weights, scores, recording, record
        self.anchor = torch.zeros((), requires_grad=True, device=request.device)
        # (slot per row [rows], rows run) while circuit.py runs a sparse block again, one expert's term per row
        self.only: tuple[Tensor, int] | None = None

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
        # No attention mask: dpa pads on the right, and under causal attention a real token never reads a later
        # one, so the real rows are what they would be with the mask; the padded rows then read real tokens
        # instead of nothing (a fully masked row is NaN in some eager kernels, e.g. Gemma 2's in float64).
        args = dict(attention_mask=None, position_ids=position_ids, use_cache=False)
        if inputs_embeds is not None:  # (times the multiplier the model applies to ids' embeddings alone: Falcon-H1's)
            m = self.spec.ids_only_multiplier
            args["inputs_embeds"] = inputs_embeds if m == 1 else inputs_embeds * m
        else:
            args["input_ids"] = req.input_ids if input_ids is None else input_ids
        overridden = getattr(self, "overridden", None)
        if overridden is not None:
            overridden.ran.clear()
        if self.spec.parts.rotary is not None and rope_depends_on_length(self.model.config):  # LongRoPE, dynamic NTK
            with each_prompt_alone(get(self.model, self.spec.parts.rotary)):  # a prompt's rotary never its batch's
                hidden = self.spec.base(self.model)(**args).last_hidden_state
        else:
            hidden = self.spec.base(self.model)(**args).last_hidden_state
        if overridden is not None:
            check_all_ran(self.model, overridden)
        return hidden

    def embed(self, input_ids: Tensor | None = None) -> Tensor:
        """Token embeddings [rows pos d_model] (what the input ablation zeroes)."""
        return self.spec.embed(self.model)(self.request.input_ids if input_ids is None else input_ids)

    def backward(self, value: Tensor, extra: list[Tensor] = (), *, again: bool = False) -> list[Tensor | None]:
        """Run the linearised backward from the scalar ``value``; returns the gradients of ``extra``.
        ``again``: keep the graph for another backward from another value (one per generated token)."""
        grads = torch.autograd.grad(value, [self.anchor, *extra], allow_unused=True, retain_graph=again)
        return list(grads[1:])


RECORDABLE = frozenset({"resid", "mid", "branches", "head_inputs", "neuron_inputs", "rope", "calls"})


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
    spec = request.spec
    if weights is not None:  # a mixture of experts' router and expert weights filled in (balanced) where unset
        weights = weights.for_model(spec.n_experts > 0, spec.family)
    if spec.n_experts:  # on every call: the experts dpa runs must be all there is (a parameter added since is refused)
        layers = spec.layers(model)
        for i in spec.expert_layers:
            check_experts(layers[i], spec.on_layer(i), i)
    recording = Recording()
    undo: list[Callable[[], None]] = []  # run in reverse, all of them, whatever happens (run_all)
    try:
        hold(model, undo)
        override = model_state(model, undo)
        stack = ExitStack()  # grad modes (thread-local): closing twice is a no-op
        undo.append(stack.close)
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if (weights is not None if grad is None else grad) else torch.no_grad())
        session = Session(model, request, weights, scores, recording, set(record))
        session.overridden = override
        handles: list = []  # removed with the rest by guard.model_state (hook dictionaries as they were)
        hook = lambda module, fn, pre=False: handles.append(  # noqa: E731  (another thread's forward: untouched)
            module.register_forward_pre_hook(owned(fn)) if pre else module.register_forward_hook(owned(fn)))
        layers = layer_modules(model, spec)

        if scores is not None:
            wrap(override, spec.embed(model), post=lambda out: Tap.apply(
                out, session.anchor, torch.linalg.vecdot, scores.sink("tokens"), 1))
            if spec.positions(model) is not None:  # learned positions (GPT-2): their share, per position
                wrap(override, spec.positions(model), post=lambda out: Tap.apply(
                    out, session.anchor, torch.linalg.vecdot, scores.sink("positions"), 1))
        if weights is not None:  # the layers' norms: linearise_layer
            override(spec.final_norm(model), freeze_norm(spec.final_norm(model), spec.parts.norm_kind, 1.0,
                                                         scores.sink("bias") if scores is not None else None))
        if "resid" in record:
            hook(spec.final_norm(model), keep_input(recording.resid, spec.n_layers), pre=True)
        for i, mods in enumerate(layers):
            _instrument_layer(session, i, mods, hook, handles, override, undo, explicit=explicit, attn_keep=attn_keep,
                              neuron_keep=neuron_keep, lean=lean)
        yield session
    finally:
        run_all(reversed(undo))


def _instrument_layer(session: Session, i: int, mods, hook: Callable, handles: list, override: Callable,
                      undo: list, *, explicit: bool, attn_keep: dict | None, neuron_keep: dict | None,
                      lean: bool) -> None:
    """Layer ``i`` of ``instrument``: its recordings, its linearisation (or the plain forward's recordings), the
    ablation masks, the attention path (explicit, tempered or banded) and lean mode's checkpoint."""
    model, request, spec = session.model, session.request, session.request.spec
    weights, recording, record = session.weights, session.recording, session.record
    mixes = mods.attention is not None  # (Nemotron-H's MLP layers have no token mixer)
    neurons = mods.mlp is not None or not spec.d_mlp  # (nor its mixer layers an MLP, in a model with MLPs: their row
    # of neurons holds none, nothing to record or ablate; a model with no MLP at all is refused by _neurons)
    if mixes and ("rope" in record or explicit or attn_keep is not None):
        handles.append(mods.attention.register_forward_pre_hook(_keep_rope(recording.rope, i),
                                                                with_kwargs=True))
    if "calls" in record and mixes:
        handles.append(mods.attention.register_forward_pre_hook(_keep_call(recording.calls, i),
                                                                with_kwargs=True))
        if mods.beside is not None:  # (Falcon-H1's Mamba-2 block beside attention: keyed ("beside", i))
            handles.append(mods.beside.attention.register_forward_pre_hook(_keep_call(recording.calls, ("beside", i)),
                                                                           with_kwargs=True))
    if "resid" in record:
        handles.append(mods.layer.register_forward_pre_hook(_keep_layer_input(recording.resid, i),
                                                            with_kwargs=True))
    if "mid" in record and mods.mid is not None:  # (a layer without an MLP has no residual between its blocks)
        hook(mods.mid, keep_input(recording.mid, i), pre=True)
    if weights is not None:
        linearise_layer(session, i, mods, hook, override)
    else:
        if "branches" in record:  # each branch's part of its (possibly fused) projection's output
            for name, module in mods.branches.items():
                hook(module, _keep_output(recording.branches, (name, i), functools.partial(mods.output, name)))
        if "neuron_inputs" in record and neurons:
            hook(_neurons(mods, spec, "recording neuron inputs"), keep_input(recording.neuron_inputs, i),
                 pre=True)
    if neuron_keep and neuron_keep.get(i) is not None and neurons:
        if mods.experts is not None and weights is None:  # the experts' neurons, inside dpa's loop
            from .experts import mask_experts

            mask_experts(spec, mods, override, neuron_keep[i])
        else:
            hook(_neurons(mods, spec, "ablating neurons"), _mask_input(neuron_keep[i]), pre=True)
    temperature = 1.0 if weights is None else weights.temperature
    if mods.kind != "attention":  # a mixer block (LFM2's convolution) runs its own forward: no softmax to temper;
        # a layer whose one block is an MLP (Nemotron-H's) has no attention, and no head an ablation could remove
        keep = (attn_keep or {}).get(i)  # a mask that keeps every edge leaves the block as it is
        if explicit or (mixes and keep is not None and not bool((keep != 0).all())):  # alpha asked for, or an edge
            what = (f"is a {mods.kind} layer ({spec.family})" if mixes else  # removed
                    f"has no token mixer (its one block is an MLP, {spec.family})")
            raise UnsupportedModelError(
                f"layers[{i}] {what}: this computation (edge scores, attention ablations, the gradient baselines, "
                "circuit verification) reads attention probabilities, which it does not have; dpa.attribute's token, "
                "unit and neuron scores cover it")
    elif explicit or attn_keep is not None:
        from .explicit import attention_forward

        # (an attention module whose forward is its own was refused by the model's checks: families._check_own_forwards)
        keep = (attn_keep or {}).get(i)
        override(mods.attention, attention_forward(spec, request, mods, i, keep, recording, temperature))
    else:
        undo.append(functools.partial(put_config, mods.attention, mods.attention.__dict__.get("config")))
        if temperature != 1:  # GIM's softmax rule on the model's own kernel: the module's config, put back
            temper(mods.attention, temperature)
        if banded(spec, i, request.n_tokens):  # a long input: a sliding-window layer by bands
            band(mods.attention, spec.sliding_windows[i])
    if lean:
        override(mods.layer, functools.partial(checkpoint, mods.layer.forward, use_reentrant=False))
        if release_memory is not None and spec.device(model).type == "cpu":
            hook(mods.layer, release_memory_hook, pre=True)


def banded(spec: ModelSpec, i: int, n_tokens: int) -> bool:
    """Whether layer i runs its attention by bands over ``n_tokens`` (``linearise.banded_attention``): a sliding
    window, and an input long enough (``BANDED_FROM``) for the bands to save work."""
    window = spec.sliding_windows[i]
    return window is not None and n_tokens >= max(BANDED_FROM, 4 * window)


@contextmanager
def banded_attention(model: nn.Module, n_tokens: int) -> Iterator[None]:
    """The model's sliding-window layers by bands over an input of ``n_tokens``, as dpa runs them, for a
    gradient timed beside DPA on the same kernels; their configs put back after."""
    spec = spec_for(model)
    undo = []
    try:
        for i, mods in enumerate(layer_modules(model, spec)):
            attention = mods.attention
            if attention is not None and banded(spec, i, n_tokens):
                undo.append(functools.partial(put_config, attention, attention.__dict__.get("config")))
                band(attention, spec.sliding_windows[i])
        yield
    finally:
        run_all(reversed(undo))


def _keep_layer_input(store: dict, i: int) -> Callable:
    """A pre-hook keeping the residual stream entering decoder layer i."""
    def pre(_module, args, kwargs):
        store[i] = args[0] if args else kwargs["hidden_states"]
    return pre


def _keep_call(store: dict, i) -> Callable:
    """A pre-hook keeping the arguments layer i's attention is called with, all but its input."""
    def pre(_module, args, kwargs):
        store[i] = (args[1:], kwargs) if args else ((), {k: v for k, v in kwargs.items() if k != "hidden_states"})
    return pre


def _keep_rope(store: dict, i: int) -> Callable:
    """A pre-hook keeping the (cos, sin) pair layer i's attention is called with."""
    def pre(_module, args, kwargs):
        pair = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if pair is not None:
            store[i] = tuple(pair)
    return pre


def _keep_output(store: dict, key, part: Callable = lambda out: out) -> Callable:
    def post(_module, _args, out):
        store[key] = part(out).detach()
    return post


def _neurons(mods, spec, what: str):
    """The module whose input is the MLP's neurons; a mixture of experts has none (they are inside its experts)."""
    if mods.neurons is None:
        from .errors import UnsupportedModelError

        if mods.mlp is None:
            raise UnsupportedModelError(f"{what} needs MLP neurons, and {spec.family}'s layers have no MLP")
        raise UnsupportedModelError(f"{what} is not supported on a mixture of experts ({spec.family}) yet: its neurons "
                                    "are inside the experts; the DPA scores themselves (dpa.attribute) are")
    return mods.neurons


def _mask_input(keep: Tensor) -> Callable:
    def pre(_module, args):  # (a dense layer of a mixed layout: its neurons are the row's first columns)
        return (args[0] * keep[..., :args[0].shape[-1]].to(args[0].dtype), *args[1:])
    return pre


def logits_at(model: nn.Module, request: Request, hidden: Tensor, positions: Tensor | int | None = None) -> Tensor:
    """Next-token logits [rows vocab] from a last hidden state [rows pos d_model] at the target
    positions (one per row, or ``positions``), in float32 or better: only those rows are unembedded.
    They are the model's own, after its final soft-cap where it has one (Gemma 2)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pos = request.positions if positions is None else positions
    if isinstance(pos, Tensor) and pos.numel() == 1:
        pos = int(pos)
    final = hidden[:, pos] if isinstance(pos, int) else hidden[rows, pos.to(hidden.device)]
    logits = unembed(model, request, final)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def unembed(model: nn.Module, request: Request, final: Tensor) -> Tensor:
    """The model's own logits from final hidden states [..., d_model], in its dtype: the unembedding, then the
    final soft-cap where the model has one (Gemma 2), after the division by ``logits_scaling`` where it has one
    (Granite). Every logit dpa computes from a hidden state comes from here."""
    logits = request.spec.logits(request.spec.unembed(model)(final))
    cap = request.spec.final_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def clean_logits(model: nn.Module, request: Request) -> Tensor:
    """One plain forward pass (under the model's lock): logits [batch vocab] at the target positions."""
    with instrument(model, request) as session:
        return logits_at(model, request, session.forward())
