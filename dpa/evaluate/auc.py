"""Area under a faithfulness curve: the trapezoid rule over linear f (book: faithfulness).

Curves are y(f) = 100 * mean p_ablated / p_clean at the grid fractions f. Two modes:
* ``paper``: the paper's anchor points are added before integrating (then sorted by f), so its
  numbers can be reproduced. Input disruption (0, 100); input recovery (1, 100); component
  disruption (1e-10, 100); component recovery (1e-6, 0) and (1, 100). The anchors put floors
  under the numbers: input disruption on the 0.1 ... 1 grid is at least 5, component recovery
  at least about 27.5, whatever the method.
* ``clean``: the grid points alone.
Total = recovery AUC - disruption AUC (higher is better). Each mode integrates the curves of its
own protocol (curves.py: the paper's unit sets and softmax dtype, or the clean ones); where the
two protocols measure the same curves, one pair of curves serves both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, Sequence

from torch import Tensor

from ..checks import check_choice, check_float
from ..errors import InputError, InputTypeError, NonFiniteError

Mode = Literal["paper", "clean"]
ANCHORS = {
    ("input", "disruption"): ((0.0, 100.0),),
    ("input", "recovery"): ((1.0, 100.0),),
    ("component", "disruption"): ((1e-10, 100.0),),
    ("component", "recovery"): ((1e-6, 0.0), (1.0, 100.0)),
}


def trapezoid(x: Sequence[float], y: Sequence[float]) -> float:
    """Trapezoid rule over points sorted by x."""
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(x, x[1:], y, y[1:]))


def _numbers(name: str, values) -> list[float]:
    """A sequence of finite real numbers; NaN or infinity is a NonFiniteError naming the entry."""
    if (isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable)
            or (isinstance(values, Tensor) and values.dim() != 1)):
        raise InputTypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        try:
            out.append(check_float(f"{name}[{i}]", v))
        except InputTypeError:
            raise
        except InputError as err:  # with no bounds, check_float refuses only NaN and infinities
            raise NonFiniteError(str(err)) from None
    return out


def auc(fractions: Sequence[float], values: Sequence[float], *, curve: Literal["disruption", "recovery"],
        unit: Literal["input", "component"], mode: Mode = "clean") -> float:
    """AUC of one curve in ``mode`` (see the module docstring). ``fractions`` in [0, 1], one finite value each."""
    return _auc(fractions, values, curve, unit, mode, "values")


def _auc(fractions, values, curve: str, unit: str, mode: str, name: str) -> float:
    """``auc``, its messages naming the curve's values ``name``."""
    check_choice("curve", curve, ("disruption", "recovery"))
    check_choice("unit", unit, ("input", "component"))
    check_choice("mode", mode, ("paper", "clean"))
    fractions, values = _numbers("fractions", fractions), _numbers(name, values)
    if len(fractions) != len(values):
        raise InputError(f"{name} has {len(values)} values for {len(fractions)} fractions (one value per fraction)")
    if not fractions:
        raise InputError("fractions is empty: a curve needs at least one point")
    bad = next((i for i, f in enumerate(fractions) if not 0 <= f <= 1), None)
    if bad is not None:
        raise InputError(f"fractions[{bad}] must be in [0, 1], got {fractions[bad]}")
    points = list(zip(fractions, values))
    if mode == "paper":
        points += ANCHORS[(unit, curve)]
    points.sort(key=lambda p: p[0])  # stable: an anchor at a grid fraction follows the grid point
    return trapezoid([p[0] for p in points], [p[1] for p in points])


def auc_summary(fractions: Sequence[float], disruption: Sequence[float], recovery: Sequence[float], *,
                unit: Literal["input", "component"],
                paper: tuple[Sequence[float], Sequence[float]] | None = None) -> dict[str, dict[str, float]]:
    """{mode: {disruption, recovery, total}} for both modes. ``disruption`` and ``recovery`` are the
    clean protocol's curves; ``paper`` = (disruption, recovery) of the paper's protocol where they
    differ (default: the same curves)."""
    check_choice("unit", unit, ("input", "component"))
    if paper is not None and (not isinstance(paper, (tuple, list)) or len(paper) != 2):
        size = f" of {len(paper)}" if isinstance(paper, (tuple, list)) else ""
        raise InputTypeError(f"paper must be a pair (disruption, recovery) of curves, or None, got "
                             f"{type(paper).__name__}{size}")
    curves = {"clean": ((disruption, "disruption"), (recovery, "recovery")),
              "paper": ((disruption, "disruption"), (recovery, "recovery")) if paper is None
              else ((paper[0], "paper[0]"), (paper[1], "paper[1]"))}
    out = {}
    for mode in ("paper", "clean"):
        (dis, dis_name), (rec, rec_name) = curves[mode]
        d = _auc(fractions, dis, "disruption", unit, mode, dis_name)
        r = _auc(fractions, rec, "recovery", unit, mode, rec_name)
        out[mode] = {"disruption": d, "recovery": r, "total": r - d}
    return out
