"""Attribute a file of prompts: batches of similar length, every result kept, resumable, data-parallel.

    dpa attribute --prompts prompts.jsonl --out runs/p        (torchrun --nproc-per-node N -m dpa ... splits it)
    dpa.attribute_file(model, tokenizer, "prompts.jsonl", "runs/p")  ->  summary dict
    dpa.read_results("runs/p")                                      ->  [dpa.Attribution, ...] in input order

Input: JSON lines ``{"prompt": ..., "target": ..., "contrast": ..., "position": ..., "id": ...}`` (all but the
prompt optional), or plain text, one prompt a line. Every record is checked by the request step before any
attribution; a bad one (not JSON, no prompt, an empty prompt, a target that is not one token, ...) goes to
``errors.jsonl`` with its line number and is skipped, never attributed.

Output folder:

* ``scores/batch-NNNNNN.safetensors``: one file per batch, written to a temporary name and renamed, so it is
  whole or absent. It holds the token, head and neuron scores of the batch's prompts and, in its metadata,
  each prompt's record (id, line, tokens, target, logit, completeness gap, top components, ...). These files
  are the results: a run killed at any moment loses at most the batch in flight.
* ``results.jsonl`` (one line per prompt, input order), ``errors.jsonl`` and ``summary.json``: written
  atomically when the run ends, from the batch files.
* ``config.json``: the settings; a run started again with the same ``--out`` skips the batches that are
  there, and refuses other settings.

The plan (which prompts form which batch) depends only on the input and the settings, not on how many
processes run it; under torchrun rank r takes batches r, r + N, ..., and rank 0 writes the merged files once
every rank is done, so the output is the same as one process's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from torch import nn

from . import distributed, request
from .attribute import attribute
from .checks import check_bool, check_choice, check_int
from .errors import DPAError, InputError, InputTypeError
from .result import Attribution, check_run_config, model_identity, publish, run_folder, write_text
from .weights import PathWeights

TENSORS = ("token_scores", "head_scores", "neuron_scores")
FORMAT = "dpa-batch-1"


@dataclass(frozen=True)
class Record:
    """One prompt of the input file."""

    line: int  # 1-based line number in the file
    id: str
    prompt: str
    target: str | int | None = None
    contrast: str | int | None = None
    position: int | None = None


def read_prompts(path: str | os.PathLike) -> tuple[list[Record], list[dict]]:
    """The records of a prompt file and the errors of the lines that are not records.

    JSON lines when the file ends in ``.jsonl`` / ``.json`` or its first non-blank line starts with ``{``;
    otherwise plain text, one prompt a line. Blank lines are skipped."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"prompts must be the path of a file, got {type(path).__name__}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"no prompt file {str(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"{str(path)!r} is a folder; give a file of prompts (JSON lines or one prompt a line)") \
            from None
    except UnicodeDecodeError as err:
        raise InputError(f"{str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise InputError(f"cannot read {str(path)!r}: {err.strerror or err}") from None
    lines = text.splitlines()
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    jsonl = path.suffix.lower() in (".jsonl", ".json") or first.startswith("{")
    records, errors = [], []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if not jsonl:
            records.append(Record(line=n, id=str(n), prompt=raw))
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as err:
            errors.append({"line": n, "error": f"not valid JSON ({err.msg} at column {err.colno})"})
            continue
        problem = _record_problem(row)
        if problem:
            errors.append({"line": n, "id": str(row.get("id", n)) if isinstance(row, dict) else str(n),
                           "error": problem})
            continue
        records.append(Record(line=n, id=str(row.get("id", n)), prompt=row["prompt"], target=row.get("target"),
                              contrast=row.get("contrast"), position=row.get("position")))
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"{str(path)!r}: the id {dup!r} is used by more than one record; ids must be unique")
    return records, errors


def _record_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a record must be a JSON object with a \"prompt\", got {type(row).__name__}"
    unknown = sorted(set(row) - {"prompt", "target", "contrast", "position", "id"})
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}; a record has prompt, target, contrast, position and id"
    if not isinstance(row.get("prompt"), str):
        return "a record needs a \"prompt\" string"
    for key in ("target", "contrast"):
        if row.get(key) is not None and (isinstance(row[key], bool) or not isinstance(row[key], (str, int))):
            return f"{key} must be a token string or an int id, got {row[key]!r}"
    if row.get("position") is not None and (isinstance(row["position"], bool) or not isinstance(row["position"], int)):
        return f"position must be an int, got {row['position']!r}"
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        return f"id must be a string or an int, got {row['id']!r}"
    return None


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


def attribute_file(model: nn.Module, tokenizer, prompts: str | os.PathLike, out: str | os.PathLike, *,
                   target: str | int | None = None, contrast: str | int | None = None, kind: str = "logit",
                   weights: PathWeights | None = None, multi_token: str = "error", batch_size: int = 8,
                   top: int = 10, progress: bool = True) -> dict:
    """Attribute every prompt of the file ``prompts`` into the folder ``out`` (see the module docstring).

    target / contrast: for records that name none (default: the model's prediction, no contrast).
    batch_size: prompts per forward and backward pass, grouped by length. top: components kept per prompt in
    ``results.jsonl`` (every score is in the batch files). Returns the summary (also ``summary.json``).
    Under torchrun every rank calls this; each attributes its share, rank 0 writes the merged files.
    """
    opts = Options(target=target, contrast=contrast, kind=check_choice("kind", kind, ("logit", "logprob")),
                   weights=PathWeights() if weights is None else weights,
                   multi_token=check_choice("multi_token", multi_token, ("error", "first")),
                   batch_size=check_int("batch_size", batch_size, low=1), top=check_int("top", top, low=0))
    if not isinstance(opts.weights, PathWeights):
        raise InputTypeError(f"weights must be a dpa.PathWeights, got {type(opts.weights).__name__}")
    progress = check_bool("progress", progress)
    spec = request.check_model(model)
    request.check_tokenizer(tokenizer)
    if tokenizer is None:
        raise InputError("attribute_file reads text prompts: it needs the tokenizer")
    records, errors = read_prompts(prompts)
    n_prompts = len(records) + len(errors)  # every non-blank line
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a folder (a str or path), got {type(out).__name__}")
    out = run_folder(out)
    group = distributed.current()
    identity = {"format": FORMAT, "prompts_sha256": _sha256(Path(prompts)),
                **model_identity(model, spec.unembed(model).weight.dtype), "target": opts.target,
                "contrast": opts.contrast, "kind": opts.kind, "weights": opts.weights.to_dict(),
                "multi_token": opts.multi_token, "batch_size": opts.batch_size, "top": opts.top}
    if group.main:
        check_run_config(out, identity)
        (out / "scores").mkdir(exist_ok=True)
        for stale in (out / "scores").glob(".batch-*.tmp"):  # left by a killed run; no rank writes yet
            stale.unlink()
    group.barrier()
    lengths: dict[int, int] = {}
    for r in records:  # the request step, without the model: a bad record is reported, never attributed
        try:
            enc = request.encode(tokenizer, spec, r.prompt, _or(r.target, opts.target),
                                 contrast=_or(r.contrast, opts.contrast), kind=opts.kind, position=r.position,
                                 multi_token=opts.multi_token, batch=False)
            lengths[r.line] = len(enc.rows[0])
        except DPAError as err:
            errors.append({"line": r.line, "id": r.id, "error": f"{type(err).__name__}: {err}"})
    good = sorted((r for r in records if r.line in lengths), key=lambda r: (lengths[r.line], r.line))
    plan = [good[i:i + opts.batch_size] for i in range(0, len(good), opts.batch_size)]
    done = {p.name for p in (out / "scores").glob("batch-*.safetensors")}
    mine = [(b, batch) for b, batch in enumerate(plan) if group.mine(b) and _shard_name(b) not in done]
    from tqdm.auto import tqdm

    start = time.perf_counter()
    bar = tqdm(total=sum(len(batch) for _, batch in mine), unit="prompt", disable=not progress or not mine,
               desc=f"attributing{f' (rank {group.rank} of {group.world})' if group.world > 1 else ''}")
    failed = None
    try:
        for b, batch in mine:
            _write_shard(out / "scores" / _shard_name(b), *_attribute_batch(model, tokenizer, batch, opts), opts.top)
            bar.update(len(batch))
    except BaseException as err:  # noqa: BLE001  told to the other ranks, so that none waits for ever
        failed = err
    finally:
        bar.close()
    if not group.all_ok(failed is None):
        if failed is not None:
            raise failed
        raise InputError("another rank of this torchrun failed; see its message")
    group.barrier()
    summary = None
    if group.main:
        summary = _merge(out, n_prompts, errors, plan, identity, time.perf_counter() - start, group.world)
    group.barrier()
    return summary if summary is not None else json.loads((out / "summary.json").read_text())


def _or(value, default):
    return default if value is None else value


def _shard_name(b: int) -> str:
    return f"batch-{b:06d}.safetensors"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


def _meta(r: Record, res: Attribution, top: int) -> dict:
    """The JSON record of one result: everything but the score tensors, plus its id, line and top components."""
    data = {k: v for k, v in res.to_dict().items() if k not in TENSORS and k not in (
        "edge_scores", "neuron_position_scores", "effective_targets")}
    comps = res.top_components(top) if top else {"positive": [], "negative": []}
    return {"id": r.id, "line": r.line, **data,
            "top_components": {sign: [c._asdict() for c in cs] for sign, cs in comps.items()}}


def _write_shard(path: Path, done: list[tuple[Record, Attribution]], errors: list[dict], top: int) -> None:
    """The batch's tensors and records in one safetensors file, written whole or not at all."""
    from safetensors.torch import save_file

    tensors = {f"{r.line}/{name}": getattr(res, name).detach().cpu().contiguous() for r, res in done
               for name in TENSORS}
    meta = {"format": FORMAT, "records": json.dumps([_meta(r, res, top) for r, res in done]),
            "errors": json.dumps(errors)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read_shard(path: Path) -> tuple[list[dict], list[dict], Any]:
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    meta = handle.metadata() or {}
    if meta.get("format") != FORMAT:
        raise InputError(f"{path} is not a dpa batch file")
    return json.loads(meta["records"]), json.loads(meta["errors"]), handle


def _merge(out: Path, n_prompts: int, errors: list[dict], plan: list[list[Record]], identity: dict,
           seconds: float, world: int) -> dict:
    """Rank 0, once every rank is done: results.jsonl in input order, errors.jsonl, summary.json."""
    rows, late = [], []
    for path in sorted((out / "scores").glob("batch-*.safetensors")):
        r, e, _ = _read_shard(path)
        rows += [{**x, "file": f"scores/{path.name}"} for x in r]
        late += e
    rows.sort(key=lambda x: x["line"])
    every = sorted(errors + late, key=lambda x: x["line"])
    write_text(out / "results.jsonl", "".join(json.dumps(x) + "\n" for x in rows))
    write_text(out / "errors.jsonl", "".join(json.dumps(x) + "\n" for x in every))
    summary = {"prompts": n_prompts, "attributed": len(rows), "errors": len(every), "batches": len(plan),
               "processes": world, "seconds_this_run": round(seconds, 3), "settings": identity}
    write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def read_results(out: str | os.PathLike) -> list[Attribution]:
    """The results of ``attribute_file`` (or ``dpa attribute --prompts``) in ``out``, as ``dpa.Attribution``s in
    input order. Reads the batch files, so it works on a run that was interrupted (what is there so far)."""
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a results folder (a str or path), got {type(out).__name__}")
    folder = Path(out) / "scores"
    if not folder.is_dir():
        raise InputError(f"{str(out)!r} holds no dpa batch results (no scores/ folder)")
    keep = {f.name for f in fields(Attribution)} | {"score_dtype"}
    found = []
    for path in sorted(folder.glob("batch-*.safetensors")):
        rows, _, handle = _read_shard(path)
        for row in rows:
            data = {k: v for k, v in row.items() if k in keep}
            data.update({name: handle.get_tensor(f"{row['line']}/{name}").tolist() for name in TENSORS})
            found.append((row["line"], Attribution.from_dict(data)))
    return [res for _, res in sorted(found, key=lambda x: x[0])]
