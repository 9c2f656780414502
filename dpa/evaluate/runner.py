"""The faithfulness benchmark runner: filter, attribute, ablate, aggregate; resumable.

``evaluate(model, tokenizer, settings, out)`` walks a dataset in file order. Each example is
checked once by the paper's filter (verdicts cached in ``out/filter.jsonl``); for each valid one,
every method attributes it (timed) and its disruption and recovery curves are measured
(``out/samples.jsonl``, one line per sample and method). A restart skips what those files
already hold. At the end ``results.json``, ``results.csv``, ``results.md`` and the figures are
written from the first ``limit`` valid samples.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import platform
import sys
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from .. import distributed, locks
from ..families import spec_for
from ..baselines import COMPONENT_METHODS, INPUT_METHODS
from ..checks import check_bool, check_choice, check_float, check_int
from ..errors import InputError, InputTypeError, UnsupportedModelError
from ..weights import PRESETS, PathWeights
from .auc import auc_summary
from .curves import (GRANULARITIES, ONE_KIND, ComponentUnits, Unit, component_curves, component_units,
                     fraction_grid, input_curves)
from ..files import model_identity, run_folder, run_id, split_lines, write_text
from .datasets import CHAT_DATASETS, DATASETS, GENERATED, DataError, load_examples
from .filter import Verdict, check
from .prompts import check_prompt, encode_example
from .stats import FEW_SAMPLES

# The methods of the paper's tables (activation patching and occlusion are opt-in: one forward per unit).
PAPER_METHODS = {
    "input": ("dpa", "random", "last_layer_attention", "mean_attention", "attention_rollout", "gradient",
              "input_x_gradient", "integrated_gradients", "depass", "ifr"),
    "component": ("dpa", "dpa_mid", "random", "attn_only", "mlp_only", "norm_only", "gradient", "atp", "ifr"),
}


@dataclass(frozen=True)
class Settings:
    """What one benchmark run measures. Fields other than ``methods`` and ``limit`` must match
    when a run is resumed in the same folder."""

    dataset: str
    unit: Unit
    methods: tuple[str, ...] = ()
    limit: int | None = None  # valid samples to evaluate (None: all)
    component_units: str = "fine"  # fine: edges + position-level neurons; coarse: heads + neurons; edges; neurons
    weights: PathWeights = field(default_factory=PathWeights)  # for DPA
    contrast: bool = False  # IOI: True attributes logit(IO) - logit(S) (a variant); False the IO logit, as the
    # reference code does. The metric is p(IO) either way
    seed: int = 0  # random baseline and tie-breaking
    steps: int = 20  # integrated gradients
    batch_size: int = 16  # ablated copies per forward pass
    max_tokens: int = 400
    min_probability: float = 0.1
    filter: str = "paper"  # paper: the model must get the sample right; length: only the token limit
    data_dir: str | None = None
    n_generated: int = 1000  # ioi_templates
    prompt: str = "chat"  # squad_v2.0, imdb: the chat template, or "plain" text for a base model (prompts.py)

    def __post_init__(self) -> None:
        """Every field checked (and put in its canonical form) here, once, for the Python API and the CLI alike."""
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (a frozen dataclass)
        check_choice("dataset", self.dataset, DATASETS + GENERATED)
        check_choice("unit", self.unit, ("input", "component"))
        fix("methods", check_method_names(self.methods))
        if self.limit is not None:
            fix("limit", check_int("limit (valid samples to evaluate; None for all)", self.limit, low=1))
        check_choice("component_units", self.component_units, GRANULARITIES)
        if not isinstance(self.weights, PathWeights):
            raise InputTypeError(f"weights must be a dpa.PathWeights (e.g. PathWeights(0, 0, 1, 0, 1) or "
                                 f"PathWeights.parse('0,0,1,0,1')), got {type(self.weights).__name__}")
        fix("contrast", check_bool("contrast", self.contrast))
        fix("seed", check_int("seed", self.seed))
        fix("steps", check_int("steps", self.steps, low=1))
        fix("batch_size", check_int("batch_size", self.batch_size, low=1))
        fix("max_tokens", check_int("max_tokens", self.max_tokens, low=1))
        p = check_float("min_probability", self.min_probability)
        if not 0 <= p < 1:
            raise InputError(f"min_probability must be in [0, 1) (a sample is kept when p(target) > min_probability), "
                             f"got {p}")
        fix("min_probability", p)
        check_choice("filter", self.filter, ("paper", "length"))
        if self.data_dir is not None:
            if not isinstance(self.data_dir, (str, os.PathLike)):
                raise InputTypeError(f"data_dir must be a folder (a str or path) or None, got "
                                     f"{type(self.data_dir).__name__}")
            fix("data_dir", os.fspath(self.data_dir))
        fix("n_generated", check_int("n_generated", self.n_generated, low=1))
        check_prompt(self.prompt)
        if self.prompt != "chat" and self.dataset not in CHAT_DATASETS:
            raise InputError(f"prompt={self.prompt!r} applies to the chat datasets ({', '.join(CHAT_DATASETS)}); "
                             f"{self.dataset} is raw text already")

    def identity(self) -> dict:
        keep = ("dataset", "unit", "component_units", "weights", "contrast", "seed", "steps", "max_tokens",
                "min_probability", "filter", "n_generated")
        d = asdict(self)
        out = {k: d[k] for k in keep}
        if self.dataset in CHAT_DATASETS:  # units: the paragraph / review alone (issue 20); a folder
            out["context_units"] = "paragraph"  # from before, whose units were the whole user turn, is not resumed
        if self.prompt != "chat":  # recorded only when not the chat template, which every earlier run used
            out["prompt"] = self.prompt
        return out


def check_method_names(methods) -> tuple[str, ...]:
    """Method names as a tuple of non-empty strings (a list or tuple of them; () for the paper's table)."""
    if isinstance(methods, str):
        raise InputTypeError(f"methods must be a tuple of method names, e.g. ({methods!r},), not the string "
                             f"{methods!r} (a string would be read letter by letter)")
    if not isinstance(methods, (tuple, list)):
        raise InputTypeError(f"methods must be a tuple of method names (or 'paper' / 'all' in it), got "
                             f"{type(methods).__name__}")
    bad = next((m for m in methods if not isinstance(m, str) or not m.strip()), None)
    if bad is not None:
        raise InputTypeError(f"methods must hold method names (non-empty strings), got {bad!r}")
    return tuple(methods)


def available_methods(unit: Unit) -> dict[str, Callable]:
    check_choice("unit", unit, ("input", "component"))
    return INPUT_METHODS if unit == "input" else COMPONENT_METHODS


def resolve_methods(settings: Settings) -> dict[str, Callable]:
    """Method name -> function with the run's options bound (weights, seed, steps, units)."""
    registry = available_methods(settings.unit)
    names = list(settings.methods) or ["paper"]
    if "all" in names:
        names = list(registry)
    elif "paper" in names:
        names = [n for n in names if n != "paper"] + list(PAPER_METHODS[settings.unit])
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise InputError(f"unknown {settings.unit} method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(registry)} (or 'paper', 'all')")
    pool = {"weights": settings.weights, "seed": settings.seed, "steps": settings.steps,
            "units": "coarse" if settings.component_units == "coarse" else "fine"}
    out = {}
    for name in dict.fromkeys(names):
        fn = registry[name]
        params = inspect.signature(fn).parameters
        out[name] = functools.partial(fn, **{k: v for k, v in pool.items() if k in params})
    return out


class Store:
    """The run folder's JSON-lines files: filter verdicts and per-sample results. Rank r of a torchrun appends to
    its own part (``samples.rank<r>.jsonl``); rank 0 to ``samples.jsonl``, and it merges the parts at the end.

    ``run``: the run's name (``dpa.files.run_id`` of its identity), stamped on every row written; a row stamped
    with another (a file copied from another folder) is refused by file and line (``DataError``), a row with
    none (dpa before run names) is read. A last line cut short (a run killed while appending) is dropped, and
    this rank's own file cut back to its last whole line; another line that is not a record is measured again,
    with a warning naming the file and the lines."""

    def __init__(self, out: Path, rank: int = 0, run: str | None = None):
        self.out = out
        self.rank = rank
        self.run = run
        self.verdicts: dict[int, dict] = {r["index"]: r for r in self._read_all("filter")}
        self.samples: dict[tuple[int, str], dict] = {(r["index"], r["method"]): r for r in self._read_all("samples")}

    def _name(self, kind: str, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        return f"{kind}.jsonl" if rank == 0 else f"{kind}.rank{rank}.jsonl"

    def _read_all(self, kind: str) -> list[dict]:
        paths = sorted(self.out.glob(f"{kind}.rank*.jsonl"))
        return [row for path in [self.out / f"{kind}.jsonl", *paths] for row in self._read(path)]

    def _read(self, path: Path) -> list[dict]:
        if not path.exists():
            return []
        try:
            text = path.read_bytes().decode("utf-8")  # bytes: lines end at "\\r\\n", "\\r" or "\\n" (files.split_lines)
        except (UnicodeDecodeError, OSError) as err:
            raise DataError(f"cannot read {path} ({err}); move it out of the folder (what it held is measured "
                            f"again) or use a new --out folder") from None
        if text and not text.endswith("\n"):  # cut short by an interruption: drop the partial line
            text = text[:text.rfind("\n") + 1]
            if path.name == self._name(path.name.split(".")[0]):  # this rank's own file only
                write_text(path, text)
        rows, bad = [], []
        for n, line in enumerate(split_lines(text), start=1):  # a corrupt line (or not a record) is run again
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("index"), int) and (
                    not path.name.startswith("samples") or isinstance(row.get("method"), str)):
                if self.run is not None and row.get("run", self.run) != self.run:
                    raise DataError(f"{path}, line {n}: a row of another run (run {row['run']}, this folder's is "
                                    f"{self.run}), from a file copied from another folder? Move the file out of "
                                    f"the folder, or use a new --out folder")
                rows.append(row)
            elif line.strip():
                bad.append(n)
        if bad:
            warnings.warn(f"{path}: line(s) {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''} "
                          f"are not records dpa wrote; what they held is measured again", stacklevel=2)
        return rows

    def _stamp(self, row: dict) -> dict:
        return row if self.run is None else {**row, "run": self.run}

    def _append(self, kind: str, row: dict) -> None:
        path = self.out / self._name(kind)
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as err:
            raise DataError(f"cannot write {path}: {err.strerror or err}") from None

    def add_verdict(self, row: dict, write: bool = True) -> None:
        row = self._stamp(row)
        self.verdicts[row["index"]] = row
        if write:
            self._append("filter", row)

    def add_sample(self, row: dict) -> None:
        row = self._stamp(row)
        self.samples[(row["index"], row["method"])] = row
        self._append("samples", row)

    def merge(self, order: list[int], methods: list[str]) -> None:
        """Rank 0, once every rank is done: every part into ``samples.jsonl`` (atomically), in the order one
        process writes it (samples in order, methods in order; rows of other runs after them), parts removed."""
        rank = {(index, m): (i, j) for i, index in enumerate(order) for j, m in enumerate(methods)}
        rows = sorted(self.samples.values(), key=lambda r: (*rank.get((r["index"], r["method"]), (len(order), 0)),
                                                            r["index"], r["method"]))
        write_text(self.out / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        for part in self.out.glob("samples.rank*.jsonl"):
            part.unlink()


def _unembedding(model: nn.Module) -> torch.Tensor:
    """The unembedding weight (``lm_head``, or GPT-NeoX's ``embed_out``: the family description's path)."""
    return spec_for(model).unembed(model).weight


def _sync(model: nn.Module) -> None:
    if _unembedding(model).device.type == "cuda":
        torch.cuda.synchronize()


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


@contextlib.contextmanager
def _running(model: nn.Module, tokenizer, settings: Settings, out: str | Path, *,
             methods: dict[str, Callable] | None, progress: bool, figures: bool) -> Iterator[dict]:
    """``evaluate``, yielding its results while the run still holds the folder (a sweep writes its files then)."""
    from tqdm.auto import tqdm

    if not isinstance(settings, Settings):
        raise InputTypeError(f"settings must be a dpa.evaluate.Settings, got {type(settings).__name__}")
    group = distributed.current()
    progress, figures = check_bool("progress", progress), check_bool("figures", figures)
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a folder (a str or path), got {type(out).__name__}")
    methods = check_methods(methods) if methods is not None else resolve_methods(settings)
    _check_kinds(settings, methods)
    from ..baselines import supports

    spec = spec_for(model)
    unsupported = [name for name, fn in methods.items() if not supports(fn, spec)]
    if unsupported:
        raise UnsupportedModelError(f"method(s) {', '.join(unsupported)} do not handle the layers of {spec.family} "
                                    "(see dpa.baselines.supports: the methods that recompute layers from their "
                                    "weights read some layouts only, dpa_mid needs the residual between attention "
                                    "and a dense MLP); leave them out (--methods)")
    examples = load_examples(settings.dataset, settings.data_dir, seed=settings.seed,
                             n_generated=settings.n_generated)  # missing or malformed data: before any file
    out = run_folder(out, DataError)
    identity = {**settings.identity(), "weights": settings.weights.to_dict(),
                **model_identity(model, _unembedding(model).dtype, tokenizer)}
    # one run at a time in the folder, and only the run it holds (rank 0 locks it for every rank)
    with locks.start(out, identity, group, DataError) as identity:
        run = run_id(identity)
        store = Store(out, rank=group.rank, run=run)
        fractions = fraction_grid(settings.dataset, settings.unit)
        total = min(settings.limit or len(examples), len(examples))
        total = len(range(group.rank, total, group.world))
        chosen: list[int] = []
        estimated = False
        bar = tqdm(total=total, desc=f"{settings.dataset} {settings.unit}", unit="sample", disable=not progress)
        failed = None
        try:
            for index, example in enumerate(examples):
                if settings.limit is not None and len(chosen) >= settings.limit:
                    break
                sample = encode_example(tokenizer, example, settings.prompt)
                if index not in store.verdicts:
                    v: Verdict = check(model, tokenizer, sample, max_tokens=settings.max_tokens,
                                       min_probability=settings.min_probability,
                                       correct_only=settings.filter == "paper")
                    store.add_verdict({"index": index, "id": example.id, **asdict(v)}, write=group.main)
                elif str(store.verdicts[index].get("id", example.id)) != str(example.id):
                    raise DataError(f"{out / 'filter.jsonl'}: sample {index} was record "
                                    f"{store.verdicts[index]['id']!r} when this folder was started, and is record "
                                    f"{example.id!r} in the data now (another data file, or its records reordered): "
                                    "resume with the data the run started with, or use a new --out folder")
                if not store.verdicts[index]["valid"]:
                    bar.set_postfix(checked=index + 1, valid=len(chosen))
                    continue
                chosen.append(index)
                if not group.mine(len(chosen) - 1):
                    continue
                units = _sample_units(sample, spec, settings) if settings.unit == "component" else None
                started, measured = time.perf_counter(), False
                for name, fn in methods.items():
                    if (index, name) in store.samples and _complete(store.samples[(index, name)], settings, model):
                        continue
                    bar.set_postfix(checked=index + 1, valid=len(chosen), method=name)
                    store.add_sample(_measure(model, tokenizer, settings, sample, index, name, fn, units, fractions))
                    measured = True
                bar.update(1)
                if measured and not estimated and progress and group.main:  # the first sample measured here
                    estimated = True
                    bar.write(_estimate(time.perf_counter() - started, total - bar.n, len(methods)), file=sys.stderr)
        except BaseException as err:  # noqa: BLE001  told to the other ranks, so that none waits for ever
            failed = err
        bar.close()
        group.stop_together(failed)
        group.barrier()
        if group.main:
            store = Store(out, run=run)  # every rank's samples
            store.merge(chosen, list(methods))
            results = summarize(settings, methods, store, chosen, fractions, model, n_checked=len(store.verdicts))
            write_results(results, out, figures=figures)
            if len(chosen) < FEW_SAMPLES and "dpa" in methods and len(methods) > 1:
                warnings.warn(_few_samples(store, chosen, list(methods), fractions, settings.unit), FewSamplesWarning,
                              stacklevel=3)
        group.barrier()
        yield results if group.main else json.loads((out / "results.json").read_text(encoding="utf-8"))


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


def _sample_units(sample, spec, settings: Settings) -> dict[str | None, tuple[ComponentUnits, ComponentUnits]]:
    """A sample's (clean, paper) unit sets, keyed by the kind a method scores: None for both kinds,
    or a method of ``ONE_KIND``, whose paper units hold its own kind alone."""
    args = (sample, spec.n_layers, spec.n_heads, spec.d_mlp, settings.component_units)
    clean = component_units(*args)
    kinds = [None] + [m for m, kind in ONE_KIND.items() if settings.component_units in ("fine", "coarse", kind)]
    return {m: (clean, component_units(*args, protocol="paper", method=m)) for m in kinds}


def _measure(model, tokenizer, settings: Settings, sample, index: int, name: str, fn,
             units: dict[str | None, tuple[ComponentUnits, ComponentUnits]] | None, fractions) -> dict:
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


def check_methods(methods) -> dict[str, Callable]:
    """``evaluate``'s ``methods`` override: a dict of method name -> attribution function."""
    if not isinstance(methods, Mapping):
        raise InputTypeError(f"methods must be a dict of method name -> attribution function, got "
                             f"{type(methods).__name__}")
    if not methods:
        raise InputError("methods is empty: give at least one method name -> attribution function")
    for name, fn in methods.items():
        if not isinstance(name, str) or not name.strip():
            raise InputTypeError(f"methods: each name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise InputTypeError(f"methods[{name!r}] must be an attribution function (model, tokenizer, prompt, "
                                 f"target, ...) -> Attribution, got {type(fn).__name__}")
    return dict(methods)


def _check_kinds(settings: Settings, methods) -> None:
    """A method that scores one kind of component has nothing to rank among units of the other kind."""
    if settings.unit != "component" or settings.component_units not in ("edges", "neurons"):
        return
    wrong = [n for n in methods if ONE_KIND.get(n, settings.component_units) != settings.component_units]
    if wrong:
        raise InputError(f"{', '.join(wrong)} score(s) {ONE_KIND[wrong[0]]} only: nothing to rank among "
                         f"--component-units {settings.component_units}")


def _native_is_float32(model: nn.Module) -> bool:
    return _unembedding(model).dtype in (torch.float32, torch.float64)


def _complete(row: dict, settings: Settings, model: nn.Module) -> bool:
    """Whether a stored row has what the results need. Rows of older dpa versions hold the clean
    curves alone; for input units of a float32 model those are the paper's curves too (same units,
    same softmax), otherwise the sample is measured again."""
    return "paper_disruption" in row or (settings.unit == "input" and _native_is_float32(model))


def _paper_curve(row: dict, key: str) -> list[float]:
    return row.get(f"paper_{key}", row[key])


def summarize(settings: Settings, methods, store: Store, chosen: list[int], fractions, model: nn.Module, *,
              n_checked: int) -> dict:
    """Mean curves, AUCs (both modes) and timings per method over the chosen samples."""
    per_method = {}
    for name in methods:
        rows = [store.samples[(i, name)] for i in chosen if (i, name) in store.samples]
        rows = [r for r in rows if _complete(r, settings, model)]
        if not rows:
            continue
        mean = lambda curve: [sum(curve(r)[j] for r in rows) / len(rows) for j in range(len(fractions))]  # noqa: E731
        disruption, recovery = mean(lambda r: r["disruption"]), mean(lambda r: r["recovery"])
        paper = (mean(lambda r: _paper_curve(r, "disruption")), mean(lambda r: _paper_curve(r, "recovery")))
        per_method[name] = {
            "n_samples": len(rows),
            "seconds_per_sample": sum(r["seconds"] for r in rows) / len(rows),
            "eval_seconds_per_sample": sum(r["eval_seconds"] for r in rows) / len(rows),
            "disruption": disruption, "recovery": recovery,  # the clean protocol's mean curves
            "paper_disruption": paper[0], "paper_recovery": paper[1],  # the paper's protocol
            "auc": auc_summary(fractions, disruption, recovery, unit=settings.unit, paper=paper),
        }
    checked = [store.verdicts[i] for i in sorted(store.verdicts)]
    device = _unembedding(model).device
    return {
        "dataset": settings.dataset, "unit": settings.unit,
        "component_units": settings.component_units if settings.unit == "component" else None,
        "model": getattr(model.config, "_name_or_path", ""), "dtype": str(_unembedding(model).dtype),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "settings": {**asdict(settings), "weights": settings.weights.to_dict()},
        "fractions": list(fractions), "n_checked": n_checked, "n_valid": sum(r["valid"] for r in checked),
        "n_evaluated": len(chosen), "dropped": dict(Counter(r["reason"] for r in checked if not r["valid"])),
        "p_clean_mean": _mean([store.verdicts[i]["probability"] for i in chosen]),
        "methods": per_method,
    }


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


CSV_COLUMNS = ("method", "n_samples", "seconds_per_sample", "paper_disruption", "paper_recovery", "paper_total",
               "clean_disruption", "clean_recovery", "clean_total")


def table_rows(results: dict) -> list[dict]:
    """One row per method, best paper-mode total first."""
    rows = []
    for name, m in results["methods"].items():
        row = {"method": name, "n_samples": m["n_samples"], "seconds_per_sample": m["seconds_per_sample"]}
        for mode in ("paper", "clean"):
            for key in ("disruption", "recovery", "total"):
                row[f"{mode}_{key}"] = m["auc"][mode][key]
        rows.append(row)
    return sorted(rows, key=lambda r: -r["paper_total"])


def markdown_table(results: dict) -> str:
    head = (f"{results['dataset']}, {results['unit']} units"
            + (f" ({results['component_units']})" if results.get("component_units") else "")
            + f", {results['model']}: {results['n_evaluated']} samples "
            f"({results['n_valid']} valid of {results['n_checked']} checked)\n\n")
    lines = ["| method | total (paper) | disruption (paper) | recovery (paper) | total (clean) | s / sample |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in table_rows(results):
        lines.append(f"| {r['method']} | {r['paper_total']:.2f} | {r['paper_disruption']:.2f} | "
                     f"{r['paper_recovery']:.2f} | {r['clean_total']:.2f} | {r['seconds_per_sample']:.3f} |")
    return head + "\n".join(lines) + "\n"


def figure_files(results: dict, figures: bool = True) -> tuple[str, ...]:
    """The figures ``write_results`` writes: none when asked for none, or when no method has results."""
    return ("curves.png", "auc.png") if figures and results["methods"] else ()


def write_results(results: dict, out: Path, *, figures: bool = True) -> None:
    write_text(out / "results.json", json.dumps(results, indent=1) + "\n")  # each file atomically
    rows = [",".join(f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]) for c in CSV_COLUMNS)
            for r in table_rows(results)]
    write_text(out / "results.csv", "\n".join([",".join(CSV_COLUMNS), *rows]) + "\n")
    write_text(out / "results.md", markdown_table(results))
    if figure_files(results, figures):
        from .plots import plot_auc, plot_curves

        plot_curves(results, out / "curves.png")
        plot_auc(results, out / "auc.png")


def sweep_methods(settings: Settings, families, ps) -> tuple[dict[str, Callable], list[dict]]:
    """DPA under each (family, p): methods named by their weights (shared points run once)."""
    from ..baselines import dpa_component, dpa_input

    if isinstance(families, str) or not isinstance(families, (tuple, list)):
        raise InputTypeError(f"families must be a list of family names ({', '.join(PRESETS)}), got {families!r}")
    unknown = [f for f in families if f not in PRESETS]
    if unknown or not families:
        raise InputError(f"families must name one or more of {', '.join(PRESETS)}, got {list(families)!r}")
    if isinstance(ps, (str, bytes)) or not isinstance(ps, (tuple, list)) or not ps:
        raise InputTypeError(f"ps must be a non-empty list of numbers in [0, 1], got {ps!r}")
    ps = [check_float(f"ps[{i}]", p, low=0, high=1) for i, p in enumerate(ps)]
    base = dpa_input if settings.unit == "input" else dpa_component
    methods, points = {}, []
    for family in families:
        for p in ps:
            w = PathWeights.preset(family, p)
            name = "dpa[" + ",".join(f"{x:g}" for x in w.as_tuple()) + "]"
            methods[name] = functools.partial(base, weights=w)
            points.append({"family": family, "p": p, "weights": w.to_dict(), "method": name})
    return methods, points


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
        return _write_sweep(settings, results, points, Path(out), figures)


def _write_sweep(settings: Settings, results: dict, points: list[dict], out: Path, figures: bool) -> dict:
    for point in points:
        m = results["methods"].get(point["method"])
        point["auc"] = None if m is None else m["auc"]
    summary = {"dataset": settings.dataset, "unit": settings.unit, "model": results["model"],
               "n_evaluated": results["n_evaluated"], "points": points}
    write_text(out / "sweep.json", json.dumps(summary, indent=1) + "\n")
    lines = ["family,p,q,k,v,gate,up,paper_total,clean_total"]
    for pt in points:
        if pt["auc"] is None:
            continue
        w = ",".join(f"{pt['weights'][k]:g}" for k in ("query", "key", "value", "gate", "up"))
        lines.append(f"{pt['family']},{pt['p']:g},{w},{pt['auc']['paper']['total']:.6g},"
                     f"{pt['auc']['clean']['total']:.6g}")
    write_text(out / "sweep.csv", "\n".join(lines) + "\n")
    if figures:
        from .plots import plot_sweep

        plot_sweep(summary, out / "sweep.png")
    return summary
