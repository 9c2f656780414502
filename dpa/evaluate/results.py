"""A run's results: its stored rows aggregated per method (mean curves, AUCs, timings) and written as
``results.json``, ``results.csv``, ``results.md`` and the figures; a sweep's ``sweep.json`` / ``.csv`` / ``.png``."""

from __future__ import annotations

import json
import math
import platform
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..files import write_text
from .auc import auc_summary
from .measure import is_complete, unembedding
from .settings import Settings
from .store import Store


def _paper_curve(row: dict, key: str) -> list[float]:
    return row.get(f"paper_{key}", row[key])


def summarize(settings: Settings, methods, store: Store, chosen: list[int], fractions, model: nn.Module, *,
              n_checked: int) -> dict:
    """Mean curves, AUCs (both modes) and timings per method over the chosen samples."""
    per_method = {}
    for name in methods:
        rows = [store.samples[(i, name)] for i in chosen if (i, name) in store.samples]
        rows = [r for r in rows if is_complete(r, settings, model)]
        if not rows:
            continue
        mean = lambda curve: [sum(curve(r)[j] for r in rows) / len(rows) for j in range(len(fractions))]  # noqa: E731
        disruption, recovery = mean(lambda r: r["disruption"]), mean(lambda r: r["recovery"])
        paper = (mean(lambda r: _paper_curve(r, "disruption")), mean(lambda r: _paper_curve(r, "recovery")))
        per_method[name] = {
            "n_samples": len(rows),
            "seconds_per_sample": sum(r["seconds"] for r in rows) / len(rows),
            "eval_seconds_per_sample": sum(r["eval_seconds"] for r in rows) / len(rows),
            "disruption": disruption, "recovery": recovery,  # the clean protocol's mean curves
            "paper_disruption": paper[0], "paper_recovery": paper[1],  # the paper's protocol
            "auc": auc_summary(fractions, disruption, recovery, unit=settings.unit, paper=paper),
        }
    checked = [store.verdicts[i] for i in sorted(store.verdicts)]
    device = unembedding(model).device
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu ({platform.processor() or platform.machine()})")
    return {
        "dataset": settings.dataset, "unit": settings.unit,
        "component_units": settings.component_units if settings.unit == "component" else None,
        "model": getattr(model.config, "_name_or_path", ""), "dtype": str(unembedding(model).dtype),
        "device": where,
        "torch": torch.__version__, "settings": {**asdict(settings), "weights": settings.weights.to_dict()},
        "fractions": list(fractions), "n_checked": n_checked, "n_valid": sum(r["valid"] for r in checked),
        "n_evaluated": len(chosen), "dropped": dict(Counter(r["reason"] for r in checked if not r["valid"])),
        "p_clean_mean": _mean([store.verdicts[i]["probability"] for i in chosen]),
        "methods": per_method,
    }


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


CSV_COLUMNS = ("method", "n_samples", "seconds_per_sample", "paper_disruption", "paper_recovery", "paper_total",
               "clean_disruption", "clean_recovery", "clean_total")


def table_rows(results: dict) -> list[dict]:
    """One row per method, best paper-mode total first."""
    rows = []
    for name, m in results["methods"].items():
        row = {"method": name, "n_samples": m["n_samples"], "seconds_per_sample": m["seconds_per_sample"]}
        for mode in ("paper", "clean"):
            for key in ("disruption", "recovery", "total"):
                row[f"{mode}_{key}"] = m["auc"][mode][key]
        rows.append(row)
    return sorted(rows, key=lambda r: -r["paper_total"])


def markdown_table(results: dict) -> str:
    head = (f"{results['dataset']}, {results['unit']} units"
            + (f" ({results['component_units']})" if results.get("component_units") else "")
            + f", {results['model']}: {results['n_evaluated']} samples "
            f"({results['n_valid']} valid of {results['n_checked']} checked)\n\n")
    lines = ["| method | total (paper) | disruption (paper) | recovery (paper) | total (clean) | s / sample |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in table_rows(results):
        lines.append(f"| {r['method']} | {r['paper_total']:.2f} | {r['paper_disruption']:.2f} | "
                     f"{r['paper_recovery']:.2f} | {r['clean_total']:.2f} | {r['seconds_per_sample']:.3f} |")
    return head + "\n".join(lines) + "\n"


def figure_files(results: dict, figures: bool = True) -> tuple[str, ...]:
    """The figures ``write_results`` writes: none when asked for none, or when no method has results."""
    return ("curves.png", "auc.png") if figures and results["methods"] else ()


def write_results(results: dict, out: Path, *, figures: bool = True) -> None:
    write_text(out / "results.json", json.dumps(results, indent=1) + "\n")  # each file atomically
    rows = [",".join(f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]) for c in CSV_COLUMNS)
            for r in table_rows(results)]
    write_text(out / "results.csv", "\n".join([",".join(CSV_COLUMNS), *rows]) + "\n")
    write_text(out / "results.md", markdown_table(results))
    if figure_files(results, figures):
        from .plots import plot_auc, plot_curves

        plot_curves(results, out / "curves.png")
        plot_auc(results, out / "auc.png")


def write_sweep(settings: Settings, results: dict, points: list[dict], out: Path, figures: bool) -> dict:
    """A sweep's files (``sweep.json``, ``sweep.csv``, ``sweep.png``): each point's AUCs, from the run's results."""
    for point in points:
        m = results["methods"].get(point["method"])
        point["auc"] = None if m is None else m["auc"]
    summary = {"dataset": settings.dataset, "unit": settings.unit, "model": results["model"],
               "n_evaluated": results["n_evaluated"], "points": points}
    write_text(out / "sweep.json", json.dumps(summary, indent=1) + "\n")
    lines = ["family,p,q,k,v,gate,up,paper_total,clean_total"]
    for pt in points:
        if pt["auc"] is None:
            continue
        w = ",".join(f"{pt['weights'][k]:g}" for k in ("query", "key", "value", "gate", "up"))
        lines.append(f"{pt['family']},{pt['p']:g},{w},{pt['auc']['paper']['total']:.6g},"
                     f"{pt['auc']['clean']['total']:.6g}")
    write_text(out / "sweep.csv", "\n".join(lines) + "\n")
    if figures:
        from .plots import plot_sweep

        plot_sweep(summary, out / "sweep.png")
    return summary
