"""Two methods on the same samples: the paired difference of their total AUCs with a bootstrap interval
(``benchmarks/paired.py``, and the warning of ``dpa evaluate`` when a run has too few samples to rank methods).

A benchmark's total AUC is the mean of the per-sample totals (the trapezoid is linear in the curve), so the
difference of two methods' totals is the mean of the per-sample differences; its 95% interval comes from
resampling the samples (paired: one resample draws the same samples for both methods)."""

from __future__ import annotations

import random

from .auc import auc_summary

# Below this many samples a run says it cannot rank methods (the committed 100-sample runs' intervals on a
# difference of totals are 5 to 25 AUC points wide; they widen as 1/sqrt(n)).
FEW_SAMPLES = 30


def sample_total(row: dict, fractions, unit: str, mode: str = "paper") -> float:
    """One sample's total AUC (recovery - disruption) from its ``samples.jsonl`` row, in ``mode``."""
    paper = (row.get("paper_disruption", row["disruption"]),  # rows of older runs hold the clean curves
             row.get("paper_recovery", row["recovery"]))
    return auc_summary(fractions, row["disruption"], row["recovery"], unit=unit, paper=paper)[mode]["total"]


def paired_difference(a: dict[int, float], b: dict[int, float], *, resamples: int = 2000, seed: int = 0) -> dict:
    """Mean totals, their difference with a paired bootstrap 95% interval, and wins, on the common samples."""
    common = sorted(a.keys() & b.keys())
    diff = [a[i] - b[i] for i in common]
    n = len(diff)
    rng = random.Random(seed)
    means = sorted(sum(diff[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return {"samples": n, "a": sum(a[i] for i in common) / n, "b": sum(b[i] for i in common) / n,
            "difference": sum(diff) / n, "interval": (means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]),
            "wins": sum(d > 0 for d in diff), "losses": sum(d < 0 for d in diff)}


def separation(rows: dict[tuple[int, str], dict], chosen: list[int], methods: list[str], fractions, unit: str,
               against: str = "dpa", mode: str = "paper") -> list[tuple[str, dict]]:
    """``against`` minus every other method on the ``chosen`` samples: (method, ``paired_difference``)."""
    totals = {m: {i: sample_total(rows[(i, m)], fractions, unit, mode) for i in chosen if (i, m) in rows}
              for m in methods}
    return [(m, paired_difference(totals[against], totals[m])) for m in methods
            if m != against and totals[m] and totals[against]]
