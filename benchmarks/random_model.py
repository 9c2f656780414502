"""A model folder with random weights in a given shape, for timing where the real weights cannot go.

    python benchmarks/random_model.py SOURCE OUT [--set hidden_size=2048 num_hidden_layers=16 ...] [--device cuda]

SOURCE: a saved model's folder (its config.json and tokenizer files are read; its weights are not). OUT gets the
config (with the --set overrides), random weights (seed 0, transformers' own initialisation) and SOURCE's tokenizer
files. The cost of DPA against a gradient does not depend on the weights' values, only on the shapes; the GPU table
of benchmarks/results/README.md was measured on such folders, the model files being too big to carry to that machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "tokenizer.model")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (JSON values)")
    p.add_argument("--device", default="cpu", help="where to initialise (cuda is faster for big shapes)")
    args = p.parse_args()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        if not key or not value:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        overrides[key] = json.loads(value)
    config = AutoConfig.from_pretrained(args.source, **overrides)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (Path(args.source) / name).exists():
            shutil.copy(Path(args.source) / name, Path(args.out) / name)
    n = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"{args.out}: {config.model_type}, {n:.1f} M parameters, random weights")


if __name__ == "__main__":
    main()
