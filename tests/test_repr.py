"""Results read from Python: a short ``repr``, a notebook's HTML view, ``summary()`` equal to the CLI's report, and
the figure helpers (issue 31, point 4)."""

from __future__ import annotations

import html

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dpa  # noqa: E402
from dpa.cli import main  # noqa: E402

from .test_cli import PROMPT, tiny, tiny_dir  # noqa: E402,F401 (a saved tiny model and its loaded copy)


@pytest.fixture(scope="module")
def res(tiny):  # noqa: F811
    model, tok = tiny
    return dpa.attribute(model, tok, PROMPT, target=" is")


def test_repr_is_a_few_lines_naming_the_target_and_the_top_units(res):
    text = repr(res)
    assert text.count("\n") <= 6 and len(text) < 900, text
    assert f"logit({res.target.token!r})" in text and "top tokens:" in text and "top components:" in text
    assert "tensor(" not in text
    best = res.top_components(1)["positive"][0]
    assert f"L{best.layer}" in text


def test_summary_is_the_cli_report(res, tiny_dir, capsys):  # noqa: F811
    capsys.readouterr()
    assert main(["attribute", PROMPT, "--target", " is", "--model", str(tiny_dir), "--color", "never",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == res.summary()


def test_html_view_colours_every_token_and_escapes_them(res):
    page = res._repr_html_()
    assert page.count("<span") == len(res.tokens)
    for token in res.tokens:
        assert html.escape(token.replace("\n", "\\n"), quote=True) in page
    assert "<script" not in page and "background:#" in page


def test_figures_show_the_scores(res):
    fig = res.plot_heads()
    image = fig.axes[0].images[0].get_array()
    assert torch.allclose(torch.as_tensor(image.data, dtype=torch.float32), res.head_scores.float())
    fig = res.plot_tokens()
    heights = [b.get_height() for b in fig.axes[0].patches]
    assert heights == pytest.approx(res.token_scores.float().tolist())
    fig = res.plot_components(3)
    widths = sorted(b.get_width() for b in fig.axes[0].patches)
    comps = res.top_components(3)
    assert widths == pytest.approx(sorted(c.score for c in comps["positive"] + comps["negative"]))
    _, ax = plt.subplots()
    assert res.plot_tokens(ax=ax) is ax.figure  # drawn into the axes given
    plt.close("all")


def test_a_circuit_reads_in_a_few_lines_and_its_summary_is_the_cli_report(tiny, tiny_dir, capsys):  # noqa: F811
    model, tok = tiny
    circ = dpa.circuit(model, tok, PROMPT, target=" is", nodes=6)
    text = repr(circ)
    assert text.count("\n") <= 8 and "->" in text and "tensor(" not in text
    assert "<table>" in circ._repr_html_()
    capsys.readouterr()
    assert main(["circuit", PROMPT, "--target", " is", "--nodes", "6", "--model", str(tiny_dir),
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == circ.summary()
