"""What DPA's SQuAD recovery loses, and to which tokens (issue 20): its curves under two diagnostic rankings.

    python benchmarks/squad_counterfactual.py [--diagnosis benchmarks/results/squad-diagnosis] [--data-dir ../shared/data]

Not a variant of the method and not the benchmark's protocol: the benchmark ranks by signed score. Here DPA's
token scores are re-ranked (1) by |score|, which moves the negatively scored tokens (the question's "?", ":",
"Who", the newline: see diagnosis.md) up, and (2) with the question's tokens first and the rest by DPA's score.
If recovery comes back, what DPA's ranking misses is the tokens the model needs but that push the answer's logit
down or barely at all: necessity, not contribution. Writes ``counterfactual.json`` and ``counterfactual.md``
beside diagnosis.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch

import dpa
from dpa.baselines import dpa_input
from dpa.evaluate.auc import auc
from dpa.evaluate.curves import fraction_grid, input_curves
from dpa.evaluate.datasets import load_examples, load_records
from dpa.evaluate.prompts import encode_example

from squad_diagnosis import spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diagnosis", default="benchmarks/results/squad-diagnosis")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(args.diagnosis)
    diagnosis = json.loads((folder / "diagnosis.json").read_text(encoding="utf-8"))
    fractions = fraction_grid("squad_v2.0", "input")
    model, tokenizer = dpa.load_model()
    records, examples = load_records("squad_v2.0", args.data_dir), load_examples("squad_v2.0", args.data_dir)
    out = []
    for n, row in enumerate(diagnosis):
        example, record = examples[row["index"]], records[row["index"]]
        sample = encode_example(tokenizer, example)
        a = dpa_input(model, tokenizer, sample.input_ids, sample.target_id, position=sample.position)
        question = torch.zeros_like(a.token_scores)
        question[spans(tokenizer, example, record)["question"]] = 1
        top = float(a.token_scores.abs().max()) + 1
        rankings = {"signed (the protocol)": a.token_scores, "by |score|": a.token_scores.abs(),
                    "question first": a.token_scores + question * 2 * top}
        result = {"index": row["index"]}
        for name, scores in rankings.items():
            c = input_curves(model, sample, replace(a, token_scores=scores), fractions)
            rec = auc(fractions, c.recovery, curve="recovery", unit="input", mode="paper")
            dis = auc(fractions, c.disruption, curve="disruption", unit="input", mode="paper")
            result[name] = {"recovery": rec, "disruption": dis, "total": rec - dis}
        out.append(result)
        print(f"{n + 1}/{len(diagnosis)} sample {row['index']}: " + ", ".join(
            f"{k} {v['total']:.1f}" for k, v in result.items() if k != "index"), flush=True)
    (folder / "counterfactual.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    names = [k for k in out[0] if k != "index"]
    lines = [f"# DPA's SQuAD curves under diagnostic rankings ({len(out)} samples; paper-mode AUC, means)", "",
             "| ranking of DPA's token scores | total | disruption | recovery |", "|---|---:|---:|---:|"]
    for k in names:
        lines.append(f"| {k} | {statistics.mean(r[k]['total'] for r in out):.2f} | "
                     f"{statistics.mean(r[k]['disruption'] for r in out):.2f} | "
                     f"{statistics.mean(r[k]['recovery'] for r in out):.2f} |")
    (folder / "counterfactual.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
