"""Serve MathJax and the widget runtime from local files, so the built book works offline.

Sphinx loads MathJax from a CDN by default, and myst-nb loads require.js and the
ipywidgets html-manager from CDNs. ``_config.yml`` points ``mathjax_path`` and
``nb_ipywidgets_js`` at ``_static/dpa-assets/``; this extension fills that folder
after the build from npm packages (``npm install`` at the repository root, which
.ci/install runs, puts them in ``node_modules/``; never committed)
and from anywidget's Python package (its AMD module for the html-manager).

The npm packages (``package.json`` at the repository root) are looked up in ``$DPA_NODE_MODULES`` or
``<repo>/node_modules``.

It also drops inline scripts that a page would declare twice. Sphinx 7.4 adds an inline script registered
after the builder started (sphinx-thebe's ``const THEBE_JS_URL = ...``, sphinx-togglebutton's selector) to every
page twice, once with the file name None and once with ''; the second ``const`` is a SyntaxError in the
browser's console on every page.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

# The repository's package.json pins mathjax 3.2.2, requirejs 2.3.7, @jupyter-widgets/html-manager 1.0.15.
NPM_INSTALL = "npm install --no-audit --no-fund"
ASSETS = "dpa-assets"
# MathJax: the combined component Sphinx asks for, plus what it loads on demand
# (TeX extensions, fonts, the menu); the speech engine (sre) is left out.
MATHJAX_KEEP = ("tex-mml-chtml.js", "input", "output", "ui", "a11y", "adaptors")


def node_modules(app: Sphinx) -> Path:
    return Path(os.environ.get("DPA_NODE_MODULES") or Path(app.confdir) / "node_modules")


def _anywidget_amd() -> Path:
    import anywidget

    return Path(anywidget.__file__).parent / "nbextension" / "index.js"


def sources(app: Sphinx) -> dict[str, Path]:
    """Each asset's place under _static/dpa-assets and the file or folder it is copied from."""
    nm = node_modules(app)
    out = {
        "require.js": nm / "requirejs" / "require.js",
        "html-manager": nm / "@jupyter-widgets" / "html-manager" / "dist",
        "anywidget.js": _anywidget_amd(),
    }
    for name in MATHJAX_KEEP:
        out[f"mathjax/{name}"] = nm / "mathjax" / "es5" / name
    return out


def check_assets(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    missing = [str(p) for p in sources(app).values() if not p.exists()]
    if missing:
        raise ExtensionError(
            "the offline book assets are missing: " + ", ".join(missing)
            + ". Fetch them with `npm install` at the repository root (package.json lists them), or with\n  "
            + NPM_INSTALL + "\n(or set DPA_NODE_MODULES to a node_modules folder holding them)")


def copy_assets(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    root = Path(app.outdir) / "_static" / ASSETS
    for name, src in sources(app).items():
        dest = root / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.map", "embed.js", "embed.js.LICENSE.txt", "libembed-amd.js"))
        else:
            shutil.copy2(src, dest)


def drop_duplicate_scripts(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Keep the first of scripts that differ only by a file name of None or '' (an inline script twice)."""
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, unique = set(), []
    for script in scripts:
        attributes = getattr(script, "attributes", {})
        key = (getattr(script, "filename", script) or "", getattr(script, "priority", None),
               tuple(sorted((k, str(v)) for k, v in attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique  # the builder restores its own list before the next page


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", check_assets)
    app.connect("html-page-context", drop_duplicate_scripts)
    app.connect("build-finished", copy_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
