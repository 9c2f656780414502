"""Attribute a file of prompts: batches of similar length, every result kept, resumable, data-parallel.

    dpa attribute --prompts prompts.jsonl --out runs/p        (torchrun --nproc-per-node N -m dpa ... splits it)
    dpa.attribute_file(model, tokenizer, "prompts.jsonl", "runs/p")  ->  summary dict
    dpa.read_results("runs/p")                ->  [dpa.Attribution, ...] in input order, each with .line and .id

Input: JSON lines ``{"prompt": ..., "target": ..., "contrast": ..., "position": ..., "id": ...}`` (all but the
prompt optional), or plain text, one prompt a line: the format given (``format=``, ``--format``), else the
extension's (``.jsonl`` / ``.ndjson`` / ``.json``, ``.txt``), else guessed, refused when the lines leave it open
(``read_prompts``). Lines end at "\\n" only. Every record is checked by the request step before any
attribution; a bad one (not JSON, no prompt, an empty prompt, a target that is not one token, ...) goes to
``errors.jsonl`` with its line number and is skipped, never attributed.

Output folder:

* ``scores/batch-NNNNNN.safetensors``: one file per batch, written to a temporary name and renamed, so it is
  whole or absent. It holds the token, head and neuron scores of the batch's prompts and, in its metadata,
  each prompt's record (id, line, tokens, target, logit, completeness gap, top components, ...). These files
  are the results: a run killed at any moment loses at most the batch in flight.
* ``results.jsonl`` (one line per prompt, input order), ``errors.jsonl`` and ``summary.json``: written
  atomically when the run ends, from the batch files.
* ``config.json``: the settings, the prompt file's sha256 and format, and the model's name, dtype and weights'
  fingerprint; a run started again with the same ``--out`` skips the batches that are there, and refuses other
  settings or other weights (a model folder overwritten since; ``dpa.locks``). A batch file that cannot be read
  (cut short, not a dpa file), of another run, or that does not hold its batch's prompts, each a whole record
  with scores of the right shapes, is refused by name (delete it to attribute its batch again), never merged.
* ``.dpa.lock``, while a run writes the folder: a second run on it is refused (``dpa.locks``).

The plan (which prompts form which batch) depends only on the input and the settings, not on how many
processes run it; under torchrun rank r takes batches r, r + N, ..., and rank 0 writes the merged files once
every rank is done, so the output is the same as one process's.

This module plans and attributes the batches; ``dpa.prompt_file`` reads the prompt file and ``dpa.batch_folder``
writes and reads the folder's files (``read_prompts`` and ``read_results`` are importable from here too).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from torch import nn

from . import distributed, locks, request
from .attribute import attribute
from .batch_folder import FORMAT, TENSORS, check_shards, merge, read_results, shard_name, write_shard
from .checks import check_bool, check_choice, check_int
from .errors import DPAError, InputError, InputTypeError
from .files import model_identity, run_folder, run_id
from .prompt_file import EXTENSIONS, FORMATS, PromptFile, Record, load_prompts, read_prompts
from .result import Attribution
from .weights import PathWeights

__all__ = [  # this module's own names, and those of its parts that were defined here before
    "EXTENSIONS", "FORMAT", "FORMATS", "Options", "PromptFile", "Record", "TENSORS", "attribute_file",
    "read_prompts", "read_results",
]


@dataclass(frozen=True)
class Options:
    """What every prompt of a run is attributed with (records may set their own target, contrast, position)."""

    target: str | int | None = None
    contrast: str | int | None = None
    kind: str = "logit"
    weights: PathWeights = PathWeights()
    multi_token: str = "error"
    batch_size: int = 8
    top: int = 10


def _plan(tokenizer, spec, records: list, opts: Options, errors: list) -> list[list]:
    """The batches of the good records, shortest first (grouped by length); each record the request step refuses
    (without the model) goes to ``errors`` instead, never attributed."""
    lengths: dict[int, int] = {}
    for r in records:
        try:
            enc = request.encode(tokenizer, spec, r.prompt, _or(r.target, opts.target),
                                 contrast=_or(r.contrast, opts.contrast), kind=opts.kind, position=r.position,
                                 multi_token=opts.multi_token, batch=False, multi_options=request.MULTI_TOKEN)
            lengths[r.line] = len(enc.rows[0])
        except DPAError as err:
            errors.append({"line": r.line, "id": r.id, "error": f"{type(err).__name__}: {err}"})
    good = sorted((r for r in records if r.line in lengths), key=lambda r: (lengths[r.line], r.line))
    return [good[i:i + opts.batch_size] for i in range(0, len(good), opts.batch_size)]


def attribute_file(model: nn.Module, tokenizer, prompts: str | os.PathLike, out: str | os.PathLike, *,
                   target: str | int | None = None, contrast: str | int | None = None, kind: str = "logit",
                   weights: PathWeights | None = None, multi_token: str = "error", batch_size: int = 8,
                   top: int = 10, progress: bool = True, format: str | None = None) -> dict:
    """Attribute every prompt of the file ``prompts`` into the folder ``out`` (see the module docstring).

    model, tokenizer: as in ``dpa.attribute``. prompts: a text file (one prompt a line) or JSON lines (one object
    a line: ``prompt``, and optionally ``id``, ``target``, ``contrast``, ``position``). out: the results folder (made if
    missing; a run started there before is resumed).
    target / contrast: for records that name none (default: the model's prediction, no contrast). kind, weights,
    multi_token: as in ``dpa.attribute``. progress: show a progress bar (default True).
    batch_size: prompts per forward and backward pass, grouped by length. top: components kept per prompt in
    ``results.jsonl`` (every score is in the batch files). format: ``"jsonl"`` or ``"text"`` (None: by the
    file's extension, else guessed; see ``read_prompts``). Returns the summary (also ``summary.json``).
    Under torchrun every rank calls this; each attributes its share, rank 0 writes the merged files.
    """
    opts = Options(target=target, contrast=contrast, kind=check_choice("kind", kind, ("logit", "logprob")),
                   weights=PathWeights() if weights is None else weights,
                   multi_token=check_choice("multi_token", multi_token, request.MULTI_TOKEN),
                   batch_size=check_int("batch_size", batch_size, low=1), top=check_int("top", top, low=0))
    if not isinstance(opts.weights, PathWeights):
        raise InputTypeError(f"weights must be a dpa.PathWeights, got {type(opts.weights).__name__}")
    progress = check_bool("progress", progress)
    spec = request.check_model(model)
    request.check_tokenizer(tokenizer)
    if tokenizer is None:
        raise InputError("attribute_file reads text prompts: it needs the tokenizer")
    loaded = load_prompts(prompts, format)
    records, errors = loaded.records, list(loaded.errors)
    n_prompts = len(records) + len(errors)  # every non-blank line but comments
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a folder (a str or path), got {type(out).__name__}")
    out = run_folder(out)
    group = distributed.current()
    identity = {"format": FORMAT, "prompts_sha256": loaded.sha256, "prompts_format": loaded.format,
                **model_identity(model, spec.unembed(model).weight.dtype, tokenizer), "target": opts.target,
                "contrast": opts.contrast, "kind": opts.kind, "weights": opts.weights.to_dict(),
                "multi_token": opts.multi_token, "batch_size": opts.batch_size, "top": opts.top}
    # one run at a time in the folder, and only the run it holds (rank 0 locks it for every rank)
    with locks.start(out, identity, group, legacy={"prompts_format": loaded.legacy_format}) as identity:
        run = run_id(identity)
        if group.main:
            (out / "scores").mkdir(exist_ok=True)
            for stale in (out / "scores").glob(".batch-*.tmp"):  # left by a killed run; no rank writes yet
                stale.unlink()
        group.barrier()
        plan = _plan(tokenizer, spec, records, opts, errors)
        done = check_shards(out, plan, run)  # every rank alike (read-only), so that a refusal stops them all
        mine = [(b, batch) for b, batch in enumerate(plan) if group.mine(b) and b not in done]
        from tqdm.auto import tqdm

        start = time.perf_counter()
        bar = tqdm(total=sum(len(batch) for _, batch in mine), unit="prompt", disable=not progress or not mine,
                   desc=f"attributing{f' (rank {group.rank} of {group.world})' if group.world > 1 else ''}")
        failed = None
        try:
            for b, batch in mine:
                write_shard(out / "scores" / shard_name(b), *_attribute_batch(model, tokenizer, batch, opts),
                             opts.top, run)
                bar.update(len(batch))
        except BaseException as err:  # noqa: BLE001  told to the other ranks, so that none waits for ever
            failed = err
        finally:
            bar.close()
        group.stop_together(failed)
        group.barrier()
        summary = None
        if group.main:
            summary = merge(out, n_prompts, errors, plan, identity, run, time.perf_counter() - start, group.world)
        group.barrier()
        return summary if summary is not None else json.loads((out / "summary.json").read_text())


def _or(value, default):
    return default if value is None else value


def _attribute_batch(model, tokenizer, batch: list[Record], opts: Options) -> tuple[list[tuple[Record, Attribution]],
                                                                                    list[dict]]:
    """One batch through ``dpa.attribute``; if the batch fails as a whole, each prompt alone, so that one bad
    prompt (say, one whose activations overflow) is an error of its own and the rest are attributed."""
    args = dict(kind=opts.kind, weights=opts.weights, multi_token=opts.multi_token)
    try:
        results = attribute(model, tokenizer, [r.prompt for r in batch],
                            [_or(r.target, opts.target) for r in batch],
                            contrast=[_or(r.contrast, opts.contrast) for r in batch],
                            position=[r.position for r in batch], **args)
        return list(zip(batch, results)), []
    except DPAError:
        if len(batch) == 1:
            raise
    done, errors = [], []
    for r in batch:
        try:
            done.append((r, attribute(model, tokenizer, r.prompt, _or(r.target, opts.target),
                                      contrast=_or(r.contrast, opts.contrast), position=r.position, **args)))
        except DPAError as err:
            errors.append({"line": r.line, "id": r.id, "error": f"{type(err).__name__}: {err}"})
    return done, errors
