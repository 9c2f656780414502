"""One sample measured: each method's attribution of it timed, and its disruption and recovery curves taken
in both protocols (a row of ``samples.jsonl``); and whether a stored row has what the results need."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..families import spec_for
from .curves import ONE_KIND, ComponentUnits, component_curves, component_units, input_curves, unit_layers
from .settings import Settings
from ..spec import one_mixer_per_layer


def unembedding(model: nn.Module) -> torch.Tensor:
    """The unembedding weight (``lm_head``, or GPT-NeoX's ``embed_out``: the family description's path)."""
    return spec_for(model).unembed(model).weight


def _sync(model: nn.Module) -> None:
    if unembedding(model).device.type == "cuda":
        torch.cuda.synchronize()


def sample_units(sample, spec, settings: Settings) -> dict[str | None, tuple[ComponentUnits, ComponentUnits]]:
    """A sample's (clean, paper) unit sets, keyed by the kind a method scores: None for both kinds,
    or a method of ``ONE_KIND``, whose paper units hold its own kind alone."""
    if settings.component_units != "neurons":  # (refused before any work: runner.check_ablation)
        one_mixer_per_layer(spec, "ablating heads is")
    args = (sample, spec.n_layers, spec.n_heads, spec.d_mlp, settings.component_units)
    layers = unit_layers(spec)  # (Nemotron-H's layers of one block: the units that exist)
    clean = component_units(*args, layers=layers)
    kinds = [None] + [m for m, kind in ONE_KIND.items() if settings.component_units in ("fine", "coarse", kind)]
    return {m: (clean, component_units(*args, protocol="paper", method=m, layers=layers)) for m in kinds}


def measure(model, tokenizer, settings: Settings, sample, index: int, name: str, fn,
            units: dict[str | None, tuple[ComponentUnits, ComponentUnits]] | None, fractions) -> dict:
    """The row of one sample and method: the attribution's seconds, and the clean and paper curves it gives
    (``units``: the sample's ``sample_units`` for component units, None for input units)."""
    contrast = sample.contrast_id if settings.contrast else None
    _sync(model)
    start = time.perf_counter()
    attribution = fn(model, tokenizer, sample.input_ids, sample.target_id, contrast=contrast, position=sample.position)
    _sync(model)
    seconds = time.perf_counter() - start
    if settings.unit == "input":
        curves = input_curves(model, sample, attribution, fractions, seed=settings.seed,
                              batch_size=settings.batch_size)
        paper = curves.native  # the same units: only the softmax dtype differs
    else:
        clean_units, paper_units = units[attribution.method if attribution.method in ONE_KIND else None]
        curves = component_curves(model, sample, attribution, clean_units, fractions, seed=settings.seed,
                                  batch_size=settings.batch_size)
        paper = (curves if paper_units.same_as(clean_units)  # coarse units of a two-kind method
                 else component_curves(model, sample, attribution, paper_units, fractions, seed=settings.seed,
                                       batch_size=settings.batch_size)).native
    return {"index": index, "id": sample.id, "method": name, "seconds": seconds,
            "eval_seconds": time.perf_counter() - start - seconds, "n_tokens": sample.n_tokens,
            "n_units": curves.n_units, "p_clean": curves.p_clean, "disruption": curves.disruption,
            "recovery": curves.recovery, "paper_n_units": paper.n_units, "paper_p_clean": paper.p_clean,
            "paper_disruption": paper.disruption, "paper_recovery": paper.recovery}


def _native_is_float32(model: nn.Module) -> bool:
    return unembedding(model).dtype in (torch.float32, torch.float64)


def is_complete(row: dict, settings: Settings, model: nn.Module) -> bool:
    """Whether a stored row has what the results need. Rows of older dpa versions hold the clean
    curves alone; for input units of a float32 model those are the paper's curves too (same units,
    same softmax), otherwise the sample is measured again."""
    return "paper_disruption" in row or (settings.unit == "input" and _native_is_float32(model))
