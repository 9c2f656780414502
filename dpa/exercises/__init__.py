"""The book's exercises: a checker per exercise (``from dpa.exercises import check``), and the teacher's
student copy of the book (``python -m dpa.exercises student-copy OUT``).

A checker runs the learner's function on random float64 tensors against torch.autograd (the oracle each chapter
proves its rule equal to) and answers in one line. One module per chapter declares that chapter's exercises:
its cases, oracle and the mistakes learners make, each with its hint.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._core import REGISTRY, VERDICTS, Exercise, ExerciseFailed, Mistake, Verdict

__all__ = ["Exercise", "ExerciseFailed", "Mistake", "Verdict", "REGISTRY", "VERDICTS", "load_chapters"]

_LOADED = False


def load_chapters() -> None:
    """Import every chapter module of this package once (each registers its exercises)."""
    global _LOADED
    if _LOADED:
        return
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_") and info.name not in ("check", "student"):
            importlib.import_module(f"{__name__}.{info.name}")
    _LOADED = True
