"""Cost of a circuit graph against one DPA call and against edge attribution patching, on the same model and input.

    python benchmarks/bench_circuit.py [--model NAME] [--lengths 32 128 512] [--nodes 16 64 256] [--out FILE]

Per prompt length: median seconds of ``dpa.attribute`` (the bar), ``dpa.circuit`` with 64 nodes and every edge
between them, and edge attribution patching (EAP: attribution patching of every edge into the same 64
destinations, one backward pass of the real model per destination node, from the destination's score z_v . G_v
to every upstream head and neuron output), and the ratios to DPA measured in the same run (methods interleaved,
so a busy machine slows all of them alike). Then, at one length, the graph's cost for 16, 64 and 256 nodes: the
ratio to DPA and the cost per node, which stays flat when the cost grows linearly with the number of nodes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load, make_ids, parser  # noqa: E402


def eap(model, circ, ids: torch.Tensor) -> None:
    """Edge attribution patching's gradients for the circuit's destination units: one forward with every head
    and neuron output kept, then one backward per destination (its score z_v . G_v on the real model) to all of
    them. What dpa.circuit replaces with one block per destination."""
    import dpa
    from dpa.families import layer_modules

    spec = dpa.spec_for(model)
    mods = layer_modules(model, spec)
    kept: dict[tuple[int, int], torch.Tensor] = {}

    def keep(key):
        def pre(_m, args):
            kept[key] = args[0]
        return pre
    handles = [m.heads.register_forward_pre_hook(keep((i, 0))) for i, m in enumerate(mods)]
    handles += [m.neurons.register_forward_pre_hook(keep((i, 1))) for i, m in enumerate(mods)]
    try:
        with torch.enable_grad():
            emb = spec.embed(model)(ids[None]).detach().requires_grad_(True)
            spec.base(model)(inputs_embeds=emb, use_cache=False)
            upstream = [kept[k] for k in sorted(kept)]
            for i in circ.units:
                n = circ.nodes[i]
                z = kept[(n.layer, n.block)][0]
                cols = slice(n.index * (spec.d_head if n.kind == "head" else 1),
                             (n.index + 1) * (spec.d_head if n.kind == "head" else 1))
                s_v = (z[:, cols] * circ._reads[i].to(z.dtype)).sum()
                torch.autograd.grad(s_v, upstream, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--nodes-length", type=int, default=128, help="prompt length of the nodes sweep")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--eap-repeats", type=int, default=3)
    args = p.parse_args()
    import dpa

    model, tok, device, machine = load(args)
    rows, sweep = [], []
    for n in args.lengths:
        ids = make_ids(tok, n)
        target = int(ids[-1])
        dpa.attribute(model, None, ids, target=target)  # warm-up of every method at the measured length
        circ = dpa.circuit(model, None, ids, target=target, nodes=64)
        if args.eap_repeats:
            eap(model, circ, ids)
        times = {"dpa": [], "circuit": [], "eap": []}
        for r in range(args.repeats):
            times["dpa"].append(timed(lambda: dpa.attribute(model, None, ids, target=target)))
            t = timed(lambda: times.setdefault("_c", []).append(dpa.circuit(model, None, ids, target=target,
                                                                              nodes=64)))
            times["circuit"].append(t)
            if r < args.eap_repeats:
                circ = times["_c"][-1]
                times["eap"].append(timed(lambda: eap(model, circ, ids)))
        med = {m: statistics.median(times[m]) for m in ("dpa", "circuit", "eap")}
        circ = times["_c"][-1]
        row = {"tokens": n, "nodes": len(circ.units), "edges": int((circ.edges != 0).sum()),
               "dpa_s": med["dpa"], "circuit_s": med["circuit"], "eap_s": med["eap"],
               "circuit_over_dpa": med["circuit"] / med["dpa"], "eap_over_dpa": med["eap"] / med["dpa"],
               "eap_over_circuit": med["eap"] / med["circuit"]}
        rows.append(row)
        print(f"{n:5d} tokens | DPA {med['dpa']*1e3:8.1f} ms | circuit (64 nodes) {med['circuit']*1e3:8.1f} ms "
              f"= {row['circuit_over_dpa']:.2f}x DPA | EAP (64 backward passes) {med['eap']*1e3:9.1f} ms "
              f"= {row['eap_over_dpa']:.1f}x DPA = {row['eap_over_circuit']:.1f}x circuit", flush=True)
    ids = make_ids(tok, args.nodes_length)
    target = int(ids[-1])
    dpa.attribute(model, None, ids, target=target)  # warm-up at the measured length
    for k in args.nodes:
        dpa.circuit(model, None, ids, target=target, nodes=k)
        times = {"dpa": [], "circuit": []}
        for _ in range(args.repeats):
            times["dpa"].append(timed(lambda: dpa.attribute(model, None, ids, target=target)))
            times["circuit"].append(timed(lambda: dpa.circuit(model, None, ids, target=target, nodes=k)))
        med = {m: statistics.median(v) for m, v in times.items()}
        extra = med["circuit"] - med["dpa"]
        row = {"tokens": args.nodes_length, "nodes": k, "dpa_s": med["dpa"], "circuit_s": med["circuit"],
               "circuit_over_dpa": med["circuit"] / med["dpa"], "extra_per_node_over_dpa": extra / k / med["dpa"]}
        sweep.append(row)
        print(f"{k:4d} nodes at {args.nodes_length} tokens | circuit {med['circuit']*1e3:8.1f} ms = "
              f"{row['circuit_over_dpa']:.2f}x DPA | beyond DPA per node {row['extra_per_node_over_dpa']*100:.2f}% "
              "of a DPA call", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"machine": machine, "device": device.type, "dtype": str(model.dtype),
                       "threads": torch.get_num_threads(), "lengths": rows, "nodes": sweep}, fh, indent=1)


if __name__ == "__main__":
    main()
