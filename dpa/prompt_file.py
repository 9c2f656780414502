"""A prompt file read (``dpa.batch``'s input): its records, the errors of its other lines, and what identifies it.

JSON lines or plain text, by the format given, else the extension's, else guessed (``read_prompts``); a
line that is not a record (blank and comment lines aside) is an error of its own, with its line number, never
attributed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checks import check_choice
from .errors import InputError, InputTypeError
from .files import decode_text, load_json, split_lines


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
    loaded = load_prompts(path, format)
    return loaded.records, loaded.errors


def load_prompts(path, format: str | None) -> PromptFile:
    """The prompt file at ``path`` as read (``read_prompts``), with its sha256 and format."""
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
