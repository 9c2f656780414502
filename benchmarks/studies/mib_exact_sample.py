"""Exact patching on a sample of a real model's edges, against every method's edge scores on the same pairs.

    python benchmarks/studies/mib_exact_sample.py --model smollm2 --task ioi --pairs 20 --edges 200

Each edge's exact effect is m(full) - m(full with that edge alone patched), summed over the first ``--pairs`` pairs of
the task (``dpa.mib.edge_scores(method="exact", edges=...)``: one patched run per edge and batch). The methods'
scores are read from the benchmark's run folders (``bench_mib.py``: batches/scores-*.pt), summed over the same
pairs. The sample: three quarters drawn from the edges some method ranks among its top 1000 by |score| (where
the large effects are), a quarter uniformly from all edges. Writes ``exact-sample.json`` in the task's folder:
per method the Pearson and Spearman correlations with exact patching over the sample, and the share of edges
whose sign it gets right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository: benchmarks.bench_mib
sys.path.insert(0, str(ROOT))

from benchmarks.bench_mib import MODELS, RESULTS, _pairs_file  # noqa: E402

SCORED = ("dpa", "dpa-cf", "dpa-ig", "eap", "eap-ig", "gim", "gim-package")


def method_scores(folder: Path, n_pairs: int) -> dict[str, torch.Tensor]:
    """Each method's scores summed over the first ``n_pairs`` pairs, from its run folder's batches."""
    out = {}
    for method in SCORED:
        run = folder / method
        if not (run / "run.json").exists():
            continue
        size = json.loads((run / "run.json").read_text())["batch_size"]
        if n_pairs % size:
            raise SystemExit(f"--pairs must be a multiple of the runs' batch size ({size})")
        parts = [run / "batches" / f"scores-{b:05d}.pt" for b in range(n_pairs // size)]
        if all(p.exists() for p in parts):
            out[method] = sum(_value(torch.load(p, weights_only=True)) for p in parts)
    return out


def _value(saved):
    """A batch file's scores: stamped with its run (``dpa.mib.discover``), or bare (as an older dpa wrote them)."""
    return saved["value"] if isinstance(saved, dict) else saved


def sample(scores: dict[str, torch.Tensor], exists: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """[writer reader] bool: ``n`` edges, 3/4 from the union of the methods' top 1000 by |score|, 1/4 uniform."""
    g = torch.Generator().manual_seed(seed)
    top = torch.zeros_like(exists)
    for s in scores.values():
        flat = (s.abs() * exists).flatten()
        top.view(-1)[flat.topk(1000).indices] = True
    top &= exists
    chosen = torch.zeros_like(exists)
    strong = top.flatten().nonzero().flatten()
    pick = strong[torch.randperm(strong.numel(), generator=g)[: 3 * n // 4]]
    chosen.view(-1)[pick] = True
    rest = (exists & ~chosen).flatten().nonzero().flatten()
    chosen.view(-1)[rest[torch.randperm(rest.numel(), generator=g)[: n - pick.numel()]]] = True
    return chosen


def rank(x: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(x.numel(), dtype=x.dtype)
    return r


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main() -> None:
    import dpa
    from dpa.mib.graph import Graph
    from dpa.mib.methods import edge_scores
    from dpa.request import check_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODELS), default="smollm2")
    p.add_argument("--task", default="ioi")
    p.add_argument("--pairs", type=int, default=20)
    p.add_argument("--edges", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = RESULTS / args.model / args.task
    if not (folder / "pairs.json").exists():
        raise SystemExit(f"run bench_mib.py --model {args.model} --tasks {args.task} first ({folder} has no pairs)")
    model, _ = dpa.load_model(MODELS[args.model])
    pairs = _pairs_file(folder, None)
    rows = list(range(args.pairs))
    scores = method_scores(folder, args.pairs)
    if not scores:
        raise SystemExit(f"no method's scores in {folder} yet")
    graph = Graph.of(check_model(model))
    chosen = sample(scores, graph.exists, args.edges, args.seed)
    from tqdm.auto import tqdm

    with tqdm(total=args.pairs, desc="exact patching", unit="pair") as bar:
        exact = edge_scores(model, pairs.subset(rows), "exact", edges=chosen, batch_size=10,
                            progress=lambda k: bar.update(k))
    idx = chosen.flatten().nonzero().flatten()
    truth = exact.flatten()[idx]
    out = {"model": args.model, "task": args.task, "pairs": args.pairs, "edges": int(idx.numel()), "seed": args.seed,
           "methods": {}, "exact": truth.tolist(), "edge_names": [graph.edge_name(int(i) // graph.n_readers,
                                                                                   int(i) % graph.n_readers)
                                                                   for i in idx]}
    for method, s in scores.items():
        mine = s.flatten()[idx]
        out["methods"][method] = {"pearson": pearson(mine, truth), "spearman": pearson(rank(mine), rank(truth)),
                                  "sign": float(((mine > 0) == (truth > 0)).double().mean()), "scores": mine.tolist()}
        print(f"{method:12s} pearson {out['methods'][method]['pearson']:+.3f}  spearman "
              f"{out['methods'][method]['spearman']:+.3f}  sign {out['methods'][method]['sign']:.2f}")
    (folder / "exact-sample.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
