"""The faithfulness benchmark runner: filter, attribute, ablate, aggregate; resumable.

``evaluate(model, tokenizer, settings, out)`` walks a dataset in file order. Each example is
checked once by the paper's filter (verdicts cached in ``out/filter.jsonl``); for each valid one,
every method attributes it (timed) and its disruption and recovery curves are measured
(``out/samples.jsonl``, one line per sample and method). A restart skips what those files
already hold. At the end ``results.json``, ``results.csv``, ``results.md`` and the figures are
written from the first ``limit`` valid samples.

The run's parts are modules of their own: ``settings`` (what a run measures: ``Settings`` and the methods),
``store`` (the folder's JSON-lines files), ``measure`` (one sample's row) and ``results`` (the aggregate and the
files written from it). The public names they held when they were part of this module are importable from here
too.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from torch import nn

from .. import distributed, locks
from ..checks import check_bool
from ..errors import InputTypeError, UnsupportedModelError
from ..families import ModelSpec, spec_for
from ..files import model_identity, run_folder, run_id
from .curves import fraction_grid
from .datasets import DataError, load_examples
from .filter import Verdict, check
from .measure import is_complete, unembedding
from .measure import measure as _measure, sample_units as _sample_units  # under these names here, as before
from .prompts import encode_example
from .results import (CSV_COLUMNS, figure_files, markdown_table, summarize, table_rows, write_results,
                      write_sweep)
from .settings import (PAPER_METHODS, Settings, available_methods, check_kinds, check_method_names, check_methods,
                       check_supported, resolve_methods, sweep_methods)
from .stats import FEW_SAMPLES
from .store import Store

__all__ = [  # the runner's own names, and those of its parts that were defined here before
    "CSV_COLUMNS", "FewSamplesWarning", "PAPER_METHODS", "Settings", "Store", "available_methods",
    "check_method_names", "check_methods", "evaluate", "figure_files", "markdown_table", "resolve_methods",
    "summarize", "sweep", "sweep_methods", "table_rows", "write_results",
]


def evaluate(model: nn.Module, tokenizer, settings: Settings, out: str | Path, *,
             methods: dict[str, Callable] | None = None, progress: bool = True, figures: bool = True) -> dict:
    """Run the benchmark; returns (and writes) the results. ``methods`` overrides the registry.

    Under torchrun (an initialised torch.distributed process group) rank r of N measures the valid samples
    r, r + N, ... and writes its own part; rank 0 merges the parts and writes the results once every rank is
    done (``dpa.distributed``), so the folder is what one process would have written. The run holds the folder
    while it writes it: a second run on it is refused (``dpa.locks``).
    """
    with _running(model, tokenizer, settings, out, methods=methods, progress=progress, figures=figures) as results:
        return results


@dataclass(frozen=True)
class _Run:
    """One run in its folder: what its steps share."""

    model: nn.Module
    tokenizer: object
    settings: Settings
    spec: ModelSpec
    methods: dict[str, Callable]
    out: Path
    group: distributed.Group
    id: str  # the run's name (``dpa.files.run_id`` of its identity), stamped on the rows it writes
    fractions: tuple[float, ...]  # the grid of ablated fractions (``curves.fraction_grid``)


@contextlib.contextmanager
def _running(model: nn.Module, tokenizer, settings: Settings, out: str | Path, *,
             methods: dict[str, Callable] | None, progress: bool, figures: bool) -> Iterator[dict]:
    """``evaluate``, yielding its results while the run still holds the folder (a sweep writes its files then)."""
    if not isinstance(settings, Settings):
        raise InputTypeError(f"settings must be a dpa.evaluate.Settings, got {type(settings).__name__}")
    group = distributed.current()
    progress, figures = check_bool("progress", progress), check_bool("figures", figures)
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a folder (a str or path), got {type(out).__name__}")
    methods, spec = _methods(model, settings, methods)
    examples = load_examples(settings.dataset, settings.data_dir, seed=settings.seed,
                             n_generated=settings.n_generated)  # missing or malformed data: before any file
    out = run_folder(out, DataError)
    # one run at a time in the folder, and only the run it holds (rank 0 locks it for every rank)
    with locks.start(out, _identity(settings, model, tokenizer), group, DataError) as identity:
        run = _Run(model, tokenizer, settings, spec, methods, out, group, run_id(identity),
                   fraction_grid(settings.dataset, settings.unit))
        chosen = _walk_together(run, Store(out, rank=group.rank, run=run.id), examples, progress)
        results = _finish(run, chosen, figures) if group.main else None
        group.barrier()
        yield results if group.main else json.loads((out / "results.json").read_text(encoding="utf-8"))


def _methods(model: nn.Module, settings: Settings, methods) -> tuple[dict[str, Callable], ModelSpec]:
    """The run's methods (``methods``, else those the settings name) and the model's description, each method
    checked: it ranks units of the kind it scores, and handles the model's layers."""
    methods = check_methods(methods) if methods is not None else resolve_methods(settings)
    check_kinds(settings, methods)
    spec = spec_for(model)
    check_supported(methods, spec)
    check_ablation(settings, spec)
    return methods, spec


def check_ablation(settings: Settings, spec: ModelSpec) -> None:
    """The component benchmark ablates attention edges and heads through dpa's explicit attention path; a hybrid's
    mixer layers (LFM2's convolutions) have no attention probabilities to ablate: refused before any work is done
    (its neurons alone are ablated as on any model). A model whose layers have no MLP (Mamba-2's) has no neurons
    to ablate either."""
    if settings.unit != "component":
        return
    neurons = bool(spec.d_mlp or spec.n_experts)
    runs = ("the input benchmark (unit='input') and the neurons alone (component_units='neurons') run on it"
            if neurons else "the input benchmark (unit='input') runs on it")
    if settings.component_units != "neurons" and spec.mixed:
        raise UnsupportedModelError(
            f"the component benchmark ablates attention edges and heads, and {spec.family} has {spec.non_attention}, "
            f"without attention probabilities; {runs}")
    if settings.component_units != "neurons" and spec.n_beside:
        raise UnsupportedModelError(
            f"the component benchmark ablates attention edges and heads, and {spec.family} has a {spec.beside_kind} "
            f"block beside attention on every layer, whose units dpa does not ablate yet; {runs}")
    if not neurons:
        raise UnsupportedModelError(f"the component benchmark's neurons are MLP neurons, and {spec.family}'s layers "
                                    "have no MLP; the input benchmark (unit='input') runs on it")


def _identity(settings: Settings, model: nn.Module, tokenizer) -> dict:
    """What makes the folder's run the same run when resumed: the settings that must match, and the model's."""
    return {**settings.identity(), "weights": settings.weights.to_dict(),
            **model_identity(model, unembedding(model).dtype, tokenizer)}


def _walk_together(run: _Run, store: Store, examples: list, progress: bool) -> list[int]:
    """This rank's walk (``_walk``) under a progress bar; an error on any rank is raised on every rank."""
    from tqdm.auto import tqdm

    total = min(run.settings.limit or len(examples), len(examples))
    total = len(range(run.group.rank, total, run.group.world))
    bar = tqdm(total=total, desc=f"{run.settings.dataset} {run.settings.unit}", unit="sample", disable=not progress)
    failed = chosen = None
    try:
        chosen = _walk(run, store, examples, bar, progress and run.group.main)
    except BaseException as err:  # noqa: BLE001  told to the other ranks, so that none waits for ever
        failed = err
    bar.close()
    run.group.stop_together(failed)
    run.group.barrier()
    return chosen


def _walk(run: _Run, store: Store, examples: list, bar, estimate: bool) -> list[int]:
    """The valid samples (their indices, every rank's), in file order up to the limit: each example checked
    once by the filter (``_verdict``), each valid one of this rank's share measured by the methods that lack it.
    ``estimate``: say after the first sample measured how long the run will take."""
    settings = run.settings
    chosen: list[int] = []
    for index, example in enumerate(examples):
        if settings.limit is not None and len(chosen) >= settings.limit:
            break
        sample = encode_example(run.tokenizer, example, settings.prompt)
        if not _verdict(run, store, index, example, sample)["valid"]:
            bar.set_postfix(checked=index + 1, valid=len(chosen))
            continue
        chosen.append(index)
        if not run.group.mine(len(chosen) - 1):
            continue
        units = _sample_units(sample, run.spec, settings) if settings.unit == "component" else None
        started = time.perf_counter()
        measured = _measure_missing(run, store, index, sample, units, bar, len(chosen))
        bar.update(1)
        if measured and estimate:  # the first sample measured here
            estimate = False
            bar.write(_estimate(time.perf_counter() - started, bar.total - bar.n, len(run.methods)), file=sys.stderr)
    return chosen


def _verdict(run: _Run, store: Store, index: int, example, sample) -> dict:
    """The filter's verdict on example ``index``: the stored one, which must be of the same record, else checked
    now (and written by rank 0)."""
    settings = run.settings
    if index not in store.verdicts:
        v: Verdict = check(run.model, run.tokenizer, sample, max_tokens=settings.max_tokens,
                           min_probability=settings.min_probability, correct_only=settings.filter == "paper")
        store.add_verdict({"index": index, "id": example.id, **asdict(v)}, write=run.group.main)
    elif str(store.verdicts[index].get("id", example.id)) != str(example.id):
        raise DataError(f"{run.out / 'filter.jsonl'}: sample {index} was record {store.verdicts[index]['id']!r} "
                        f"when this folder was started, and is record {example.id!r} in the data now (another data "
                        "file, or its records reordered): resume with the data the run started with, or use a new "
                        "--out folder")
    return store.verdicts[index]


def _measure_missing(run: _Run, store: Store, index: int, sample, units, bar, n_valid: int) -> bool:
    """Each method's row of a sample that the store lacks (or holds from an older dpa without what the results
    need), measured and stored; whether any was."""
    measured = False
    for name, fn in run.methods.items():
        if (index, name) in store.samples and is_complete(store.samples[(index, name)], run.settings, run.model):
            continue
        bar.set_postfix(checked=index + 1, valid=n_valid, method=name)
        store.add_sample(_measure(run.model, run.tokenizer, run.settings, sample, index, name, fn, units,
                                  run.fractions))
        measured = True
    return measured


def _finish(run: _Run, chosen: list[int], figures: bool) -> dict:
    """Rank 0, once every rank is done: every rank's samples merged, the results summarized and written, and a
    run too small to rank its methods warned of."""
    store = Store(run.out, run=run.id)  # every rank's samples
    store.merge(chosen, list(run.methods))
    results = summarize(run.settings, run.methods, store, chosen, run.fractions, run.model,
                        n_checked=len(store.verdicts))
    write_results(results, run.out, figures=figures)
    if len(chosen) < FEW_SAMPLES and "dpa" in run.methods and len(run.methods) > 1:
        warnings.warn(_few_samples(store, chosen, list(run.methods), run.fractions, run.settings.unit),
                      FewSamplesWarning, stacklevel=4)  # the caller of evaluate (or sweep): through _running
    return results


class FewSamplesWarning(UserWarning):
    """A run with too few samples to rank methods: the paired intervals it gives are said with it."""


def _estimate(seconds: float, left: int, n_methods: int) -> str:
    """What the first sample measured says of the run's length (the filter's passes, before each valid sample,
    come on top)."""
    total = seconds * left
    span = f"{total / 3600:.1f} h" if total >= 5400 else f"{total / 60:.0f} min" if total >= 90 else f"{total:.0f} s"
    return (f"the first sample took {seconds:.1f} s ({n_methods} methods): about {span} for the {left} samples "
            "left, plus the filter's checks")


def _few_samples(store: Store, chosen: list[int], methods: list[str], fractions, unit: str) -> str:
    """The warning of a run too small to rank methods, with the paired 95% intervals it gives (paper mode)."""
    from .stats import separation

    lines = [f"{len(chosen)} samples cannot rank methods reliably (the committed runs use 100): the paired 95% "
             "bootstrap intervals of DPA's total AUC minus each method's here are"]
    for name, r in separation(store.samples, chosen, methods, fractions, unit):
        lo, hi = r["interval"]
        verdict = "cannot tell them apart" if lo <= 0 <= hi else "apart"
        lines.append(f"  dpa - {name}: {r['difference']:+.2f} [{lo:+.2f}, {hi:+.2f}] ({verdict})")
    lines.append("  run more samples (--limit) before comparing methods")
    return "\n".join(lines)


def sweep(model: nn.Module, tokenizer, settings: Settings, out: str | Path, *, families, ps,
          progress: bool = True, figures: bool = True) -> dict:
    """The sensitivity analysis: total AUC of DPA over p for each path-weight family."""
    if not isinstance(settings, Settings):
        raise InputTypeError(f"settings must be a dpa.evaluate.Settings, got {type(settings).__name__}")
    methods, points = sweep_methods(settings, families, ps)
    with _running(model, tokenizer, replace(settings, methods=tuple(methods)), out, methods=methods,
                  progress=progress, figures=False) as results:  # the sweep's files too, while it holds the folder
        if not distributed.current().main:  # rank 0 writes the sweep's files
            return results
        return write_sweep(settings, results, points, Path(out), figures)
