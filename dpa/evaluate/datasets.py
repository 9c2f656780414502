"""The benchmark data: the four JSON files of the DPA paper's evaluation, read-only.

``load_examples("known_1000")`` finds the data folder (``data_dir`` argument, else ``$DPA_DATA``,
else ``../shared/data`` next to the repository or the working directory) and turns each record into
an ``Example``: the prompt (raw text or chat turns), the answer whose first token is the target and,
for IOI, the contrast name. ``"ioi_templates"`` is IOI generated from templates (ioi.py).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .ioi import generate_ioi
from ..errors import DPAError, InputError

DATASETS = ("known_1000", "ioi", "squad_v2.0", "imdb")
GENERATED = ("ioi_templates",)
CHAT_DATASETS = ("squad_v2.0", "imdb")  # prompts with an instruction, a user turn and "Answer:" (the rest: raw text)
FILES = {name: f"{name}.json" for name in DATASETS}

SQUAD_SYSTEM = ("Answer the question using the context. Reply with the answer only: a short phrase copied "
                "from the context.")
IMDB_SYSTEM = "You are a sentiment classifier. Read the movie review and answer Positive or Negative."


class DataError(DPAError, FileNotFoundError):
    """The benchmark data is missing or not in the reference format."""


@dataclass(frozen=True)
class Example:
    """One benchmark record, ready to tokenise (prompts.py)."""

    id: str
    answer: str  # the target is the first token of " " + answer
    contrast: str | None = None  # IOI: the subject name (the natural foil)
    text: str | None = None  # raw-text prompt (Known 1000, IOI)
    system: str | None = None  # chat prompt (SQuAD, IMDb): system turn
    user: str | None = None  # user turn: the context (and the question) with their labels
    prefill: str | None = None  # continued assistant turn
    units: str | None = None  # the part of the user turn whose tokens are the units: the paragraph (SQuAD) or the
    # review (IMDb), as the reference data says ("the context is the paragraph"); None: the whole user turn

    @property
    def chat(self) -> bool:
        return self.text is None


def find_data_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding the data files; raises ``DataError`` saying where to get them."""
    if data_dir is not None:
        path = Path(data_dir).expanduser()
        if not path.is_dir():
            raise DataError(f"--data-dir {path} is not a folder")
        return path
    if os.environ.get("DPA_DATA"):
        return find_data_dir(os.environ["DPA_DATA"])
    repo = Path(__file__).resolve().parents[2]  # the folder holding the dpa package
    tried = list(dict.fromkeys([repo.parent / "shared" / "data", Path.cwd().resolve().parent / "shared" / "data"]))
    for path in tried:
        if path.is_dir():
            return path
    raise DataError(
        "benchmark data not found (looked in " + ", ".join(map(str, tried)) + "). The four files "
        "known_1000.json, ioi.json, squad_v2.0.json and imdb.json are the ones published with the DPA paper's "
        "reference code (Jantsch et al., arXiv 2603.19742); put them in a folder and pass --data-dir DIR "
        "(or set DPA_DATA)")


def load_records(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """The raw records of one data file."""
    if not isinstance(name, str) or name not in FILES:
        raise InputError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    path = find_data_dir(data_dir) / FILES[name]
    if not path.is_file():
        raise DataError(f"{path} does not exist; the folder must hold {FILES[name]}")
    try:
        with open(path, encoding="utf-8-sig") as fh:  # a byte-order mark is not part of the JSON
            records = json.load(fh)
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    if not isinstance(records, list):
        raise DataError(f"{path} must hold a JSON list of records, got a {type(records).__name__}")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataError(f"{path}: record {bad} is a {type(records[bad]).__name__}, not an object with the "
                        f"dataset's fields")
    return records


def subject_name(prompt: str, answer: str) -> str:
    """IOI's subject (S): the capitalised name used twice in the prompt, other than the answer."""
    counts = Counter(re.findall(r"\b[A-Z][a-z]+\b", prompt))
    names = [w for w, n in counts.items() if n >= 2 and w != answer]
    if len(names) != 1:
        raise DataError(f"cannot find the IOI subject in {prompt!r}: candidates {names}")
    return names[0]


def _example(name: str, r: dict) -> Example:
    field = lambda key: _field(r, key, name)  # noqa: E731
    if name == "known_1000":
        return Example(id=str(r.get("known_id", "")), answer=field("attribute"), text=field("prompt"))
    if name in ("ioi", "ioi_templates"):
        prompt, answer = field("prompt"), field("answer")
        contrast = r.get("contrast") or subject_name(prompt, answer)
        return Example(id=str(r.get("case_id", "")), answer=answer, contrast=contrast, text=prompt)
    if name == "squad_v2.0":
        return Example(id=str(r.get("id", "")), answer=field("answer"), system=SQUAD_SYSTEM,
                       user=f"Context: {field('context')}\nQuestion: {field('question')}", prefill="Answer:",
                       units=field("context"))
    if name == "imdb":
        return Example(id=str(r.get("id", "")), answer=field("answer"), system=IMDB_SYSTEM,
                       user=f"Review: {field('text')}", prefill="Answer:", units=field("text"))
    raise InputError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS + GENERATED)}")


def _field(record: dict, key: str, name: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        raise DataError(f"a {name} record has no {key!r} text: {str(record)[:200]}")
    return value


def load_examples(name: str, data_dir: str | Path | None = None, *, seed: int = 0,
                  n_generated: int = 1000) -> list[Example]:
    """The examples of a dataset, in file order (``ioi_templates``: ``n_generated`` seeded prompts)."""
    if not isinstance(name, str) or name not in DATASETS + GENERATED:
        raise InputError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS + GENERATED)}")
    records = generate_ioi(n_generated, seed=seed) if name == "ioi_templates" else load_records(name, data_dir)
    return [_example(name, r) for r in records]
