"""Shared browser-test helpers: a JupyterLab server started by the test, and Debian's Chromium
driven by Playwright (never ``playwright install``: it downloads a browser).

Use in a test module::

    from .browser_utils import browser, lab, open_notebook, run_cell, write_notebook  # noqa: F401 (fixtures)

``lab`` (module scope) starts JupyterLab on 127.0.0.1 in a temporary root with isolated
config, runtime, settings and workspace folders, and stops it by PID; ``browser`` (module
scope) is a headless Chromium. Tests using them are marked ``browser``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = os.environ.get("DPA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IDLE = "Python 3 (ipykernel) | Idle"
# Turn off the "Jupyter news" toast (it can cover cells) and update checks.
SETTING_OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


@dataclass
class Lab:
    url: str  # http://127.0.0.1:PORT
    root: Path  # the server's root folder: notebooks written here open at /lab/tree/NAME
    process: subprocess.Popen
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(base: Path, timeout: float = 90.0) -> Lab:
    """Start JupyterLab in ``base``/root with every per-user folder inside ``base``."""
    root, config, runtime = base / "root", base / "config", base / "runtime"
    for folder in (root, config / "labconfig", runtime):
        folder.mkdir(parents=True, exist_ok=True)
    (config / "labconfig" / "default_setting_overrides.json").write_text(json.dumps(SETTING_OVERRIDES))
    port = free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_PLATFORM_DIRS": "1", "PYTHONUNBUFFERED": "1"}
    log = base / "lab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
           "--LabApp.extension_manager=readonly", "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
           f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={base / 'settings'}",
           f"--LabApp.workspaces_dir={base / 'workspaces'}"]
    with open(log, "w") as fh:
        process = subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=2) as response:
                if response.status == 200:
                    return Lab(url, root, process, log)
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_lab(Lab(url, root, process, log))
            raise RuntimeError(f"JupyterLab did not answer in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def stop_lab(lab: Lab) -> None:
    """Stop the server (and so its kernels) by PID."""
    if lab.process.poll() is None:
        lab.process.terminate()
        try:
            lab.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            lab.process.kill()
            lab.process.wait(timeout=10)


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Iterator[Lab]:
    server = start_lab(tmp_path_factory.mktemp("jupyterlab"))
    try:
        yield server
    finally:
        stop_lab(server)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        pytest.fail(f"no Chromium at {CHROMIUM} (apt-get install chromium; or set DPA_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A minimal nbformat-4 notebook of code cells (no outputs)."""
    nb = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"cell-{i}", "metadata": {}, "outputs": [],
                   "source": src} for i, src in enumerate(cells)],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))
    return path


def open_notebook(page, lab: Lab, name: str, timeout_ms: int = 120_000) -> None:
    """Open ``name`` (relative to the lab root) and wait for its kernel to be idle."""
    page.goto(f"{lab.url}/lab/tree/{name}?reset")  # ?reset: no notebooks of earlier tests restored beside it
    page.get_by_text(IDLE).first.wait_for(timeout=timeout_ms)


def wait_idle(page, timeout_ms: int = 300_000) -> None:
    """Wait until the kernel has finished what was queued (status bar back to Idle)."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem, .jp-StatusBar-Item')]"
        ".some(e => e.textContent.includes('| Idle'))", timeout=timeout_ms)


def run_cell(page, index: int, timeout_ms: int = 300_000) -> str:
    """Run code cell ``index`` of the open notebook and return its output text once it finished.

    A cell finished when its prompt shows an execution count ("[n]:"), not "[*]:".
    """
    # the notebook in view: a notebook another test left open sits in a hidden tab with cells of its own
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell").nth(index)
    cell.scroll_into_view_if_needed()  # JupyterLab renders only the cells near the view (below a tall widget)
    prompt = cell.locator(".jp-InputArea-prompt")
    before = prompt.inner_text()
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")
    page.wait_for_function("([el, before]) => el.textContent !== before && /\\[\\d+\\]/.test(el.textContent)",
                           arg=[prompt.element_handle(), before], timeout=timeout_ms)
    return cell.locator(".jp-OutputArea").inner_text()


# ---------------------------------------------------------------- the circuit graph's geometry

GRAPH_WIDTHS = (700, 1000, 1400)  # the page widths the graph must read at (issue 31)

# Measures a drawn ``.dpa-graph`` (dpa_widgets/static/src/graph.js) from its elements' boxes: every node wholly in the
# viewport, no two nodes overlapping, each node's text inside its box, the verified-edge marks and the "⋯" of
# compressed positions in view and clear of the nodes and of each other, the slanted token labels not cut off,
# the row labels in their strip and apart, the graph no wider than its container, the panel beside or below it.
GRAPH_GEOMETRY = """(root) => {
  const problems = [];
  const R = (el) => el.getBoundingClientRect();
  const name = (el) => (el.closest("[data-label]")?.getAttribute("data-label") || el.textContent || el.className.baseVal || "").slice(0, 40);
  const inside = (r, o, t = 0.5) => r.left >= o.left - t && r.right <= o.right + t && r.top >= o.top - t && r.bottom <= o.bottom + t;
  const overlap = (a, b, t = 0.5) => a.left < b.right - t && b.left < a.right - t && a.top < b.bottom - t && b.top < a.bottom - t;
  const vpEl = root.querySelector(".dpa-graph-viewport"), vp = R(vpEl);
  const frame = R(root.querySelector(".dpa-graph-scroll"));
  const nodes = [...root.querySelectorAll(".dpa-graph-node rect")];
  const nodeR = nodes.map(R);
  nodes.forEach((n, i) => { if (!inside(nodeR[i], vp)) problems.push(`node ${name(n)} not wholly in view`); });
  for (let i = 0; i < nodes.length; i++) for (let j = i + 1; j < nodes.length; j++)
    if (overlap(nodeR[i], nodeR[j])) problems.push(`nodes ${name(nodes[i])} and ${name(nodes[j])} overlap`);
  root.querySelectorAll(".dpa-graph-node text").forEach((t) => {
    const r = R(t), box = R(t.parentNode.querySelector("rect"));
    if (!inside(r, box, 1)) problems.push(`the text of ${name(t)} runs out of its box`);
  });
  const free = [...root.querySelectorAll(".dpa-graph-check, .dpa-graph-gap")];
  free.forEach((t, i) => {
    const r = R(t);
    if (!inside(r, vp)) problems.push(`label ${name(t)} not wholly in view`);
    nodeR.forEach((b, j) => { if (overlap(r, b)) problems.push(`label ${name(t)} over node ${name(nodes[j])}`); });
    free.slice(i + 1).forEach((u) => { if (overlap(r, R(u))) problems.push(`labels ${name(t)} and ${name(u)} overlap`); });
  });
  root.querySelectorAll(".dpa-graph-toklabel").forEach((t) => { if (!inside(R(t), vp)) problems.push(`token label ${name(t)} cut off`); });
  const rows = [...root.querySelectorAll(".dpa-graph-rowlabel")], strip = R(root.querySelector(".dpa-graph-rows"));
  rows.forEach((t, i) => {
    const r = R(t);
    if (!inside(r, strip)) problems.push(`row label ${name(t)} cut off`);
    if (t.scrollWidth > t.clientWidth + 1) problems.push(`row label ${name(t)} cut short`);
    nodeR.forEach((b, j) => { if (overlap(r, b)) problems.push(`row label ${name(t)} over node ${name(nodes[j])}`); });
    rows.slice(i + 1).forEach((u) => { if (overlap(r, R(u))) problems.push(`row labels ${name(t)} and ${name(u)} overlap`); });
  });
  const host = root.parentElement ? R(root.parentElement) : frame;
  if (frame.right > host.right + 1 || frame.left < host.left - 1) problems.push(`the graph is wider than its container (${frame.width} > ${host.width})`);
  const panel = root.querySelector(".dpa-graph-panel");
  if (panel && overlap(R(panel), frame)) problems.push("the panel covers the graph");
  const target = root.querySelector(".dpa-graph-node.dpa-graph-target rect");
  return { problems, nodes: nodes.length, tokens: root.querySelectorAll(".dpa-graph-node.dpa-graph-token").length,
    zoom: Number(root.dataset.zoom), width: frame.width, height: vp.height, target: !!target && inside(R(target), vp) };
}"""


def graph_problems(graph) -> dict:
    """GRAPH_GEOMETRY of a ``.dpa-graph`` locator: {"problems": [...], "nodes", "tokens", "zoom", "width",
    "height", "target" (the target wholly in view)}."""
    return graph.evaluate(GRAPH_GEOMETRY)


def assert_graph_reads(graph, shot: Path | None = None) -> dict:
    """The drawn graph passes GRAPH_GEOMETRY, shows its target and token row; a screenshot goes to ``shot``."""
    graph.page.wait_for_function("(el) => Number(el.dataset.zoom) > 0", arg=graph.element_handle(), timeout=10_000)
    graph.page.wait_for_timeout(150)  # a resize refits on the next frame
    found = graph_problems(graph)
    if shot is not None:
        graph.screenshot(path=str(shot))
    assert not found["problems"], "\n".join(found["problems"][:20])
    assert found["target"], "the target is not in view"
    assert found["tokens"] > 0, "no token drawn"
    return found
