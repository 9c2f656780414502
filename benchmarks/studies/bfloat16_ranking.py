"""Rank as the reference code does: scores rounded to bfloat16 before ranking (issue 20).

    python benchmarks/studies/bfloat16_ranking.py [--run benchmarks/results/squad_v2.0-input]
                                                  [--methods dpa,mean_attention]
                                                  [--out benchmarks/results/squad-diagnosis/bfloat16-ranking]

The authors' evaluation code rounds every method's scores to bfloat16 before it ranks them, which turns near-equal
scores into ties (broken here by the benchmark's seeded permutation); dpa ranks the float32 scores. This runs the
benchmark again on the samples of ``--run`` (its settings, its filter verdicts) with each method's scores rounded
to bfloat16, through ``dpa.evaluate`` with a ``methods`` override, so the curves, AUCs and tie-breaking are the
protocol's own. The model itself stays in float32. Writes the run's usual files to ``--out`` and
``comparison.md``: each method's totals with float32 and with bfloat16 ranking, side by side. Resumable.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

import dpa
from dpa.baselines import INPUT_METHODS
from dpa.evaluate import evaluate
from dpa.evaluate.runner import Settings

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/: common.py
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from common import run_config  # noqa: E402  (a run's prompt form and model; None: the default)


def rounded(fn, attribution_dtype=torch.bfloat16):
    """The method, its token scores rounded to ``attribution_dtype`` (and back): ties where they collide."""
    @functools.wraps(fn)
    def method(*args, **kwargs):
        a = fn(*args, **kwargs)
        return replace(a, token_scores=a.token_scores.to(attribution_dtype).to(a.token_scores.dtype))
    return method


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="benchmarks/results/squad_v2.0-input")
    p.add_argument("--methods", default="dpa,mean_attention")
    p.add_argument("--out", default="benchmarks/results/squad-diagnosis/bfloat16-ranking")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run, out = Path(args.run), Path(args.out)
    config = json.loads((run / "config.json").read_text(encoding="utf-8"))
    first = json.loads((run / "results.json").read_text(encoding="utf-8"))
    if config["unit"] != "input":
        raise SystemExit("bfloat16 ranking is implemented for input runs (token scores)")
    _, prompt, name = run_config(run)
    settings = Settings(config["dataset"], "input", limit=first["n_evaluated"], data_dir=args.data_dir,
                        seed=config["seed"], prompt=prompt)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "filter.jsonl").exists():  # the same model and dtype: the run's verdicts hold
        shutil.copy(run / "filter.jsonl", out / "filter.jsonl")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = {f"{m} (bfloat16 ranking)": rounded(INPUT_METHODS[m]) for m in names}
    model, tokenizer = dpa.load_model(name, device="cpu", dtype=torch.float32)
    results = evaluate(model, tokenizer, replace(settings, methods=tuple(methods)), out, methods=methods)
    lines = [f"# {config['dataset']} input, {results['n_evaluated']} samples: scores ranked in float32 (dpa) and "
             "rounded to bfloat16 first (the reference code); total AUC, paper mode", "",
             "| method | float32 ranking | bfloat16 ranking | difference |", "|---|---:|---:|---:|"]
    for m in names:
        a = first["methods"][m]["auc"]["paper"]["total"]
        b = results["methods"][f"{m} (bfloat16 ranking)"]["auc"]["paper"]["total"]
        lines.append(f"| {m} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    (out / "comparison.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
