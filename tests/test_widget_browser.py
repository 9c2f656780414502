"""CircuitWidget in a real browser: JupyterLab with a kernel, and a save_html file with no network.

Screenshots go to ``$DPA_SCREENSHOTS`` when set (to look at them), else to the test's tmp folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest

import dpa
from dpa_widgets import CircuitWidget, export, save_html
from dpa_widgets.page import circuit_html

from .browser_utils import (GRAPH_WIDTHS, assert_graph_reads, browser, lab, open_notebook, run_cell,  # noqa: F401
                            write_notebook)
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


KERNEL_CONTROLS = ("select.dpa-target", "input.dpa-typed", "input.dpa-contrast", "select.dpa-preset", "input.dpa-p",
                   "select.dpa-method", "button.dpa-verify")
STATIC_REASON = "static page: changing the target, weights or method"


def open_offline(browser, path: Path, width: int):  # noqa: F811 (the fixture is passed in)
    """``path`` from disk with every non-file request blocked; (page, blocked URLs, console errors)."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    blocked: list[str] = []
    errors: list[str] = []

    def only_files(route):
        if route.request.url.startswith(("file:", "blob:", "data:")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", only_files)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.goto(path.as_uri())
    return page, blocked, errors


def assert_static_controls(widget_el) -> None:
    """The controls that need a kernel are off, and the view says why (visibly, not only in a tooltip)."""
    reason = widget_el.locator(".dpa-offline")
    reason.get_by_text(STATIC_REASON).wait_for(timeout=15_000)  # after the short "connecting…"
    assert reason.is_visible()
    assert "running kernel" in reason.inner_text() and "JupyterLab" in reason.inner_text()
    for selector in KERNEL_CONTROLS:
        assert widget_el.locator(selector).is_disabled(), f"{selector} is enabled on a static page"


def finish_offline_page(page, widget_el, screenshot, width: int, errors: list, blocked: list) -> None:
    """The end of every offline-page test: a screenshot, the layout at book widths, no console error and no
    request to the network."""
    page.screenshot(path=str(screenshot), full_page=True)
    if width < 1000:
        assert_holds_together(page, widget_el)
    assert not errors, errors
    assert not blocked, f"the page asked the network for {blocked}"


def assert_holds_together(page, widget_el) -> None:
    """At book widths (the page's body narrowed from 900 to 560 px): the "Export:" label sits on its buttons'
    line, the neuron swatches keep their size, the axes are labelled, and nothing sticks out of the widget."""
    assert widget_el.locator("svg.dpa-heatmap text", has_text="L0").count() == 1
    for width in range(900, 550, -10):
        page.evaluate(f"() => {{ document.body.style.maxWidth = '{width}px'; }}")
        tops = page.evaluate("""() => {
            const footer = document.querySelector('.dpa-circuit .dpa-footer');
            const label = [...footer.querySelectorAll('span')].find(e => e.textContent === 'Export:');
            return [label, ...footer.querySelectorAll('.dpa-export-json, .dpa-export-svg, .dpa-export-png')]
                .map(e => e.getBoundingClientRect().top); }""")
        assert max(tops) - min(tops) < 8, f"at {width} px 'Export:' is not on its buttons' line: {tops}"
        swatches = page.eval_on_selector_all(".dpa-circuit .dpa-swatch", """els => els.map(e => {
            const r = e.getBoundingClientRect(); return [r.width, r.height]; })""")
        assert swatches and all(w >= 9 and h >= 9 for w, h in swatches), f"at {width} px squashed swatches: {swatches}"
        overflow = page.eval_on_selector(".dpa-circuit", "e => e.scrollWidth - e.clientWidth")
        assert overflow <= 1, f"at {width} px the widget is {overflow} px wider than its container"
    page.evaluate("() => { document.body.style.maxWidth = ''; }")


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
        page.wait_for_function("() => !document.querySelector('.dpa-circuit select.dpa-target').disabled",
                               timeout=30_000)  # the kernel answered the view's hello: live
        for selector in KERNEL_CONTROLS:
            if selector != "input.dpa-p":  # the slider is for the sensitivity families, off for "default"
                assert widget.locator(selector).is_enabled(), selector
        assert not widget.locator(".dpa-offline").is_visible()
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

        # the keyboard in JupyterLab: Tab walks the controls, the tokens and the heatmap; Enter submits the
        # token box (JupyterLab's own shortcuts leave it alone)
        widget.locator("select.dpa-target").focus()
        reached = []
        for _ in range(40):
            page.keyboard.press("Tab")
            reached.append(page.evaluate("() => { const a = document.activeElement; return a.closest('.dpa-circuit') ? "
                                         "(a.getAttribute('data-focus') || a.tagName.toLowerCase() + '.' + a.getAttribute('class')) : 'outside'; }"))
        for control in ("input.dpa-typed", "input.dpa-contrast", "select.dpa-preset", "select.dpa-method", "token:0",
                        "heads", "neuron:"):
            assert any(r.startswith(control) for r in reached), (control, reached)
        typed = widget.locator("input.dpa-typed")
        typed.fill(" John")
        typed.press("Enter")
        widget.get_by_text('Target " John"').wait_for(timeout=120_000)
        page.wait_for_function("() => !document.querySelector('.dpa-circuit.dpa-busy')", timeout=120_000)
        out = run_cell(page, 2)
        assert "TARGET ' John' ok" in out, out
        widget.screenshot(path=str(shots(tmp_path) / "lab-widget-light.png"))
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 800, "height": 1000})  # a ~700 px wide output area
        page.wait_for_timeout(500)
        widget.screenshot(path=str(shots(tmp_path) / "lab-widget-700.png"))
        page.set_viewport_size({"width": 1400, "height": 1000})

        page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
        page.wait_for_timeout(500)
        widget.screenshot(path=str(shots(tmp_path) / "lab-widget-dark.png"))
        background = page.eval_on_selector(".dpa-circuit", "e => getComputedStyle(e).backgroundColor")
        assert background not in ("rgb(255, 255, 255)", "rgba(0, 0, 0, 0)"), "the dark theme reaches the widget"
    finally:
        page.close()


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", kv_heads=2)
    result = dpa.attribute(model, None, random_ids(9).tolist(), edges=True, neuron_positions=True)
    return model, result


def unexported_head(widget: CircuitWidget) -> tuple[int, int]:
    return next((l, h) for l in range(3) for h in range(4) if f"head:{l}:{h}" not in widget._details)


@pytest.mark.parametrize("width", [1400, 700])
def test_save_html_renders_offline(browser, tmp_path, tiny, width):  # noqa: F811
    model, result = tiny
    widget = CircuitWidget(result, model, None)
    top_layer, top_head = map(int, divmod(int(result.head_scores.abs().argmax()), 4))
    path = save_html(widget, tmp_path / "circuit.html")

    page, blocked, errors = open_offline(browser, path, width)
    try:
        widget_el = page.locator(".dpa-circuit")
        widget_el.locator("rect.dpa-head").nth(11).wait_for(timeout=30_000)
        assert widget_el.locator("rect.dpa-head").count() == 3 * 4
        assert widget_el.locator(".dpa-token").count() == 9
        assert_static_controls(widget_el)
        widget_el.locator(f'rect.dpa-head[data-layer="{top_layer}"][data-head="{top_head}"]').click()
        widget_el.locator("canvas.dpa-edges").wait_for(timeout=10_000)  # exported details of a top head
        assert widget_el.locator(".dpa-edge-queries text").count() == 9, "every query row is labelled"
        assert widget_el.locator(".dpa-edge-keys text").count() == 9, "every key column is labelled"
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
        page.screenshot(path=str(shots(tmp_path) / f"save-html-offline-{width}.png"), full_page=True)
        if width < 1000:
            assert_holds_together(page, widget_el)

        layer, head = unexported_head(widget)
        widget_el.locator(f'rect.dpa-head[data-layer="{layer}"][data-head="{head}"]').click()
        widget_el.locator(".dpa-detail").get_by_text("details not exported for this head").wait_for(timeout=5_000)
        assert "loading" not in widget_el.locator(".dpa-detail").inner_text()
        assert not errors, errors
        assert not blocked, f"the page asked the network for {blocked}"
    finally:
        page.close()


@pytest.mark.parametrize("width", [1400, 700])
def test_saved_live_state_is_static_without_a_kernel(browser, tmp_path, tiny, monkeypatch, width):  # noqa: F811
    """A book page: widget state saved from a live kernel (``_live`` true, the baselines listed), rendered by
    the html-manager with no kernel. The view must not believe ``_live``: no kernel answers its hello."""
    model, result = tiny
    widget = CircuitWidget(result, model, None)
    monkeypatch.setattr(export, "OFFLINE", {})  # keep the state exactly as the kernel has it
    text = export.page(widget)
    assert re.search(r'"_live": true', text) and '"tokens:' in text, "the saved state says live"
    path = tmp_path / "book-like.html"
    # a book column: the widget in a ~700 px article at width 700
    path.write_text(text.replace("<body>", f'<body style="max-width: {width - 40}px; margin: 0 auto">'))

    page, blocked, errors = open_offline(browser, path, width + 100 if width < 1000 else width)
    try:
        widget_el = page.locator(".dpa-circuit")
        widget_el.locator("rect.dpa-head").nth(11).wait_for(timeout=30_000)
        assert_static_controls(widget_el)
        layer, head = unexported_head(widget)
        widget_el.locator(f'rect.dpa-head[data-layer="{layer}"][data-head="{head}"]').click()
        widget_el.locator(".dpa-detail").get_by_text("details not exported for this head").wait_for(timeout=5_000)
        widget_el.locator(".dpa-token").nth(3).click()  # a token's routes were sent up front
        widget_el.locator(".dpa-detail").get_by_text("heads reading it").wait_for(timeout=5_000)
        finish_offline_page(page, widget_el, shots(tmp_path) / f"saved-live-state-{width}.png", width, errors, blocked)
    finally:
        page.close()


# ---------------------------------------------------------------- mixture of experts

MOE_SLOTS = 5  # the tiny Qwen2-MoE: 4 routed experts and the shared one
HOVER = re.compile(r"^expert L\d\.(E\d|shared): [−+]?\d")
MOE_NEURON = re.compile(r"^L\d\.(E\d|S)\.N\d+$")


@pytest.fixture(scope="module")
def tiny_moe():
    model = tiny_model("qwen2_moe", 2)
    result = dpa.attribute(model, None, random_ids(9).tolist(), edges=True, neuron_positions=True)
    return model, result


def assert_experts_panel(widget_el, result) -> None:
    """The layer x expert heatmap: one cell per layer and slot, the shared column marked, named neurons."""
    panel = widget_el.locator(".dpa-experts-panel")
    panel.locator("rect.dpa-expert").nth(3 * MOE_SLOTS - 1).wait_for(timeout=30_000)
    assert panel.locator("rect.dpa-expert").count() == 3 * MOE_SLOTS
    assert panel.locator("rect.dpa-expert.dpa-shared").count() == 3
    assert "experts (layer × expert)" in panel.locator(".dpa-caption").inner_text()
    assert panel.locator(".dpa-legend").is_visible()
    labels = widget_el.locator(".dpa-neuron span:nth-child(2)").all_inner_texts()
    assert labels and all(MOE_NEURON.match(t) for t in labels), labels
    layer, slot = 1, MOE_SLOTS - 1  # the shared expert of the middle layer: routed at every position
    panel.locator(f'rect.dpa-expert[data-layer="{layer}"][data-expert="{slot}"]').hover()
    hover = widget_el.locator(".dpa-hover").inner_text()
    assert hover.startswith(f"expert L{layer}.shared: ") and HOVER.match(hover), hover
    value = float(hover.split(": ")[1].replace("−", "-"))
    assert value == pytest.approx(float(result.expert_scores[layer, slot]), rel=2e-2, abs=1e-3)


@pytest.mark.parametrize("width", [1400, 700])
def test_moe_save_html_shows_the_experts(browser, tmp_path, tiny_moe, width):  # noqa: F811
    """A mixture of experts on a static page: the experts panel, its hover text, an expert's details."""
    model, result = tiny_moe
    widget = CircuitWidget(result, model, None)
    path = save_html(widget, tmp_path / "moe.html")
    page, blocked, errors = open_offline(browser, path, width)
    try:
        widget_el = page.locator(".dpa-circuit")
        assert_experts_panel(widget_el, result)
        assert_static_controls(widget_el)
        top_layer, top_slot = map(int, divmod(int(result.expert_scores.abs().argmax()), MOE_SLOTS))
        widget_el.locator(f'rect.dpa-expert[data-layer="{top_layer}"][data-expert="{top_slot}"]').click()
        widget_el.locator(f'rect.dpa-expert.dpa-locked[data-layer="{top_layer}"][data-expert="{top_slot}"]').wait_for()
        detail = widget_el.locator(".dpa-detail")
        detail.locator(".dpa-expert-title").wait_for(timeout=5_000)
        assert detail.locator(".dpa-expert-positions code").count() >= 1, "its per-position scores (exported)"
        assert "tokens coloured by expert" in widget_el.locator(".dpa-tokens-panel .dpa-caption").inner_text()
        finish_offline_page(page, widget_el, shots(tmp_path) / f"save-html-moe-{width}.png", width, errors, blocked)
    finally:
        page.close()


def test_hybrid_save_html_names_each_rows_units(browser, tmp_path):  # noqa: F811
    """A hybrid (LFM2: convolution, attention, convolution) on a static page: each heat-map row says its kind,
    a convolution unit's hover and details name it L0.C3 with its channels, an attention head's L1.H2 with its KV
    group."""
    _hybrid_page(browser, tmp_path, "lfm2", "conv", "conv L0.C3 (channels 24–31): ", "conv L2.C1 · ",
                 "heads and conv units (layer × unit)")


def test_scan_save_html_names_its_units(browser, tmp_path):  # noqa: F811
    """Bamba (Mamba-2, attention, Mamba-2) on a static page: the rows say their kind, a scan unit's hover and
    details name it L0.S3 (its channels are the block's inner ones, not named), an attention head keeps its KV
    group."""
    _hybrid_page(browser, tmp_path, "bamba", "scan", "scan L0.S3: ", "scan L2.S1 · ", "heads and scan units")


def test_granite_with_experts_save_html_names_its_units_and_experts(browser, tmp_path):  # noqa: F811
    """Granite 4.0-H with experts (Mamba-2, attention, Mamba-2; four routed experts and the dense MLP beside them) on
    a static page: the rows say their kind, and the experts' panel has a slot for the shared MLP after the routed
    experts."""
    _hybrid_page(browser, tmp_path, "granitemoehybrid", "scan", "scan L0.S3: ", "scan L2.S1 · ",
                 "heads and scan units", experts=5)


def test_qwen3_next_save_html_names_its_delta_units_and_experts(browser, tmp_path):  # noqa: F811
    """Qwen3-Next (Gated DeltaNet, gated attention, Gated DeltaNet; four routed experts and a gated shared one) on a
    static page: the delta rows say their kind, their units are named D, and the experts' panel has the shared
    slot."""
    _hybrid_page(browser, tmp_path, "qwen3_next", "delta", "delta L0.D3: ", "delta L2.D1 · ",
                 "heads and delta units", experts=5)


def test_jamba_save_html_has_experts_on_its_sparse_layers_only(browser, tmp_path):  # noqa: F811
    """Jamba's released layout (experts on every other layer; here the Mamba layers 0 and 2, a dense MLP on the
    attention layer 1) on a static page: the experts' panel has no cells on the dense row, a dense layer's neurons
    are named as its MLP's (L1.N5), a sparse layer's by expert (L0.E2.N5)."""
    _hybrid_page(browser, tmp_path, "jamba", "scan", "scan L0.S3: ", "scan L2.S1 · ", "heads and scan units",
                 experts=4)


def test_nemotron_h_save_html_leaves_the_mlp_layer_without_units(browser, tmp_path):  # noqa: F811
    """Nemotron-H (a Mamba-2 block, an MLP, attention: one block per layer) on a static page: the rows say their kind,
    the MLP layer's row has no cells (it has no token mixer), the caption lists heads and scan units only, and the
    neurons listed are the MLP layer's."""
    model = tiny_model("nemotron_h", 2, layers_block_type=["linear_attention", "mlp", "full_attention"],
                       num_hidden_layers=3)  # (the dense layout; its moe layers: tests/test_nemotron_moe.py)
    with _static_page(browser, tmp_path, model, cells=8) as (page, widget_el, heat, blocked, errors):
        ticks = heat.locator("text.dpa-tick").all_text_contents()
        assert {"L0 scan", "L1 mlp", "L2 attn"} <= set(ticks), ticks
        assert heat.locator('rect.dpa-head[data-layer="1"]').count() == 0
        assert heat.locator('rect.dpa-head[data-layer="0"]').count() == 4
        captions = widget_el.locator(".dpa-panel .dpa-caption").all_inner_texts()
        assert any("heads and scan units (layer × unit)" in c for c in captions), captions
        heat.locator('rect.dpa-head[data-layer="0"][data-head="3"]').hover()
        assert widget_el.locator(".dpa-hover").inner_text().startswith("scan L0.S3: ")
        labels = widget_el.locator(".dpa-neuron span:nth-child(2)").all_inner_texts()
        assert labels and all(t.startswith("L1.N") for t in labels), labels
        heat.locator('rect.dpa-head[data-layer="2"][data-head="1"]').click()
        title = widget_el.locator(".dpa-detail .dpa-detail-title").first
        title.wait_for(timeout=5_000)
        assert title.inner_text().startswith("head L2.H1 · "), title.inner_text()
        finish_offline_page(page, widget_el, shots(tmp_path) / "save-html-nemotron-h-1400.png", 1400, errors, blocked)


def test_falcon_h1_save_html_draws_heads_and_scan_units_side_by_side(browser, tmp_path):  # noqa: F811
    """Falcon-H1 (every layer: 4 attention heads and a Mamba-2 block's 4 SSM heads side by side) on a static page:
    each row has 8 cells, the heads then the scan units past a rule, each block named (H0–H3, S0–S3) and numbered
    from 0, the KV groups over the heads alone; a scan unit's hover and details name it L0.S1 and its exported edges
    colour the tokens, a head keeps its KV group; a neuron's details list the tokens it promotes."""
    with _static_page(browser, tmp_path, tiny_model("falcon_h1"), cells=24) as (page, widget_el, heat, blocked, errors):
        assert [heat.locator(f'rect.dpa-head[data-layer="{i}"]').count() for i in range(3)] == [8, 8, 8]
        assert heat.locator('rect.dpa-head[data-kind="scan"]').count() == 12
        assert heat.locator("line.dpa-beside-sep").count() == 1
        split = float(heat.locator("line.dpa-beside-sep").get_attribute("x1"))
        x = [float(heat.locator(f'rect.dpa-head[data-layer="0"][data-head="{c}"]').get_attribute("x"))
             for c in range(8)]
        assert x[3] + 14 < split < x[4], (x, split)
        own = "els => els.map(e => [e.childNodes[0].textContent, Number(e.getAttribute('x'))])"  # (less the <title>)
        assert [t for t, _ in heat.locator("text.dpa-kind").evaluate_all(own)] == ["H0–H3", "S0–S3"]
        kv = [(t, at) for t, at in heat.locator("text.dpa-tick").evaluate_all(own) if t.startswith("kv")]
        assert [t for t, _ in kv] == ["kv0", "kv1"] and all(at < split for _, at in kv), kv
        caption = heat.locator("xpath=ancestor::section[1]").locator(".dpa-caption").inner_text()
        assert caption.startswith("heads | scan units (layer × unit) · "), caption
        heat.locator('rect.dpa-head[data-layer="0"][data-head="5"]').hover()
        assert widget_el.locator(".dpa-hover").inner_text().startswith("scan L0.S1: ")
        heat.locator('rect.dpa-head[data-layer="1"][data-head="2"]').hover()
        assert widget_el.locator(".dpa-hover").inner_text().startswith("head L1.H2 (KV group 1): ")
        detail = widget_el.locator(".dpa-detail")
        top = detail.locator(".dpa-vocab", has_text="top scan units: ").locator("code.dpa-pick")
        assert top.count() >= 1 and all(".S" in t for t in top.all_inner_texts())
        heads = detail.locator(".dpa-vocab", has_text="top heads: ").locator("code").all_inner_texts()
        assert heads and all(".H" in t for t in heads), heads
        label = top.first.inner_text().split()[0]  # the top scan unit: its details (edges) are on the page
        top.first.click()
        detail.locator(".dpa-detail-title").first.wait_for(timeout=5_000)
        assert detail.locator(".dpa-detail-title").first.inner_text().startswith(f"scan {label} · ")
        assert detail.locator("canvas.dpa-edges").count() == 1
        tokens = widget_el.locator(".dpa-tokens-panel .dpa-caption").inner_text()
        assert tokens == f"tokens coloured by scan {label} (its edges from each key)", tokens
        widget_el.locator(".dpa-neuron").first.click()  # the lens reads it (through the MLP's down multiplier)
        assert detail.locator(".dpa-vocab", has_text="promotes: ").locator("code").count() >= 1
        finish_offline_page(page, widget_el, shots(tmp_path) / "save-html-falcon-h1-1400.png", 1400, errors, blocked)


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_mamba_save_html_has_no_mlp_panel_to_fill(browser, tmp_path, family):  # noqa: F811
    """Mamba-2 and Mamba (three blocks, no attention, no MLP) on a static page: every row is a scan row, a unit's
    details name it (a Mamba unit is one channel: 64 a row), and the page says there are no MLP neurons instead of an
    empty panel; no console error."""
    with _static_page(browser, tmp_path, tiny_model(family)) as (page, widget_el, heat, blocked, errors):
        ticks = heat.locator("text.dpa-tick").all_text_contents()
        rows = {"L0 scan", "L2 scan"} if family == "mamba" else {"L0 scan", "L1 scan", "L2 scan"}  # (64 units: 9 px
        assert rows <= set(ticks) and not any("attn" in t for t in ticks), ticks  # rows, every other one named)
        assert heat.locator('rect.dpa-head[data-layer="0"]').count() == (64 if family == "mamba" else 4)
        heat.locator('rect.dpa-head[data-layer="2"][data-head="1"]').click()
        title = widget_el.locator(".dpa-detail .dpa-detail-title").first
        title.wait_for(timeout=5_000)
        assert title.inner_text().startswith("scan L2.S1 · "), title.inner_text()
        finish_offline_page(page, widget_el, shots(tmp_path) / f"save-html-{family}-1400.png", 1400, errors, blocked)
        assert "no MLP" in widget_el.inner_text()


@contextlib.contextmanager
def _static_page(browser, tmp_path, model, cells=12):  # noqa: F811
    """The model's attribution (edges, neuron positions, effective targets) saved as a static page and opened
    offline at 1400 px, its head heatmap drawn: (page, widget, heatmap, blocked requests, console errors)."""
    result = dpa.attribute(model, None, random_ids(9).tolist(), edges=True, neuron_positions=True,
                           effective_targets=True)
    path = save_html(CircuitWidget(result, model, None), tmp_path / f"{model.config.model_type}.html")
    page, blocked, errors = open_offline(browser, path, 1400)
    try:
        widget_el = page.locator(".dpa-circuit")
        heat = widget_el.locator("svg.dpa-heatmap").first
        heat.locator("rect.dpa-head").nth(cells - 1).wait_for(timeout=30_000)
        yield page, widget_el, heat, blocked, errors
    finally:
        page.close()


def _hybrid_page(browser, tmp_path, family, kind, hover_l0_h3, title_l2_h1, caption, experts=0):  # noqa: F811
    with _static_page(browser, tmp_path, tiny_model(family, 2)) as (page, widget_el, heat, blocked, errors):
        ticks = heat.locator("text.dpa-tick").all_text_contents()
        assert {f"L0 {kind}", "L1 attn", f"L2 {kind}"} <= set(ticks), ticks
        captions = widget_el.locator(".dpa-panel .dpa-caption").all_inner_texts()
        assert any(caption in c for c in captions), captions
        heat.locator('rect.dpa-head[data-layer="0"][data-head="3"]').hover()
        hover = widget_el.locator(".dpa-hover").inner_text()
        assert hover.startswith(hover_l0_h3), hover
        heat.locator('rect.dpa-head[data-layer="1"][data-head="2"]').hover()
        assert widget_el.locator(".dpa-hover").inner_text().startswith("head L1.H2 (KV group 1): ")
        heat.locator('rect.dpa-head[data-layer="2"][data-head="1"]').click()
        title = widget_el.locator(".dpa-detail .dpa-detail-title").first
        title.wait_for(timeout=5_000)
        assert title.inner_text().startswith(title_l2_h1), title.inner_text()
        if experts:  # every slot of each layer with experts: the routed experts, then the shared one (a dense layer
            sparse = dpa.spec_for(tiny_model(family, 2)).expert_layers  # of a mixed layout, Jamba's: no cells)
            cells = widget_el.locator(".dpa-experts-panel rect.dpa-expert")
            cells.nth(len(sparse) * experts - 1).wait_for(timeout=5_000)
            assert cells.count() == len(sparse) * experts, cells.count()
            assert {int(c.get_attribute("data-layer")) for c in cells.all()} == set(sparse)
            shared = widget_el.locator(".dpa-experts-panel rect.dpa-expert.dpa-shared").count()
            assert shared == (len(sparse) if dpa.spec_for(tiny_model(family, 2)).d_shared else 0), shared
            dense = set(range(3)) - set(sparse)
            labels = widget_el.locator(".dpa-neuron span:nth-child(2)").all_inner_texts()
            assert all((".E" in t or ".S." in t) == (int(t[1]) not in dense) for t in labels), labels
        name = "hybrid" if family == "lfm2" else kind if not experts else f"{family}-experts"
        finish_offline_page(page, widget_el, shots(tmp_path) / f"save-html-{name}-1400.png", 1400, errors, blocked)


MOE_SETUP = f"""\
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})  # the repository: tests.conftest
import dpa
from dpa_widgets import CircuitWidget
from tests.conftest import random_ids, tiny_model
model = tiny_model("qwen2_moe", 2)
result = dpa.attribute(model, None, random_ids(9).tolist(), edges=True, neuron_positions=True)
w = CircuitWidget(result, model, None)
w"""
NOT_SENT = ('print("NOT_SENT", next((l, e) for l in range(3) for e in range(5) if f"expert:{l}:{e}" not in w._details '
            'and e < 4))')
SHOW_EXPERT = ('print("EXPERT", w.selected_expert, w.selection.get("expert", {}).get("name"), '
               '"expert:{}:{}".format(*w.selected_expert) in w._details)')


def test_jupyterlab_moe_experts_panel(lab, browser, tmp_path):  # noqa: F811
    """The tiny Qwen2-MoE in a kernel: the experts panel renders, and an expert clicked in the view is read
    back in Python, its per-position details sent by the kernel."""
    write_notebook(lab.root / "moe.ipynb", [MOE_SETUP, NOT_SENT, SHOW_EXPERT])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, "moe.ipynb")
        out = run_cell(page, 0)
        assert "Error" not in out, out
        widget_el = page.locator(".dpa-circuit")
        page.wait_for_function("() => !document.querySelector('.dpa-circuit select.dpa-target').disabled",
                               timeout=30_000)  # the kernel answered the view's hello: live
        out = run_cell(page, 1)
        found = re.search(r"NOT_SENT \((\d+), (\d+)\)", out)
        assert found, out
        layer, slot = map(int, found.groups())  # a routed expert not sent yet
        widget_el.locator(f'rect.dpa-expert[data-layer="{layer}"][data-expert="{slot}"]').wait_for(timeout=30_000)
        assert widget_el.locator("rect.dpa-expert").count() == 3 * MOE_SLOTS
        widget_el.locator(f'rect.dpa-expert[data-layer="{layer}"][data-expert="{slot}"]').click()
        detail = widget_el.locator(".dpa-detail")
        detail.get_by_text(f"expert L{layer}.E{slot}").wait_for(timeout=10_000)
        page.wait_for_function("() => !document.querySelector('.dpa-circuit .dpa-detail .dpa-missing')",
                               timeout=30_000)  # the details came from the kernel
        assert detail.locator(".dpa-expert-positions").count() == 1
        out = run_cell(page, 2)
        assert f"EXPERT [{layer}, {slot}] E{slot} True" in out, out
        widget_el.locator(f'rect.dpa-expert[data-layer="1"][data-expert="{MOE_SLOTS - 1}"]').hover()
        assert widget_el.locator(".dpa-hover").inner_text().startswith("expert L1.shared: ")
        widget_el.screenshot(path=str(shots(tmp_path) / "lab-moe-expert-selected.png"))
    finally:
        page.close()


# ---------------------------------------------------------------- the circuit graph view

GRAPH_SETUP = f"""\
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})  # the repository: tests.conftest
import dpa
from dpa_widgets import CircuitWidget
from tests.conftest import random_ids, tiny_model
model = tiny_model("llama", kv_heads=2)
ids = random_ids(9).tolist()
result = dpa.attribute(model, None, ids, target=5, edges=True, neuron_positions=True)
circ = dpa.circuit(model, None, ids, target=5, nodes=16)
w = CircuitWidget(result, model, None, circuit=circ)
w"""
SHOW_GRAPH = 'print("GRAPH", repr(w.selected_node), w.graph_threshold, w.selected_edge, sorted(w._graph_verify))'
UNITS = ".dpa-graph-node.dpa-graph-head, .dpa-graph-node.dpa-graph-neuron"


def ink(png: bytes) -> float:
    """The share of a screenshot's pixels that are drawn: coloured (the score scale) or dark (text, outlines)."""
    import io

    from PIL import Image

    pixels = list(Image.open(io.BytesIO(png)).convert("RGB").getdata())
    return sum(1 for p in pixels if max(p) - min(p) > 40 or max(p) < 160) / len(pixels)


def assert_graph_drawn(graph, path: Path, units: int, tokens: int | tuple[int, int]) -> None:
    """The graph has its nodes and edges (``tokens``: how many token nodes, or a (least, most) range: a long
    prompt shows only the positions with something drawn), and its screenshot (saved to ``path``) is not
    blank."""
    assert graph.locator(UNITS).count() == units
    least, most = tokens if isinstance(tokens, tuple) else (tokens, tokens)
    assert least <= graph.locator(".dpa-graph-node.dpa-graph-token").count() <= most
    assert graph.locator(".dpa-graph-node.dpa-graph-target").count() == 1
    assert graph.locator("path.dpa-graph-edge").count() >= units, "every unit has at least its edge to the target"
    share = ink(graph.locator(".dpa-graph-scroll").screenshot(path=str(path)))
    assert share > 0.01, f"the drawing is nearly blank: {share:.2%} of its pixels drawn"


def test_jupyterlab_graph_view(lab, browser, tmp_path):  # noqa: F811
    """The graph of a tiny model's circuit in a kernel: hover lights a node's edges, a click is read back in
    Python, the slider prunes, and verify runs path patching in the kernel and shows the result."""
    write_notebook(lab.root / "graph.ipynb", [GRAPH_SETUP, SHOW_GRAPH])
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        open_notebook(page, lab, "graph.ipynb")
        out = run_cell(page, 0)
        assert "Error" not in out, out
        graph = page.locator(".dpa-circuit .dpa-graph")
        graph.locator(UNITS).nth(15).wait_for(timeout=60_000)
        page.wait_for_function("() => !document.querySelector('.dpa-circuit select.dpa-target').disabled",
                               timeout=30_000)  # the kernel answered the view's hello: live
        assert_graph_drawn(graph, shots(tmp_path) / "lab-graph.png", 16, 9)
        for width in sorted(GRAPH_WIDTHS, reverse=True):  # the window narrows: the graph fits again each time
            page.set_viewport_size({"width": width, "height": 1000})
            found = assert_graph_reads(graph, shots(tmp_path) / f"lab-graph-{width}.png")
            assert found["width"] < width, found
        page.set_viewport_size({"width": 1400, "height": 1000})

        slider = graph.locator("input.dpa-graph-threshold")
        slider.fill("0.5")  # input (prunes live) and change (sets graph_threshold)
        page.wait_for_function(f"() => document.querySelectorAll('{UNITS}').length < 16", timeout=5_000)
        kept = graph.locator(UNITS).count()
        assert 0 < kept < 16 and f"{kept} of 16 units" in graph.locator(".dpa-graph-kept").inner_text()

        unit = graph.locator(UNITS).last
        label = unit.get_attribute("data-label")
        unit.hover()
        graph.locator(f'.dpa-graph-node.dpa-graph-lit[data-label="{label}"]').wait_for(timeout=5_000)
        assert graph.locator("path.dpa-graph-edge.dpa-graph-lit").count() >= 1
        assert graph.locator(".dpa-graph-hover").inner_text().startswith(label)
        graph.locator(".dpa-graph-scroll").screenshot(path=str(shots(tmp_path) / "lab-graph-hover.png"))
        unit.click()
        graph.locator(f'.dpa-graph-node.dpa-graph-selected[data-label="{label}"]').wait_for(timeout=5_000)
        graph.locator(".dpa-graph-panel").get_by_text("top inputs").wait_for()

        flow = graph.locator(".dpa-graph-panel .dpa-graph-flow").first  # its strongest input
        source, destination = flow.get_attribute("data-edge").split("->")
        flow.click()
        verify = graph.locator("button.dpa-graph-verify")
        assert verify.is_enabled(), graph.locator(".dpa-graph-panel").inner_text()
        verify.click()
        result = graph.locator(".dpa-graph-result")
        result.get_by_text("measured change: the destination's score").wait_for(timeout=60_000)
        assert "measured / predicted" in result.inner_text() and "first-order prediction" in result.inner_text()
        assert "Which tells more" in graph.locator(".dpa-graph-verdict").inner_text()
        out = run_cell(page, 1)
        assert f"GRAPH {label!r} 0.5 [{source!r}, {destination!r}] [{f'{source}->{destination}'!r}]" in out, out
        page.screenshot(path=str(shots(tmp_path) / "lab-graph-verified.png"), full_page=True)
    finally:
        page.close()


@pytest.fixture(scope="module")
def long_circuit():
    """A 64-node circuit of a tiny model on a 100-token prompt (the render-time case)."""
    model = tiny_model("llama", kv_heads=2, max_position_embeddings=128)
    ids = random_ids(100).tolist()
    result = dpa.attribute(model, None, ids, target=5)
    return result, dpa.circuit(model, None, ids, target=5, nodes=64)


RENDER_TIME = """async () => {
    const frame = () => new Promise((resolve) => requestAnimationFrame(resolve));
    const t0 = performance.now();
    document.querySelector('.dpa-circuit button.dpa-tab[data-view="graph"]').click();
    while (!document.querySelector('.dpa-graph-node')) await frame();
    await frame(); await frame();  // laid out and painted
    return [performance.now() - t0, Number(document.querySelector('.dpa-graph').dataset.renderMs)];
}"""


def test_graph_save_html_offline_and_render_time(browser, tmp_path, long_circuit, capsys):  # noqa: F811
    """A save_html page with a 64-node graph of a 100-token prompt: drawn offline (no network) within a bound,
    pruned by the slider; verify is off and says why."""
    result, circ = long_circuit
    widget = CircuitWidget(result, circuit=circ, view="scores")
    path = save_html(widget, tmp_path / "graph.html")
    page, blocked, errors = open_offline(browser, path, 1400)
    try:
        widget_el = page.locator(".dpa-circuit")
        widget_el.locator("button.dpa-tab").nth(1).wait_for(timeout=30_000)
        total, drawing = page.evaluate(RENDER_TIME)
        with capsys.disabled():
            print(f"\ngraph render, 64 units on a 100-token prompt ({len(circ.to_json()['edges'])} edges): "
                  f"{total:.0f} ms from the tab click to painted, {drawing:.0f} ms of it drawing (prune, layout, SVG)")
        assert total < 3000, f"{total:.0f} ms to draw the graph"
        graph = widget_el.locator(".dpa-graph")
        assert_graph_drawn(graph, shots(tmp_path) / "save-html-graph.png", 64, (2, 100))
        widget_el.locator(".dpa-offline").get_by_text(STATIC_REASON).wait_for(timeout=15_000)
        assert widget_el.locator("select.dpa-target").is_disabled()
        graph.locator(UNITS).first.click()
        graph.locator(".dpa-graph-panel .dpa-graph-flow").first.click()
        assert graph.locator("button.dpa-graph-verify").is_disabled()
        assert "static page: verifying an edge" in graph.locator(".dpa-graph-reason").inner_text()
        graph.locator("input.dpa-graph-threshold").fill("0.3")
        assert graph.locator(UNITS).count() < 64
        page.screenshot(path=str(shots(tmp_path) / "save-html-graph-pruned.png"), full_page=True)
        assert not errors, errors
        assert not blocked, f"the page asked the network for {blocked}"
    finally:
        page.close()


def graph_page(kind: str, long_circuit, tmp_path: Path) -> Path:
    """The long circuit's graph as a page: the widget's save_html (opened on its graph view) or the CLI's
    ``dpa circuit --html`` page (dpa_widgets.page.circuit_html)."""
    result, circ = long_circuit
    if kind == "widget":
        return save_html(CircuitWidget(result, circuit=circ, view="graph"), tmp_path / "widget.html")
    path = tmp_path / "circuit.html"
    path.write_text(circuit_html(circ), encoding="utf-8")
    return path


@pytest.mark.parametrize("width", [700, 1000, 1400])
@pytest.mark.parametrize("kind", ["widget", "cli"])
def test_graph_reads_at_a_glance(browser, tmp_path, long_circuit, kind, width):  # noqa: F811
    """The 64-unit graph of a 100-token prompt opens whole, inside its container, with no label over a node
    and nothing cut off (the boxes of the drawn elements, tests/browser_utils.py GRAPH_GEOMETRY); the positions
    with nothing drawn share narrow columns."""
    page, blocked, errors = open_offline(browser, graph_page(kind, long_circuit, tmp_path), width)
    try:
        graph = page.locator(".dpa-graph").first
        graph.locator(UNITS).nth(63).wait_for(timeout=30_000)
        found = assert_graph_reads(graph, shots(tmp_path) / f"graph-{kind}-{width}.png")
        assert found["width"] <= width and found["nodes"] == 64 + 1 + found["tokens"], found
        assert found["tokens"] < 100 and graph.locator(".dpa-graph-gap, .dpa-graph-gapband").count() >= 1, "no position compressed"
        assert 0.3 < found["zoom"] <= 1, found
        assert not errors, errors
        assert not blocked, blocked
    finally:
        page.close()


def view_box(graph) -> list[float]:
    return [float(v) for v in graph.locator("svg.dpa-graph-svg").get_attribute("viewBox").split()]


def test_graph_zooms_pans_and_answers_the_keyboard(browser, tmp_path, long_circuit):  # noqa: F811
    """The buttons, ctrl + wheel, a drag and the keys zoom and pan; fit shows the whole circuit again; Tab
    reaches the nodes and Enter selects one; the panel's flows are reached with Tab and chosen with Enter."""
    page, blocked, errors = open_offline(browser, graph_page("cli", long_circuit, tmp_path), 1000)
    try:
        graph = page.locator(".dpa-graph").first
        graph.locator(UNITS).nth(63).wait_for(timeout=30_000)
        fitted = assert_graph_reads(graph)
        zoom = lambda: float(graph.get_attribute("data-zoom"))  # noqa: E731
        graph.locator("button.dpa-graph-zoom-in").click()
        assert zoom() == pytest.approx(fitted["zoom"] * 1.25, rel=1e-3)
        graph.locator("button.dpa-graph-zoom-out").click()
        assert zoom() == pytest.approx(fitted["zoom"], rel=1e-3)
        viewport = graph.locator(".dpa-graph-viewport")
        box = viewport.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.keyboard.down("Control")
        page.mouse.wheel(0, -200)
        page.keyboard.up("Control")
        assert zoom() > fitted["zoom"] * 1.2, "ctrl + wheel zooms in"
        before = view_box(graph)
        page.mouse.move(box["x"] + 5, box["y"] + box["height"] - 5)  # a corner: background, not a node
        page.mouse.down()
        page.mouse.move(box["x"] + 85, box["y"] + box["height"] - 45, steps=5)
        page.mouse.up()
        after = view_box(graph)
        assert after[0] < before[0] and after[1] > before[1], (before, after)  # dragged right and up
        graph.locator("button.dpa-graph-fit").click()
        assert_graph_reads(graph)
        assert zoom() == pytest.approx(fitted["zoom"], rel=1e-3)

        viewport.focus()
        page.keyboard.press("+")
        assert zoom() == pytest.approx(fitted["zoom"] * 1.25, rel=1e-3)
        start = view_box(graph)
        page.keyboard.press("ArrowRight")
        assert view_box(graph)[0] > start[0], "the arrow keys pan"
        page.keyboard.press("0")
        assert zoom() == pytest.approx(fitted["zoom"], rel=1e-3)
        label = "() => document.activeElement.getAttribute('data-label')"
        page.keyboard.press("Tab")  # one stop for the graph's nodes: the target (a roving tabindex)
        assert page.evaluate(label) == "target", "Tab does not reach the nodes"
        page.keyboard.press("ArrowDown")  # from node to node
        focused = page.evaluate(label)
        assert focused and focused != "target", focused
        page.keyboard.press("Enter")
        title = graph.locator(".dpa-graph-panel .dpa-graph-title")
        assert title.inner_text().startswith(focused), title.inner_text()
        assert page.evaluate(label) == focused, "the focus stays on the node it selected"
        page.keyboard.press("Tab")  # out of the graph in one step
        assert page.evaluate(label) is None
        page.keyboard.press("Shift+Tab")
        assert page.evaluate(label) == focused, "back to the selected node"
        page.keyboard.press("Escape")
        assert graph.locator(".dpa-graph-panel .dpa-graph-title").count() == 0, "Escape clears the selection"

        graph.locator(UNITS).first.click()
        flow = graph.locator(".dpa-graph-panel .dpa-graph-flow").first
        flow.focus()
        page.keyboard.press("Enter")
        graph.locator(".dpa-graph-panel .dpa-graph-verify").wait_for(timeout=5_000)
        assert not errors, errors
        assert not blocked, blocked
    finally:
        page.close()
