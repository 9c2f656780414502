"""The run folder's JSON-lines files: the filter's verdicts (``filter.jsonl``) and the measured samples
(``samples.jsonl``), read back on resume, appended to as the run goes, merged across torchrun ranks at the end."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..files import split_lines, write_text
from .datasets import DataError


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
