"""Cost of DPA against a forward pass and an autograd gradient, on the same model and input.

    python benchmarks/bench_attribute.py [--model NAME] [--lengths 32 128 512] [--repeats 5] [--out FILE]

Prints, per prompt length: median seconds of a forward pass; a forward + autograd gradient of the
target logit w.r.t. the embeddings (the bar); ``dpa.attribute`` as called by default (token, head and
neuron scores, and the next-token distribution at the target: p(target) and the top predictions);
the same without that distribution (``probabilities=False``: the scores alone); and with edge scores
(``edges=True``). Each method is first run once at the measured length, then the methods run interleaved
``--repeats`` times (a busy machine slows all of them alike); the ratios are the median of each round's ratio to
the gradient of the same round. Then peak memory of each (resident set above the loaded
model, sampled in a fresh process per method on CPU; torch.cuda.max_memory_allocated on CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load, make_ids, parser, peak_memory, sync  # noqa: E402

METHODS = ("forward", "gradient", "dpa", "dpa_scores", "dpa_edges")


def run_method(name: str, model, ids: torch.Tensor, target: int) -> None:
    import dpa

    device = model.model.embed_tokens.weight.device
    ids = ids.to(device)
    if name == "forward":
        with torch.no_grad():
            h = model.model(input_ids=ids[None], use_cache=False).last_hidden_state
            (h[0, -1] @ model.lm_head.weight[target]).item()
    elif name == "gradient":
        emb = model.model.embed_tokens(ids[None]).detach().float().requires_grad_(True)
        h = model.model(inputs_embeds=emb.to(model.dtype), use_cache=False).last_hidden_state
        (h[0, -1].float() @ model.lm_head.weight[target].float()).backward()
        emb.grad.sum().item()
    elif name == "dpa":
        dpa.attribute(model, None, ids, target=target)
    elif name == "dpa_scores":
        dpa.attribute(model, None, ids, target=target, probabilities=False)
    elif name == "dpa_edges":
        dpa.attribute(model, None, ids, target=target, edges=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def child_peak(model_name: str | None, n: int, method: str, device: str | None) -> float:
    """Peak memory in MiB of one method in a fresh process, above the loaded model's."""
    argv = [sys.executable, __file__, "--child", method, "--lengths", str(n)]
    argv += (["--model", model_name] if model_name else []) + (["--device", device] if device else [])
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child(args) -> None:
    import dpa

    model, tok = dpa.load_model(args.model, device=args.device)
    ids = make_ids(tok, args.lengths[0])
    run_method(args.child, model, ids[:8], 0)  # warm up allocator and kernels
    with peak_memory(model.model.embed_tokens.weight.device) as peak:
        run_method(args.child, model, ids, int(ids[-1]))
    print(peak.mib)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--long", type=int, default=1024, help="lengths above this use --long-repeats")
    p.add_argument("--long-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--edges-max", type=int, default=1024,
                   help="time edges=True only up to this length (its [layer, head, pos, pos] result grows as pos^2)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory subprocesses")
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, device, machine = load(args)
    rows = []
    for n in args.lengths:
        ids = make_ids(tok, n)
        target = int(ids[-1])
        methods = [m for m in METHODS if m != "dpa_edges" or n <= args.edges_max]
        for m in methods:  # warm-up at the measured length: kernels, allocator and the autotuned paths of this shape
            run_method(m, model, ids, target)
        times = {m: [] for m in methods}
        repeats = args.repeats if n <= args.long else max(1, args.long_repeats)
        for _ in range(repeats):
            for m in methods:  # interleaved: noise hits every method alike; nothing else runs inside a timed call
                sync(device)
                t0 = time.perf_counter()
                run_method(m, model, ids, target)
                sync(device)
                times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) for m, v in times.items()}
        ratio = lambda m, bar: statistics.median(a / b for a, b in zip(times[m], times[bar]))  # noqa: E731 (per round)
        row = {"tokens": n, "repeats": repeats, **{f"{m}_s": med[m] for m in methods},
               **{f"{m}_over_gradient": ratio(m, "gradient") for m in methods[2:]},
               "gradient_over_forward": ratio("gradient", "forward")}
        if not args.no_memory:
            for m in methods:
                row[f"{m}_peak_mib"] = child_peak(args.model, n, m, args.device)
        rows.append(row)
        print(format_row(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"machine": machine, "device": device.type, "dtype": str(model.dtype),
                       "threads": torch.get_num_threads(), "rows": rows}, fh, indent=1)


def format_row(r: dict) -> str:
    s = (f"{r['tokens']:5d} tokens | forward {r['forward_s']*1e3:8.1f} ms | gradient {r['gradient_s']*1e3:8.1f} ms | "
         f"DPA {r['dpa_s']*1e3:8.1f} ms | DPA/grad {r['dpa_over_gradient']:.3f}x | "
         f"scores only/grad {r['dpa_scores_over_gradient']:.3f}x"
         + (f" | edges/grad {r['dpa_edges_over_gradient']:.3f}x" if "dpa_edges_over_gradient" in r else ""))
    if "forward_peak_mib" in r:
        s += " | peak MiB " + " ".join(f"{m}={r[f'{m}_peak_mib']:.0f}" for m in METHODS if f"{m}_peak_mib" in r)
    return s


if __name__ == "__main__":
    main()
