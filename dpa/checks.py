"""Argument checks shared by every entry point: one place that says what a number, a flag or a choice is.

Each check returns the value in its canonical Python form (an ``int``, a ``float``, a ``bool``) and
otherwise raises ``InputTypeError`` (a wrong type: also a ``TypeError``) or ``InputError`` (a wrong
value: also a ``ValueError``), naming the argument, the value and what would be accepted. Numpy
scalars and 0-d tensors count as numbers; ``bool`` does not count as a number.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

import torch

from .errors import InputError, InputTypeError


def show(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _scalar(value: Any) -> Any:
    """A 0-d tensor or a numpy scalar as the Python number it holds; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return value.item()
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and callable(item):
        return item()
    return value


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """An integer in [low, high] (either bound optional)."""
    v = _scalar(value)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InputTypeError(f"{name} must be an int, got {show(value)}")
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        span = f"at least {low}" if high is None else f"at most {high}" if low is None else f"in [{low}, {high}]"
        raise InputError(f"{name} must be {span}, got {v}")
    return v


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                above: float | None = None) -> float:
    """A finite real number in [low, high] (or > above); ints are accepted."""
    v = _scalar(value)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InputTypeError(f"{name} must be a number, got {show(value)}")
    v = float(v)
    if not math.isfinite(v):
        raise InputError(f"{name} must be a finite number, got {v}")
    if (low is not None and v < low) or (high is not None and v > high) or (above is not None and v <= above):
        span = (f"greater than {above}" if above is not None else f"at least {low}" if high is None
                else f"at most {high}" if low is None else f"in [{low}, {high}]")
        raise InputError(f"{name} must be {span}, got {v}")
    return v


def check_bool(name: str, value: Any) -> bool:
    """True or False (a numpy or 0-d tensor bool too); not 0, 1, None or a string."""
    v = _scalar(value)
    if not isinstance(v, bool):
        raise InputTypeError(f"{name} must be True or False, got {show(value)}")
    return v


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """One of ``choices`` (compared exactly: "Left" is not "left")."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(repr, choices))}, got {show(value)}")
    return value


# Arguments that existed and went: {name: what to do instead}. Passing one is refused by name.
REMOVED = {
    "padding_side": "it was never needed: dpa pads a batch on the right itself and the scores never depend on "
                    "padding; drop the argument",
}


def check_removed(function: str, kwargs: dict) -> None:
    """Refuse the keyword arguments a function does not take (``InputTypeError``, a ``TypeError`` as Python's own):
    a removed one by name, with what to do instead."""
    for name in kwargs:
        if name in REMOVED:
            raise InputTypeError(f"{function}() no longer takes {name}: {REMOVED[name]}")
        raise InputTypeError(f"{function}() got an unexpected keyword argument {name!r}")
