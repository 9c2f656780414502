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
