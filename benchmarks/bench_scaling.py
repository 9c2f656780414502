"""How DPA's cost scales, against the alternatives, on the default model.

    python benchmarks/bench_scaling.py components [--tokens 32] [--out FILE]
    python benchmarks/bench_scaling.py length [--lengths 128 512 1024 2048 4096] [--modes full lean] [--out FILE]

components: seconds to score a growing set of components — one layer's heads, all heads, all
  heads plus one layer's neurons, every head and neuron — with DPA (one call scores them all,
  dense edges and position-level neurons included), exact activation patching (one forward pass
  per unit, batched 64 at a time), attribution patching (AtP: one forward and one backward
  pass) and integrated gradients (20 steps of forward + backward). All as ratios to one forward
  + autograd backward pass timed in the same run. Patching of the largest sets is extrapolated
  from its measured seconds per unit unless --full is given (the table says which).
length: seconds and peak memory of DPA (token, head and neuron scores) in full and lean memory
  mode from 128 to 4096 tokens, against a forward + backward pass. Time and memory are measured
  apart. Time: in this process, at each length every mode is run once to warm up at that length,
  then --repeats rounds run the modes interleaved (a busy machine slows all of them alike); each
  mode's median, and the median of the per-round ratios to the forward + backward pass. Nothing
  else runs inside a timed call. Memory: each mode in a fresh process (the resident set above the
  loaded model, sampled by a thread, and the whole process's peak), untimed. Where both modes ran,
  the largest difference of their scores relative to the largest score.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load, make_ids, parser, peak_memory, sync  # noqa: E402


def timed(fn, device, repeats=3) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def forward_backward(model, ids, target):
    """The gradient of the target logit to the input embeddings; a long input's sliding-window layers by the same
    bands as DPA's (``dpa.instrument.banded_attention``), so that both run the same attention kernels."""
    from dpa.instrument import banded_attention

    emb = model.model.embed_tokens(ids[None]).detach().float().requires_grad_(True)
    with banded_attention(model, len(ids)):
        h = model.model(inputs_embeds=emb.to(model.dtype), use_cache=False).last_hidden_state
        (h[0, -1].float() @ model.lm_head.weight[target].float()).backward()


def patch_units(model, ids, units: list[tuple[str, int, int]], target: int, batch: int = 64) -> None:
    """Zero one unit per batch row (a head's probabilities or a neuron's SiLU(s)); read the target logit."""
    from dpa import request
    from dpa.instrument import instrument

    spec = model.config
    req = request.build(model, None, ids, target)
    t = len(ids)
    dtype, device = model.dtype, ids.device
    with torch.no_grad():
        for start in range(0, len(units), batch):
            chunk = units[start:start + batch]
            attn, neurons = {}, {}
            for row, (kind, layer, index) in enumerate(chunk):
                if kind == "head":
                    keep = attn.setdefault(layer, torch.ones(len(chunk), spec.num_attention_heads, 1, 1, dtype=dtype,
                                                             device=device))
                    keep[row, index] = 0
                else:
                    keep = neurons.setdefault(layer, torch.ones(len(chunk), 1, spec.intermediate_size, dtype=dtype,
                                                                device=device))
                    keep[row, 0, index] = 0
            with instrument(model, req, attn_keep=attn or None, neuron_keep=neurons) as session:
                h = session.forward(input_ids=ids[None].expand(len(chunk), t))
            (h[:, -1] @ model.lm_head.weight[target]).sum().item()


def components(args, model, tok) -> dict:
    import dpa
    from dpa.baselines import atp, integrated_gradients

    device = model.model.embed_tokens.weight.device
    ids = make_ids(tok, args.tokens).to(device)
    target = int(ids[-1])
    L, H, I = model.config.num_hidden_layers, model.config.num_attention_heads, model.config.intermediate_size
    sets = {
        f"{H} heads (one layer)": [("head", L - 1, h) for h in range(H)],
        f"{L * H} heads (all)": [("head", l, h) for l in range(L) for h in range(H)],
        f"{L * H + I} (all heads + one layer's neurons)": [("head", l, h) for l in range(L) for h in range(H)]
        + [("neuron", L - 1, n) for n in range(I)],
        f"{L * (H + I)} (every head and neuron)": [("head", l, h) for l in range(L) for h in range(H)]
        + [("neuron", l, n) for l in range(L) for n in range(I)],
    }
    fb = timed(lambda: forward_backward(model, ids, target), device)
    dpa_s = timed(lambda: dpa.attribute(model, None, ids, target=target, edges=True, neuron_positions=True), device)
    atp_s = timed(lambda: atp(model, None, ids, target=target), device)
    ig_s = timed(lambda: integrated_gradients(model, None, ids, target=target, steps=20), device, repeats=1)
    per_unit = None
    rows = []
    for name, units in sets.items():
        exact = args.full or len(units) <= 2000
        if exact:
            patch_s = timed(lambda: patch_units(model, ids, units, target), device, repeats=1)
            per_unit = patch_s / len(units)
        else:
            patch_s = per_unit * len(units)
        rows.append({"components": name, "n": len(units), "dpa_s": dpa_s, "atp_s": atp_s, "ig20_s": ig_s,
                     "patching_s": patch_s, "patching_measured": exact, "forward_backward_s": fb,
                     "dpa_over_fb": dpa_s / fb, "atp_over_fb": atp_s / fb, "ig20_over_fb": ig_s / fb,
                     "patching_over_fb": patch_s / fb})
        print(f"{name:45s} | DPA {dpa_s / fb:5.2f}x | AtP {atp_s / fb:5.2f}x | IG-20 {ig_s / fb:6.1f}x | "
              f"patching {patch_s / fb:9.1f}x{'' if exact else ' (extrapolated)'}   (x one forward+backward = "
              f"{fb * 1e3:.0f} ms)", flush=True)
    return {"tokens": args.tokens, "rows": rows}


def length_child(args) -> None:
    import dpa

    model, tok = dpa.load_model(args.model, device=args.device)
    device = model.model.embed_tokens.weight.device
    ids = make_ids(tok, args.lengths[0]).to(device)
    target = int(ids[-1])
    if args.child == "forward_backward":
        fn = lambda: forward_backward(model, ids, target)  # noqa: E731
    else:
        fn = lambda: dpa.attribute(model, None, ids, target=target, memory=args.child)  # noqa: E731
    forward_backward(model, ids[:16], target)  # warm-up of kernels and allocator on a short input
    with peak_memory(device) as peak:  # a sampling thread runs meanwhile: these seconds serve only long inputs
        start = time.perf_counter()
        res = fn()
        sync(device)
        seconds = time.perf_counter() - start
    if args.scores and res is not None:
        torch.save({k: getattr(res, k) for k in ("token_scores", "head_scores", "neuron_scores")}, args.scores)
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)
    print(json.dumps({"peak_mib": peak.mib, "process_peak_mib": process_peak / 2**20, "s": seconds}))


def length_times(model, tok, n: int, modes: list[str], repeats: int) -> dict:
    """Seconds of each mode at ``n`` tokens: one warm-up call each at that length, then ``repeats`` interleaved
    rounds; medians, and the median of each round's ratio to the forward + backward pass."""
    import dpa

    device = model.model.embed_tokens.weight.device
    ids = make_ids(tok, n).to(device)
    target = int(ids[-1])
    calls = {m: (lambda: forward_backward(model, ids, target)) if m == "forward_backward"
             else (lambda m=m: dpa.attribute(model, None, ids, target=target, memory=m)) for m in modes}
    for fn in calls.values():
        fn()
    times = {m: [] for m in modes}
    for _ in range(repeats):
        for m, fn in calls.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[m].append(time.perf_counter() - t0)
    out = {f"{m}_s": statistics.median(v) for m, v in times.items()}
    out["repeats"] = repeats
    if "forward_backward" in times:
        for m in modes:
            if m != "forward_backward":
                out[f"{m}_over_fb"] = statistics.median(a / b for a, b in zip(times[m], times["forward_backward"]))
    return out


def length(args, model, tok) -> dict:
    from dpa.attribute import free_memory, graph_bytes, plan_memory
    from dpa.families import spec_for

    rows = []
    tmp = tempfile.mkdtemp(prefix="dpa-bench-")
    spec = spec_for(model)
    for n in args.lengths:
        row = {"tokens": n}  # what memory="auto" picks at this length, here and now, and from what
        row.update(auto_lean=plan_memory(model, spec, 1, n, "auto"), graph_estimate_mib=graph_bytes(
            model, spec, 1, n) / 2**20, free_mib=free_memory(model, spec) / 2**20)
        for mode in args.modes:
            argv = [sys.executable, __file__, "length", "--child", mode, "--lengths", str(n),
                    "--scores", os.path.join(tmp, f"{mode}-{n}.pt")]
            argv += (["--model", args.model] if args.model else []) + (["--device", args.device] if args.device else [])
            out = subprocess.run(argv, capture_output=True, text=True)
            if out.returncode != 0:
                row[f"{mode}_error"] = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
                print(f"{n} tokens {mode}: failed: {row[f'{mode}_error']}", flush=True)
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            row[f"{mode}_peak_mib"], row[f"{mode}_process_peak_mib"] = res["peak_mib"], res["process_peak_mib"]
            row[f"{mode}_child_s"] = res["s"]
        ran = [m for m in args.modes if f"{m}_error" not in row]
        repeats = args.repeats if n <= args.long else args.long_repeats
        if repeats:
            row.update(length_times(model, tok, n, ran, repeats))
        else:  # a call of minutes: the one call each mode made in its fresh process is its time
            row.update({f"{m}_s": row[f"{m}_child_s"] for m in ran}, repeats=0)
            if "forward_backward" in ran:
                row.update({f"{m}_over_fb": row[f"{m}_s"] / row["forward_backward_s"] for m in ran
                            if m != "forward_backward"})
        files = [os.path.join(tmp, f"{m}-{n}.pt") for m in ("full", "lean")]
        if all(os.path.exists(f) for f in files):  # lean against full: the largest relative difference
            full, lean = (torch.load(f) for f in files)
            row["lean_vs_full_rel"] = max(float((lean[k] - full[k]).abs().max() / full[k].abs().max()) for k in full)
        rows.append(row)
        fmt = lambda m: (f"{m} {row[m + '_s']:7.2f} s" + (f" ({row[m + '_over_fb']:.2f}x)" if m + "_over_fb" in row  # noqa: E731
                                                             else "") + f" {row[m + '_peak_mib'] / 1024:6.2f} GiB"
                         if m + "_s" in row else f"{m} failed")
        agree = f" | lean vs full {row['lean_vs_full_rel']:.1e}" if "lean_vs_full_rel" in row else ""
        print(f"{n:5d} tokens | " + " | ".join(fmt(m) for m in args.modes) + agree, flush=True)
    return {"rows": rows}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("what", choices=["components", "length"])
    p.add_argument("--tokens", type=int, default=32, help="prompt length for 'components'")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    p.add_argument("--modes", nargs="+", default=["forward_backward", "full", "lean"],
                   choices=["forward_backward", "full", "lean"], help="what 'length' measures at each length")
    p.add_argument("--full", action="store_true", help="measure patching of every set (no extrapolation)")
    p.add_argument("--repeats", type=int, default=5, help="'length': interleaved timing rounds per length")
    p.add_argument("--long", type=int, default=1024, help="'length': lengths above this use --long-repeats")
    p.add_argument("--long-repeats", type=int, default=3,
                   help="0: no rounds in this process; each mode's time is that of its one call in a fresh process")
    p.add_argument("--scores", help=argparse.SUPPRESS)  # a child writes its scores here
    args = p.parse_args()
    if args.child:
        return length_child(args)
    model, tok, device, machine = load(args)
    data = components(args, model, tok) if args.what == "components" else length(args, model, tok)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"machine": machine, "dtype": str(model.dtype), **data}, fh, indent=1)


if __name__ == "__main__":
    main()
