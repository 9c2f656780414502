"""Shared helpers of the benchmark scripts (and of the studies in ``studies/``): command line, model loading, peak
memory of a block, machine label, prompts, a finished run's configuration."""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil
import torch


class Peak:
    mib: float = 0.0


@contextmanager
def peak_memory(device: torch.device) -> Iterator[Peak]:
    """Peak memory of the block in MiB above what was in use when it began.

    CUDA: torch.cuda.max_memory_allocated. CPU: the process's resident set sampled every
    2 ms by a thread (glibc may keep freed memory, so measure each method in a fresh process).
    """
    peak = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield peak
        torch.cuda.synchronize()
        peak.mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    proc = psutil.Process()
    base = proc.memory_info().rss
    top = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            top[0] = max(top[0], proc.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        top[0] = max(top[0], proc.memory_info().rss)
        peak.mib = (top[0] - base) / 2**20


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously): a timed call ends when its work does."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def machine_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {torch.get_num_threads()} threads, {psutil.cpu_count()} cores (torch {torch.__version__})"


def make_ids(tokenizer, n: int) -> torch.Tensor:
    """A natural-text prompt of exactly n tokens."""
    text = ("The Eiffel Tower is located in the city of Paris, which is the capital of France. "
            "When Mary and John went to the store, John gave a drink to Mary. ") * (n // 20 + 10)
    ids = tokenizer(text)["input_ids"][:n]
    if len(ids) < n:
        raise ValueError(f"could not build a {n}-token prompt")
    return torch.tensor(ids)


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes: --model, --device, --out (and the hidden --child,
    with which a script runs one measurement in a fresh process)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name or folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when available)")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def load(args: argparse.Namespace):
    """The model of --model on --device, with a header line: (model, tokenizer, device, machine label)."""
    import dpa

    model, tok = dpa.load_model(args.model, device=args.device)
    device = model.model.embed_tokens.weight.device
    machine = machine_label(device)
    print(f"model {args.model or 'SmolLM2-135M-Instruct'} ({model.dtype}) on {machine}", flush=True)
    return model, tok, device, machine


def run_config(results: Path) -> tuple[bool, str, str | None]:
    """A ``dpa evaluate`` run's units (the paragraph, recorded in its identity since the fix, or the user turn), its
    prompt form and its model (None: the default)."""
    from dpa.models import DEFAULT_MODEL

    config = json.loads((Path(results) / "config.json").read_text(encoding="utf-8"))
    model = None if config.get("model", DEFAULT_MODEL) == DEFAULT_MODEL else config["model"]
    return config.get("context_units") == "paragraph", config.get("prompt", "chat"), model
