"""``dpa circuit --html`` and ``dpa attribute --html`` find their page builders through the ``dpa.views`` entry
points (the core builds no page, holds no JavaScript and never imports dpa_widgets): found, they are
``dpa_widgets.page.circuit_html`` and ``html_report``; absent or broken, ``--html`` is a one-line error that says
what to install, before the model loads, and writes nothing."""

from __future__ import annotations

import importlib.metadata

import pytest

import dpa
from dpa import cli
from dpa_widgets.page import circuit_html, html_report

from .conftest import random_ids, tiny_model
from .test_cli import PROMPT, run


def test_the_entry_points_are_the_widgets_page_builders():
    assert cli._view("circuit_html") is circuit_html and cli._view("html_report") is html_report


def test_the_page_inlines_graph_js_and_the_data():
    circ = dpa.circuit(tiny_model("llama", kv_heads=2), None, random_ids(5).tolist(), target=3, nodes=4)
    page = circuit_html(circ, prompt="a prompt")
    assert "<title>DPA circuit: a prompt</title>" in page
    assert "export function renderGraph(" in page and 'renderGraph(document.getElementById("graph"), {' in page
    assert page.count("</script>") == 1 and "<tr><td class='num'>" in page


class Damaged:
    """An entry point whose package fails as it is imported (a source of the widget's script missing)."""

    def load(self):
        from dpa_widgets.bundle import BundleError

        raise BundleError("dom.js is missing")


def _no_model(*args, **kwargs):
    raise AssertionError("the model loaded before --html was checked")


@pytest.mark.parametrize("command", ["circuit", "attribute"])
@pytest.mark.parametrize("found, message", [
    ([], "is not installed"),
    ([importlib.metadata.EntryPoint("circuit_html", "dpa_no_such_package.page:circuit_html", cli.VIEWS)],
     "which does not import (No module named 'dpa_no_such_package')"),
    ([importlib.metadata.EntryPoint("circuit_html", "dpa_widgets.page:no_such_name", cli.VIEWS)],
     "which does not import"),
    ([Damaged()], "which fails as it loads (BundleError: dom.js is missing); reinstall it"),
])
def test_without_the_widget_package_html_is_a_clear_error(capsys, monkeypatch, tmp_path, found, message, command):
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **select: importlib.metadata.EntryPoints(found)
                        if select.get("group") == cli.VIEWS else real(**select))
    monkeypatch.setattr(cli, "_load", _no_model)
    page = tmp_path / "g.html"
    code, out, err = run(capsys, command, PROMPT, "--model", str(tmp_path / "unused"), "--html", str(page))
    assert code == 2 and out == ""
    assert err.startswith("error: --html draws its page with dpa's widget package") and message in err
    assert 'pip install "dpa[widget]"' in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not page.exists()
