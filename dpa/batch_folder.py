"""A batch run's results folder (``dpa.batch``): its batch files written whole and read back checked, merged
into ``results.jsonl`` / ``errors.jsonl`` / ``summary.json``, and read as results (``read_results``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from . import locks
from .errors import InputError, InputTypeError
from .files import run_id, write_bytes, write_text
from .prompt_file import Record
from .result import Attribution

TENSORS = ("token_scores", "head_scores", "neuron_scores")
FORMAT = "dpa-batch-1"


def shard_name(b: int) -> str:
    """The name of batch ``b``'s file in ``scores/``."""
    return f"batch-{b:06d}.safetensors"


def _meta(r: Record, res: Attribution, top: int) -> dict:
    """The JSON record of one result: everything but the score tensors, plus its id, line and top components."""
    data = {k: v for k, v in res.to_dict().items() if k not in TENSORS and k not in (
        "edge_scores", "neuron_position_scores", "effective_targets")}
    comps = res.top_components(top) if top else {"positive": [], "negative": []}
    return {"id": r.id, "line": r.line, **data,
            "top_components": {sign: [c._asdict() for c in cs] for sign, cs in comps.items()}}


def write_shard(path: Path, done: list[tuple[Record, Attribution]], errors: list[dict], top: int,
                run: str) -> None:
    """The batch's tensors and records in one safetensors file, written whole or not at all."""
    from safetensors.torch import save

    tensors = {f"{r.line}/{name}": getattr(res, name).detach().cpu().contiguous() for r, res in done
               for name in TENSORS}
    meta = {"format": FORMAT, "run": run, "records": json.dumps([_meta(r, res, top) for r, res in done]),
            "errors": json.dumps(errors)}
    write_bytes(path, save(tensors, metadata=meta))


SHARD = re.compile(r"batch-(\d{6})\.safetensors")
WHAT_TO_DO = "delete it (its batch is attributed again when the run is resumed) or use a new --out folder"


def _shard_files(out: Path) -> dict[int, Path]:
    """The batch files of ``out/scores`` by batch number; a file named like one but not as dpa names them is
    refused."""
    found = {}
    for path in sorted((out / "scores").glob("batch-*.safetensors")):
        m = SHARD.fullmatch(path.name)
        if m is None:
            raise InputError(f"{path} is not a file dpa writes (batch-NNNNNN.safetensors); move it out of the folder")
        found[int(m.group(1))] = path
    return found


def _read_shard(path: Path, run: str | None = None, lines: list[int] | None = None,
                shapes: list | None = None) -> tuple[list[dict], list[dict], Any]:
    """A batch file's records, errors and open handle, each checked: readable, dpa's, of ``run`` (when the file
    says), holding the prompts of ``lines`` (when given), each record whole (what ``read_results`` makes a
    ``dpa.Attribution`` of: an edited or damaged one fails here, by file and line, on resume as on reading), a
    tensor for each score, token scores one a token, head and neuron scores in two dimensions (their shapes
    appended to ``shapes``, for ``_check_shapes``). Anything else: ``InputError`` naming the file and what to do.
    The one reader of batch files: resume (``check_shards``), merge and ``read_results`` all read through it."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        meta = handle.metadata() or {}
    except Exception as err:  # noqa: BLE001  safetensors' own error (no subclass of OSError) or an OSError
        raise InputError(f"{path} cannot be read ({' '.join(str(err).split())}): it was cut short or is not a dpa "
                         f"batch file; {WHAT_TO_DO}") from None
    if meta.get("format") != FORMAT:
        raise InputError(f"{path} is not a dpa batch file (format {meta.get('format')!r}, not {FORMAT!r}); "
                         f"move it out of the folder")
    if run is not None and meta.get("run", run) != run:  # files of dpa before run names are checked below only
        raise InputError(f"{path} is a batch of another run (run {meta['run']}, this folder's is {run}): copied "
                         f"from another folder, or left by other settings; {WHAT_TO_DO}")
    try:
        records, errors = json.loads(meta["records"]), json.loads(meta["errors"])
    except (KeyError, TypeError, json.JSONDecodeError):
        records = errors = None
    if not (isinstance(records, list) and isinstance(errors, list) and all(
            isinstance(x, dict) and isinstance(x.get("line"), int) for x in records + errors) and all(
            isinstance(r.get("tokens"), list) and isinstance(r.get("id"), str) and isinstance(
                r.get("top_components"), dict) for r in records) and all(
            isinstance(e.get("error"), str) for e in errors)):
        raise InputError(f"{path}: its records are damaged; {WHAT_TO_DO}")
    held = sorted(x["line"] for x in records + errors)
    if lines is not None and held != sorted(lines):
        raise InputError(f"{path} holds the prompts of lines {_span(held)}, but this run's batch of that number is "
                         f"lines {_span(sorted(lines))}: a file of another run; {WHAT_TO_DO}")
    keys = set(handle.keys())
    for r in records:
        got = {}
        for name in TENSORS:
            key = f"{r['line']}/{name}"
            shape = got[name] = tuple(handle.get_slice(key).get_shape()) if key in keys else None
            if shape is None:
                raise InputError(f"{path}: the {name} of line {r['line']} are missing; {WHAT_TO_DO}")
            if name == "token_scores" and shape != (len(r["tokens"]),):
                raise InputError(f"{path}: the token_scores of line {r['line']} are of shape {list(shape)}, not "
                                 f"[{len(r['tokens'])}] (one a token); {WHAT_TO_DO}")
            if name != "token_scores" and len(shape) != 2:
                raise InputError(f"{path}: the {name} of line {r['line']} are of shape {list(shape)}, not "
                                 f"[layers, units]; {WHAT_TO_DO}")
            if shapes is not None and name != "token_scores":
                shapes.append((path, r["line"], name, shape))
        d = r.get("d_expert")  # the neuron scores' width matters to d_expert alone: no bigger stand-in is built
        width = d if isinstance(d, int) and 0 < d <= got["neuron_scores"][1] else 0
        heads = got["head_scores"][1] if r.get("beside") is not None else 0  # (a row's width matters to beside:
        try:  # the column its units start from, Falcon-H1's)
            _attribution(r, {"token_scores": [0.0] * len(r["tokens"]),
                             "head_scores": [[0.0] * heads] * got["head_scores"][0],
                             "neuron_scores": [[0.0] * width] * got["neuron_scores"][0]})
        except InputError as err:
            raise InputError(f"{path}: the record of line {r['line']} is damaged ({err}); {WHAT_TO_DO}") from None
    return records, errors, handle


KEEP = frozenset({f.name for f in fields(Attribution)} | {"score_dtype"})  # a record's fields of a result


def _attribution(record: dict, scores: dict) -> Attribution:
    """The ``dpa.Attribution`` of a batch file's record and its ``scores`` (nested lists, by name)."""
    return Attribution.from_dict({**{k: v for k, v in record.items() if k in KEEP}, **scores})


def _check_shapes(shapes: list) -> None:
    """Head (and neuron) scores of one shape in every batch file: a file whose shape is not the most common one
    is refused by name (both files named, when two disagree alone)."""
    from collections import Counter

    for name in ("head_scores", "neuron_scores"):
        seen = [(path, line, shape) for path, line, n, shape in shapes if n == name]
        counts = Counter(shape for _, _, shape in seen).most_common()
        if len(counts) < 2:
            continue
        common = counts[0][0]
        path, line, shape = next(x for x in seen if x[2] != common)
        if counts[0][1] == counts[1][1]:
            first = next(x for x in seen if x[2] == common)
            raise InputError(f"{first[0]} and {path} disagree: the {name} of line {first[1]} are of shape "
                             f"{list(common)}, those of line {line} {list(shape)}; one is damaged or of another "
                             f"run: delete it (its batch is attributed again when the run is resumed)")
        raise InputError(f"{path}: the {name} of line {line} are of shape {list(shape)}, not {list(common)} as in "
                         f"the other batch files; {WHAT_TO_DO}")


def _span(lines: list[int]) -> str:
    return ", ".join(map(str, lines[:6])) + (", ..." if len(lines) > 6 else "") if lines else "none"


def check_shards(out: Path, plan: list[list[Record]], run: str) -> set[int]:
    """The batches of ``plan`` already in ``out/scores``, each file checked (``_read_shard``); a file of no batch
    of the plan is refused."""
    shapes: list = []
    done = set()
    for b, path in _shard_files(out).items():
        if b >= len(plan):
            raise InputError(f"{path} is batch {b}, but this run has {len(plan)} batches: a file of another run; "
                             f"{WHAT_TO_DO}")
        _read_shard(path, run, [r.line for r in plan[b]], shapes)
        done.add(b)
    _check_shapes(shapes)
    return done


def merge(out: Path, n_prompts: int, errors: list[dict], plan: list[list[Record]], identity: dict, run: str,
          seconds: float, world: int) -> dict:
    """Rank 0, once every rank is done: results.jsonl in input order, errors.jsonl, summary.json."""
    rows, late = [], []
    shapes: list = []
    for b, path in _shard_files(out).items():
        if b >= len(plan):
            raise InputError(f"{path} is batch {b}, but this run has {len(plan)} batches: a file of another run; "
                             f"{WHAT_TO_DO}")
        r, e, _ = _read_shard(path, run, [x.line for x in plan[b]], shapes)
        rows += [{**x, "file": f"scores/{path.name}"} for x in r]
        late += e
    _check_shapes(shapes)
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
    input order. Reads the batch files, so it works on a run that was interrupted (what is there so far).

    A prompt that was refused (``errors.jsonl``) or not attributed yet has no result, so the list is not one
    result per line of the prompt file: each result says which prompt it is, ``res.line`` (the 1-based line of
    the prompt file) and ``res.id`` (the record's ``"id"``, as text; its line number, as text, when it has none).
    Match results to prompts by them, e.g. ``{res.id: res for res in read_results(out)}``, never by position.
    (``line`` and ``id`` are attributes of the object read, not fields: ``to_json`` does not write them.)"""
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"out must be a results folder (a str or path), got {type(out).__name__}")
    folder = Path(out) / "scores"
    if not folder.is_dir():
        raise InputError(f"{str(out)!r} holds no dpa batch results (no scores/ folder)")
    run, shards, shapes, where = _folder_run(Path(out)), [], [], {}
    for path in _shard_files(Path(out)).values():  # every file checked before any is read
        rows, _, handle = _read_shard(path, run, shapes=shapes)
        for row in rows:
            if row["line"] in where:
                raise InputError(f"{where[row['line']]} and {path} both hold line {row['line']}: one is a file of "
                                 f"another run; delete it, or read a folder of one run")
            where[row["line"]] = path
        shards.append((rows, handle))
    _check_shapes(shapes)
    found = []
    for rows, handle in shards:
        for row in rows:
            res = _attribution(row, {name: handle.get_tensor(f"{row['line']}/{name}").tolist() for name in TENSORS})
            res.line, res.id = row["line"], row["id"]
            found.append(res)
    return sorted(found, key=lambda res: res.line)


def _folder_run(out: Path) -> str | None:
    """The run name of the folder's config.json (None if it has none that reads)."""
    config = locks.folder_config(out)
    return None if config is None else run_id(config)
