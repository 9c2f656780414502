"""The tutorial book: its notebooks as committed, the Jupyter Book build (warnings are errors),
and the built pages in Chromium opened from disk with the network blocked.

The notebooks themselves run under ``pytest --nbmake book/`` (their asserts are the tests).
Building executes the notebooks (some load the default model), so the build and the page tests
are marked ``slow``; the build runs once per module into a temporary folder and the browser tests
read that output. A notebook that nbmake ran in the same session is not executed again: the build
shows that run's outputs (tests/conftest.py keeps them; they go into the build's execution cache). To check an existing build instead, point ``DPA_BOOK_HTML`` at its ``_build/html``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml

from .browser_utils import GRAPH_WIDTHS, assert_graph_reads, browser  # noqa: F401 (fixture)
from .conftest import BOOK_BUILD, EXECUTED_NOTEBOOKS

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
EQUATION_PAGE = "rmsnorm"
WIDGET_PAGE = "inspecting-circuits"
GRAPH_PAGE = "circuits-as-graphs"  # the widget's graph view, from saved state


def toc_files() -> list[str]:
    """The documents of _toc.yml, relative to the root and without suffix (``book/glu``)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def notebooks() -> list[Path]:
    return sorted(BOOK.glob("*.ipynb"))


class TestCommittedNotebooks:
    def test_every_notebook_is_in_the_toc_and_every_toc_entry_exists(self):
        listed = toc_files()
        for nb in notebooks():
            assert f"book/{nb.stem}" in listed, f"{nb.name} is not listed in _toc.yml"
        for name in listed:
            assert [p for p in (ROOT / f"{name}.ipynb", ROOT / f"{name}.md") if p.exists()], f"{name} is missing"

    def test_names_are_hyphenated(self):
        for name in toc_files():
            assert re.fullmatch(r"book/[a-z0-9]+(-[a-z0-9]+)*", name), name

    def test_every_repository_path_the_docs_name_exists(self):
        """A file or folder named in backticks (`benchmarks/...`, `book/...`, `dpa/...`, `tests/...`) in README.md,
        the results README or a chapter's prose exists: a renamed result must not leave a reader a dead pointer."""
        texts = {name: (ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "benchmarks/results/README.md")}
        for nb in notebooks():
            cells = json.loads(nb.read_text())["cells"]
            texts[nb.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        pattern = re.compile(r"`((?:benchmarks|book|dpa|dpa_widgets|tests|\.ci)/[^`\s:]*)`")
        missing = [(name, path) for name, text in texts.items() for path in pattern.findall(text)
                   if not re.search(r"[<>*{}]", path) and not (ROOT / path).exists()]
        assert not missing, missing

    def test_nothing_cites_the_project_notes_outside_the_repository(self):
        """A reader has the repository, not the team's notes: help texts, pages, docstrings and chapters cite the
        book's chapters instead of method.md and the other notes beside the repository."""
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
        cited = []
        for name in listed:
            if name == "tests/test_book.py":  # this test names them
                continue
            if name.endswith((".py", ".md", ".ipynb", ".toml", ".yml", ".js", ".css", ".html", ".txt")) and (ROOT / name).is_file():
                text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
                cited += [(name, note) for note in ("method.md", "style.md", "environment.md") if note in text]
        assert not cited, cited

    @pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
    def test_committed_without_outputs(self, path):
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"cell {i} has outputs"
        assert "widgets" not in nb["metadata"], "saved widget state is committed"

    @pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
    def test_no_chdir(self, path):
        source = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        assert "chdir" not in source

    @pytest.mark.parametrize("path", [p for p in notebooks() if p.stem != WIDGET_PAGE], ids=lambda p: p.name)
    def test_chapters_assert(self, path):
        """Every chapter checks what it shows: the asserts are what nbmake tests."""
        source = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        assert re.search(r"\bassert\b|assert_close", source)


def build_config(out: Path) -> tuple[Path, list[str]]:
    """_config.yml for a build into ``out`` that takes each notebook nbmake already ran in this session from an
    execution cache holding that run (the others are executed). Returns the config and the reused notebooks."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    cache = get_cache(str(out / "execution-cache"))
    reused = []
    for path in notebooks():
        executed = EXECUTED_NOTEBOOKS.get(str(path.resolve()))
        if executed is None:
            continue
        # the committed notebook with the run's outputs: the cache matches notebooks by their code and metadata,
        # and the run added timings to each cell's metadata
        nb = nbformat.read(str(path), as_version=4)
        if [c.source for c in nb.cells] != [c.source for c in executed.cells]:
            continue  # edited since nbmake ran it: the build executes it
        for cell, ran in zip(nb.cells, executed.cells):
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
        nb.metadata.update({k: v for k, v in executed.metadata.items() if k in ("language_info", "widgets")})
        cache.cache_notebook_bundle(CacheBundleIn(nb, str(path)), check_validity=False, overwrite=True)
        reused.append(path.stem)
    config["execute"].update(execute_notebooks="cache", cache=str(out / "execution-cache"))
    # paths in the config are read from the config's folder: name them absolutely
    config["sphinx"]["local_extensions"] = {name: str(ROOT / folder)
                                            for name, folder in config["sphinx"]["local_extensions"].items()}
    path = out / "_config.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, reused


@pytest.fixture(scope="module")
def built_book(tmp_path_factory, pytestconfig) -> Path:
    """Build the book once into a temporary folder (executing the notebooks nbmake did not run in this session);
    return its html/.

    The build time and each executed notebook's time go to the terminal summary (tests/conftest.py)."""
    if os.environ.get("DPA_BOOK_HTML"):
        return Path(os.environ["DPA_BOOK_HTML"])
    out = tmp_path_factory.mktemp("book")
    config, reused = build_config(out)
    jb = Path(sys.executable).with_name("jupyter-book")  # this interpreter's CLI (there is no python -m entry)
    cmd = [str(jb if jb.exists() else "jupyter-book"), "build", str(ROOT), "--path-output", str(out), "-W", "-n",
           "--keep-going", "--config", str(config)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    seconds = time.monotonic() - start
    executed = re.finditer(r"([\w.-]+)\.ipynb: Executed notebook in ([\d.]+) seconds", log)
    pytestconfig.stash[BOOK_BUILD] = {"seconds": seconds, "notebooks": {m[1]: float(m[2]) for m in executed},
                                      "reused": reused}
    assert proc.returncode == 0, f"jupyter-book build failed ({proc.returncode}):\n{log[-6000:]}"
    print(f"book built in {seconds:.0f} s")
    return out / "_build" / "html"


@pytest.mark.slow
class TestBuild:
    def test_each_notebook_ran_once(self, built_book, pytestconfig):
        """A notebook nbmake ran is shown from that run (the cache matched it), every other one is executed."""
        build = pytestconfig.stash.get(BOOK_BUILD, None)
        if build is None:
            pytest.skip("DPA_BOOK_HTML: an existing build")
        executed, reused = set(build["notebooks"]), set(build["reused"])
        assert not executed & reused, f"executed again although nbmake ran them: {sorted(executed & reused)}"
        assert executed | reused == {p.stem for p in notebooks()}

    def test_every_chapter_is_a_page(self, built_book):
        for name in toc_files():
            assert (built_book / f"{name}.html").is_file(), name
        assert (built_book / "index.html").is_file()

    def test_pages_load_nothing_from_the_network(self, built_book):
        for name in toc_files():
            html = (built_book / f"{name}.html").read_text()
            sources = re.findall(r'<(?:script|link)\b[^>]*(?:src|href)="([^"]+)"', html)
            remote = [s for s in sources if re.match(r"(https?:)?//", s)]
            assert not remote, f"{name} loads {remote}"
            assert "dpa-assets/mathjax/tex-mml-chtml.js" in html or "class=\"math" not in html

    def test_offline_assets_are_copied(self, built_book):
        assets = built_book / "_static" / "dpa-assets"
        for rel in ("mathjax/tex-mml-chtml.js", "require.js", "html-manager/embed-amd.js", "anywidget.js"):
            assert (assets / rel).is_file(), rel

    def test_executed_pages_carry_outputs(self, built_book):
        html = (built_book / "book" / "end-to-end.html").read_text()
        assert "cell_output" in html and "<img" in html  # printed numbers and the figure

    def test_the_exercises_cite_equations_by_the_numbers_the_pages_show(self, built_book):
        """The checkers' messages name equations by number (dpa.exercises._equations.equation_numbers): each is the number
        the built page shows beside that equation."""
        from dpa.exercises._equations import equation_numbers

        numbers = equation_numbers()
        assert len(numbers) > 50
        for label, (chapter, n) in numbers.items():
            html = (built_book / "book" / f"{chapter}.html").read_text()
            shown = re.search(rf'id="equation-{label}">\s*<span class="eqno">\((\d+)\)', html)
            assert shown and int(shown[1]) == n, (label, n, shown and shown[1])

    def test_exercise_solutions_are_folded_with_their_verdicts_shown(self, built_book):
        """Each chapter's solutions sit in closed "Show the solution" toggles; the learner's cell shows "not answered
        yet" and the folded solution's check "passed" (its output stays visible under the toggle)."""
        for nb in notebooks():
            cells = json.loads(nb.read_text())["cells"]
            solutions = [c for c in cells if c["cell_type"] == "code" and "solution" in c["metadata"].get("tags", [])]
            if not solutions:
                continue
            html = (built_book / "book" / f"{nb.stem}.html").read_text()
            folded = re.findall(r'<details class="[^"]*\bhide\b[^"]*above-input"[^>]*>\s*<summary[^>]*>\s*'
                                r'<p class="collapsed admonition-title">Show the solution</p>', html)
            assert len(folded) == len(solutions), (nb.stem, len(folded), len(solutions))
            text = re.sub(r"<[^>]+>", "", html)
            assert text.count("passed --") == len(solutions) and "not answered yet" in text, nb.stem


def shot_folder() -> Path:
    """Where the book tests' screenshots go: ``$DPA_SCREENSHOTS`` when set (to look at them), else a temporary
    folder."""
    import tempfile

    folder = Path(os.environ.get("DPA_SCREENSHOTS") or tempfile.mkdtemp(prefix="dpa-book-shots-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_offline(browser, page_file: Path, page=None):  # noqa: F811 (the fixture is passed in)
    """A page from disk with every non-file request blocked (in ``page``, or a new one); returns (page, blocked
    URLs)."""
    page = page or browser.new_page()
    blocked: list[str] = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(page_file.as_uri())
    return page, blocked


def in_flight(page) -> set:
    """The page's requests not yet answered, from now on (a set kept up to date as they come and go)."""
    pending: set = set()
    page.on("request", lambda r: pending.add(r))
    page.on("requestfinished", lambda r: pending.discard(r))
    page.on("requestfailed", lambda r: pending.discard(r))
    return pending


def settle(page, pending: set, quiet_ms: int = 500, timeout_s: float = 120) -> None:
    """Wait until the page has had no request in flight (``pending``, from ``in_flight``) for ``quiet_ms``: what it
    loads late is then answered, its console errors logged. Counted from the requests themselves, not Chromium's
    "networkidle" event, which a loaded CI machine missed for 30 s on a page this machine saw idle in 2 s; a page
    still loading after ``timeout_s`` fails with the URLs it waits on."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        page.wait_for_timeout(100)  # (lets Playwright dispatch the request events and the route handler)
        if pending:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_ms / 1000:
            return
    raise AssertionError(f"{page.url} still loads after {timeout_s:.0f} s: " + ", ".join(r.url for r in pending))


def console_problems(page) -> list[str]:
    """Collect the page's console errors and uncaught exceptions from now on (the list fills as they come)."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console error: {m.text} ({m.location.get('url', '')})")
            if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    return problems


CODE_WIDTHS = (1000, 1400)  # the book's column at a narrow and a wide window


@pytest.fixture(scope="module")
def every_page(built_book, browser):  # noqa: F811
    """Every page opened once, from disk offline: its console problems, blocked requests, and at each of
    ``CODE_WIDTHS`` the code blocks and outputs wider than their column (one load per page serves both tests)."""
    seen = {}
    for name in ["index"] + toc_files():
        page = browser.new_page(viewport={"width": CODE_WIDTHS[0], "height": 900})
        problems, pending = console_problems(page), in_flight(page)
        try:
            page, blocked = open_offline(browser, built_book / f"{name}.html", page)
            if name == f"book/{WIDGET_PAGE}":
                page.locator(".dpa-circuit").first.locator("rect.dpa-head").first.wait_for(timeout=60_000)
            if name == f"book/{GRAPH_PAGE}":
                page.locator(".dpa-graph-nodes").first.wait_for(timeout=60_000)
            settle(page, pending)
            wide = {}
            for width in CODE_WIDTHS if name != "index" else ():  # (index.html only redirects to the first chapter)
                page.set_viewport_size({"width": width, "height": 900})
                wide[width] = page.evaluate("() => [...document.querySelectorAll('pre')].filter(p => p.offsetParent "
                                            "!== null && p.scrollWidth > p.clientWidth + 1).map(p => "
                                            "p.textContent.slice(0, 60))")
        finally:
            page.close()
        seen[name] = {"problems": problems, "blocked": blocked, "wide": wide}
    return seen


@pytest.mark.slow
@pytest.mark.browser
class TestBuiltPagesInBrowser:
    def test_pages_log_no_console_error(self, every_page):
        """Every page, opened from disk offline, loads without a console error or an uncaught exception: no
        script declared twice (sphinx-thebe's THEBE_JS_URL), no theme-mode complaint, no asset that fails to load
        (the html-manager's fonts on the widget page, which load once the widget has rendered)."""
        found = {name: seen["problems"] for name, seen in every_page.items() if seen["problems"]}
        assert not found, "\n".join(f"{name}: {p}" for name, problems in found.items() for p in problems)
        blocked = {name: seen["blocked"] for name, seen in every_page.items() if seen["blocked"]}
        assert not blocked, f"network requests: {blocked}"

    @pytest.mark.parametrize("width", CODE_WIDTHS)
    def test_no_code_line_is_cut_off(self, every_page, width):
        """Every code block and printed output of every page fits its column (wrapped where long): nothing hidden
        behind a scrollbar at the book's width."""
        cut = {name: seen["wide"][width] for name, seen in every_page.items() if seen["wide"].get(width)}
        assert not cut, cut
        assert sum(width in seen["wide"] for seen in every_page.values()) == len(toc_files())

    def test_equations_render_offline(self, built_book, browser):  # noqa: F811
        page, blocked = open_offline(browser, built_book / "book" / f"{EQUATION_PAGE}.html")
        try:
            page.wait_for_selector("mjx-container", timeout=30_000)
            page.wait_for_function("() => [...document.querySelectorAll('.math')].every("
                                   "e => e.querySelector('mjx-container'))", timeout=30_000)
            n_math = page.locator(".math").count()
            assert n_math >= 10
            assert page.locator(".math mjx-container").count() == n_math
            assert page.locator("mjx-container[display='true']").count() >= 4  # the labelled equations
            assert page.locator("mjx-merror").count() == 0  # no TeX errors
            assert not blocked, f"network requests: {blocked}"
        finally:
            page.close()

    def test_widget_renders_from_saved_state(self, built_book, browser):  # noqa: F811
        page_file = built_book / "book" / f"{WIDGET_PAGE}.html"
        assert 'type="application/vnd.jupyter.widget-state+json"' in page_file.read_text()
        page, blocked = open_offline(browser, page_file)
        try:
            widget = page.locator(".dpa-circuit").first
            widget.locator("rect.dpa-head").first.wait_for(timeout=60_000)
            assert widget.locator("rect.dpa-head").count() > 0
            assert widget.locator(".dpa-token").count() > 0
            assert not blocked, f"network requests: {blocked}"
        finally:
            page.close()


    def test_graph_view_renders_from_saved_state(self, built_book, browser):  # noqa: F811
        """The chapter's circuit graph draws offline in the static page: nodes, edges, the pruning slider at the
        threshold the chapter set, and the selected node's panel."""
        page_file = built_book / "book" / f"{GRAPH_PAGE}.html"
        assert 'type="application/vnd.jupyter.widget-state+json"' in page_file.read_text()
        page, blocked = open_offline(browser, page_file)
        try:
            nodes = page.locator(".dpa-graph-nodes").first
            nodes.wait_for(timeout=60_000)
            assert nodes.locator("> *").count() > 10
            assert page.locator(".dpa-graph-edges path").count() > 10
            assert "L23.H0@13" in page.locator(".dpa-graph-panel").first.inner_text()
            graph = page.locator(".dpa-graph").first
            for width in GRAPH_WIDTHS:  # the book's column at each width: the whole graph, nothing cut off
                page.set_viewport_size({"width": width, "height": 900})
                graph.scroll_into_view_if_needed()
                assert_graph_reads(graph, shot_folder() / f"book-graph-{width}.png")
            assert not blocked, f"network requests: {blocked}"
        finally:
            page.close()
