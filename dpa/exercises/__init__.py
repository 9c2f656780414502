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
# the chapter modules in the book's order (_toc.yml), so that `list`, check.names() and REGISTRY read as the book does
_BOOK_ORDER = ("residual_stream", "rmsnorm", "glu", "softmax_taylor", "rope", "modified_backward", "circuits_as_graphs",
               "layernorm_gelu", "soft_capping", "mixture_of_experts")


def load_chapters() -> None:
    """Import every chapter module of this package once (each registers its exercises), in the book's order."""
    global _LOADED
    if _LOADED:
        return
    names = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")
             and m.name not in ("check", "student")]
    for name in sorted(names, key=lambda n: (_BOOK_ORDER.index(n) if n in _BOOK_ORDER else len(_BOOK_ORDER), n)):
        importlib.import_module(f"{__name__}.{name}")
    _LOADED = True
