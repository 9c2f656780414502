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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch import nn

from . import distributed, locks, request
from .attribute import attribute
from .checks import check_bool, check_choice, check_int
from .errors import DPAError, InputError, InputTypeError
from .files import decode_text, load_json, model_identity, run_folder, run_id, split_lines, write_bytes, write_text
from .result import Attribution
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


FORMATS = ("jsonl", "text")
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".txt": "text"}
BOM = "\ufeff"


@dataclass(frozen=True)
class PromptFile:
    """A prompt file as read: its records, the errors of its other lines, and what identifies it."""

    records: list[Record]
    errors: list[dict]
    sha256: str
    format: str  # jsonl or text, as read
    legacy_format: str  # what dpa before formats were explicit made of it (to resume a folder of then)


def read_prompts(path: str | os.PathLike, format: str | None = None) -> tuple[list[Record], list[dict]]:
    """The records of a prompt file and the errors of the lines that are not records.

    ``format``: ``"jsonl"`` (one JSON object a line) or ``"text"`` (one prompt a line); None: by the extension
    (``.jsonl``, ``.ndjson``, ``.json``: JSON lines; ``.txt``: text), else guessed from the lines: text when no
    line is a JSON object, JSON lines when every line is one (or a comment), refused when some are and some
    are not; a ``.csv`` or ``.tsv`` file is refused unless ``format`` is given; so is one JSON list, or one JSON
    object spread over several lines (pretty-printed), in JSON lines. A line ends at "\\r\\n", "\\r" or "\\n"
    (``files.split_lines``). Blank lines are skipped; in JSON lines, so
    are comment lines (``#`` or ``//`` first). A byte-order mark (U+FEFF) at the start of a line (a file joined to
    another) is dropped; one inside a text line is that line's error. The file must be UTF-8 text holding at least
    one prompt: anything else (compressed, UTF-16, empty) is refused naming the file (``files.decode_text``)."""
    loaded = _load_prompts(path, format)
    return loaded.records, loaded.errors


def _load_prompts(path, format: str | None) -> PromptFile:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"prompts must be the path of a file, got {type(path).__name__}")
    if format is not None:
        check_choice("format", format, FORMATS)
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise InputError(f"{str(path)!r} is not a regular file (a pipe, FIFO or device: /dev/stdin, <(...)): it can "
                         "be read only once, and a results folder resumes from the same file; save the prompts to a "
                         "file first")
    try:
        data = path.read_bytes()  # bytes: no newline translation (split_lines says where a line ends)
    except FileNotFoundError:
        raise InputError(f"no prompt file {str(path)!r}") from None
    except IsADirectoryError:
        raise InputError(f"{str(path)!r} is a folder; give a file of prompts (JSON lines or one prompt a line)") \
            from None
    except OSError as err:
        raise InputError(f"cannot read {str(path)!r}: {err.strerror or err}") from None
    text = decode_text(data, str(path))  # UTF-8, or what it is instead (compressed, UTF-16, empty) by name
    if format is None and path.suffix.lower() in (".csv", ".tsv"):  # guessed as text, a header row is a prompt
        raise InputError(f"{str(path)!r} is a {path.suffix} file; prompts are JSON lines (.jsonl, .ndjson, .json: "
                         "one object a line) or text (.txt: one prompt a line): convert it, or give --format text "
                         "(format='text') to attribute every line, a header too, as a prompt")
    lines = [ln.removeprefix(BOM) for ln in split_lines(text)]
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    legacy = "jsonl" if path.suffix.lower() in (".jsonl", ".json") or first.startswith("{") else "text"
    fmt = format or EXTENSIONS.get(path.suffix.lower()) or _guess_format(path, lines)
    if fmt == "jsonl" and first.startswith("[") and isinstance(_whole_json(text), list):
        raise InputError(f"{str(path)!r} holds one JSON list; a prompt file holds one JSON object a line "
                         f"(JSON lines): write each record on a line of its own")
    spread = _object_lines(text) if fmt == "jsonl" and first.startswith("{") else 1
    if spread > 1:  # else one "not valid JSON" error a line, and nothing attributed
        raise InputError(f"{str(path)!r} holds a JSON object spread over several lines (pretty-printed: its first "
                         f"record takes {spread} lines); a prompt file holds one JSON object a line (JSON lines): "
                         f"write each record on one line (e.g. jq -c . FILE)")
    records, errors, named = [], [], set()  # named: the lines whose record gives an id
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        if fmt == "text":
            if BOM in raw:
                errors.append({"line": n, "id": str(n), "error": "a byte-order mark (U+FEFF, invisible) inside the "
                               "line; remove it (U+2060 is the word joiner), or give the prompt as JSON"})
            else:
                records.append(Record(line=n, id=str(n), prompt=raw))
            continue
        if raw.lstrip().startswith(("#", "//")):  # no JSON value starts so: a comment line
            continue
        try:
            row = load_json(raw, "the line")  # dpa's one JSON reader: a key twice in a record is refused
        except InputError as err:
            errors.append({"line": n, "error": str(err)})
            continue
        problem = _record_problem(row)
        if problem:
            errors.append({"line": n, "id": str(row.get("id", n)) if isinstance(row, dict) else str(n),
                           "error": problem})
            continue
        records.append(Record(line=n, id=str(row.get("id", n)), prompt=row["prompt"], target=row.get("target"),
                              contrast=row.get("contrast"), position=row.get("position")))
        if "id" in row:
            named.add(n)
    if not records and not errors:
        raise InputError(f"{str(path)!r} holds no prompts (only blank or comment lines)")
    first: dict[str, Record] = {}
    for r in records:
        if r.id in first:  # a record without an id is named by its line number: say so, it may be the clash
            a, b = (f"line {x.line}" + ("" if x.line in named else " (no \"id\": named by its line number)")
                    for x in (first[r.id], r))
            raise InputError(f"{str(path)!r}: {a} and {b} have the same id {r.id!r} (ids are compared as text); give "
                             f"each record an id of its own")
        first[r.id] = r
    return PromptFile(records, errors, hashlib.sha256(data).hexdigest(), fmt, legacy)


def _guess_format(path: Path, lines: list[str]) -> str:
    """The format of a file whose extension says none: text when no line is a JSON object, JSON lines when every
    non-blank line is one or a comment; anything else is refused (which is meant cannot be told)."""
    kinds = [_line_kind(ln) for ln in lines if ln.strip()]
    if "object" not in kinds:
        return "text"
    if all(k in ("object", "comment") for k in kinds):
        return "jsonl"
    n = next(i for i, ln in enumerate(lines, start=1) if ln.strip() and _line_kind(ln) == "other")
    raise InputError(f"cannot tell whether {str(path)!r} is JSON lines or text: some lines are JSON objects, line "
                     f"{n} is not; give the format (--format jsonl or --format text; format= in Python), or name "
                     f"the file .jsonl or .txt")


def _line_kind(line: str) -> str:
    stripped = line.strip()
    if stripped.startswith(("#", "//")):
        return "comment"
    if stripped.startswith("{"):
        try:
            return "object" if isinstance(json.loads(stripped), dict) else "other"
        except json.JSONDecodeError:
            pass
    return "other"


def _object_lines(text: str) -> int:
    """The number of lines the first JSON value of ``text`` takes, when it is an object (else 0). A JSON string
    holds no line end, so an object of JSON lines takes one; a pretty-printed one several."""
    text = text.removeprefix(BOM).lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):  # JSONDecodeError, an integer of over 4300 digits, nested too deeply
        return 0
    return len(split_lines(text[:end])) if isinstance(value, dict) else 0


def _whole_json(text: str) -> Any:
    """The JSON value the whole text is (None when it is not one: JSON lines fail at their second line)."""
    try:
        return json.loads(text.removeprefix(BOM))
    except (ValueError, RecursionError):  # JSONDecodeError, an integer of over 4300 digits, nested too deeply
        return None


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
    loaded = _load_prompts(prompts, format)
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
        done = _check_shards(out, plan, run)  # every rank alike (read-only), so that a refusal stops them all
        mine = [(b, batch) for b, batch in enumerate(plan) if group.mine(b) and b not in done]
        from tqdm.auto import tqdm

        start = time.perf_counter()
        bar = tqdm(total=sum(len(batch) for _, batch in mine), unit="prompt", disable=not progress or not mine,
                   desc=f"attributing{f' (rank {group.rank} of {group.world})' if group.world > 1 else ''}")
        failed = None
        try:
            for b, batch in mine:
                _write_shard(out / "scores" / _shard_name(b), *_attribute_batch(model, tokenizer, batch, opts),
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
            summary = _merge(out, n_prompts, errors, plan, identity, run, time.perf_counter() - start, group.world)
        group.barrier()
        return summary if summary is not None else json.loads((out / "summary.json").read_text())


def _or(value, default):
    return default if value is None else value


def _shard_name(b: int) -> str:
    return f"batch-{b:06d}.safetensors"


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


def _write_shard(path: Path, done: list[tuple[Record, Attribution]], errors: list[dict], top: int,
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
    The one reader of batch files: resume (``_check_shards``), merge and ``read_results`` all read through it."""
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
        try:
            _attribution(r, {"token_scores": [0.0] * len(r["tokens"]), "head_scores": [[]] * got["head_scores"][0],
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


def _check_shards(out: Path, plan: list[list[Record]], run: str) -> set[int]:
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


def _merge(out: Path, n_prompts: int, errors: list[dict], plan: list[list[Record]], identity: dict, run: str,
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
