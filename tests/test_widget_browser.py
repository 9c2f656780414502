"""CircuitWidget in a real browser: JupyterLab with a kernel, and a save_html file with no network.

Screenshots go to ``$DPA_SCREENSHOTS`` when set (to look at them), else to the test's tmp folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import dpa
from dpa_widgets import CircuitWidget, save_html

from .browser_utils import browser, lab, open_notebook, run_cell, write_notebook  # noqa: F401 (fixtures)
from .conftest import random_ids, tiny_model

pytestmark = pytest.mark.browser

IOI = "When Mary and John went to the store, John gave a drink to"
SETUP = f"""\
import dpa
from dpa_widgets import CircuitWidget
model, tokenizer = dpa.load_model()
result = dpa.attribute(model, tokenizer, {IOI!r}, edges=True, neuron_positions=True)
w = CircuitWidget(result, model, tokenizer)
w"""
SHOW_SELECTION = 'print("SELECTED", w.selected_head, w.selection.get("head", {}).get("layer"))'
SHOW_TARGET = 'print("TARGET", repr(w.result.target.token), w._error or "ok")'


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("DPA_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def token_colours(page) -> list[str]:
    return page.eval_on_selector_all(".dpa-circuit .dpa-token", "els => els.map(e => e.style.background)")


@pytest.mark.slow
def test_jupyterlab_click_head_and_change_target(lab, browser, tmp_path):  # noqa: F811
    write_notebook(lab.root / "inspect.ipynb", [SETUP, SHOW_SELECTION, SHOW_TARGET])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, "inspect.ipynb")
        out = run_cell(page, 0)
        assert "Error" not in out, out
        widget = page.locator(".dpa-circuit")
        # fails here if the widget does not render: 30 layers x 9 heads for SmolLM2-135M
        widget.locator("rect.dpa-head").nth(269).wait_for(timeout=60_000)
        assert widget.locator("rect.dpa-head").count() == 30 * 9
        assert widget.locator(".dpa-token").count() == 14
        before = token_colours(page)
        assert len(set(before)) > 3, "tokens are coloured by their scores"

        cell = widget.locator('rect.dpa-head[data-layer="14"][data-head="4"]')
        cell.click()
        widget.locator('rect.dpa-head.dpa-locked[data-layer="14"][data-head="4"]').wait_for()
        widget.locator("canvas.dpa-edges").wait_for(timeout=30_000)  # the head's edges came from the kernel
        out = run_cell(page, 1)
        assert re.search(r"SELECTED \[14, 4\] 14", out), out
        page.screenshot(path=str(shots(tmp_path) / "lab-head-selected.png"), full_page=True)

        widget.locator('rect.dpa-head[data-layer="14"][data-head="4"]').click()  # unlock: back to token scores
        page.wait_for_function("() => !document.querySelector('.dpa-circuit rect.dpa-head.dpa-locked')")
        assert token_colours(page) == before
        options = widget.locator("select.dpa-target option").all_inner_texts()
        assert options[0].startswith("·Mary") and len(options) == 10, options
        widget.locator("select.dpa-target").select_option(index=1)  # the model's second guess
        second = options[1].split()[0].replace("·", " ")
        widget.get_by_text(f'Target "{second}"').wait_for(timeout=120_000)
        page.wait_for_function("() => !document.querySelector('.dpa-circuit.dpa-busy')", timeout=120_000)
        after = token_colours(page)
        assert after != before, "the token colours follow the new target"
        out = run_cell(page, 2)
        assert f"TARGET {second!r} ok" in out, out
        widget.screenshot(path=str(shots(tmp_path) / "lab-widget-light.png"))

        page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.wait_for_timeout(500)
        widget.screenshot(path=str(shots(tmp_path) / "lab-widget-dark.png"))
        background = page.eval_on_selector(".dpa-circuit", "e => getComputedStyle(e).backgroundColor")
        assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), "the dark theme reaches the widget"
    finally:
        page.close()


def test_save_html_renders_offline(browser, tmp_path):  # noqa: F811
    model = tiny_model("llama", kv_heads=2)
    result = dpa.attribute(model, None, random_ids(9).tolist(), edges=True, neuron_positions=True)
    widget = CircuitWidget(result, model, None)
    top_layer, top_head = map(int, divmod(int(result.head_scores.abs().argmax()), 4))
    path = save_html(widget, tmp_path / "circuit.html")

    page = browser.new_page(viewport={"width": 1200, "height": 900})
    blocked: list[str] = []

    def only_files(route):
        if route.request.url.startswith(("file:", "blob:", "data:")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", only_files)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        widget_el = page.locator(".dpa-circuit")
        widget_el.locator("rect.dpa-head").nth(11).wait_for(timeout=30_000)
        assert widget_el.locator("rect.dpa-head").count() == 3 * 4
        assert widget_el.locator(".dpa-token").count() == 9
        assert widget_el.locator("select.dpa-target").is_disabled(), "no kernel: live controls are off"
        widget_el.locator(f'rect.dpa-head[data-layer="{top_layer}"][data-head="{top_head}"]').click()
        widget_el.locator("canvas.dpa-edges").wait_for(timeout=10_000)  # exported details of a top head
        with page.expect_download() as download:
            widget_el.locator("button.dpa-export-svg").click()
        svg = Path(download.value.path()).read_text()
        assert svg.startswith("<svg") and svg.count('<rect ') > 12
        with page.expect_download() as download:
            widget_el.locator("button.dpa-export-png").click()
        assert Path(download.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with page.expect_download() as download:
            widget_el.locator("button.dpa-export-json").click()
        selection = json.loads(Path(download.value.path()).read_text())
        assert selection["head"]["layer"] == top_layer and selection["head"]["head"] == top_head
        page.screenshot(path=str(shots(tmp_path) / "save-html-offline.png"), full_page=True)
        assert not errors, errors
        assert not blocked, f"the page asked the network for {blocked}"
    finally:
        page.close()
