"""Put the `dpa evaluate` result folders side by side as markdown tables.

    python benchmarks/faithfulness_table.py [RESULTS_DIR]

Reads ``<dataset>-<unit>/results.json`` under RESULTS_DIR (default: benchmarks/results) and prints
four tables, one column per dataset × unit, one row per method: total AUC in paper mode, total
AUC in clean mode, seconds per sample (the attribution call alone), and that time as a multiple
of DPA's on the same sample (the median over samples of the per-sample ratio, read from
``samples.jsonl``: the methods of one sample run back to back, so the ratio survives a busy
machine better than the seconds do). Where a run folder holds ``timing.json`` (``bench_methods.py``: the
attribution calls timed again on a quiet machine, in one run), its two time tables take that file's figures instead,
and the column's name carries a dagger. The paper's Llama-3.1-8B-Instruct figures for DPA and the
best baseline are printed under them.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RUNS = ["known_1000-input", "squad_v2.0-input", "imdb-input", "known_1000-component", "ioi-component"]

# Llama-3.1-8B-Instruct, total AUC in the paper's mode (the paper's tables, arXiv 2603.19742).
PAPER = {
    "known_1000-input": ("DPA 28.09", "last-layer attention 19.57"),
    "squad_v2.0-input": ("DPA 74.78", "mean attention 72.40"),
    "imdb-input": ("DPA 30.17", "last-layer attention 11.89"),
    "known_1000-component": ("DPA 123.50", "attention-only 92.77"),
    "ioi-component": ("DPA 86.87", "attention-only 92.92"),
}


def load(root: Path) -> dict[str, dict]:
    out = {}
    for run in RUNS:
        path = root / run / "results.json"
        if path.exists():
            out[run] = json.loads(path.read_text())
    return out


def time_ratios(folder: Path, n_evaluated: int) -> dict[str, float]:
    """Method -> median over the evaluated samples of seconds(method) / seconds(dpa) on that sample."""
    read = lambda name: [json.loads(x) for x in (folder / name).read_text().splitlines() if x.strip()]  # noqa: E731
    valid = sorted({r["index"] for r in read("filter.jsonl") if r["valid"]})[:n_evaluated]
    seconds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in read("samples.jsonl"):
        seconds[r["index"]][r["method"]] = r["seconds"]
    ratios = defaultdict(list)
    for i in valid:
        for method, sec in seconds[i].items():
            if "dpa" in seconds[i]:
                ratios[method].append(sec / seconds[i]["dpa"])
    return {method: statistics.median(rs) for method, rs in ratios.items()}


def table(results: dict[str, dict], value, fmt: str, best=max) -> str:
    runs = list(results)
    methods = []
    for r in runs:
        methods += [m for m in results[r]["methods"] if m not in methods]
    head = "| method | " + " | ".join(runs) + " |\n|---|" + "---:|" * len(runs) + "\n"
    bests = {}
    for r in runs:
        vals = [value(m) for m in results[r]["methods"].values()]
        bests[r] = best(vals) if vals and best else None
    lines = []
    for name in methods:
        cells = []
        for r in runs:
            m = results[r]["methods"].get(name)
            if m is None:
                cells.append("")
                continue
            v = value(m)
            cell = format(v, fmt)
            cells.append(f"**{cell}**" if bests[r] is not None and v == bests[r] else cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results"
    results = load(root)
    if not results:
        sys.exit(f"no <dataset>-<unit>/results.json under {root}")
    print("Samples: " + "; ".join(f"{r} {res['n_evaluated']} evaluated ({res['n_valid']} valid of "
                                  f"{res['n_checked']} checked)" for r, res in results.items()) + "\n")
    print("Total AUC, paper mode (higher is better; best in bold)\n")
    print(table(results, lambda m: m["auc"]["paper"]["total"], ".2f"))
    print("Total AUC, clean mode\n")
    print(table(results, lambda m: m["auc"]["clean"]["total"], ".2f"))
    timed = {}
    for run, res in results.items():
        if (root / run / "timing.json").exists():
            timed[run] = json.loads((root / run / "timing.json").read_text())
            for name, m in res["methods"].items():
                m["seconds_per_sample"] = timed[run]["mean_seconds"][name]
                m["time_ratio"] = timed[run]["median_ratio_to_dpa"][name]
            continue
        ratios = time_ratios(root / run, res["n_evaluated"])
        for name, m in res["methods"].items():
            m["time_ratio"] = ratios.get(name, float("nan"))
    times = {(f"{r} †" if r in timed else r): res for r, res in results.items()}
    print("Seconds per sample, attribution call alone (fastest in bold)\n")
    print(table(times, lambda m: m["seconds_per_sample"], ".3f", best=min))
    print("Time per sample as a multiple of DPA's on the same sample (median over samples)\n")
    print(table(times, lambda m: m["time_ratio"], ".2f", best=None))
    for r, t in timed.items():
        print(f"† {r}: timed again by bench_methods.py ({t['date']}, {len(t['indices'])} samples, {t['machine']}), "
              "not in the evaluation run\n")
    print("The paper, Llama-3.1-8B-Instruct, total AUC (paper mode)\n")
    print("| run | DPA | best baseline |\n|---|---:|---|")
    for r in RUNS:
        print(f"| {r} | {PAPER[r][0][4:]} | {PAPER[r][1]} |")


if __name__ == "__main__":
    main()
