"""The book's equation numbers, for the checkers' messages: a label such as "eq-glu-gate" is named by the number
the built book shows beside it."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

BOOK = Path(__file__).resolve().parents[2] / "book"


@lru_cache(maxsize=1)
def equation_numbers() -> dict[str, tuple[str, int]]:
    """{label: (chapter, number)}: the number the built book shows beside each labelled equation. The book numbers
    its labelled display equations ($$ ... $$ (label)) in one sequence through the chapters in _toc.yml's order
    (tests/test_book.py checks these numbers against the built pages). Empty where the book is not beside the
    package (an installed wheel): the messages then name the labels."""
    numbers: dict[str, tuple[str, int]] = {}
    toc = BOOK.parent / "_toc.yml"
    if not toc.is_file():
        return numbers
    files = re.findall(r"^\s*(?:root|-\s*file):\s*(\S+)", toc.read_text(encoding="utf-8"), flags=re.M)
    n = 0
    for name in files:
        path = BOOK.parent / f"{name}.ipynb"
        if path.is_file():
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        elif (BOOK.parent / f"{name}.md").is_file():
            text = (BOOK.parent / f"{name}.md").read_text(encoding="utf-8")
        else:
            continue
        for label in re.findall(r"^\$\$ \((eq-[\w-]+)\)", text, flags=re.M):
            n += 1
            numbers[label] = (Path(name).name, n)
    return numbers


def render(text: str, chapter: str) -> str:
    """Equation labels as the book shows them: "equation (eq-glu-gate)" -> "equation (5)" in its own chapter,
    "(eq-norm-pullback)" -> "(equation 3 of chapter rmsnorm)" in another, "(eq-a, eq-b)" -> "(equations 3, 5)".
    A label the book does not have is left as it is."""
    numbers = equation_numbers()

    def number(label: str) -> str | None:
        if label not in numbers:
            return None
        where, n = numbers[label]
        return f"{n}" if where == chapter else f"{n} of chapter {where}"

    def group(m: re.Match) -> str:
        labels = re.split(r",\s*", m[1])
        found = [number(label) for label in labels]
        if None in found:
            return m[0]
        return f"(equation{'s' if len(found) > 1 else ''} {', '.join(found)})"

    text = re.sub(r"equation \((eq-[\w-]+)\)", lambda m: f"equation ({number(m[1])})" if number(m[1]) else m[0],
                  text)
    return re.sub(r"\((eq-[\w-]+(?:,\s*eq-[\w-]+)*)\)", group, text)
