"""The teacher's student copy of the book: every notebook with its solution cells emptied.

``python -m dpa.exercises student-copy OUT`` writes OUT/book/*.ipynb (and the book's other files, _toc.yml and
_config.yml, so that the copy builds as a book too). A solution cell is one tagged ``solution`` (the chapters'
folded solutions); its source is emptied and its outputs cleared, every other cell is copied as it is. The copy
runs under nbmake with every exercise unanswered: each check then says "not answered yet" and raises nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SOLUTION = "solution"


def is_solution(cell: dict) -> bool:
    return SOLUTION in cell.get("metadata", {}).get("tags", [])


def strip_notebook(nb: dict) -> tuple[dict, int]:
    """The notebook with its solution cells emptied (in place), and how many there were."""
    n = 0
    for cell in nb["cells"]:
        if is_solution(cell):
            n += 1
            cell["source"] = []
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
    return nb, n


def student_copy(root: str | Path, out: str | Path) -> dict[str, int]:
    """Copy the book under ``root`` (the repository: book/, _toc.yml, _config.yml) to ``out`` with every solution
    emptied. Refuses an ``out`` that exists and is not empty, and a ``root`` without a book. Returns {notebook:
    solutions emptied}."""
    root, out = Path(root).expanduser(), Path(out).expanduser()
    book = root / "book"
    if not book.is_dir() or not any(book.glob("*.ipynb")):
        raise FileNotFoundError(f"{book} holds no notebooks: pass the repository's folder (the one with book/)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: name a new one")
    if out.resolve().is_relative_to(book.resolve()):
        raise ValueError(f"{out} is inside the book: name a folder outside {book}")
    counts: dict[str, int] = {}
    ignore = shutil.ignore_patterns("_build", ".ipynb_checkpoints", "__pycache__", "*.ipynb")
    shutil.copytree(book, out / "book", ignore=ignore)
    for name in ("_toc.yml", "_config.yml"):
        if (root / name).exists():
            shutil.copy2(root / name, out / name)
    for path in sorted(book.glob("*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        nb, counts[path.name] = strip_notebook(nb)
        (out / "book" / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return counts
