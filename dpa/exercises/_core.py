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

import json
import math
import os
import re
from functools import lru_cache
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

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
    def __call__(self, answer: Any = None) -> Verdict:
        verdict = self._judge(answer)
        VERDICTS.append(verdict)
        print(verdict.message)
        if verdict.status == "wrong" and os.environ.get("DPA_EXERCISES_STRICT") == "1":
            raise ExerciseFailed(verdict.message)
        return verdict

    def _judge(self, answer: Any) -> Verdict:
        label = f"{self.name}"
        if answer is None or answer is Ellipsis:
            return self._unanswered("nothing to check yet")
        if self.call is None and isinstance(answer, (tuple, list)) and any(a is None or a is Ellipsis for a in answer):
            return self._unanswered("some of the answer is still None")
        if self.call is not None and not callable(answer):
            return self._wrong(f"pass your function itself, {self.signature or 'fn'}, not its result", "not callable")
        for seed in range(self.n_cases):
            case = self.cases(torch.Generator().manual_seed(1000 + seed))
            try:
                got = answer if self.call is None else self.call(answer, _copy(case))
            except NotImplementedError:
                return self._unanswered("your function raises NotImplementedError")
            except Exception as err:  # the learner's bug, reported in one line
                return self._wrong(f"your function raised {type(err).__name__}: {_first_line(err)}"
                                   + (f" (it is called as {self.signature})" if self.signature else ""), "raised")
            if got is None or got is Ellipsis:
                return self._unanswered(f"{label} returned None")
            want = self.oracle(_copy(case))
            problem = self._compare(got, want, case)
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

    def _compare(self, got: Any, want: Any, case: dict) -> tuple[str, str] | None:
        """None when ``got`` is right, else (message, hint)."""
        parts = self.parts or ("the answer",)
        gots, wants = (got, want) if self.parts else ((got,), (want,))
        if self.parts and (not isinstance(got, (tuple, list)) or len(got) != len(parts)):
            return f"return {len(parts)} things, ({', '.join(parts)}), as a tuple", "arity"
        wrong = []
        for name, g, w in zip(parts, gots, wants):
            g = _as_tensor(g, w)
            if isinstance(g, str):
                return f"{name}: {g}", "type"
            if g.shape != w.shape:
                return (f"{name} has shape {tuple(g.shape)}; the answer's is {tuple(w.shape)}"
                        f" -- check which side each matrix multiplies from ({self.where})", "shape")
            if not torch.isfinite(g).all():
                return f"{name} holds NaN or infinity -- see {self.where}", "non-finite"
            if not self._close(g, w):
                wrong.append((name, g, w))
        if not wrong:
            return None
        for mistake in self.mistakes:
            m = mistake.answer(_copy(case))
            ms = m if self.parts else (m,)
            if all(self._close(_as_tensor(g, w), x) for g, w, x in zip(gots, wants, ms)
                   if x is not None and isinstance(_as_tensor(g, w), Tensor)):
                return mistake.hint, mistake.hint
        name, g, w = wrong[0]
        return _generic(name, g, w, self.where, len(parts) > 1 and len(wrong) < len(parts))

    def _close(self, a: Tensor, b: Tensor) -> bool:
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        return a.shape == b.shape and torch.allclose(a.to(F64), b.to(F64), rtol=self.rtol, atol=self.atol * scale)


BOOK = Path(__file__).resolve().parents[2] / "book"
_LABEL = re.compile(r"\(((?:eq)-[\w-]+)\)")


@lru_cache(maxsize=1)
def equation_numbers() -> dict[str, tuple[str, int]]:
    """{label: (chapter, number)}: the number the built book shows beside each labelled equation (the labelled
    display equations of a chapter are numbered 1, 2, ... in order). Empty where the book is not beside the
    package (an installed wheel): the messages then name the labels."""
    numbers: dict[str, tuple[str, int]] = {}
    for path in sorted(BOOK.glob("*.ipynb")) if BOOK.is_dir() else ():
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        for i, label in enumerate(re.findall(r"^\$\$ \((eq-[\w-]+)\)", text, flags=re.M), 1):
            numbers[label] = (path.stem, i)
    return numbers


def render(text: str, chapter: str) -> str:
    """Equation labels as the book shows them: "equation (eq-glu-gate)" -> "equation (5)" in its own chapter,
    "(eq-norm-pullback)" -> "(equation 3 of chapter rmsnorm)" in another, "(eq-a, eq-b)" -> "(equations 3, 5)".
    A label the book does not have is left as it is."""
    numbers = equation_numbers()

    def number(label: str) -> str | None:
        if label not in numbers:
            return None
        where, n = numbers[label]
        return f"{n}" if where == chapter else f"{n} of chapter {where}"

    def group(m: re.Match) -> str:
        labels = re.split(r",\s*", m[1])
        found = [number(label) for label in labels]
        if None in found:
            return m[0]
        return f"(equation{'s' if len(found) > 1 else ''} {', '.join(found)})"

    text = re.sub(r"equation \((eq-[\w-]+)\)", lambda m: f"equation ({number(m[1])})" if number(m[1]) else m[0],
                  text)
    return re.sub(r"\((eq-[\w-]+(?:,\s*eq-[\w-]+)*)\)", group, text)


def _generic(name: str, g: Tensor, w: Tensor, where: str, only_this: bool) -> tuple[str, str]:
    """A wrong answer that matches no known mistake: its sign, a constant factor, or how far off it is."""
    g, w = g.to(F64), w.to(F64)
    lead = f"{name} is wrong" + (" (the other parts are right)" if only_this else "")
    if torch.allclose(g, -w, rtol=1e-7, atol=1e-9):
        return f"{lead}: its sign is flipped -- see {where}", "sign"
    if float(w.norm()) > 0 and float(g.norm()) > 0:
        c = float((g * w).sum() / (w * w).sum())
        if torch.allclose(g, c * w, rtol=1e-6, atol=1e-9) and math.isfinite(c):
            return f"{lead}: it is the answer times {c:.4g} -- a factor is missing or extra; see {where}", "factor"
    rel = float((g - w).norm() / max(float(w.norm()), 1e-30))
    return f"{lead}: it is off by {rel:.2g} relative to the autograd oracle -- re-read {where}", "off"


def _as_tensor(x: Any, like: Tensor) -> Tensor | str:
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, (int, float)) or (hasattr(x, "__array__") and not isinstance(x, (str, bytes))):
        try:
            return torch.as_tensor(x, dtype=F64).reshape(like.shape) if torch.as_tensor(x).numel() == like.numel() \
                else torch.as_tensor(x, dtype=F64)
        except (TypeError, ValueError, RuntimeError):
            pass
    if isinstance(x, (list, tuple)):
        try:
            return torch.as_tensor(x, dtype=F64)
        except (TypeError, ValueError, RuntimeError):
            pass
    return f"got a {type(x).__name__}; return a tensor (or a number)"


def _copy(case: dict) -> dict:
    """A fresh copy per call: a learner's in-place edit cannot leak into the oracle."""
    return {k: v.clone() if isinstance(v, Tensor) else v for k, v in case.items()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    """A float64 standard normal tensor from the case's generator."""
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


def vjp(f: Callable[[Tensor], Tensor], x: Tensor, t: Tensor) -> Tensor:
    """autograd's pull-back of the target ``t`` through ``f`` at ``x``: the gradient of ``t . f(x)``."""
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad((t * f(x)).sum(), x)
    return g.detach()
