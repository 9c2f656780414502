"""Area under a faithfulness curve: the trapezoid rule over linear f (method.md section 6).

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

from typing import Literal, Sequence

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


def auc(fractions: Sequence[float], values: Sequence[float], *, curve: Literal["disruption", "recovery"],
        unit: Literal["input", "component"], mode: Mode = "clean") -> float:
    """AUC of one curve in ``mode`` (see the module docstring)."""
    if len(fractions) != len(values):
        raise ValueError(f"{len(fractions)} fractions but {len(values)} values")
    if (unit, curve) not in ANCHORS:
        raise ValueError(f"unknown curve {curve!r} or unit {unit!r}")
    if mode not in ("paper", "clean"):
        raise ValueError(f"mode must be 'paper' or 'clean', got {mode!r}")
    points = list(zip(map(float, fractions), map(float, values)))
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
    curves = {"clean": (disruption, recovery), "paper": paper or (disruption, recovery)}
    out = {}
    for mode in ("paper", "clean"):
        dis, rec = curves[mode]
        d = auc(fractions, dis, curve="disruption", unit=unit, mode=mode)
        r = auc(fractions, rec, curve="recovery", unit=unit, mode=mode)
        out[mode] = {"disruption": d, "recovery": r, "total": r - d}
    return out
