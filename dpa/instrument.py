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
import sys
import threading
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .errors import ModelStateError, UnsupportedModelError
from .families import ModelSpec, check_experts, get, layer_modules, rope_depends_on_length, spec_for
from .linearise import BANDED_FROM, Scores, Tap, band, freeze_norm, keep_input, linearise_layer, temper, wrap
from .request import Request, check_loaded
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


# --- one call at a time on any module, and the model's state to restore ---

class _Claim:
    """One call's hold on the modules of a model: its thread, the generator of its ``session``/``exclusive``, its
    undo steps."""

    def __init__(self, thread: threading.Thread, gen, undo: list):
        self.thread, self.gen, self.undo = thread, gen, undo

    def stale(self) -> bool:
        """The call ended without letting go: an asynchronous exception landed before its restore held signals."""
        return self.gen is not None and self.gen.gi_frame is None


# Module -> the call holding it. dpa's rules and taps live on the modules, so calls are kept apart module by module,
# not model by model: two model objects sharing their decoder (``m2.model = m1.model``, a wrapper around a model)
# are one model to this. A call claims every module of its model at once, or waits until none is held (no
# deadlock). A call whose restore was cut short (its generator finished, its claim still there) is put back by the
# next call that meets it, from any thread (every restore step is idempotent), instead of blocking for ever.
_CLAIMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CLAIMS_CHANGED = threading.Condition()
_HEAL_GUARD = threading.Lock()


@contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """Hold the model's modules (other threads wait); the same thread re-entering is an error."""
    undo: list[Callable[[], None]] = []
    try:
        _hold(model, undo)
        yield
    finally:
        run_all(reversed(undo))


def _hold(model: nn.Module, undo: list) -> None:
    """Claim every module of ``model`` for this thread, waiting while another call holds any of them (refusing a
    re-entry from the same thread); ``undo`` gets the step that lets them go again (idempotent: see ``run_all``).
    Called from the generator of a ``contextmanager`` (``session``, ``exclusive``), whose state tells whether the
    call holding a module is still running."""
    me = threading.current_thread()
    claim = _Claim(me, _calling_generator(), undo)
    modules = list(model.modules())
    while True:
        with _CLAIMS_CHANGED:
            others = {id(c): c for m in modules if (c := _CLAIMS.get(m)) is not None}
            if not others:
                for m in modules:
                    _CLAIMS[m] = claim
                break
            if any(c.thread is me and not c.stale() for c in others.values()):
                raise ModelStateError("dpa is already running on this model in this thread (a call from inside a "
                                      "hook or callback of another dpa call); make the calls one after another")
            stale = [c for c in others.values() if c.stale()]
            if not stale:
                _CLAIMS_CHANGED.wait(0.25)
                continue
        for c in stale:
            _finish_stale(c)

    def release() -> None:
        with _CLAIMS_CHANGED:
            for m in modules:
                if _CLAIMS.get(m) is claim:
                    del _CLAIMS[m]
            _CLAIMS_CHANGED.notify_all()

    undo.append(release)


@contextmanager
def checking(model: nn.Module) -> Iterator[None]:
    """Hold ``model``'s modules for the module checks (``families.spec_for`` probes each norm's and activation's own
    forward): while another thread's call has its rules and taps on them, the probes would read dpa's forward, not
    the model's, and refuse a sound model. Inside this thread's own call the modules are held already."""
    me = threading.current_thread()
    with _CLAIMS_CHANGED:
        mine = any((c := _CLAIMS.get(m)) is not None and c.thread is me and not c.stale() for m in model.modules())
    if mine:
        yield
        return
    with exclusive(model):
        yield


def _calling_generator():
    """The generator of the contextmanager whose entry called ``_hold`` (None if called otherwise)."""
    frame = sys._getframe(3)  # _hold <- the generator's frame <- contextlib's __enter__
    cm = frame.f_locals.get("self") if frame.f_code.co_name == "__enter__" else None
    return getattr(cm, "gen", None)


def _finish_stale(claim: _Claim) -> None:
    """Run the restore of a call that ended without it (which lets its modules go)."""
    with _HEAL_GUARD:  # one thread at a time puts a model back
        with _CLAIMS_CHANGED:
            if claim not in _CLAIMS.values():  # another thread put it back meanwhile
                return
        try:
            run_all(reversed(claim.undo))
        except Exception as err:  # noqa: BLE001 - said by name
            raise ModelStateError(f"an earlier dpa call on this model ended before putting it back, and putting it "
                                  f"back now failed ({type(err).__name__}: {err}); load the model again") from err


def _guard(owner: threading.Thread) -> Callable:
    """A forward pre-hook refusing the model's forward in any thread but the call's own while dpa's rules and taps
    are on it: another thread's plain forward would run them and overwrite what the call recorded. The autograd
    engine's own threads (a lean-mode layer recomputed in a CUDA backward) pass."""
    def pre(_module, _args):
        if threading.current_thread() is not owner and torch._C._current_autograd_node() is None:
            raise ModelStateError("dpa is attributing this model in another thread: its forward cannot run until "
                                  "that call ends (dpa's rules and taps are on its modules); wait for it, or run a "
                                  "copy of the model")
    return pre


# --- putting the model back: every step runs, whatever interrupts it ---

_MISSING = object()
# A module's hook dictionaries (torch keeps the with-kwargs and always-called flags beside the hooks): restored
# as they were, so a hook registered during a call -- dpa's, or one left by an interrupt -- never stays.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def run_all(steps) -> None:
    """Run every step of a restore: each is idempotent, so one that raises (a KeyboardInterrupt from inside it,
    a library's error) is tried again, up to three times, and the others run whatever it did. Signals with a
    Python handler (SIGINT's KeyboardInterrupt, a harness's SIGALRM timeout) are held while they run (the main
    thread) and delivered after; holding them is the first step, so a signal landing while it is set up is caught
    like an exception landing between two steps: the loop goes on from the step it was on. The first exception is
    raised once all have run."""
    held = _HeldSignals()
    pending = [held.hold, *steps]
    tries = [0] * len(pending)
    errors: list[BaseException] = []
    try:
        while pending:
            try:
                while pending:  # a step is dropped once it ran, or failed three times
                    tries[-len(pending)] += 1
                    if _ran(pending[0], errors) or tries[-len(pending)] >= 3:
                        pending.pop(0)
            except BaseException as err:  # noqa: BLE001 - an exception outside a step: go on where it was
                errors.append(err)
    finally:
        held.deliver()
    if errors:
        raise errors[0]


def _ran(step: Callable[[], None], errors: list) -> bool:
    """Run one restore step; False, with its exception noted, if it raised."""
    try:
        step()
        return True
    except BaseException as err:  # noqa: BLE001 - raised by run_all, after the other steps
        errors.append(err)
        return False


class _HeldSignals:
    """Every signal with a Python handler noted, not handled, from ``hold`` (idempotent: it can be run again after
    an interruption) to ``deliver``, which puts the handlers back and raises the noted signals again, to the
    handlers the caller had (SIGINT: KeyboardInterrupt by default). Signals reach the main thread only, so
    elsewhere this does nothing. Left alone: handlers installed outside Python, and asyncio's (a no-op whose work
    is done through the wakeup file descriptor, which the signal reaches anyway)."""

    def __init__(self):
        self.previous: dict[int, Callable] = {}
        self.noted: list[int] = []
        self.noter = lambda signum, _frame: self.noted.append(signum)  # one object: getsignal() says it is there

    def hold(self) -> None:
        import signal

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            handler = signal.getsignal(sig)
            if (handler is self.noter or not callable(handler)
                    or getattr(handler, "__name__", "") == "_sighandler_noop"):
                continue
            self.previous[sig] = handler  # noted before it is replaced: a retry finds it replaced, or not
            signal.signal(sig, self.noter)

    def deliver(self) -> None:
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(self.noted):
            signal.raise_signal(sig)


def _signals() -> list:
    import signal

    out = []
    for sig in signal.valid_signals():
        try:
            signal.getsignal(sig)
            out.append(sig)
        except (ValueError, OSError):
            pass
    return out


_SIGNALS = _signals()  # read once: valid_signals() is slow, and a signal can land while it runs


class _Saved:
    """What a dpa call changes or could leave changed, as it was: each module's train flag, instance ``forward``
    (or its absence) and hook dictionaries, each parameter's ``requires_grad``. ``steps()``: the idempotent steps
    that put them back (``run_all``)."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = [(m, m.training, m.__dict__.get("forward", _MISSING),
                         {a: dict(d) for a in _HOOK_DICTS if (d := getattr(m, a, None))}) for m in modules]
        params = {id(p): p for m in modules for p in m._parameters.values() if p is not None}
        self.params = [(p, p.requires_grad) for p in params.values()]

    def steps(self) -> list[Callable[[], None]]:
        return ([functools.partial(_put_back, *saved) for saved in self.modules]
                + [functools.partial(_put_flag, p, flag) for p, flag in self.params])


def _put_back(m: nn.Module, training: bool, forward, hooks: dict) -> None:
    if forward is _MISSING:
        m.__dict__.pop("forward", None)
    elif m.__dict__.get("forward", _MISSING) is not forward:
        m.__dict__["forward"] = forward
    added = {k for k, fn in getattr(m, "_forward_hooks", {}).items()  # transformers' output-capturing hooks, put
             if k not in hooks.get("_forward_hooks", {}) and _harmless(fn)}  # there by the model's own forward: kept
    for name in _HOOK_DICTS:
        d, want = getattr(m, name, None), hooks.get(name, {})
        if d is None:
            continue
        if added:
            want = {**want, **{k: v for k, v in d.items() if k in added}}
        if len(d) != len(want) or any(d.get(k, _MISSING) is not v for k, v in want.items()):
            d.clear()
            d.update(want)
    if m.training != training:
        m.training = training


def _put_config(m: nn.Module, config) -> None:
    if m.__dict__.get("config") is not config:
        m.__dict__["config"] = config


def _put_flag(p: nn.Parameter, flag: bool) -> None:
    if p.requires_grad != flag:
        p.requires_grad_(flag)


def _model_state(model: nn.Module, undo: list) -> Callable[[nn.Module, Callable], None]:
    """Eval mode and no parameter gradients; returns ``override(module, forward)`` for instance forwards.
    ``undo`` gets the steps that put everything back as it was (``_Saved``), whatever happens inside. A module
    with foreign hooks or a patched forward, or offloaded weights, is refused first, before anything changes."""
    check_global_hooks()
    check_loaded(model)
    check_autocast(model)
    modules = []
    for name, m in model.named_modules():  # one pass: foreign hooks, and what to put back
        check_module_hooks(name, m)
        modules.append(m)
    saved = _Saved(modules)
    undo.extend(saved.steps())
    for m, training, _, _ in saved.modules:
        if training:
            m.training = False
    for p, flag in saved.params:
        if flag:
            p.requires_grad_(False)
    guard = _guard(threading.current_thread())
    for m in modules:  # every container (the model, its decoder, each layer and block): the ways into a forward
        if next(m.children(), None) is not None:
            m.register_forward_pre_hook(guard)  # first of the hooks, removed with them (_Saved)

    def override(module: nn.Module, forward: Callable) -> None:
        def run(*args, **kwargs):
            guard(module, args)
            ran.add(id(module))
            return forward(*args, **kwargs)

        overridden[id(module)] = module
        module.__dict__["forward"] = run  # what nn.Module.__setattr__ does for a plain attribute

    ran: set[int] = set()
    overridden: dict[int, nn.Module] = {}
    override.ran, override.modules = ran, overridden  # Session.forward checks that each of them ran
    return override


def check_all_ran(model: nn.Module, override) -> None:
    """Every module dpa put its rules or taps on ran in the model's forward: a forward that computes a block without
    calling them (a fused kernel patched in, F.silu called in place of the activation module) would leave that
    part of the model unlinearised and its scores wrong, silently; refused by name."""
    missing = [i for i in override.modules if i not in override.ran]
    if missing:
        names = {id(m): name for name, m in model.named_modules()}
        shown = ", ".join(names.get(i, type(override.modules[i]).__name__) for i in missing[:4])
        raise UnsupportedModelError(
            f"{shown}{' and others' if len(missing) > 4 else ''} did not run in the model's forward (a forward "
            "patched to compute its block without calling these modules: a fused kernel, or F.silu in place of "
            "the activation module?); dpa linearises and taps the modules themselves, so their part would be "
            "left out: restore the model's own forward before attributing")


# Hooks that never change a value: transformers' output capturing (records outputs) and the hook
# gradient checkpointing puts on the embeddings (marks their output as requiring grad). accelerate's
# device hooks (``_hf_hook``) move tensors between devices and are not module hooks.
_HARMLESS_HOOK_MODULES = ("transformers.utils.output_capturing",)
_HARMLESS_HOOKS = ("PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",)
_HINT = "; remove it (handle.remove()) before attributing, or attribute a copy of the model"


def check_global_hooks() -> None:
    """Refuse global module hooks (torch.nn.modules.module.register_module_*_hook): they run on every
    module and could change activations or gradients behind dpa's back."""
    from torch.nn.modules import module as torch_module

    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        if getattr(torch_module, f"_global_{kind}_hooks"):
            raise ModelStateError(f"a global module {kind.replace('_', '-')} hook is registered "
                                  f"(torch.nn.modules.module.register_module_{kind}_hook): it could change what dpa "
                                  f"attributes{_HINT}")


def check_autocast(model: nn.Module) -> None:
    """Refuse a call under ``torch.autocast`` on the model's device: the forward would run in another precision than
    the model's weights, while dpa's rules, taps and scores assume the model's own arithmetic (and the completeness
    and batch identities would only hold to the autocast precision)."""
    for kind in sorted({p.device.type for p in model.parameters()} - {"meta"}):
        try:
            on = torch.is_autocast_enabled(kind)
        except (RuntimeError, ValueError):  # a device type without autocast
            continue
        if on:
            raise ModelStateError(f"dpa was called under torch.autocast ({kind}): the model would run in "
                                  f"{torch.get_autocast_dtype(kind)} while its weights are "
                                  f"{next(model.parameters()).dtype}; call dpa outside the autocast region, or cast "
                                  "the model itself (model.to(torch.bfloat16))")


def _harmless(fn) -> bool:
    return (getattr(fn, "__module__", "").startswith(_HARMLESS_HOOK_MODULES)
            or getattr(fn, "__qualname__", "") in _HARMLESS_HOOKS)


def check_module_hooks(name: str, module: nn.Module) -> None:
    """Refuse a module carrying hooks from outside dpa, or a forward patched on the instance: a silently
    wrong attribution otherwise. transformers' output-capturing hooks and accelerate's device hooks pass."""
    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        for fn in getattr(module, f"_{kind}_hooks").values():
            if not _harmless(fn):
                raise ModelStateError(
                    f"the model has a {kind.replace('_', '-')} hook on {name or 'the model itself'} "
                    f"({getattr(fn, '__qualname__', type(fn).__name__)}): it could change what dpa attributes{_HINT}")
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        raise ModelStateError(f"{name or 'the model'} is a torch.compile'd module: dpa runs the model's own modules "
                              f"eagerly, with its rules on them; put the original back ({name or 'model'}._orig_mod) "
                              "before attributing")
    if "forward" in module.__dict__ and not hasattr(module, "_hf_hook"):
        raise ModelStateError(f"{name or 'the model'}.forward is replaced on the instance "
                              f"({getattr(module.forward, '__qualname__', module.forward)!r}): dpa cannot vouch "
                              "for what it computes; restore the module's own forward before attributing")


def _malloc_trim():
    """glibc's malloc_trim, or None elsewhere. Lean mode calls it as each decoder layer starts (in the
    forward and again when the backward recomputes the layer): glibc otherwise keeps the memory that
    the previous layer freed, and the process's resident set grows with every layer."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_release_memory = _malloc_trim()


def _trim(_module, _args) -> None:
    _release_memory(0)


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
        if inputs_embeds is not None:
            args["inputs_embeds"] = inputs_embeds
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
        for i, layer in enumerate(spec.layers(model)):
            check_experts(layer, spec.parts, i)
    recording = Recording()
    undo: list[Callable[[], None]] = []  # run in reverse, all of them, whatever happens (run_all)
    try:
        _hold(model, undo)
        override = _model_state(model, undo)
        stack = ExitStack()  # grad modes (thread-local): closing twice is a no-op
        undo.append(stack.close)
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if (weights is not None if grad is None else grad) else torch.no_grad())
        session = Session(model, request, weights, scores, recording, set(record))
        session.overridden = override
        handles: list = []  # removed with the rest by _Saved (hook dictionaries as they were)
        hook = lambda module, fn, pre=False: handles.append(  # noqa: E731
            module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn))
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
    if "rope" in record or explicit or attn_keep is not None:
        handles.append(mods.attention.register_forward_pre_hook(_keep_rope(recording.rope, i),
                                                                with_kwargs=True))
    if "calls" in record:
        handles.append(mods.attention.register_forward_pre_hook(_keep_call(recording.calls, i),
                                                                with_kwargs=True))
    if "resid" in record:
        handles.append(mods.layer.register_forward_pre_hook(_keep_layer_input(recording.resid, i),
                                                            with_kwargs=True))
    if "mid" in record:
        hook(mods.mid, keep_input(recording.mid, i), pre=True)
    if weights is not None:
        linearise_layer(session, i, mods, hook, override)
    else:
        if "branches" in record:  # each branch's part of its (possibly fused) projection's output
            for name, module in mods.branches.items():
                hook(module, _keep_output(recording.branches, (name, i), functools.partial(mods.output, name)))
        if "neuron_inputs" in record:
            hook(_neurons(mods, spec, "recording neuron inputs"), keep_input(recording.neuron_inputs, i),
                 pre=True)
    if neuron_keep and neuron_keep.get(i) is not None:
        if mods.experts is not None and weights is None:  # the experts' neurons, inside dpa's loop
            from .experts import mask_experts

            mask_experts(spec, mods, override, neuron_keep[i])
        else:
            hook(_neurons(mods, spec, "ablating neurons"), _mask_input(neuron_keep[i]), pre=True)
    temperature = 1.0 if weights is None else weights.temperature
    if explicit or attn_keep is not None:
        from .explicit import attention_forward

        keep = (attn_keep or {}).get(i)
        override(mods.attention, attention_forward(spec, request, mods, i, keep, recording, temperature))
    else:
        undo.append(functools.partial(_put_config, mods.attention, mods.attention.__dict__.get("config")))
        if temperature != 1:  # GIM's softmax rule on the model's own kernel: the module's config, put back
            temper(mods.attention, temperature)
        if banded(spec, i, request.n_tokens):  # a long input: a sliding-window layer by bands
            band(mods.attention, spec.sliding_windows[i])
    if lean:
        override(mods.layer, functools.partial(checkpoint, mods.layer.forward, use_reentrant=False))
        if _release_memory is not None and spec.device(model).type == "cpu":
            hook(mods.layer, _trim, pre=True)


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
            if banded(spec, i, n_tokens):
                undo.append(functools.partial(_put_config, attention, attention.__dict__.get("config")))
                band(attention, spec.sliding_windows[i])
        yield
    finally:
        run_all(reversed(undo))


def _keep_layer_input(store: dict, i: int) -> Callable:
    """A pre-hook keeping the residual stream entering decoder layer i."""
    def pre(_module, args, kwargs):
        store[i] = args[0] if args else kwargs["hidden_states"]
    return pre


def _keep_call(store: dict, i: int) -> Callable:
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

        raise UnsupportedModelError(f"{what} is not supported on a mixture of experts ({spec.family}) yet: its neurons "
                                    "are inside the experts; the DPA scores themselves (dpa.attribute) are")
    return mods.neurons


def _mask_input(keep: Tensor) -> Callable:
    def pre(_module, args):
        return (args[0] * keep.to(args[0].dtype), *args[1:])
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
    final soft-cap where the model has one (Gemma 2). Every logit dpa computes from a hidden state comes from here."""
    logits = request.spec.unembed(model)(final)
    cap = request.spec.final_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def clean_logits(model: nn.Module, request: Request) -> Tensor:
    """One plain forward pass (under the model's lock): logits [batch vocab] at the target positions."""
    with instrument(model, request) as session:
        return logits_at(model, request, session.forward())
