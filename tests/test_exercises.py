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


def _pair_toy() -> Exercise:
    """A throwaway two-part exercise (not registered): (2x, 3x), each part with its own equation."""
    ex = _toy()
    ex.__dict__.update(name="pair", parts=("a", "b"), part_equations=("eq-glu-up", "eq-glu-gate"),
                       signature="pair(x) -> (a, b)", oracle=lambda c: (2 * c["x"], 3 * c["x"]),
                       mistakes=[Mistake("b forgot its 3", lambda c: (None, c["x"]))])
    return ex


def _by_hand_toy() -> Exercise:
    """A throwaway by-hand exercise: the numbers (1/3, [2/3, -1/3])."""
    ex = _toy()
    ex.__dict__.update(name="hand", parts=("r", "v"), call=None, n_cases=1, rtol=0, atol=5e-3,
                       cases=lambda g: {}, oracle=lambda c: (torch.tensor(1 / 3, dtype=torch.float64),
                                                            torch.tensor([2 / 3, -1 / 3], dtype=torch.float64)),
                       mistakes=[])
    return ex


@pytest.mark.parametrize("answer, status, hint", [
    (lambda x: (2 * x).numpy(), "passed", ""),
    (lambda x: (2 * x).tolist(), "passed", ""),
    (lambda x: [2 * v for v in x], "passed", ""),  # a list of 0-d tensors
    (lambda x: (2 * x).to_sparse(), "passed", ""),
    (lambda x: (2 * x).requires_grad_(), "passed", ""),
    (lambda x: (2 * x).float(), "wrong", "dtype"),  # right to float32's precision is not float64's
    (lambda x: (2 * x).numpy().astype("float32"), "wrong", "dtype"),
    (lambda x: (2 * x).round().long(), "wrong", "dtype"),
    (lambda x: (2 * x) > 0, "wrong", "dtype"),
    (lambda x: (2 * x).to(torch.complex128) + 1j, "wrong", "dtype"),  # the imaginary part is not dropped
    (lambda x: (2 * x).to("meta"), "wrong", "type"),
    (lambda x: {"answer": 2 * x}, "wrong", "type"),
    (lambda x: True, "wrong", "type"),
    (lambda x: (2 * x)[None], "wrong", "shape"),  # [1, n] for [n]: the same values, broadcasting hides nothing
    (lambda x: 2.000001 * x, "wrong", "near"),  # a rounded constant, or float32 on the way: not "re-read (3)"
    (lambda x: x.to_sparse().ne(0), "wrong", "raised"),  # torch's own NotImplementedError: no stub, a bug
])
def test_answers_of_odd_types_are_read_or_named_in_one_line(answer, status, hint, monkeypatch, capsys):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    verdict = _toy()(answer)
    printed = capsys.readouterr().out
    assert verdict.status == status and verdict.hint == hint, printed
    assert printed.count("\n") == 1 and "Traceback" not in printed


def test_a_shape_message_says_what_the_shape_means(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    assert "size 1" in _toy()(lambda x: (2 * x)[None]).message
    assert "which side" not in _toy()(lambda x: (2 * x)[:1]).message  # a vector cut short is no matmul's side


def test_what_the_learners_function_does_to_torch_stays_in_it(monkeypatch):
    """A function that sets the default dtype, turns autograd off or seeds torch changes none of them for the
    oracle or the rest of the notebook."""
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")

    def meddling(a, cos, sin):
        torch.set_default_dtype(torch.float16)
        torch.set_grad_enabled(False)
        torch.manual_seed(0)
        return a * cos - rotate_half(a * sin)

    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert check.rope_transpose(meddling)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_check_runs_inside_no_grad_and_inference_mode(mode):
    """The oracle is autograd, and scale_grad's checker differentiates the learner's function: both work in a
    notebook cell under torch.no_grad() or torch.inference_mode()."""
    with mode():
        assert check.rope_transpose(lambda a, cos, sin: a * cos - rotate_half(a * sin))
        assert check.scale_grad(lambda x, mu: mu * x + (1 - mu) * x.detach())
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_learners_function_is_not_swallowed(error):
    def interrupted(x):
        raise error()

    with pytest.raises(error):
        _toy()(interrupted)


def test_a_check_called_with_more_than_the_answer(monkeypatch, capsys):
    """check.x(a, b) for a by-hand answer of two parts is check.x((a, b)); anything else is named in one line."""
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    assert _by_hand_toy()(1 / 3, [2 / 3, -1 / 3])
    assert _by_hand_toy()(1 / 3, [2 / 3, -1 / 3], 5).hint == "usage"
    assert _toy()(lambda x: 2 * x, 2).hint == "usage"
    assert _toy()(lambda x: 2 * x, strict=False).hint == "usage"
    assert _toy()(check.glu_paths).hint == "usage"  # the checker itself is not the learner's function
    printed = capsys.readouterr().out
    assert printed.count("\n") == 5 and "Traceback" not in printed


def test_parts_in_the_wrong_order_are_named_so(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    verdict = _pair_toy()(lambda x: (3 * x, 2 * x))
    assert verdict.hint == "order" and "wrong order" in verdict.message
    verdict = _by_hand_toy()(([2 / 3, -1 / 3], 1 / 3))
    assert verdict.status == "wrong" and "parts" in verdict.message  # [2] is no number: the parts are misplaced


def test_a_known_mistake_in_one_part_says_the_other_part_is_wrong_too(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    assert _pair_toy()(lambda x: (2 * x, x)).message.endswith("b forgot its 3.")
    verdict = _pair_toy()(lambda x: (5 * x, x))
    assert "b forgot its 3" in verdict.message and "a is wrong too" in verdict.message
    assert "other parts are right" not in _pair_toy()(lambda x: (5 * x, 7 * x)).message
    assert "other parts are right" in _pair_toy()(lambda x: (2 * x, 7 * x)).message


def test_a_wrong_part_cites_its_own_equation(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    numbers = equation_numbers()
    message = _pair_toy()(lambda x: (2 * x, torch.sin(x))).message
    assert f"equation ({numbers['eq-glu-gate'][1]})" in message, message


def test_a_by_hand_answer_rounded_along_the_way_is_told_so(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")
    assert _by_hand_toy()((0.33, [0.67, -0.33]))  # two decimals pass
    assert _by_hand_toy()(([0.333], [[0.667, -0.333]]))  # and so do [x] for x, [[a, b]] for [a, b]
    verdict = _by_hand_toy()((0.3, [0.7, -0.3]))
    assert verdict.hint == "near" and "carry more decimals" in verdict.message
    # r = 0.33 carried into gamma * r * t: rounding, not "a factor is missing"
    verdict = check.rms_by_hand((0.33, [1, -1, 1], [1.98, -0.99, 0.198], [1.85, -0.85, -0.54]))
    assert verdict.hint == "near" and "factor" not in verdict.message, verdict.message
    assert "other parts are right" in verdict.message


def test_a_function_that_forgot_its_return_is_asked_about_it(monkeypatch):
    monkeypatch.setenv("DPA_EXERCISES_STRICT", "0")

    def forgot(x):
        2 * x

    verdict = _toy()(forgot)
    assert verdict.status == "unanswered" and "return" in verdict.message


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(AttributeError, match="glu_paths"):
        check.glu_path


def test_equation_labels_render_as_the_built_book_numbers_them():
    numbers = equation_numbers()  # the numbers themselves are checked against the built pages in tests/test_book.py
    assert numbers["eq-glu-forward"][0] == "glu" and numbers["eq-rmsnorm"][0] == "rmsnorm"
    assert numbers["eq-glu-forward"][1] < numbers["eq-glu-lambda"][1] < numbers["eq-glu-up"][1]  # in page order
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
        texts = [m.hint for m in ex.mistakes] + [f"({label})" for label in (ex.equation, *ex.part_equations) if label]
        assert not ex.part_equations or len(ex.part_equations) == len(ex.parts), ex.name
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
    """The one command a teacher runs, then two of the copy's chapters under nbmake, whole: no error with every
    exercise unanswered. (The exercise sections of every chapter run unanswered above, in-process; the rest of a
    chapter is the book's own, which nbmake runs in the book.)"""
    subprocess.run([sys.executable, "-m", "dpa.exercises", "student-copy", str(tmp_path / "class")], check=True)
    notebooks = [str(tmp_path / "class" / "book" / f"{c}.ipynb") for c in ("glu", "mixture-of-experts")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", *notebooks],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_student_copy_to_a_home_relative_path_and_a_path_with_spaces(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")  # a "~" taken literally would land here
    assert student_copy(ROOT, "~/my class")["glu.ipynb"]
    assert (tmp_path / "my class" / "book" / "glu.ipynb").exists() and not (tmp_path / "work" / "~").exists()


def test_student_copy_errors_are_one_line(tmp_path, capsys):
    from dpa.exercises.__main__ import main

    (tmp_path / "file").write_text("x")
    assert main(["student-copy", str(tmp_path / "file" / "class")]) == 2  # under a file: NotADirectoryError
    assert main(["student-copy", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err, err


@pytest.mark.parametrize("chapter", written_chapters())
def test_no_example_in_a_learner_cell_gives_an_answer_away(chapter):
    """The format examples in the learner cells' comments ("e.g. [1.23, -4.56, 7.89]") hold none of the by-hand
    answer's numbers, and no example row adds up to zero where the exercise asks whether delta does."""
    load_chapters()
    cells = exercise_cells(json.loads((BOOK / f"{chapter}.ipynb").read_text()))
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        call = re.search(r"check\.(\w+)\(", src)
        if cell["cell_type"] != "code" or is_solution(cell) or not call or REGISTRY[call[1]].call is not None:
            continue
        ex = REGISTRY[call[1]]
        answer = torch.cat([torch.as_tensor(p, dtype=torch.float64).flatten() for p in ex.oracle(ex.cases(None))])
        for example in re.findall(r"e\.g\. \[([^\]]*)\]", src):
            numbers = torch.tensor([float(x) for x in example.split(",")], dtype=torch.float64)
            assert not torch.isclose(numbers[:, None], answer[None], atol=5e-3, rtol=0).any(), (ex.name, example)
            assert abs(float(numbers.sum())) > 1e-9, (ex.name, example)


@pytest.mark.parametrize("style", ["global", "with"])
def test_a_check_runs_on_the_cpu_whatever_the_notebooks_default_device(style):
    """A notebook that set torch.set_default_device("cuda") (here "meta", which every machine has) still gets its
    verdict, and keeps its default device."""
    context = torch.device("meta") if style == "with" else contextlib.nullcontext()
    if style == "global":
        torch.set_default_device("meta")
    try:
        with context:
            assert check.rope_transpose(lambda a, cos, sin: a * cos - rotate_half(a * sin))
            assert check.glu_by_hand(([0, -1.76, -0.72], [1, -0.88, 0.36]))
            assert torch.get_default_device().type == "meta"
    finally:
        if style == "global":
            torch.set_default_device(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_answers_computed_on_a_gpu_are_read():
    assert check.rope_transpose(lambda a, cos, sin: (a * cos - rotate_half(a * sin)).cuda())
    assert check.scale_grad(lambda x, mu: mu * x.cuda() + (1 - mu) * x.cuda().detach())  # the gradient flows back
    torch.set_default_device("cuda")
    try:
        assert check.rope_transpose(lambda a, cos, sin: a * cos - rotate_half(a * sin))
    finally:
        torch.set_default_device(None)


def test_the_exercises_are_listed_in_the_books_order():
    assert list(check.names()) == list(CHAPTERS)
