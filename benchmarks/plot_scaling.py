"""Figures from the JSON that bench_scaling.py writes.

    python benchmarks/plot_scaling.py components FILE.json OUT.png
    python benchmarks/plot_scaling.py length FILE.json [MORE.json ...] OUT.png

components: cost of each method, as a multiple of one forward + backward pass, against the number
  of components scored (log-log); extrapolated patching points are drawn hollow.
length: seconds and peak memory against prompt length for the forward + backward pass and DPA in
  full and lean mode (several files are merged, e.g. a separate 4096-token run).
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_components(data: dict, out: str) -> None:
    rows = data["rows"]
    n = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label, style in [("dpa_over_fb", "DPA (all edges and neurons, one call)", "o-"),
                              ("atp_over_fb", "AtP", "s-"), ("ig20_over_fb", "integrated gradients, 20 steps", "^-")]:
        ax.plot(n, [r[key] for r in rows], style, label=label)
    measured = [r for r in rows if r["patching_measured"]]
    guessed = [r for r in rows if not r["patching_measured"]]
    ax.plot(n, [r["patching_over_fb"] for r in rows], "k-", lw=1)
    ax.plot([r["n"] for r in measured], [r["patching_over_fb"] for r in measured], "ko",
            label="activation patching (one forward per unit)")
    if guessed:
        ax.plot([r["n"] for r in guessed], [r["patching_over_fb"] for r in guessed], "o", mfc="white", mec="k",
                label="activation patching, extrapolated")
    ax.axhline(2, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("components scored")
    ax.set_ylabel("time / (one forward + backward)")
    ax.set_title(f"{data['tokens']} tokens; {data['machine']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_length(datas: list[dict], out: str) -> None:
    rows = sorted((r for d in datas for r in d["rows"]), key=lambda r: r["tokens"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.8))
    for mode, label, style in [("forward_backward", "forward + backward", "k^-"), ("full", "DPA full", "o-"),
                               ("lean", "DPA lean", "s-")]:
        pts = [r for r in rows if f"{mode}_s" in r]
        ax_t.plot([r["tokens"] for r in pts], [r[f"{mode}_s"] for r in pts], style, label=label)
        ax_m.plot([r["tokens"] for r in pts], [r[f"{mode}_peak_mib"] / 1024 for r in pts], style, label=label)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds")
    ax_m.set_ylabel("peak memory above the model (GiB)")
    fig.suptitle(datas[0]["machine"], fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if len(sys.argv) < 4 or sys.argv[1] not in ("components", "length"):
        sys.exit(__doc__)
    what, files, out = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
    datas = [json.load(open(f)) for f in files]
    if what == "components":
        plot_components(datas[0], out)
    else:
        plot_length(datas, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
