"""Cost of attributing a generation against as many gradients, on the same model, prompt and continuation.

    python benchmarks/bench_generation.py [--model NAME] [--prompt-tokens 32] [--steps 4 16 64] [--repeats 3] [--out FILE]

For each number of generated tokens G: ``dpa.attribute_generation`` with the continuation given (so that no
generation is timed: one forward over the prompt and the G tokens, then G linearised backwards through it); the
bar, G gradients -- step j's forward over its prefix and an autograd gradient of the generated token's logit
with respect to the embeddings, one after the other, what a gradient method pays to explain every step; and G
separate ``dpa.attribute`` calls, one per step (what dpa cost before a generation was one call). The continuation
is the model's own greedy one, made once beforehand. The methods run interleaved ``--repeats`` times (a busy
machine slows all of them alike) after one warm-up each; ratios are the median of each round's ratio to the
gradients of the same round.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load, make_ids, parser, sync  # noqa: E402

METHODS = ("gradients", "generation", "calls")


def greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, repetition_penalty=None, temperature=None, top_p=None, top_k=None)
    return out[0, len(ids):].tolist()


def run(name: str, model, ids: list[int], new: list[int], device) -> None:
    import dpa

    if name == "generation":
        dpa.attribute_generation(model, None, ids, new)
    elif name == "calls":
        for j, token in enumerate(new):
            dpa.attribute(model, None, ids + new[:j], target=token)
    else:
        embed, body, head = model.model.embed_tokens, model.model, model.lm_head
        for j, token in enumerate(new):
            prefix = torch.tensor([ids + new[:j]], device=device)
            emb = embed(prefix).detach().requires_grad_(True)
            h = body(inputs_embeds=emb, use_cache=False).last_hidden_state
            (h[0, -1] @ head.weight[token]).backward()
            emb.grad.sum().item()
    sync(device)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model, tok, device, machine = load(args)
    ids = make_ids(tok, args.prompt_tokens).tolist()
    rows = []
    for g in args.steps:
        new = greedy(model, ids, g)
        for m in METHODS:  # warm-up
            run(m, model, ids, new, device)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for m in METHODS:
                start = time.perf_counter()
                run(m, model, ids, new, device)
                times[m].append(time.perf_counter() - start)
        ratio = {m: statistics.median(t / g_ for t, g_ in zip(times[m], times["gradients"])) for m in METHODS}
        row = {"prompt_tokens": len(ids), "generated": g, "seconds": {m: statistics.median(t) for m, t in times.items()},
               "ratio_to_gradients": ratio}
        rows.append(row)
        print(f"G={g:>3}: {g} gradients {row['seconds']['gradients']:.2f} s; generation attributed "
              f"{row['seconds']['generation']:.2f} s = {ratio['generation']:.2f}x; {g} dpa.attribute calls "
              f"{row['seconds']['calls']:.2f} s = {ratio['calls']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model or "SmolLM2-135M-Instruct", "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
