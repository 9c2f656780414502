"""DiscoveryWidget in a real browser: JupyterLab with a kernel (tests/browser_utils.py), a tiny model's MIB circuit.

The f curve and the circuit diagram render; the size control changes the kept edges and the f shown (the kernel
reads the same); another size is evaluated in the kernel; the ranking toggle; a widget with no model offers only
the evaluated sizes and says why. Screenshots go to ``$DPA_SCREENSHOTS`` when set, else to the test's tmp folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .browser_utils import browser, lab, open_notebook, run_cell, write_notebook  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser

SETUP = """\
import torch
from dpa import mib
from dpa.tiny import tiny_model
from dpa_widgets import DiscoveryWidget

model = tiny_model("llama", 2)
g = torch.Generator().manual_seed(0)
clean = torch.randint(3, 96, (5, 6), generator=g).tolist()
counter = torch.randint(3, 96, (5, 6), generator=g).tolist()
pairs = mib.Pairs(clean, counter, [[5]] * 5, [[7]] * 5)
found = mib.discover(model, None, pairs, method="dpa-cf", batch_size=5, progress=False)
w = DiscoveryWidget(found, model=model, pairs=pairs, batch_size=5, ranking="absolute")
w"""
SHOW = 'print("STATE", w.size, w.ranking, w.current["kept"], f"{w.f:.3f}" if w.f is not None else None, ' \
       'repr(w._error))'
STATIC = "DiscoveryWidget(found)  # no model: only the evaluated sizes"
N_WRITERS = 1 + 3 * (4 + 1)  # the input, 3 layers of 4 heads and an MLP


def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("DPA_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shown(widget) -> tuple[str, int, str]:
    """(size, kept edges, f) as the view shows them ("f = 0.931")."""
    kept = int(widget.locator(".dpa-d-kept").get_attribute("data-kept"))
    return widget.get_attribute("data-size"), kept, widget.locator(".dpa-d-f").inner_text()


def same_f(text: str, value: str) -> bool:
    """The view's "f = 0.931" is the kernel's f, to the three decimals shown."""
    return text != "f = unknown" and value != "None" and abs(float(text[4:]) - float(value)) <= 5e-4


def state(page) -> tuple[str, str, int, str, str]:
    out = run_cell(page, 1)
    found = re.search(r"STATE (\S+) (\S+) (\d+) (\S+) (.*)", out)
    assert found, out
    size, ranking, kept, f, error = found.groups()
    return size, ranking, int(kept), f, error


def test_jupyterlab_discovery_widget(lab, browser, tmp_path):  # noqa: F811
    write_notebook(lab.root / "discovery.ipynb", [SETUP, SHOW, STATIC])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    try:
        open_notebook(page, lab, "discovery.ipynb")
        out = run_cell(page, 0)
        assert "Error" not in out, out
        widget = page.locator(".dpa-discovery").first
        widget.locator("svg.dpa-d-diagram").wait_for(timeout=60_000)
        assert widget.locator("svg.dpa-d-curve").count() == 1
        assert widget.locator("svg.dpa-d-curve .dpa-d-mark").count() == 2 * 10, "both curves, MIB's ten sizes"
        assert widget.locator("svg.dpa-d-curve .dpa-d-here").count() == 1, "the chosen point is marked"
        assert widget.locator("svg.dpa-d-diagram .dpa-d-node").count() == N_WRITERS + 1  # and the logits
        assert widget.locator("button.dpa-d-size").count() == 10
        page.wait_for_function("() => !document.querySelector('.dpa-discovery input.dpa-d-other').disabled",
                               timeout=30_000)  # the kernel answered the view's hello: other sizes can be asked

        size, kept, f = shown(widget)
        k_size, k_ranking, k_kept, k_f, k_error = state(page)
        assert (size, kept, k_ranking) == (k_size, k_kept, "absolute") and same_f(f, k_f), (size, kept, f)
        assert widget.locator("path.dpa-d-edge").count() == kept > 0
        assert widget.locator(".dpa-d-showing").inner_text() == f"showing {kept} of {kept} edges"
        assert "0.05" == size, "the smallest size with f >= 0.8 on the |score| ranking"

        # a size of MIB's ten: the view's own data, the kernel agrees
        widget.locator('button.dpa-d-size[data-size="0.2"]').click()
        page.wait_for_function("() => document.querySelector('.dpa-discovery').dataset.size === '0.2'")
        size, kept2, f2 = shown(widget)
        assert kept2 != kept and f2 != f and f2 != "f = unknown"
        assert widget.locator("path.dpa-d-edge").count() == kept2
        k_size, k_ranking, k_kept, k_f, k_error = state(page)
        assert (k_size, k_kept, k_error) == ("0.2", kept2, "''") and same_f(f2, k_f)
        page.screenshot(path=str(shots(tmp_path) / "lab-discovery-20.png"), full_page=True)

        # another size: evaluated in the kernel
        other = widget.locator("input.dpa-d-other")
        other.fill("15")
        other.press("Enter")
        page.wait_for_function("() => document.querySelector('.dpa-discovery').dataset.size === '0.15'")
        page.wait_for_function("() => !document.querySelector('.dpa-discovery.dpa-d-busy') && "
                               "document.querySelector('.dpa-discovery .dpa-d-f').textContent !== 'f = unknown'",
                               timeout=120_000)
        assert widget.locator("button.dpa-d-size.dpa-d-custom.dpa-d-on").inner_text() == "15%"
        assert widget.locator("svg.dpa-d-curve .dpa-d-extra").count() == 2, "the new point on both curves"
        size, kept3, f3 = shown(widget)
        k_size, k_ranking, k_kept, k_f, k_error = state(page)
        assert (k_size, k_kept, k_error) == ("0.15", kept3, "''") and kept3 > 0 and same_f(f3, k_f)

        # the ranking toggle: the same size on the signed ranking (evaluated with the other)
        widget.locator('button.dpa-d-ranking[data-ranking="signed"]').click()
        page.wait_for_function("() => document.querySelector('.dpa-discovery').dataset.ranking === 'signed'")
        size, kept4, f4 = shown(widget)
        k_size, k_ranking, k_kept, k_f, k_error = state(page)
        assert (k_size, k_ranking, k_kept) == ("0.15", "signed", kept4) and same_f(f4, k_f)

        # back to 5% on |score|, hover a node: its edges light up
        widget.locator('button.dpa-d-ranking[data-ranking="absolute"]').click()
        widget.locator('button.dpa-d-size[data-size="0.05"]').click()
        page.wait_for_function("() => document.querySelector('.dpa-discovery').dataset.size === '0.05' && "
                               "document.querySelector('.dpa-discovery').dataset.ranking === 'absolute'")
        assert shown(widget) == ("0.05", kept, f)
        widget.locator('.dpa-d-node[data-node="logits"]').hover()
        assert widget.locator("path.dpa-d-edge.dpa-d-lit").count() > 0
        assert "logits" in widget.locator(".dpa-d-hover").inner_text()
        page.mouse.move(0, 0)
        overflow = widget.evaluate("e => e.scrollWidth - e.clientWidth")
        assert overflow <= 1, f"the widget is {overflow} px wider than its output area"
        widget.screenshot(path=str(shots(tmp_path) / "lab-discovery.png"))

        # no model: only the evaluated sizes, and the view says so
        out = run_cell(page, 2)
        assert "Error" not in out, out
        still = page.locator(".dpa-discovery").nth(1)
        still.locator("svg.dpa-d-diagram").wait_for(timeout=30_000)
        assert still.locator("input.dpa-d-other").count() == 0
        assert "f is known only at the evaluated sizes" in still.locator(".dpa-d-note").inner_text()
        still.locator('button.dpa-d-size[data-size="0.5"]').click()
        page.wait_for_function("() => document.querySelectorAll('.dpa-discovery')[1].dataset.size === '0.5'")
        assert shown(still)[2] not in ("f = unknown", f)

        # a ~700 px output area (the panels wrap, nothing sticks out), and the dark theme
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 800, "height": 1000})
        page.wait_for_timeout(500)
        for el in (widget, still):
            overflow = el.evaluate("e => e.scrollWidth - e.clientWidth")
            assert overflow <= 1, f"at 800 px the widget is {overflow} px wider than its output area"
        widget.screenshot(path=str(shots(tmp_path) / "lab-discovery-700.png"))
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.wait_for_timeout(500)
        widget.screenshot(path=str(shots(tmp_path) / "lab-discovery-dark.png"))
        background = widget.evaluate("e => getComputedStyle(e).backgroundColor")
        assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), "the dark theme reaches the widget"
        assert not errors, errors
    finally:
        page.close()
