"""Figures of a benchmark run (matplotlib, written as PNG without a display)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path) -> None:
    """The figure through dpa's one writer (atomic; a device or FIFO written straight; errors name the path)."""
    import io

    from ..files import write_bytes

    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=120, format=Path(path).suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    write_bytes(path, buf.getvalue())


def _x_scale(ax, results: dict) -> None:
    if results["unit"] == "component":
        ax.set_xscale("log")
    elif min(results["fractions"]) < 0.05:  # the sigmoid grid of SQuAD / IMDb
        ax.set_xscale("logit")


def _ordered(results: dict) -> list[str]:
    methods = results["methods"]
    return sorted(methods, key=lambda m: -methods[m]["auc"]["paper"]["total"])


def plot_curves(results: dict, path: str | Path) -> None:
    """Disruption and recovery curves, one line per method (best total first in the legend): the
    paper's protocol in the top row, the clean one below."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.2), sharey=False)
    f = results["fractions"]
    rows = (("paper", "paper_"), ("clean", ""))
    for name in _ordered(results):
        m = results["methods"][name]
        style = {"lw": 2.4, "color": "black"} if name == "dpa" else {"lw": 1.3}
        for (mode, prefix), row in zip(rows, axes):
            for ax, key in zip(row, ("disruption", "recovery")):
                ax.plot(f, m.get(prefix + key, m[key]), marker="o", ms=3,
                        label=f"{name} ({m['auc'][mode]['total']:.1f})", **style)
    for (mode, _), row in zip(rows, axes):
        for ax, key in zip(row, ("disruption", "recovery")):
            _x_scale(ax, results)
            ax.set_xlabel("fraction of units f")
            ax.set_ylabel("100 · p_ablated / p_clean")
            better = "lower" if key == "disruption" else "higher"
            ax.set_title(f"{key}, {mode} protocol ({better} is better)")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=7, title=f"method (total AUC, {mode})", title_fontsize=7, loc="best")
    unit = results["unit"] + (f", {results['component_units']}" if results.get("component_units") else "")
    fig.suptitle(f"{results['dataset']} — {unit} units — {results['model']} — {results['n_evaluated']} samples")
    fig.tight_layout()
    _save(plt, fig, path)


def plot_auc(results: dict, path: str | Path) -> None:
    """Total AUC per method in both modes (horizontal bars)."""
    plt = _pyplot()
    names = _ordered(results)[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.5))
    y = range(len(names))
    for offset, mode in ((-0.2, "paper"), (0.2, "clean")):
        ax.barh([i + offset for i in y], [results["methods"][n]["auc"][mode]["total"] for n in names], height=0.38,
                label=mode)
    ax.set_yticks(list(y), names)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("total AUC = recovery − disruption (higher is better)")
    ax.legend(fontsize=8)
    ax.set_title(f"{results['dataset']}, {results['unit']} units, {results['n_evaluated']} samples", fontsize=10)
    fig.tight_layout()
    _save(plt, fig, path)


def plot_sweep(summary: dict, path: str | Path) -> None:
    """Total AUC of DPA against p, one line per path-weight family, both modes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    families = list(dict.fromkeys(pt["family"] for pt in summary["points"]))
    for ax, mode in zip(axes, ("paper", "clean")):
        for family in families:
            pts = [pt for pt in summary["points"] if pt["family"] == family and pt["auc"] is not None]
            ax.plot([pt["p"] for pt in pts], [pt["auc"][mode]["total"] for pt in pts], marker="o", label=family)
        ax.set_xlabel("p")
        ax.set_ylabel(f"total AUC ({mode})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"DPA sensitivity — {summary['dataset']}, {summary['unit']} units — {summary['n_evaluated']} samples")
    fig.tight_layout()
    _save(plt, fig, path)
