"""What DPA's SQuAD recovery loses, and to which tokens (issue 20): its curves under two diagnostic rankings.

    python benchmarks/studies/squad_counterfactual.py [--diagnosis benchmarks/results/squad-diagnosis/user-turn]
                                                      [--data-dir ../shared/data]

Runs on the samples of the first run's diagnosis, with its units: the whole user turn, the question included.
Not a variant of the method and not the benchmark's protocol: the benchmark ranks by signed score. Here DPA's
token scores are re-ranked (1) by |score|, which moves the negatively scored tokens (the question's "?", ":",
"Who", the newline: see diagnosis.md) up, and (2) with the question's tokens first and the rest by DPA's score.
If recovery comes back, what DPA's ranking misses is the tokens the model needs but that push the answer's logit
down or barely at all: necessity, not contribution. Writes ``counterfactual.json`` (per sample: the AUCs under
each ranking, and the five units DPA ranks last) and ``counterfactual.md`` beside diagnosis.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from squad_diagnosis import encode, ranking, spans

import dpa
from dpa.baselines import dpa_input
from dpa.evaluate.auc import auc
from dpa.evaluate.curves import fraction_grid, input_curves
from dpa.evaluate.datasets import load_examples, load_records

BOTTOM = 5  # the units at the end of DPA's ranking, recorded per sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--diagnosis", default="benchmarks/results/squad-diagnosis/user-turn")
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
        sample = encode(tokenizer, example, row["units"] == "paragraph")
        a = dpa_input(model, tokenizer, sample.input_ids, sample.target_id, position=sample.position)
        question = torch.zeros_like(a.token_scores)
        question_positions = spans(tokenizer, example, record)["question"]
        question[question_positions] = 1
        top = float(a.token_scores.abs().max()) + 1
        rankings = {"signed (the protocol)": a.token_scores, "by absolute score": a.token_scores.abs(),
                    "question first": a.token_scores + question * 2 * top}
        units = [i for i, c in enumerate(sample.context) if c]
        last = ranking(a.token_scores, units)[-BOTTOM:]  # what recovery keeps last
        result = {"index": row["index"], "bottom": [tokenizer.decode([sample.input_ids[i]]) for i in last],
                  "bottom_in_question": sum(i in question_positions for i in last)}
        for name, scores in rankings.items():
            c = input_curves(model, sample, replace(a, token_scores=scores), fractions)
            rec = auc(fractions, c.recovery, curve="recovery", unit="input", mode="paper")
            dis = auc(fractions, c.disruption, curve="disruption", unit="input", mode="paper")
            result[name] = {"recovery": rec, "disruption": dis, "total": rec - dis}
        out.append(result)
        print(f"{n + 1}/{len(diagnosis)} sample {row['index']}: " + ", ".join(
            f"{k} {v['total']:.1f}" for k, v in result.items() if isinstance(v, dict)), flush=True)
    (folder / "counterfactual.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    (folder / "counterfactual.md").write_text(report(out), encoding="utf-8")


def report(out: list[dict]) -> str:
    """counterfactual.md: the mean AUCs under each ranking, and the units DPA ranks last."""
    names = [k for k, v in out[0].items() if isinstance(v, dict)]
    lines = [f"# DPA's SQuAD curves under diagnostic rankings ({len(out)} samples; paper-mode AUC, means)", "",
             "| ranking of DPA's token scores | total | disruption | recovery |", "|---|---:|---:|---:|"]
    for k in names:
        lines.append(f"| {k} | {statistics.mean(r[k]['total'] for r in out):.2f} | "
                     f"{statistics.mean(r[k]['disruption'] for r in out):.2f} | "
                     f"{statistics.mean(r[k]['recovery'] for r in out):.2f} |")
    bottom = Counter(repr(t) for r in out for t in r["bottom"])
    share = statistics.mean(r["bottom_in_question"] for r in out) / BOTTOM
    lines += ["", f"The {BOTTOM} units DPA ranks last (what recovery keeps last), over all samples: {share:.0%} are "
              f"question tokens (the question is about a tenth of the units). The most frequent:", "",
              "| token | occurrences |", "|---|---:|"]
    lines += [f"| {t} | {n} |" for t, n in bottom.most_common(12)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
