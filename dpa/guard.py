"""The model kept safe around every dpa call: one call at a time on any module, and the model put back exactly as it
was, whatever interrupts the call.

``instrument`` holds the model's modules (``hold``), checks what it finds (``model_state``, with ``state_checks``:
foreign hooks, a patched forward, offloaded weights, autocast), overrides forwards through one ``override`` that
remembers which ran (``check_all_ran``), and puts everything back with ``run_all``, whose steps are idempotent and
run even when a signal or an exception lands among them. ``checking`` holds a model while ``families.spec_for`` probes its modules.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from .errors import ModelStateError, UnsupportedModelError
from .state_checks import (check_autocast, check_global_hooks, check_loaded, check_module_hooks,
                           check_saved_tensors_hooks, harmless)

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
        hold(model, undo)
        yield
    finally:
        run_all(reversed(undo))


def hold(model: nn.Module, undo: list) -> None:
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
    """The generator of the contextmanager whose entry called ``hold`` (None if called otherwise)."""
    frame = sys._getframe(3)  # hold <- the generator's frame <- contextlib's __enter__
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


def owned(fn: Callable, owner: threading.Thread | None = None) -> Callable:
    """A hook that acts in the call's own thread (``owner``, by default the one registering it) and the autograd
    engine's only: another thread's forward that was already inside a module when the call began passes it
    untouched, rather than write into what the call records (it is refused at the next module dpa overrides)."""
    owner = threading.current_thread() if owner is None else owner

    def hook(*args):
        if threading.current_thread() is owner or torch._C._current_autograd_node() is not None:
            return fn(*args)
        return None
    return hook


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
             if k not in hooks.get("_forward_hooks", {}) and harmless(fn)}  # there by the model's own forward: kept
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


def put_config(m: nn.Module, config) -> None:
    if m.__dict__.get("config") is not config:
        m.__dict__["config"] = config


def _put_flag(p: nn.Parameter, flag: bool) -> None:
    if p.requires_grad != flag:
        p.requires_grad_(flag)


def model_state(model: nn.Module, undo: list) -> Callable[[nn.Module, Callable], None]:
    """Eval mode and no parameter gradients; returns ``override(module, forward)`` for instance forwards.
    ``undo`` gets the steps that put everything back as it was (``_Saved``), whatever happens inside. A module
    with foreign hooks or a patched forward, or offloaded weights, is refused first, before anything changes."""
    check_global_hooks()
    check_saved_tensors_hooks()
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


release_memory = _malloc_trim()


def release_memory_hook(_module, _args) -> None:
    release_memory(0)




def wrap(override: Callable, module: nn.Module, *, pre: Callable | None = None, post: Callable | None = None) -> None:
    """Replace ``module``'s forward (through ``override``, which restores it) by its own forward with
    ``pre`` applied to its first input and ``post`` to its output: cheaper than forward hooks, which
    cost a registration and a slow module call each."""
    own = module.forward
    if pre is not None and post is not None:
        override(module, lambda x, *a, **k: post(own(pre(x), *a, **k)))
    elif pre is not None:
        override(module, lambda x, *a, **k: own(pre(x), *a, **k))
    else:
        override(module, lambda *a, **k: post(own(*a, **k)))
