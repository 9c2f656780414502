"""A model folder with random weights in a given shape, for timing where the real weights cannot go.

    python benchmarks/random_model.py SOURCE OUT [--set hidden_size=2048 num_hidden_layers=16 ...] [--device cuda]

SOURCE: a saved model's folder (its config.json and tokenizer files are read; its weights are not). OUT, a new or
empty folder, gets the config (with the --set overrides), random weights (seed 0, transformers' own initialisation)
and every other file of SOURCE except weights (the tokenizer's). The cost of DPA against a gradient does not depend
on the weights' values, only on the shapes; the GPU table of benchmarks/results/README.md was measured on such
folders, the model files being too big to carry to that machine.

--set KEY=VALUE: a key of the model's config (a text model's: a multimodal config is refused); VALUE is read as
JSON (2048, 0.5, true, [1, 2]), else taken as a string (hidden_act=gelu). Changing num_hidden_layers repeats
the source's per-layer pattern (layer_types) to the new depth unless it is set too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
TOKENIZER_HINTS = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build(source: Path, out: Path, overrides: dict, device: str = "cpu") -> str:
    if not (source / "config.json").is_file():
        raise ValueError(f"{source} has no config.json: give a saved model's folder")
    if out.resolve() == source.resolve():
        raise ValueError("OUT is SOURCE: the random weights would overwrite the real ones; give another folder")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: give a new or empty folder")
    raw = json.loads((source / "config.json").read_text())
    if "text_config" in raw:
        raise ValueError(f"{source} holds a multimodal config (text_config): give the text model's own folder")
    unknown = sorted(k for k in overrides if k not in raw)
    if unknown:
        raise ValueError(f"--set: {', '.join(unknown)} not in {source}/config.json (keys: {', '.join(sorted(raw))})")
    pattern = raw.get("layer_types")
    if "num_hidden_layers" in overrides and pattern and "layer_types" not in overrides:  # the pattern, repeated
        n = overrides["num_hidden_layers"] if isinstance(overrides["num_hidden_layers"], int) else 0
        overrides = {**overrides, "layer_types": [pattern[i % len(pattern)] for i in range(n)]}
    try:
        config = AutoConfig.from_pretrained(source, **overrides)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as err:  # the config class's own validation (types, consistency), or the model's
        raise ValueError(f"the config does not take these settings: {type(err).__name__}: {err}") from None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copied = []
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHTS) and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
            copied.append(f.name)
    if not any(name in copied for name in TOKENIZER_HINTS):
        print(f"warning: no tokenizer file in {source} (looked for {', '.join(TOKENIZER_HINTS)}): "
              "dpa.load_model will not find a tokenizer", file=sys.stderr)
    n = sum(t.numel() for t in model.parameters()) / 1e6
    return f"{out}: {config.model_type}, {n:.1f} M parameters, random weights; copied {', '.join(copied) or 'nothing'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (see above)")
    p.add_argument("--device", default="cpu", help="where to initialise (cuda is faster for big shapes)")
    args = p.parse_args()
    try:
        print(build(args.source, args.out, parse_set(args.set), args.device))
    except ValueError as err:
        p.error(str(err))


if __name__ == "__main__":
    main()
