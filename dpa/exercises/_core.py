"""What every exercise checker shares: random float64 cases, the autograd oracle, the catalogue of known mistakes,
and the one-line verdict.

An :class:`Exercise` names its chapter and equation, draws its own inputs (``cases``), computes the right answer
with torch.autograd or the chapter's definitions (``oracle``) and lists the mistakes learners make
(:class:`Mistake`: what the wrong answer computes, and the hint in the book's terms). ``check`` calls the
learner's function on every case and answers in one line: passed; not answered yet; or what is wrong -- a known
mistake's hint, else which part (``parts``) is off, by how much, and which equation to re-read. It never shows an
assertion traceback. With ``DPA_EXERCISES_STRICT=1`` (the test suite sets it) a wrong answer raises
:class:`ExerciseFailed` with the same line, so that a reference solution in the book that stops passing fails
the build; an unanswered exercise never raises.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from ._equations import equation_numbers, render  # noqa: F401 (re-exported)

REGISTRY: dict[str, "Exercise"] = {}
VERDICTS: list["Verdict"] = []  # every verdict of this process, in order (the tests read it)
F64 = torch.float64


class ExerciseFailed(AssertionError):
    """A wrong answer under ``DPA_EXERCISES_STRICT=1``; its message is the verdict's line."""


@dataclass(frozen=True)
class Verdict:
    """The answer of a check: ``status`` is "passed", "unanswered" or "wrong"; ``hint`` names the known mistake
    matched (or the generic diagnosis); ``message`` is the one line printed. True when passed."""

    exercise: str
    status: str
    message: str
    hint: str = ""

    def __bool__(self) -> bool:
        return self.status == "passed"

    def __repr__(self) -> str:
        return f"Verdict({self.exercise}: {self.status})"

    def _ipython_display_(self) -> None:  # the printed line is the whole answer in a notebook
        pass


@dataclass(frozen=True)
class Mistake:
    """A plausible wrong answer: ``answer(case)`` computes what it returns, ``hint`` says what is wrong."""

    hint: str
    answer: Callable[[dict], Any]


@dataclass
class Exercise:
    """One exercise. ``call(fn, case)`` runs the learner's function on a case (``None``: ``fn`` is the answer
    itself, a number or tensor computed by hand); ``parts`` names the items of a tuple answer in the book's
    words."""

    name: str
    chapter: str
    equation: str
    cases: Callable[[torch.Generator], dict]
    oracle: Callable[[dict], Any]
    call: Callable[[Callable, dict], Any] | None = None
    mistakes: list[Mistake] = field(default_factory=list)
    parts: tuple[str, ...] = ()
    part_equations: tuple[str, ...] = ()  # the equation label of each part, where they differ (else ``equation``)
    signature: str = ""  # how the learner's function is called, for the messages
    n_cases: int = 3
    rtol: float = 1e-7
    atol: float = 1e-9

    def __post_init__(self):
        if self.name in REGISTRY:
            raise ValueError(f"two exercises are named {self.name!r}")
        REGISTRY[self.name] = self

    @property
    def where(self) -> str:
        return f"equation ({self.equation})" if self.equation else f"chapter {self.chapter}"

    # -- the check --------------------------------------------------------------------------------------------
    def __call__(self, answer: Any = None, *more: Any, **extra: Any) -> Verdict:
        # torch's global state is the notebook's before and after a check, whatever the learner's function does to
        # it; a check runs on the CPU with autograd on, even where the notebook set torch.set_default_device("cuda")
        # or runs it inside torch.no_grad() or torch.inference_mode()
        with _torch_state():
            with torch.device("cpu"), torch.inference_mode(False), torch.enable_grad():
                verdict = self._judge(answer, more, extra)
        VERDICTS.append(verdict)
        print(verdict.message)
        if verdict.status == "wrong" and os.environ.get("DPA_EXERCISES_STRICT") == "1":
            raise ExerciseFailed(verdict.message)
        return verdict

    @property
    def _fn_name(self) -> str:
        return self.signature.split("(")[0] or "your_function"

    def _judge(self, answer: Any, more: tuple = (), extra: dict | None = None) -> Verdict:
        label = f"{self.name}"
        if extra or more:
            if not extra and self.call is None and len(self.parts) == 1 + len(more):
                answer = (answer, *more)  # check.x(a, b) for check.x((a, b))
            elif self.call is None:
                return self._wrong(f"pass your answer as one argument, the {len(self.parts) or 1} parts in one "
                                   f"tuple: check.{self.name}(({', '.join('...' for _ in self.parts or (1,))}))",
                                   "usage")
            else:
                return self._wrong(f"pass your function alone: check.{self.name}({self._fn_name})", "usage")
        if isinstance(answer, Exercise):
            return self._wrong(f"pass your own function, not the checker: check.{self.name}({self._fn_name})",
                               "usage")
        if answer is None or answer is Ellipsis:
            return self._unanswered("nothing to check yet")
        if self.call is None and isinstance(answer, (tuple, list)) and _holds_none(answer):
            return self._unanswered("some of the answer is still None")
        if self.call is not None and not callable(answer):
            return self._wrong(f"pass your function itself, {self.signature or 'fn'}, not its result", "not callable")
        for seed in range(self.n_cases):
            case = self.cases(torch.Generator().manual_seed(1000 + seed))
            try:
                if self.call is None:
                    got = answer
                else:
                    with _torch_state():  # what the function does to torch's global state stays in it
                        got = self.call(answer, _copy(case))
            except NotImplementedError as err:
                if not _from_torch(err):  # the learner's own `raise NotImplementedError`: a stub
                    return self._unanswered("your function raises NotImplementedError")
                return self._wrong(f"your function called something torch does not implement for its input: "
                                   f"{_first_line(err)}", "raised")
            except Exception as err:  # the learner's bug, reported in one line
                return self._wrong(f"your function raised {type(err).__name__}: {_first_line(err)}"
                                   + (f" (it is called as {self.signature})" if self.signature else ""), "raised")
            if got is None or got is Ellipsis:
                return self._unanswered(f"{label} returned None -- if you wrote it, is its `return` missing?")
            want = self.oracle(_copy(case))
            try:
                problem = self._compare(got, want, case)
            except Exception as err:  # an answer the comparison cannot read: one line, never a traceback
                problem = (f"your answer could not be read ({type(err).__name__}: {_first_line(err)}); "
                           + ("write numbers" if self.call is None else "return float64 tensors"), "unreadable")
            if problem is not None:
                return self._wrong(*problem)
        what = ("your numbers are right" if self.call is None
                else f"{label} agrees with autograd on {self.n_cases} random float64 cases")
        return Verdict(self.name, "passed", f"✓ {self.name}: passed -- {what}: {render(self.where, self.chapter)}.")

    def _unanswered(self, why: str) -> Verdict:
        return Verdict(self.name, "unanswered", f"… {self.name}: not answered yet ({why}): write your answer above "
                                                f"and run this cell again.")

    def _wrong(self, what: str, hint: str) -> Verdict:
        return Verdict(self.name, "wrong", f"✗ {self.name}: {render(what, self.chapter)}.", hint)

    def _where_part(self, i: int) -> str:
        label = self.part_equations[i] if i < len(self.part_equations) else ""
        return f"equation ({label})" if label else self.where

    def _compare(self, got: Any, want: Any, case: dict) -> tuple[str, str] | None:
        """None when ``got`` is right, else (message, hint)."""
        by_hand = self.call is None
        parts = self.parts or ("your answer",)
        if self.parts:
            if not isinstance(got, (tuple, list)) or len(got) != len(parts):
                had = f"{len(got)}" if isinstance(got, (tuple, list)) else _a(type(got).__name__)
                return (f"{'give' if by_hand else 'return'} {len(parts)} things, ({', '.join(parts)}), as a tuple; "
                        f"got {had}"), "arity"
            gots, wants = tuple(got), tuple(want)
        else:
            gots, wants = (got,), (want,)
        read = []
        for name, g in zip(parts, gots):
            g = _read(name, g, by_hand)
            if isinstance(g, tuple):
                return g
            read.append(g)
        fitted = [_fit(g, w, by_hand) for g, w in zip(read, wants)]
        if None in fitted and self._misplaced(read, wants):
            return self._order_message(), "order"
        tensors = []
        for i, (name, g, w) in enumerate(zip(parts, fitted, wants)):
            if g is None:
                return _shape_message(name, read[i], w, self._where_part(i), by_hand), "shape"
            if not torch.isfinite(g).all():
                return f"{name} holds NaN or infinity -- see {self._where_part(i)}", "non-finite"
            tensors.append(g)
        wrong = [i for i, (g, w) in enumerate(zip(tensors, wants)) if not self._close(g, w)]
        if not wrong:
            return None
        # 1. a known mistake that gives every wrong part (and leaves the right ones right)
        partial = []
        for mistake in self.mistakes:
            m = mistake.answer(_copy(case))
            ms = m if self.parts else (m,)
            given = [i for i, x in enumerate(ms) if x is not None]
            if not all(self._close(tensors[i], _f64(ms[i])) for i in given):
                continue
            explained = [i for i in wrong if i in given]
            if not explained:  # it gives only parts that are right: it says nothing of what is wrong
                continue
            if len(explained) == len(wrong):
                return mistake.hint, mistake.hint
            partial.append((mistake, [i for i in wrong if i not in given]))
        # 2. every part right, in the wrong places
        if self._misplaced(tensors, wants):
            return self._order_message(), "order"
        # 3. a known mistake in some parts, and something else wrong in the others
        if partial:
            mistake, rest = partial[0]
            names = " and ".join(parts[i] for i in rest)
            return f"{mistake.hint}; {names} {'is' if len(rest) == 1 else 'are'} wrong too", mistake.hint
        i = wrong[0]
        others = [parts[j] for j in wrong[1:]]
        return _generic(parts[i], tensors[i], wants[i].to(F64), self._where_part(i),
                        "" if len(parts) == 1 else "others" if others else "alone", others,
                        self.atol * max(1.0, float(wants[i].abs().max())) if by_hand else None)

    def _misplaced(self, gots: list[Tensor], wants: tuple) -> bool:
        """Whether the parts ``gots`` are the right ones in another order."""
        n = len(gots)
        for order in itertools.permutations(range(n)) if n > 1 else ():
            if order != tuple(range(n)):
                fits = [_fit(gots[j], wants[i], self.call is None) for i, j in enumerate(order)]
                if all(g is not None and self._close(g, w) for g, w in zip(fits, wants)):
                    return True
        return False

    def _order_message(self) -> str:
        return (f"your parts are right but in the wrong order: {'give' if self.call is None else 'return'} "
                f"({', '.join(self.parts)}), in this order")

    def _close(self, a: Tensor, b: Tensor) -> bool:
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        return a.shape == b.shape and torch.allclose(a.to(F64), b.to(F64), rtol=self.rtol, atol=self.atol * scale)


@contextlib.contextmanager
def _torch_state():
    """Restore torch's global state on the way out: the default dtype and device, grad mode and the CPU random
    generator (a learner's function may set any of them: the oracle and the rest of the notebook keep theirs)."""
    dtype, grad, rng = torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_rng_state()
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_rng_state(rng)
        if device is not None and torch.get_default_device() != device:
            with contextlib.suppress(Exception):  # torch refuses where a `with torch.device(...)` is open: leave it
                torch.set_default_device(None if device.type == "cpu" else device)


def _fit(g: Tensor, w: Tensor, by_hand: bool) -> Tensor | None:
    """``g`` in the shape of ``w``, or None. A by-hand answer may differ by dimensions of size 1 ([x] for a number,
    [[a, b]] for [a, b]: the numbers are what count); a function's answer must have the shape itself."""
    if g.shape == w.shape:
        return g
    if by_hand and g.numel() == w.numel() and g.squeeze().shape == w.squeeze().shape:
        return g.reshape(w.shape)
    return None


def _from_torch(err: BaseException) -> bool:
    """Whether a NotImplementedError comes from torch (an operator missing for a layout or device: "Could not run
    'aten::...'", or raised in torch's Python code), not from a learner's stub."""
    if "aten::" in str(err) or str(err).startswith("Could not run"):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_TORCH)


_TORCH = Path(torch.__file__).resolve().parent


def _holds_none(x: Any) -> bool:
    if x is None or x is Ellipsis:
        return True
    return isinstance(x, (tuple, list)) and any(_holds_none(a) for a in x)


def _f64(x: Any) -> Tensor:
    return x.detach().to(F64) if isinstance(x, Tensor) else torch.as_tensor(x, dtype=F64)


def _generic(name: str, g: Tensor, w: Tensor, where: str, parts: str, others: list[str],
             tolerance: float | None) -> tuple[str, str]:
    """A wrong answer that matches no known mistake: its sign, a constant factor, a near miss, or how far off it is.
    ``parts``: "" (one part), "alone" (the other parts are right) or "others" (``others`` are wrong too);
    ``tolerance``: the absolute tolerance of a by-hand answer (None: an implemented function)."""
    g, w = g.to(F64), w.to(F64)
    lead = f"{name} is wrong" + {"": "", "alone": " (the other parts are right)",
                                 "others": f" ({' and '.join(others)} {'is' if len(others) == 1 else 'are'} wrong "
                                           f"too)"}[parts]
    if torch.allclose(g, -w, rtol=1e-7, atol=1e-9):
        return f"{lead}: its sign is flipped -- see {where}", "sign"
    rel = float((g - w).norm() / max(float(w.norm()), 1e-30))
    err = float((g - w).abs().max())
    if tolerance is not None and (rel < 0.03 or err < 10 * tolerance):
        return (f"{lead}: it is close, off by up to {err:.2g}, but not within {tolerance:.2g} -- if you rounded "
                f"along the way, carry more decimals (or exact fractions); else re-read {where}"), "near"
    if tolerance is None and rel < 1e-4:
        return (f"{lead}: it is right to about {rel:.0e} only -- something small is off: a small term left out "
                f"(an eps?), a rounded constant, or float32 somewhere (torch.zeros, torch.ones, torch.tensor make "
                f"float32 unless given dtype=x.dtype); see {where}"), "near"
    if float(w.norm()) > 0 and float(g.norm()) > 0:
        c = float((g * w).sum() / (w * w).sum())
        if torch.allclose(g, c * w, rtol=1e-6, atol=1e-9) and math.isfinite(c):
            return f"{lead}: it is the answer times {c:.4g} -- a factor is missing or extra; see {where}", "factor"
    return f"{lead}: it is off by {rel:.2g} relative to the autograd oracle -- re-read {where}", "off"


def _shape_message(name: str, g: Tensor, w: Tensor, where: str, by_hand: bool) -> str:
    """What a wrong shape says about the mistake behind it."""
    gs, ws = tuple(g.shape), tuple(w.shape)
    if by_hand:
        return f"{name} has {g.numel()} number{'s' * (g.numel() != 1)}; the answer has {w.numel()} ({where})"
    head = f"{name} has shape {gs}, not {ws}"
    if g.numel() == w.numel() and g.squeeze().shape == w.squeeze().shape:
        why = "a dimension of size 1 is extra or missing (keepdim=, indexing with [i] against [i:i+1], unsqueeze)"
    elif len(gs) == len(ws) == 2 and gs == ws[::-1]:
        why = "it is transposed: check which side each matrix multiplies from"
    elif g.numel() == w.numel():
        why = "the same number of entries in another layout: check the order of the dimensions"
    elif _broadcasts(gs, ws):
        why = "it would broadcast to that shape, but every entry must be given (zeros included)"
    elif len(gs) == len(ws) and gs[:-1] == ws[:-1]:
        why = "the last dimension differs: check which side each matrix multiplies from"
    else:
        why = "follow the shapes through your computation"
    return f"{head} -- {why} ({where})"


def _broadcasts(a: tuple, b: tuple) -> bool:
    try:
        return torch.broadcast_shapes(a, b) == b
    except RuntimeError:
        return False


def _read(name: str, x: Any, by_hand: bool) -> Tensor | tuple[str, str]:
    """A learner's part as a float64 CPU tensor, or (message, hint) saying why it cannot be one. An implemented
    function must return floating-point float64, the dtype of its inputs; a by-hand answer is any real numbers."""
    want = "write numbers (a number, a list of numbers or a tensor)" if by_hand else "return a float64 tensor"
    if x is None or x is Ellipsis:
        return f"{name} is {x}; {want}", "type"
    if isinstance(x, (bool, str, bytes, dict, set)) or callable(x) and not isinstance(x, Tensor):
        return f"{name} is {_a(type(x).__name__)}; {want}", "type"
    if isinstance(x, numbers.Number) and not isinstance(x, complex):
        try:
            return torch.tensor(float(x), dtype=F64)
        except (TypeError, ValueError, OverflowError):
            return f"{name} is {_a(type(x).__name__)}; {want}", "type"
    if isinstance(x, (list, tuple)):
        leaf = _bad_leaf(x)
        if leaf is not None:
            return f"{name} holds {_a(type(leaf).__name__)} ({str(leaf)[:20]!r}); {want}", "type"
        if x and all(isinstance(a, Tensor) for a in x) and len({a.shape for a in x}) == 1 and x[0].dim() > 0:
            x = torch.stack([a.detach().cpu() for a in x])
        else:
            try:
                return torch.as_tensor(x, dtype=F64)
            except (TypeError, ValueError, RuntimeError) as err:
                return f"{name} is {_a(type(x).__name__)} that is no array of numbers ({_first_line(err)}); {want}", \
                    "type"
    if not isinstance(x, Tensor) and hasattr(x, "__array__"):
        try:
            x = torch.as_tensor(x)  # numpy: its own dtype, checked below
        except (TypeError, ValueError, RuntimeError):
            return f"{name} is {_a(type(x).__name__)}; {want}", "type"
    if not isinstance(x, Tensor):
        return f"{name} is {_a(type(x).__name__)}; {want}", "type"
    x = x.detach()
    if x.device.type == "meta":
        return f"{name} is on the meta device: it has no values; {want}", "type"
    if x.layout != torch.strided:
        x = x.to_dense()
    x = x.cpu()  # a tensor on a GPU is read where the oracle's is
    if x.is_complex():
        return f"{name} is complex ({x.dtype}); the answer is real: {want}", "dtype"
    if by_hand:
        return x.to(F64)
    if not x.is_floating_point():
        return f"{name} is {_a(str(x.dtype))} tensor; return floating-point values, float64 as the inputs are", "dtype"
    if x.dtype != F64:
        return (f"{name} is {_a(str(x.dtype))} tensor: compute in float64, the inputs' dtype (torch.zeros, "
                f"torch.ones and torch.tensor make float32 unless given dtype=x.dtype)"), "dtype"
    return x


def _a(word: str) -> str:
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def _bad_leaf(x: Any) -> Any:
    """The first entry of a nested list that is no number (nor tensor nor array), else None."""
    for a in x:
        if isinstance(a, (list, tuple)):
            bad = _bad_leaf(a)
            if bad is not None:
                return bad
        elif isinstance(a, (bool, str, bytes)) or not (isinstance(a, (numbers.Number, Tensor))
                                                       or hasattr(a, "__array__")) or isinstance(a, complex):
            return a
    return None


def _copy(case: dict) -> dict:
    """A fresh copy per call: a learner's in-place edit cannot leak into the oracle."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in case.items()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def norm_scale(x, eps, *, reduce="mean", root=True):
    """r(x) per position (eq-rmsnorm), or one of the learners' variants of it (a sum for the mean, no square root,
    one mean over the whole sequence): the chapters rmsnorm and residual-stream-and-targets (its final norm)."""
    sq = x.pow(2)
    ms = sq.mean(-1, keepdim=True) if reduce == "mean" else sq.sum(-1, keepdim=True) if reduce == "sum" else sq.mean()
    return (ms + eps).rsqrt() if root else 1 / (ms + eps)


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    """A float64 standard normal tensor from the case's generator."""
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def vjp(f: Callable[[Tensor], Tensor], x: Tensor, t: Tensor) -> Tensor:
    """autograd's pull-back of the target ``t`` through ``f`` at ``x``: the gradient of ``t . f(x)``."""
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad((t * f(x)).sum(), x)
    return g.detach()
