"""The tutorial book: it builds with warnings as errors, and its built pages render offline.

The build executes every notebook (some load the default model), so these tests are slow. To check an
existing build instead, point ``DPA_BOOK_HTML`` at its ``_build/html`` folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .browser_utils import browser  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
EQUATION_PAGE = "book/rmsnorm.html"
WIDGET_PAGE = "book/inspecting-circuits.html"
CDNS = ("cdn.jsdelivr.net", "unpkg.com", "cdnjs.cloudflare.com", "cdn.mathjax.org")


def toc_pages() -> list[str]:
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


@pytest.fixture(scope="module")
def html(tmp_path_factory) -> Path:
    if os.environ.get("DPA_BOOK_HTML"):
        return Path(os.environ["DPA_BOOK_HTML"])
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")  # the CLI of this interpreter (no python -m entry)
    cmd = [str(jb if jb.exists() else "jupyter-book"), "build", str(ROOT), "-W", "-n", "--keep-going",
           "--path-output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"jupyter-book build failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return out / "_build" / "html"


@pytest.mark.slow
def test_build_has_every_chapter_and_no_cdn(html):
    for page in toc_pages():
        built = html / f"{page}.html"
        assert built.exists(), f"{built} was not built"
        text = built.read_text()
        assert not any(cdn in text for cdn in CDNS), f"{page} loads a script from a CDN"
    assert (html / "_static" / "dpa-assets" / "mathjax" / "tex-mml-chtml.js").exists()
    assert (html / "_static" / "dpa-assets" / "html-manager" / "embed-amd.js").exists()


def open_offline(browser, path: Path):
    """A page showing ``path`` with every request that is not for a local file aborted (and recorded)."""
    page = browser.new_page()
    page.blocked = []

    def route(r):
        if r.request.url.startswith("file:"):
            r.continue_()
        else:
            page.blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(path.as_uri())
    return page


@pytest.mark.slow
@pytest.mark.browser
def test_equations_render_offline(html, browser):
    page = open_offline(browser, html / EQUATION_PAGE)
    try:
        page.wait_for_selector("mjx-container", timeout=60_000)
        assert page.locator("mjx-container[display='true']").count() >= 3  # the labelled equations
        assert page.locator("mjx-merror").count() == 0, "MathJax reported a TeX error"
        assert page.blocked == [], f"the page asked the network for {page.blocked}"
    finally:
        page.close()


@pytest.mark.slow
@pytest.mark.browser
def test_widget_renders_offline_from_saved_state(html, browser):
    if not (html / WIDGET_PAGE).exists():
        pytest.skip(f"{WIDGET_PAGE} is not in the book yet")
    page = open_offline(browser, html / WIDGET_PAGE)
    try:
        widget = page.locator(".dpa-circuit").first
        widget.locator("rect.dpa-head").first.wait_for(timeout=60_000)
        assert widget.locator(".dpa-token").count() > 0
        assert page.blocked == [], f"the page asked the network for {page.blocked}"
    finally:
        page.close()
