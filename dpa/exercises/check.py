"""The exercises' checkers, one per exercise, named as the book names them: ``check.glu_paths(my_fn)``.

Each answers in one line -- passed, not answered yet, or what is wrong in the book's terms -- and returns a
:class:`~dpa.exercises.Verdict` (true when passed). ``check.names()`` lists them by chapter.
"""

from __future__ import annotations

from . import load_chapters
from ._core import REGISTRY, Exercise


def names() -> dict[str, list[str]]:
    """{chapter: [exercise names]} in the book's order."""
    load_chapters()
    out: dict[str, list[str]] = {}
    for ex in REGISTRY.values():
        out.setdefault(ex.chapter, []).append(ex.name)
    return out


def __getattr__(name: str) -> Exercise:
    load_chapters()
    try:
        return REGISTRY[name]
    except KeyError:
        raise AttributeError(f"there is no exercise {name!r}; the exercises are {sorted(REGISTRY)}") from None


def __dir__() -> list[str]:
    load_chapters()
    return sorted([*REGISTRY, "names"])
