"""The book's exercises: the checkers answer in one line (passed, not answered yet, or what is wrong), every
reference solution in the book passes, every learner cell is unanswered, and the teacher's student copy runs with
every exercise unanswered. The plausible wrong answers of each chapter are in tests/test_exercises_<chapter>.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpa.exercises import REGISTRY, ExerciseFailed, Exercise, Mistake, check, load_chapters
from dpa.exercises._core import equation_numbers, randn, render
from dpa.exercises.student import is_solution, student_copy

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
# the derivation chapters, each with 2-4 exercises
CHAPTERS = ("residual-stream-and-targets", "rmsnorm", "glu", "softmax-taylor", "rope", "modified-backward",
            "circuits-as-graphs", "layernorm-gelu", "soft-capping", "mixture-of-experts")


def exercise_cells(nb: dict) -> list[dict]:
    """The cells of a chapter's "## Exercises" section, in order."""
    cells = nb["cells"]
    start = next(i for i, c in enumerate(cells)
                 if c["cell_type"] == "markdown" and "".join(c["source"]).startswith("## Exercises"))
    return cells[start:]


def run_section(nb: dict) -> tuple[list, str]:
    """Execute a chapter's exercise section in a fresh namespace (strict: a wrong answer raises); returns the
    verdicts it gave and what it printed."""
    from dpa.exercises import VERDICTS

    first = len(VERDICTS)
    out = io.StringIO()
    namespace: dict = {"__name__": "__exercises__"}
    with contextlib.redirect_stdout(out):
        for cell in exercise_cells(nb):
            if cell["cell_type"] == "code":
                exec(compile("".join(cell["source"]), "<cell>", "exec"), namespace)
    return VERDICTS[first:], out.getvalue()


def chapter_exercises(chapter: str) -> list[str]:
    load_chapters()
    return [name for name, ex in REGISTRY.items() if ex.chapter == chapter]


def written_chapters() -> list[str]:
    return [c for c in CHAPTERS if chapter_exercises(c)]


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "1")


# -- the checkers ----------------------------------------------------------------------------------------------

def test_every_derivation_chapter_has_two_to_four_exercises():
    counts = {c: len(chapter_exercises(c)) for c in CHAPTERS}
    assert all(2 <= n <= 4 for n in counts.values()), counts
    assert set(ex.chapter for ex in REGISTRY.values()) <= set(CHAPTERS)


def _toy() -> Exercise:
    """A throwaway exercise (not registered): double a vector."""
    ex = Exercise.__new__(Exercise)
    ex.__dict__.update(name="toy", chapter="glu", equation="eq-glu-up", n_cases=2, rtol=1e-7, atol=1e-9,
                       cases=lambda g: dict(x=randn(g, 5)), oracle=lambda c: 2 * c["x"],
                       call=lambda fn, c: fn(c["x"]), parts=(), signature="toy(x)",
                       mistakes=[Mistake("you added instead of doubling", lambda c: c["x"] + 2)])
    return ex


@pytest.mark.parametrize("answer, status, hint", [
    (None, "unanswered", ""),
    (lambda x: ..., "unanswered", ""),
    (lambda x: None, "unanswered", ""),
    (lambda x: (_ for _ in ()).throw(NotImplementedError), "unanswered", ""),
    (lambda x: 2 * x, "passed", ""),
    (lambda x: x + 2, "wrong", "you added instead of doubling"),
    (lambda x: -2 * x, "wrong", "sign"),
    (lambda x: 6 * x, "wrong", "factor"),
    (lambda x: x[:3], "wrong", "shape"),
    (lambda x: x / 0, "wrong", "non-finite"),
    (lambda x: x.foo(), "wrong", "raised"),
    (lambda x: "two x", "wrong", "type"),
    (lambda x: 2 * x + torch.randn(5, dtype=torch.float64), "wrong", "off"),
    (torch.zeros(5), "wrong", "not callable"),
])
def test_a_check_answers_in_one_line(answer, status, hint, monkeypatch, capsys):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    verdict = _toy()(answer)
    printed = capsys.readouterr().out
    assert verdict.status == status and printed.count("\n") == 1 and "Traceback" not in printed, printed
    assert verdict.hint == hint and bool(verdict) == (status == "passed")
    assert printed.startswith({"passed": "✓", "wrong": "✗", "unanswered": "…"}[status])


def test_strict_mode_raises_on_a_wrong_answer_only(capsys):
    with pytest.raises(ExerciseFailed, match="you added instead of doubling"):
        _toy()(lambda x: x + 2)
    assert _toy()(None).status == "unanswered"  # an unanswered exercise never raises
    assert _toy()(lambda x: 2 * x)


def test_a_learner_cannot_corrupt_the_oracle_in_place(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")

    def sneaky(x):
        y = 2 * x.clone()
        x.zero_()  # edits its input: the oracle gets its own copy
        return y

    assert _toy()(sneaky)


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(AttributeError, match="glu_paths"):
        check.glu_path


def test_equation_labels_render_as_the_built_book_numbers_them():
    numbers = equation_numbers()
    assert numbers["eq-glu-forward"] == ("glu", 1) and numbers["eq-rmsnorm"] == ("rmsnorm", 1)
    assert render("see equation (eq-glu-gate)", "glu") == f"see equation ({numbers['eq-glu-gate'][1]})"
    assert render("x (eq-norm-pullback)", "glu") == f"x (equation {numbers['eq-norm-pullback'][1]} of chapter rmsnorm)"
    up, gate = numbers["eq-glu-up"][1], numbers["eq-glu-gate"][1]
    assert render("both (eq-glu-up, eq-glu-gate)", "glu") == f"both (equations {up}, {gate})"
    assert render("(eq-no-such-label)", "glu") == "(eq-no-such-label)"


def test_every_hint_names_equations_that_exist():
    """Every "(eq-...)" in an exercise's hints and its own equation is a labelled equation of the book."""
    load_chapters()
    numbers = equation_numbers()
    for ex in REGISTRY.values():
        texts = [m.hint for m in ex.mistakes] + [f"({ex.equation})" if ex.equation else ""]
        labels = {label for text in texts for label in re.findall(r"eq-[\w-]*\w", text)}
        assert labels <= set(numbers), (ex.name, labels - set(numbers))


def test_every_exercise_has_at_least_two_known_mistakes():
    load_chapters()
    few = {ex.name: len(ex.mistakes) for ex in REGISTRY.values() if len(ex.mistakes) < 2}
    assert not few, few


# -- the book ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chapter", written_chapters())
def test_the_books_solutions_pass_and_the_learner_cells_are_unanswered(chapter):
    nb = json.loads((BOOK / f"{chapter}.ipynb").read_text())
    verdicts, printed = run_section(nb)
    names = chapter_exercises(chapter)
    passed = [v.exercise for v in verdicts if v.status == "passed"]
    unanswered = [v.exercise for v in verdicts if v.status == "unanswered"]
    assert sorted(passed) == sorted(names), printed  # each reference solution, once
    assert sorted(unanswered) == sorted(names), printed  # each learner cell, as committed
    assert not [v for v in verdicts if v.status == "wrong"]


@pytest.mark.parametrize("chapter", written_chapters())
def test_solutions_are_folded_and_tagged(chapter):
    """Each exercise's solution is a cell tagged "solution" (what the student copy empties), folded in the built
    book (hide-input, or a dropdown for prose) and right after the learner's cell, which calls the same check."""
    cells = exercise_cells(json.loads((BOOK / f"{chapter}.ipynb").read_text()))
    solutions = [c for c in cells if is_solution(c)]
    assert len([c for c in solutions if c["cell_type"] == "code"]) == len(chapter_exercises(chapter))
    for i, cell in enumerate(cells):
        if not is_solution(cell):
            continue
        if cell["cell_type"] == "code":
            assert "hide-input" in cell["metadata"]["tags"]
            call = re.search(r"check\.(\w+)\(", "".join(cell["source"]))[1]
            learner = "".join(cells[i - 1]["source"])
            assert not is_solution(cells[i - 1]) and f"check.{call}(" in learner, (chapter, call)
        else:
            assert "".join(cell["source"]).startswith(":::{dropdown}")


def test_student_copy_empties_every_solution_and_refuses_to_overwrite(tmp_path):
    counts = student_copy(ROOT, tmp_path / "class")
    assert counts["glu.ipynb"] == len([c for c in exercise_cells(json.loads((BOOK / "glu.ipynb").read_text()))
                                      if is_solution(c)])
    for chapter in written_chapters():
        nb = json.loads((tmp_path / "class" / "book" / f"{chapter}.ipynb").read_text())
        assert all(c["source"] == [] for c in nb["cells"] if is_solution(c))
        verdicts, printed = run_section(nb)
        assert verdicts and all(v.status == "unanswered" for v in verdicts), printed
    assert (tmp_path / "class" / "_toc.yml").exists()
    with pytest.raises(FileExistsError):
        student_copy(ROOT, tmp_path / "class")
    with pytest.raises(ValueError, match="inside the book"):
        student_copy(ROOT, BOOK / "copy")
    with pytest.raises(FileNotFoundError, match="book"):
        student_copy(tmp_path / "nowhere", tmp_path / "other")


@pytest.mark.slow
def test_the_student_copy_runs_under_nbmake(tmp_path):
    """The one command a teacher runs, then the copy's exercise chapters under nbmake: no error anywhere with
    every exercise unanswered."""
    subprocess.run([sys.executable, "-m", "dpa.exercises", "student-copy", str(tmp_path / "class")], check=True)
    notebooks = [str(tmp_path / "class" / "book" / f"{c}.ipynb") for c in written_chapters()]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", *notebooks],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
