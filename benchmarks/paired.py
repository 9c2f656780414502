"""Two methods on the same samples: the paired difference of their total AUCs, with a bootstrap interval.

    python benchmarks/paired.py RUN:METHOD RUN:METHOD [--mode paper|clean] [--resamples 2000] [--seed 0]

    python benchmarks/paired.py \\
        benchmarks/results/gemma-3-270m/sweep-squad_v2.0-input-attention:'dpa[0,0,1,0.5,0.5]' \\
        benchmarks/results/gemma-3-270m/squad_v2.0-input:mean_attention

RUN is a folder of ``dpa evaluate`` or ``dpa sweep`` (its ``samples.jsonl``, and the ranks' parts of a torchrun
that is still going); METHOD a method name in it (a sweep
names its points ``dpa[q,k,v,gate,up]``). Only the samples both runs hold are compared, and both runs must be of
the same dataset and unit. A benchmark's total AUC is the mean of the per-sample totals (the trapezoid is linear in
the curve), so the difference of two methods' totals is the mean of the per-sample differences; its 95% interval
comes from resampling the samples (paired: one resample draws the same samples for both methods). Wins count the
samples where the first method's total is strictly higher.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpa.evaluate.curves import fraction_grid
from dpa.evaluate.stats import paired_difference, sample_total


def per_sample_totals(run: Path, method: str, mode: str = "paper") -> dict[int, float]:
    """Each sample's total AUC (recovery - disruption) for one method of a run, by sample index."""
    config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    fractions = fraction_grid(config["dataset"], config["unit"])
    out = {}
    parts = [run / "samples.jsonl", *sorted(run.glob("samples.rank*.jsonl"))]  # a torchrun not yet merged
    for part in parts:
        if not part.exists():
            continue
        for line in part.read_text(encoding="utf-8").splitlines(keepends=True):
            if not line.endswith("\n"):  # a line cut off by an interrupted run (the file is only read)
                continue
            row = json.loads(line)
            if row["method"] == method:
                out[row["index"]] = sample_total(row, fractions, config["unit"], mode)
    if not out:
        raise SystemExit(f"{run}: no samples of method {method!r}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="RUN:METHOD")
    p.add_argument("b", help="RUN:METHOD")
    p.add_argument("--mode", choices=("paper", "clean"), default="paper")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    runs = []
    for spec in (args.a, args.b):
        run, sep, method = spec.partition(":")
        if not sep or not method:
            raise SystemExit(f"{spec!r}: give RUN:METHOD")
        runs.append((Path(run), method))
    configs = [json.loads((run / "config.json").read_text(encoding="utf-8")) for run, _ in runs]
    if {(c["dataset"], c["unit"]) for c in configs} != {(configs[0]["dataset"], configs[0]["unit"])}:
        raise SystemExit("the two runs are of different datasets or units")
    r = paired_difference(*(per_sample_totals(run, method, args.mode) for run, method in runs), resamples=args.resamples,
                seed=args.seed)
    lo, hi = r["interval"]
    print(f"{r['samples']} common samples, total AUC ({args.mode} mode): {runs[0][1]} {r['a']:.2f}, "
          f"{runs[1][1]} {r['b']:.2f}; difference {r['difference']:+.2f}, 95% interval [{lo:+.2f}, {hi:+.2f}]; "
          f"higher on {r['wins']}, lower on {r['losses']}")


if __name__ == "__main__":
    main()
