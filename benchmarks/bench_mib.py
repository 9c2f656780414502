"""MIB's circuit-localization protocol on the real models: CPR and CMD of every method on every task, each
method's cost as a multiple of one gradient measured in the same run, paired bootstrap intervals, curves.

    python benchmarks/bench_mib.py --model smollm2 --data ../shared/data            # every task and method
    python benchmarks/bench_mib.py --model gemma-3-270m --tasks ioi --methods dpa-cf,eap-ig
    python benchmarks/bench_mib.py --table                                          # tables and figures only

Each (model, task, method) is a ``dpa.mib.discover`` run folder under ``benchmarks/results/mib/MODEL/TASK/METHOD``
(resumable: started again, a run goes on where it stopped); ``pairs.json`` there holds the task's pairs (MIB's
filters applied, rebuilt offline: ``dpa.mib.tasks.RULES``), ``cost.json`` the cost ratios. ``--table`` writes
``benchmarks/results/mib/README.md`` (the CPR/CMD table, costs, intervals) and ``curves-MODEL.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from dpa.mib.discover import discover  # noqa: E402
from dpa.mib.evaluate import Faithfulness, paired_bootstrap  # noqa: E402
from dpa.mib.forward import batch_of  # noqa: E402
from dpa.mib.graph import Graph  # noqa: E402
from dpa.mib.methods import batch_scores  # noqa: E402
from dpa.mib.pairs import Pairs  # noqa: E402
from dpa.request import check_model  # noqa: E402

RESULTS = ROOT / "results" / "mib"
MODELS = {"smollm2": None, "gemma-3-270m": "gemma-3-270m"}
METHODS = ("dpa", "dpa-cf", "dpa-ig", "eap", "eap-ig", "gim", "gim-package", "random")
BEST_AGAINST = ("eap-ig", "gim")  # DPA's best variant is compared with these, paired


def variant(name: str):
    """A method name with its settings: ``dpa-cf``, or an experiment's variant ``dpa-cf@control_content=0.8``
    (a path-weight family at p, ``dpa.PathWeights.preset``), ``dpa-cf@weights=q:k:v:gate:up`` (colons: ``--methods``
    is a comma-separated list), ``gim@T=4``.
    Returns (method, path weights or None, temperature or None)."""
    from dpa.weights import PathWeights

    base, _, setting = name.partition("@")
    if not setting:
        return base, None, None
    key, _, value = setting.partition("=")
    if key == "T":
        return base, None, float(value)
    if key == "weights":
        return base, PathWeights.parse(value.replace(":", ",")), None
    return base, PathWeights.preset(key, float(value)), None


def _pairs_file(folder: Path, make) -> Pairs:
    path = folder / "pairs.json"
    if path.exists():
        d = json.loads(path.read_text())
        return Pairs(d["clean"], d["counter"], d["answers"], d["wrong"], d["metric"])
    pairs = make()
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"clean": pairs.clean, "counter": pairs.counter, "answers": pairs.answers,
                                "wrong": pairs.wrong, "metric": pairs.metric}))
    return pairs


def gradient_time(model, pairs: Pairs, rows: list[int]) -> float:
    """One gradient of the task metric with respect to the input embeddings, on the same batch (the unit of cost)."""
    with batch_of(model, pairs, rows, grad=True) as batch:
        spec, session = batch.session.spec, batch.session
        start = time.perf_counter()
        embeds = spec.embed(model)(batch.clean).detach().requires_grad_(True)
        hidden = session.forward(inputs_embeds=embeds)
        from dpa.instrument import logits_at

        value = batch.metric(logits_at(model, session.request, hidden)).sum()
        torch.autograd.grad(value, embeds)
        return time.perf_counter() - start


def method_time(model, pairs: Pairs, rows: list[int], method: str) -> float:
    graph = Graph.of(check_model(model))
    start = time.perf_counter()
    if method == "gim-package":
        from benchmarks.mib_gim_package import gim_package_scores

        gim_package_scores(model, pairs.subset(rows), batch_size=len(rows))
    elif method == "random":
        pass
    else:
        base, weights, temperature = variant(method)
        batch_scores(model, pairs, rows, base, graph, weights=weights, temperature=temperature)
    return time.perf_counter() - start


def costs(model, pairs: Pairs, methods, batch_size: int, repeats: int = 3) -> dict:
    """Each method's time for one batch over one gradient's on that batch, interleaved, the median of ``repeats``."""
    rows = list(range(min(batch_size, len(pairs))))
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(repeats):
        for m in methods:
            g = gradient_time(model, pairs, rows)
            ratios[m].append(method_time(model, pairs, rows, m) / g)
    return {m: statistics.median(r) for m, r in ratios.items()}


def run(args) -> None:
    import dpa
    from dpa.mib import tasks as mib_tasks

    model, tok = dpa.load_model(MODELS[args.model])
    torch.set_num_threads(args.threads)
    for task in args.tasks:
        folder = RESULTS / args.model / task
        try:
            pairs = _pairs_file(folder, lambda: mib_tasks.task_pairs(model, tok, task, n=args.n, data=args.data,
                                                                     fewer=True))
        except dpa.errors.InputError as err:  # the model answers none right: said in the table
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "skipped.txt").write_text(f"{err}\n")
            print(f"{args.model} {task}: skipped ({err})", flush=True)
            continue
        for method in args.methods:
            out = folder / method
            if (out / "faithfulness.json").exists():
                continue
            print(f"{args.model} {task} {method}", flush=True)
            start = time.perf_counter()
            if method == "gim-package":
                from benchmarks.mib_gim_package import gim_package_scores
                from dpa.mib.discover import Discovery, _faithfulness_json, _write_text
                from dpa.mib.evaluate import evaluate

                scores = gim_package_scores(model, pairs, batch_size=args.batch_size)
                found = Discovery(Graph.of(check_model(model)), scores, method,
                                  evaluate(model, pairs, scores, batch_size=args.batch_size), model.config.hidden_size)
                out.mkdir(parents=True, exist_ok=True)
                found.save_json(out / "graph.json")
                found.faithfulness.save(out / "per_pair.pt")  # per-pair metrics, for the paired intervals
                _write_text(out / "faithfulness.json", json.dumps(_faithfulness_json(found), indent=1))
            else:
                base, weights, temperature = variant(method)
                found = discover(model, tok, pairs, method=base, weights=weights, temperature=temperature,
                                 batch_size=args.batch_size, out=out, progress=not args.quiet)  # per_pair.pt too
            print(f"  CPR {found.faithfulness.cpr:.3f} CMD {found.faithfulness.cmd:.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        cost_file = folder / "cost.json"  # each ratio against a gradient timed beside it (interleaved, one process)
        before = json.loads(cost_file.read_text()) if cost_file.exists() else {"ratio": {}, "threads": {}}
        known = before["ratio"]
        threads = before["threads"] if isinstance(before["threads"], dict) else dict.fromkeys(known, before["threads"])
        missing = [m for m in args.methods if m != "random" and m not in known]
        if args.retime:  # every method run on this task, timed again in this one process, on these threads
            missing = [m.name for m in sorted(folder.iterdir()) if (m / "faithfulness.json").exists()
                       and m.name != "random"]
        if missing:
            known.update(costs(model, pairs, missing, args.batch_size))
            threads.update(dict.fromkeys(missing, args.threads))  # each ratio with the threads it was timed on
            cost_file.write_text(json.dumps({"batch_size": args.batch_size, "ratio": known,
                                             "threads": threads}, indent=1))


def _load(out: Path) -> Faithfulness | None:
    path = out / "per_pair.pt"
    return Faithfulness.load(path) if path.exists() else None


def table() -> None:
    """benchmarks/results/mib/README.md and curves-MODEL.png from the run folders."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["# MIB circuit localization: CPR (higher is better) and CMD (lower is better)", "",
             "Made by `python benchmarks/bench_mib.py --model MODEL --data ../shared/data` and `--table`. Tasks "
             "rebuilt offline (`dpa.mib.tasks.RULES`); 100 pairs each that the model answers right. A model or task "
             "appears once one of its runs has finished; a variant `METHOD@SETTING` is one of the experiments that "
             "explain the order (path weights `weights=q:k:v:gate:up`, GIM's temperature `T=`).", ""]
    for model_dir in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        tasks = sorted(p for p in model_dir.iterdir() if p.is_dir() and any(p.glob("*/faithfulness.json")))
        if not tasks:  # nothing finished yet on this model
            continue
        found_names = sorted({p.parent.name for t in tasks for p in t.glob("*/faithfulness.json")})
        methods = [m for m in METHODS if m in found_names] + [m for m in found_names if m not in METHODS]
        lines += [f"## {model_dir.name}", "", "| method | " + " | ".join(f"{t.name} CPR | CMD" for t in tasks) + " |",
                  "|---|" + "---|---|" * len(tasks)]
        for m in methods:
            cells = []
            for t in tasks:
                path = t / m / "faithfulness.json"
                if path.exists():
                    d = json.loads(path.read_text())
                    cells += [f"{d['cpr']:.3f}", f"{d['cmd']:.4f}"]
                else:
                    cells += ["", ""]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        for t in sorted(model_dir.glob("*/skipped.txt")):  # a task the model cannot do: MIB's filter leaves too few
            why = t.read_text().strip().removeprefix(f"{t.parent.name}: ")
            lines += ["", f"Not measured, {t.parent.name}: {why}"]
        lines += ["", "Cost (time of one batch's edge scores / one gradient on that batch, median of 3, same run):", "",
                  "| task | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for t in tasks:
            if (t / "cost.json").exists():
                r = json.loads((t / "cost.json").read_text())["ratio"]
                lines.append(f"| {t.name} | " + " | ".join(f"{r[m]:.1f}" if m in r else "" for m in methods) + " |")
        lines += ["", "Paired bootstrap (pairs resampled, 95%): each DPA variant that uses the counterfactual minus each "
                  "rival (for CMD, lower is better: a positive difference is DPA behind):", ""]
        for t in tasks:
            found = {m: _load(t / m) for m in methods}
            for mine in [m for m in ("dpa-cf", "dpa-ig") if found.get(m) is not None]:
                for rival in BEST_AGAINST:
                    if found.get(rival) is None:
                        continue
                    b = paired_bootstrap(found[mine], found[rival])
                    lines.append(f"* {t.name}: {mine} - {rival}: CPR {b['cpr']['difference']:+.3f} "
                                 f"[{b['cpr']['interval'][0]:+.3f}, {b['cpr']['interval'][1]:+.3f}], CMD "
                                 f"{b['cmd']['difference']:+.4f} [{b['cmd']['interval'][0]:+.4f}, "
                                 f"{b['cmd']['interval'][1]:+.4f}]")
        fig, axes = plt.subplots(2, len(tasks), figsize=(3.2 * len(tasks), 6.2), squeeze=False,
                                 layout="constrained")
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        colour = {m: palette[k % len(palette)] for k, m in enumerate(methods)}  # one colour a method, every panel
        for j, t in enumerate(tasks):
            for m in methods:
                f = _load(t / m)
                if f is None:
                    continue
                axes[0, j].plot(f.cpr_curve.sizes, f.cpr_curve.f.numpy(), marker=".", label=m, color=colour[m])
                axes[1, j].plot(f.cmd_curve.sizes, f.cmd_curve.f.numpy(), marker=".", label=m, color=colour[m])
            axes[0, j].set_title(t.name)
            for i in (0, 1):
                axes[i, j].set_xscale("log")
                axes[i, j].axhline(1, color="grey", lw=0.7, ls="--")
            axes[1, j].set_xlabel("share of edges kept")
        axes[0, 0].set_ylabel("f, signed ranking (CPR)")
        axes[1, 0].set_ylabel("f, |score| ranking (CMD)")
        handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
        fig.legend(handles.values(), handles.keys(), fontsize=7, frameon=False, loc="outside lower center",
                   ncol=min(4, len(handles)))
        fig.savefig(RESULTS / f"curves-{model_dir.name}.png", dpi=110)
        lines += ["", f"![curves](curves-{model_dir.name}.png)", ""]
    (RESULTS / "README.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    p.add_argument("--tasks", default="ioi,mcqa,arithmetic-add,arithmetic-sub,greater-than")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--data", default=os.environ.get("DPA_DATA", str(ROOT.parent.parent / "shared" / "data")))
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--retime", action="store_true",
                   help="time every method already run on each task again, in this one process (replaces cost.json)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--table", action="store_true", help="only write the tables and figures")
    args = p.parse_args()
    if args.table:
        table()
        return
    args.tasks = args.tasks.split(",")
    args.methods = args.methods.split(",")
    run(args)
    table()


if __name__ == "__main__":
    main()
