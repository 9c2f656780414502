"""GenerationWidget in a real browser: JupyterLab with a kernel (tests/browser_utils.py), a tiny model's greedy
generation. The matrix renders (a row per generated token, a cell per source before it, grey after), a click on a
row opens its heads and neurons and sets ``step`` in the kernel, a second click closes it; the saved page draws
the same with no kernel. Screenshots go to ``$DPA_SCREENSHOTS`` when set, else to the test's tmp folder."""

from __future__ import annotations

import re

import pytest

from .browser_utils import browser, lab, open_notebook, run_cell, write_notebook  # noqa: F401 (fixtures)
from .test_discovery_browser import shots

pytestmark = pytest.mark.browser

SETUP = """\
import dpa
from dpa.tiny import tiny_model
from dpa_widgets import GenerationWidget, save_html


class Chars:  # characters as tokens, ids 1..95
    all_special_ids = [0]
    def encode(self, text, add_special_tokens=False): return [ord(c) - 31 for c in text]
    def decode(self, ids): return "".join(chr(i + 31) for i in ids)
    def __call__(self, text): return {"input_ids": [0] + self.encode(text)}


TOK = Chars()
model = tiny_model("llama", 2)
gen = dpa.attribute_generation(model, TOK, "the cat sa", max_new_tokens=5, stop_at_eos=False)
w = GenerationWidget(gen, step=None)
save_html(w, "generation.html")
w"""
SHOW = 'print("STEP", w.step)'
STEPS, PROMPT = 5, 11  # BOS and 10 characters


def test_jupyterlab_generation_widget(lab, browser, tmp_path):  # noqa: F811
    write_notebook(lab.root / "generation.ipynb", [SETUP, SHOW])
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    try:
        open_notebook(page, lab, "generation.ipynb")
        out = run_cell(page, 0)
        assert "Error" not in out, out
        widget = page.locator(".dpa-gen").first
        widget.locator(".dpa-gen-matrix table").wait_for(timeout=60_000)
        rows = widget.locator("tbody tr")
        assert rows.count() == STEPS
        sources = PROMPT + STEPS - 1
        assert widget.locator("thead th.dpa-gen-col").count() == sources
        for j in range(STEPS):  # row j sees the prompt and j generated tokens; the rest is grey
            assert rows.nth(j).locator("td.dpa-gen-future").count() == sources - (PROMPT + j)
        assert widget.locator(".dpa-gen-detail").count() == 0
        rows.nth(2).locator("th.dpa-gen-row").click()
        widget.locator(".dpa-gen-detail").wait_for()
        assert widget.locator(".dpa-gen-title").inner_text().startswith("step 2:")
        assert widget.locator(".dpa-gen-heads td").count() == 3 * 4  # 3 layers of 4 heads
        assert re.search(r"STEP 2\b", run_cell(page, 1)), "the click sets step in the kernel"
        page.screenshot(path=str(shots(tmp_path) / "generation-widget.png"), full_page=True)
        rows.nth(2).locator("th.dpa-gen-row").click()
        widget.locator(".dpa-gen-detail").wait_for(state="detached")
        assert re.search(r"STEP None", run_cell(page, 1))
        saved = browser.new_page(viewport={"width": 1200, "height": 900})
        saved.goto((lab.root / "generation.html").as_uri())
        saved.locator(".dpa-gen tbody tr").nth(STEPS - 1).locator("th").click()
        saved.locator(".dpa-gen-detail").wait_for()
        saved.screenshot(path=str(shots(tmp_path) / "generation-page.png"), full_page=True)
        saved.close()
        assert not errors, errors
    finally:
        page.close()
