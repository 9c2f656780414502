"""Cost of DPA against a gradient on random models of each family kind, tiny and mid-size, the same model and input.

    python benchmarks/bench_families.py [--kinds attention conv] [--repeats 7] [--out FILE]

One row per family kind and size: an attention model (Llama, the reference), and each kind of token mixer dpa
linearises beside attention (LFM2's gated short convolution: "conv"; Bamba's Mamba-2 block: "scan"), and Mamba's
selective scan ("selective", every layer a Mamba block), and Qwen3-Next's Gated DeltaNet ("delta", three to each gated
attention layer), and Nemotron-H's layers of one block each ("blocks": Mamba-2 blocks, squared-ReLU MLPs, attention;
"sparse", Nemotron 3's: the sparse block in the MLPs' places, a sigmoid router, latent squared-ReLU experts), and
Falcon-H1's layers of attention and a Mamba-2 block side by side ("parallel").
Each model is built from its family's
config (``dpa.tiny.tiny_config``) with random weights in float32, no checkpoint needed: the cost of DPA against a
gradient depends on the shapes, not on the values. Per row: the median seconds of a forward + autograd gradient of
the target logit with respect to the embeddings (the bar) and of ``dpa.attribute`` with its defaults; the ratio is
the median of each round's DPA / gradient, the two run interleaved (a busy machine slows both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_label  # noqa: E402

# family kind -> (model_type, config overrides giving its layer pattern)
KINDS = {
    "attention": ("llama", {}),
    "conv": ("lfm2", {}),  # LFM2's pattern: two convolution layers to each attention layer
    "scan": ("bamba", {}),  # Mamba-2 blocks, two to each attention layer; SSM heads of 64 channels, one group
    "selective": ("mamba", {}),  # Mamba blocks alone (no attention, no MLP): 2 x d_model channels, states of 16
    "delta": ("qwen3_next", {"num_experts": 0}),  # Gated DeltaNets, three to each gated attention layer, dense MLPs
    "blocks": ("nemotron_h", {}),  # one block per layer (Nemotron-H's): Mamba-2 blocks, squared-ReLU MLPs, attention
    "sparse": ("nemotron_h", {"moe": True}),  # Nemotron 3's: the same with the sparse block in the MLPs' places
    "parallel": ("falcon_h1", {}),  # Falcon-H1's: attention and a Mamba-2 block side by side on every layer, µP scalars
}
# Nemotron 3's sparse block per size: routed experts (top k from the best groups), their neurons, the shared
# expert's, the latent space the experts work in
SPARSE_SIZES = {"tiny": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             moe_shared_expert_intermediate_size=64, moe_latent_size=32, n_group=2, topk_group=1),
                "mid": dict(n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                            moe_shared_expert_intermediate_size=512, moe_latent_size=256, n_group=4, topk_group=2)}
BLOCKS = ("linear_attention", "mlp", "linear_attention", "mlp", "full_attention", "mlp")  # Nemotron-H's pattern: a
# block of each kind between MLPs, two Mamba-2 blocks to each attention layer
# a Gated DeltaNet's sizes per size: key heads, value heads (two per key head), their widths (d_model channels)
DELTA_SIZES = {"tiny": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4),
               "mid": dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                           linear_value_head_dim=64, linear_conv_kernel_dim=4)}
# a Mamba-2 block's sizes per size: (SSM heads of 64 channels: 2 x d_model inner, state size, chunk)
SCAN_SIZES = {"tiny": dict(mamba_n_heads=2, mamba_d_head=64, mamba_d_state=16, mamba_chunk_size=16),
              "mid": dict(mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64)}
SIZES = {  # name -> (config sizes, prompt length)
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512), 64),
    "mid": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024), 256),
}


def build(kind: str, size: str) -> torch.nn.Module:
    from dpa.tiny import tiny_model

    family, extra = KINDS[kind]
    sizes, _ = SIZES[size]
    layers = sizes["num_hidden_layers"]
    overrides = dict(sizes, **extra)
    if family == "lfm2":
        overrides["layer_types"] = ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]
    if family == "bamba":
        overrides.update(SCAN_SIZES[size], mamba_n_groups=1, attn_layer_indices=list(range(2, layers, 3)))
    if family == "falcon_h1":  # Bamba's Mamba-2 sizes beside every attention block (2 x d_model channels)
        scan = SCAN_SIZES[size]
        overrides.update(mamba_n_heads=scan["mamba_n_heads"], mamba_d_ssm=scan["mamba_n_heads"] * scan["mamba_d_head"],
                         mamba_d_state=scan["mamba_d_state"], mamba_chunk_size=scan["mamba_chunk_size"],
                         mamba_n_groups=1)
    if family == "qwen3_next":
        overrides.update(DELTA_SIZES[size], layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                                                         for i in range(layers)])
    if family == "nemotron_h":  # Bamba's Mamba-2 sizes under Nemotron-H's keys; whole heads of d_model / heads
        scan, sparse = SCAN_SIZES[size], overrides.pop("moe", False)
        pattern = [("moe" if sparse and b == "mlp" else b) for b in BLOCKS]
        overrides.update(SPARSE_SIZES[size] if sparse else {})
        overrides.update(layers_block_type=[pattern[i % len(pattern)] for i in range(layers)], n_groups=1,
                         mamba_num_heads=scan["mamba_n_heads"], mamba_head_dim=scan["mamba_d_head"],
                         ssm_state_size=scan["mamba_d_state"], chunk_size=scan["mamba_chunk_size"],
                         head_dim=sizes["hidden_size"] // sizes["num_attention_heads"])
        return tiny_model(family, sizes["num_key_value_heads"], dtype=torch.float32, **overrides)
    if family == "mamba":  # its own config's keys: the inner width is 2 x d_model, the step's rank d_model / 16
        overrides = dict(hidden_size=sizes["hidden_size"], num_hidden_layers=layers, vocab_size=sizes["vocab_size"],
                         state_size=16, time_step_rank=-(-sizes["hidden_size"] // 16))
    overrides.pop("head_dim", None)
    return tiny_model(family, sizes["num_key_value_heads"], dtype=torch.float32, **overrides)


def gradient(model, ids: torch.Tensor, target: int) -> None:
    import dpa

    spec = dpa.spec_for(model)
    emb = spec.embed(model)(ids[None]).detach().requires_grad_(True)
    h = spec.base(model)(inputs_embeds=emb, use_cache=False).last_hidden_state
    (h[0, -1] @ spec.unembed(model).weight[target]).backward()


def measure(kind: str, size: str, repeats: int) -> dict:
    import dpa

    model = build(kind, size)
    n = SIZES[size][1]
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    target = 5
    runs = {"gradient": lambda: gradient(model, ids, target),
            "dpa": lambda: dpa.attribute(model, None, ids, target=target)}
    for fn in runs.values():  # warm-up at the measured length
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    spec = dpa.spec_for(model)
    return {"kind": kind, "family": spec.family, "size": size, "tokens": n, "layers": spec.n_layers,
            "layer_kinds": list(spec.layer_kinds) or ["attention"] * spec.n_layers, "d_model": spec.d_model,
            "repeats": repeats, "gradient_s": statistics.median(times["gradient"]),
            "dpa_s": statistics.median(times["dpa"]),
            "dpa_over_gradient": statistics.median(d / g for d, g in zip(times["dpa"], times["gradient"]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'kind':<10} {'family':<10} {'size':<5} {'tokens':>6} {'gradient s':>11} {'dpa s':>8} "
          f"{'dpa / gradient':>15}")
    for kind in args.kinds:
        for size in args.sizes:
            r = measure(kind, size, args.repeats)
            rows.append(r)
            print(f"{kind:<10} {r['family']:<10} {size:<5} {r['tokens']:>6} {r['gradient_s']:>11.4f} {r['dpa_s']:>8.4f} "
                  f"{r['dpa_over_gradient']:>15.2f}", flush=True)
    if args.out is not None:
        out = {"machine": machine_label(torch.device("cpu")), "dtype": "torch.float32",
               "threads": torch.get_num_threads(), "rows": rows}
        args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
