"""Is greater-than's gap between DPA and EAP-IG its metric's? Greater-than is the one MIB task scored by a
probability difference, p(years after YY) - p(years up to YY): a softmax over the vocabulary, which saturates.
This runs ``dpa-cf`` and ``eap-ig`` on the same 100 pairs (``benchmarks/results/mib/MODEL/greater-than/pairs.json``)
with the metric made linear in the logits: the mean logit of the years after YY minus the mean logit of the years
up to YY. If DPA's gap closes there, the probability metric is what EAP-IG's five points see and DPA's one does not.

    python benchmarks/studies/mib_metric_experiment.py --model gemma-3-270m

Writes ``benchmarks/results/mib/MODEL/greater-than@mean-logit/METHOD`` (run folders, as bench_mib's) and prints
CPR / CMD with the paired interval of dpa-cf minus eap-ig.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository: benchmarks.bench_mib
sys.path.insert(0, str(ROOT))

from benchmarks.bench_mib import MODELS, RESULTS  # noqa: E402
from dpa.mib.discover import discover  # noqa: E402
from dpa.mib.evaluate import paired_bootstrap  # noqa: E402
from dpa.mib.pairs import Pairs  # noqa: E402


class MeanLogitPairs(Pairs):
    """Greater-than's pairs with the metric linear in the logits: mean logit of the answers minus the wrong ones'."""

    def metric_of(self, rows: list[int]):
        good = [torch.tensor(self.answers[i]) for i in rows]
        bad = [torch.tensor(self.wrong[i]) for i in rows]

        def mean_logit_diff(logits):
            return torch.stack([logits[k, g.to(logits.device)].mean() - logits[k, b.to(logits.device)].mean()
                                for k, (g, b) in enumerate(zip(good, bad))])
        return mean_logit_diff


def main() -> None:
    import dpa

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(MODELS), default="gemma-3-270m")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = dpa.load_model(MODELS[args.model])
    d = json.loads((RESULTS / args.model / "greater-than" / "pairs.json").read_text())
    pairs = MeanLogitPairs(d["clean"], d["counter"], d["answers"], d["wrong"], d["metric"])
    found = {}
    for method in ("dpa-cf", "eap-ig"):
        found[method] = discover(model, tok, pairs, method=method, batch_size=10,
                                 out=RESULTS / args.model / "greater-than@mean-logit" / method, progress=False)
        f = found[method].faithfulness
        print(f"{args.model} greater-than, mean-logit metric, {method}: CPR {f.cpr:.3f} CMD {f.cmd:.4f}", flush=True)
    print(json.dumps(paired_bootstrap(found["dpa-cf"].faithfulness, found["eap-ig"].faithfulness)))


if __name__ == "__main__":
    main()
