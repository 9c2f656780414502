"""DPA against mean attention on SQuAD v2.0 input attribution, sample by sample (issue 20).

    python benchmarks/studies/squad_diagnosis.py [--results benchmarks/results/squad_v2.0-input]
                                                 [--data-dir ../shared/data]
                                                 [--out benchmarks/results/squad-diagnosis/paragraph]
    python benchmarks/studies/squad_diagnosis.py --results benchmarks/results/squad_v2.0-input-user-turn \
                                                 --out benchmarks/results/squad-diagnosis/user-turn

Reads the per-sample curves of a SQuAD run (``samples.jsonl``, 100 samples) and, for each sample, attributes it again
with DPA and mean attention on the same prompt, target and units. The units are the run's own: the paragraph (runs
whose ``config.json`` says ``context_units: paragraph``) or, for the first run, the whole user turn with the question
in it, which this diagnosis found to be why DPA lost. It measures:

* the sample's total AUC (paper mode) for each method, and who wins;
* the prompt length, where the answer sits in the context, where its tokens rank under each method;
* which kind of context unit each method ranks first: the answer span, the question, the first context token;
* the sign of the answer's first token's score: a needed token scored below 0 is ranked among the last, so it stays
  ablated in recovery until the end of the curve, and intact in disruption;
* the same for DPA with other path weights (value only; query and key only; key only): which path gives the question
  its credit, and which path scores the answer below zero where the default does;
* how each method's |score| over the whole prompt splits between the units, the question, the rest of the template
  and the first token (the attention sink): whether the template or the first token dominates.

Writes ``diagnosis.json`` (every sample's numbers), ``diagnosis.md`` (the tables) and ``diagnosis.png`` (the
recovery curves of the samples where DPA does best and worst against mean attention, and the per-sample totals
against prompt length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

import dpa
from dpa.baselines import dpa_input, mean_attention
from dpa.evaluate.auc import auc
from dpa.evaluate.curves import fraction_grid, rank
from dpa.evaluate.datasets import load_examples, load_records
from dpa.evaluate.prompts import encode_example, prompt_text
from dpa.models import DEFAULT_MODEL

BENCHMARKS = Path(__file__).resolve().parents[1]  # benchmarks/: common.py
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
from common import run_config  # noqa: E402  (a run's units, prompt form and model)

WEIGHTS = {"default": dpa.PathWeights(), "value only": dpa.PathWeights(0, 0, 1, 0.5, 0.5),
           "query+key only": dpa.PathWeights(0.5, 0.5, 0, 0.5, 0.5), "key only": dpa.PathWeights(0, 1, 0, 0.5, 0.5)}


def totals(row: dict, fractions) -> dict[str, float]:
    """Paper-mode AUCs of one sample's curves."""
    rec = auc(fractions, row["recovery"], curve="recovery", unit="input", mode="paper")
    dis = auc(fractions, row["disruption"], curve="disruption", unit="input", mode="paper")
    return {"recovery": rec, "disruption": dis, "total": rec - dis}


def encode(tokenizer, example, paragraph: bool, prompt: str = "chat"):
    """The sample as the run encoded it: paragraph units, or (the first run) the whole user turn."""
    return encode_example(tokenizer, example if paragraph else replace(example, units=None), prompt)


def spans(tokenizer, example, record, prompt: str = "chat") -> dict[str, list[int]]:
    """Token positions of the answer span (inside the context), the question, and the context units."""
    text = prompt_text(tokenizer, example, prompt)
    enc = tokenizer(text, add_special_tokens=prompt == "plain", return_offsets_mapping=True)  # as encode_example
    user = text.find(example.user, text.find(example.system) + len(example.system))
    a0 = user + len("Context: ") + record["answer_span"][0]
    a1 = user + len("Context: ") + record["answer_span"][1]
    if text[a0:a1].lower() != record["answer"].lower():
        raise ValueError(f"answer span mismatch in {record['id']}: {text[a0:a1]!r} vs {record['answer']!r}")
    q0 = text.find("\nQuestion:", user)
    offsets = enc["offset_mapping"]
    return {"answer": [i for i, (a, b) in enumerate(offsets) if a < a1 and b > a0],
            "question": [i for i, (a, b) in enumerate(offsets) if a >= q0 and b <= user + len(example.user)]}


def ranking(scores: torch.Tensor, units: list[int]) -> list[int]:
    """The context units by score, highest first (the benchmark's own ranking, ties seeded)."""
    return torch.tensor(units)[rank(scores[units], 0)].tolist()


def features(scores: torch.Tensor, sp: dict[str, list[int]], units: list[int]) -> dict[str, float]:
    order = ranking(scores, units)
    n = len(order)
    where = {p: k for k, p in enumerate(order)}
    top = order[:max(1, n // 10)]
    mass = scores.abs()
    total = float(mass.sum()) or 1.0
    rest = sorted(set(range(len(scores))) - set(units) - set(sp["question"]) - {0})
    return {"answer_rank": min(where[p] for p in sp["answer"] if p in where) / n,
            "answer_score": float(scores[sp["answer"][0]]),  # the answer's first token, in logit units
            "question_in_top10": sum(p in set(sp["question"]) for p in top) / len(top),
            "question_share_of_units": len([p for p in sp["question"] if p in where]) / n,
            "first_unit_rank": where[units[0]] / n,
            "share": {"units": float(mass[sorted(set(units) - set(sp["question"]) - {0})].sum()) / total,
                      "question": float(mass[sp["question"]].sum()) / total,
                      "template": float(mass[rest].sum()) / total, "first token": float(mass[0]) / total}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="benchmarks/results/squad_v2.0-input")
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="benchmarks/results/squad-diagnosis/paragraph")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fractions = fraction_grid("squad_v2.0", "input")
    paragraph, prompt, model_name = run_config(Path(args.results))
    with open(Path(args.results) / "samples.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    by_sample: dict[int, dict] = {}
    for r in rows:
        by_sample.setdefault(r["index"], {})[r["method"]] = r
    model, tokenizer = dpa.load_model(model_name, device="cpu", dtype=torch.float32)
    records = load_records("squad_v2.0", args.data_dir)
    examples = load_examples("squad_v2.0", args.data_dir)
    out = []
    for n, index in enumerate(sorted(by_sample)):
        example, record = examples[index], records[index]
        sample = encode(tokenizer, example, paragraph, prompt)
        units = [i for i, c in enumerate(sample.context) if c]
        sp = spans(tokenizer, example, record, prompt)
        row = {"index": index, "units": "paragraph" if paragraph else "user turn", "prompt": prompt,
               "model": model_name or DEFAULT_MODEL, "id": record["id"], "answer": record["answer"],
               "n_tokens": sample.n_tokens,
               "n_units": len(units), "answer_position": (sp["answer"][0] - units[0]) / len(units),
               "auc": {m: totals(r, fractions) for m, r in by_sample[index].items()}}
        ma = mean_attention(model, tokenizer, sample.input_ids, sample.target_id, position=sample.position)
        row["mean_attention"] = features(ma.token_scores, sp, units)
        for name, w in WEIGHTS.items():
            a = dpa_input(model, tokenizer, sample.input_ids, sample.target_id, position=sample.position, weights=w)
            row[f"dpa {name}"] = features(a.token_scores, sp, units)
        if n == 0:  # the paper's neuron target variant (t_mid) cannot change input attribution: token scores are
            mid = dpa.attribute(model, tokenizer, sample.input_ids, sample.target_id, position=sample.position,
                                neuron_target="mid")  # read below the neurons; they are bit for bit the same
            row["neuron_target_mid_same_token_scores"] = bool(torch.equal(mid.token_scores, dpa_input(
                model, tokenizer, sample.input_ids, sample.target_id, position=sample.position).token_scores))
        out.append(row)
        print(f"{n + 1}/{len(by_sample)} sample {index}: DPA {row['auc']['dpa']['total']:.1f}, mean attention "
              f"{row['auc']['mean_attention']['total']:.1f}", flush=True)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "diagnosis.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    (folder / "diagnosis.md").write_text(report(out), encoding="utf-8")
    figure(out, by_sample, fractions, folder / "diagnosis.png")


def report(out: list[dict]) -> str:
    """The tables of diagnosis.md."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    diff = [r["auc"]["dpa"]["total"] - r["auc"]["mean_attention"]["total"] for r in out]
    question = out[0]["units"] != "paragraph"  # the question is among the units only in the first run
    names = ["mean_attention"] + [f"dpa {w}" for w in WEIGHTS]
    lines = [f"# SQuAD v2.0 input attribution: DPA against mean attention, per sample ({len(out)} samples; "
             f"{out[0].get('model', DEFAULT_MODEL)}, {out[0].get('prompt', 'chat')} prompt; units: the "
             f"{out[0]['units']})", "",
             f"DPA's total AUC beats mean attention's on {sum(d > 0 for d in diff)} of {len(out)} samples "
             f"(median difference {med(diff):+.1f}).", "",
             ("| ranking | answer token ranked first | answer's first token scored below 0 | median rank of the answer "
              "(fraction of units) | " + ("question tokens among the top 10% | " if question else "")
              + "first context token's median rank |"),
             "|---|---:|---:|---:|" + ("---:|" if question else "") + "---:|"]
    for name in names:
        f = [r[name] for r in out]
        question_top = f"{statistics.mean(x['question_in_top10'] for x in f):.0%} | " if question else ""
        lines.append(f"| {name} | {sum(x['answer_rank'] == 0 for x in f)} of {len(f)} | "
                     f"{sum(x['answer_score'] < 0 for x in f)} of {len(f)} | "
                     f"{med([x['answer_rank'] for x in f]):.3f} | {question_top}"
                     f"{med([x['first_unit_rank'] for x in f]):.2f} |")
    lines += ["", "Where each method's |score| over the whole prompt goes (mean share): the context units other than "
              "the question, the question, the rest of the template, the first token:", "",
              "| method | context units | question | template | first token |", "|---|---:|---:|---:|---:|"]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{statistics.mean(r[name]['share'][k] for r in out):.0%}"
                                                 for k in ("units", "question", "template", "first token")) + " |")
    qshare = statistics.mean(r["mean_attention"]["question_share_of_units"] for r in out)
    lines += ([""] + ([f"The question is {qshare:.0%} of the units on average.", ""] if question else [])
              + ["By prompt length and answer position (terciles):", "",
              "| split | tercile | samples | DPA total | mean attention total | DPA wins |", "|---|---|---:|---:|---:|---:|"])
    for key in ("n_tokens", "answer_position"):
        ordered = sorted(out, key=lambda r: r[key])
        k = len(ordered) // 3
        for part in (p for p in (ordered[:k], ordered[k:2 * k], ordered[2 * k:]) if p):
            lo, hi = part[0][key], part[-1][key]
            lines.append(f"| {key} | {lo:.3g}–{hi:.3g} | {len(part)} | "
                         f"{statistics.mean(r['auc']['dpa']['total'] for r in part):.1f} | "
                         f"{statistics.mean(r['auc']['mean_attention']['total'] for r in part):.1f} | "
                         f"{sum(r['auc']['dpa']['total'] > r['auc']['mean_attention']['total'] for r in part)} |")
    return "\n".join(lines) + "\n"


def figure(out: list[dict], by_sample: dict, fractions, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = sorted(out, key=lambda r: r["auc"]["dpa"]["total"] - r["auc"]["mean_attention"]["total"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, picks, title in ((axes[0], ranked[-3:], "DPA's best samples (against mean attention)"),
                             (axes[1], ranked[:3], "DPA's worst samples")):
        for r, style in zip(picks, ("-", "--", ":")):
            for method, colour in (("dpa", "#b2182b"), ("mean_attention", "#2166ac")):
                ax.plot(fractions, by_sample[r["index"]][method]["recovery"], style, color=colour,
                        label=f"{method} #{r['index']}")
        ax.set(title=title, xlabel="fraction of context tokens kept", ylabel="recovery: 100 p / p_clean")
        ax.legend(fontsize=7)
    ax = axes[2]
    ax.scatter([r["n_tokens"] for r in out], [r["auc"]["dpa"]["total"] - r["auc"]["mean_attention"]["total"]
                                              for r in out], s=12, color="#444")
    ax.axhline(0, color="#999", lw=0.8)
    ax.set(title="per sample: DPA total - mean attention total", xlabel="prompt tokens", ylabel="AUC difference")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
