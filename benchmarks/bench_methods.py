"""Seconds of each attribution method alone, on the samples of a finished `dpa evaluate` run, in one process.

    python benchmarks/bench_methods.py RUN_FOLDER [--data-dir ../shared/data] [--samples N] [--threads 1] [--out FILE]
    torchrun --nproc-per-node 2 benchmarks/bench_methods.py RUN_FOLDER ...   # one rank per core, as the runs

An evaluation run times each method's attribution call (its ``seconds`` rows), but a run that is paused,
resumed over several sessions, or shares the cores with another job mixes machines in one column. This
script measures those calls again and nothing else: the samples RUN_FOLDER evaluated, or the first ``--samples``
of them (its ``filter.jsonl``: no filter pass), every method of the run's ``results.json`` as the registry builds it from
the run's settings, on the run's model in float32. Within a sample the methods run back to back, in an order
rotated from sample to sample, so that a slower minute or a warm cache favours none. Prints and writes the
mean and median seconds of each method and the median over samples of its per-sample ratio to DPA's, the figure that
survives a busy machine best. Under ``torchrun`` each rank times every N-th sample and rank 0 gathers them
(``torch.distributed``), the condition of an evaluation run under ``torchrun`` with ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

import dpa
from dpa import distributed
from dpa.evaluate.datasets import load_examples
from dpa.evaluate.prompts import encode_example
from dpa.evaluate.runner import Settings, resolve_methods

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_label, run_config  # noqa: E402  (run_config: a run's units, prompt form and model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a finished `dpa evaluate` folder (input or component unit)")
    p.add_argument("--data-dir", default=None, help="the benchmark data folder (default: found as dpa evaluate finds it)")
    p.add_argument("--samples", type=int, default=None, help="valid samples to time (default: as many as the run)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the evaluation runs used 1)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default: RUN/timing.json)")
    args = p.parse_args(argv)
    if args.samples is not None and args.samples < 1:
        p.error("--samples must be at least 1")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if not (args.run / "results.json").is_file() or not (args.run / "config.json").is_file():
        p.error(f"{args.run} is not a finished `dpa evaluate` folder (no results.json and config.json)")
    torch.set_num_threads(args.threads)
    config = json.loads((args.run / "config.json").read_text(encoding="utf-8"))
    _, prompt, model_name = run_config(args.run)  # the units do not matter here: no attribution call sees them
    results = json.loads((args.run / "results.json").read_text(encoding="utf-8"))
    names = list(results["methods"])
    settings = Settings(dataset=config["dataset"], unit=config["unit"], methods=tuple(names), steps=config["steps"],
                        component_units=config.get("component_units", "fine"),
                        seed=config["seed"], weights=dpa.PathWeights(**config["weights"]), prompt=prompt)
    methods = resolve_methods(settings)
    model, tokenizer = dpa.load_model(model_name, device="cpu")
    verdicts = [json.loads(x) for x in (args.run / "filter.jsonl").read_text(encoding="utf-8").splitlines() if x]
    valid = sorted(v["index"] for v in verdicts if v["valid"])[:args.samples or results["n_evaluated"]]
    examples = load_examples(config["dataset"], args.data_dir, seed=config["seed"], n_generated=config["n_generated"])
    machine = machine_label(torch.device("cpu"))
    print(f"{config['dataset']}: {len(valid)} samples x {len(names)} methods, {config.get('model')} on {machine}",
          flush=True)

    with distributed.group() as group:
        mine = {}  # sample index -> (tokens, {method: seconds})
        for k, index in enumerate(valid):
            if not group.mine(k):
                continue
            sample = encode_example(tokenizer, examples[index], settings.prompt)
            order = names[k % len(names):] + names[:k % len(names)]
            row = {}
            for name in order:
                start = time.perf_counter()
                methods[name](model, tokenizer, sample.input_ids, sample.target_id, position=sample.position,
                              contrast=sample.contrast_id if config["contrast"] else None)  # as the run's _measure
                row[name] = time.perf_counter() - start
            mine[index] = (sample.n_tokens, row)
            print(f"  [rank {group.rank}] sample {index} ({sample.n_tokens} tokens): "
                  + ", ".join(f"{n} {row[n]:.2f}" for n in names), flush=True)
        parts = [mine]
        if group.world > 1:
            parts = [None] * group.world
            torch.distributed.all_gather_object(parts, mine)
        world = group.world
    if not group.main:
        return 0
    rows = {index: r for part in parts for index, r in part.items()}
    n_tokens = [rows[i][0] for i in valid]
    seconds = {n: [rows[i][1][n] for i in valid] for n in names}
    machine += f", {world} process(es)"

    ratio = {n: statistics.median(s / d for s, d in zip(seconds[n], seconds["dpa"])) for n in names}
    median = {n: statistics.median(seconds[n]) for n in names}
    mean = {n: statistics.fmean(seconds[n]) for n in names}  # what an evaluation's seconds_per_sample is
    print("\n| method | seconds per sample (mean) | (median) | multiple of DPA (median per sample) |\n|---|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {mean[n]:.3f} | {median[n]:.3f} | {ratio[n]:.2f} |")
    out = args.out or args.run / "timing.json"
    out.write_text(json.dumps({
        "what": "attribution call alone, methods interleaved per sample (bench_methods.py)",
        "date": date.today().isoformat(), "machine": machine, "run": args.run.name, "indices": valid,
        "n_tokens": n_tokens, "mean_seconds": mean, "median_seconds": median, "median_ratio_to_dpa": ratio, "seconds": seconds,
    }, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
