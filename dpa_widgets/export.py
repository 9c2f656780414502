"""``save_html``: the widget as one standalone HTML file that renders with no kernel and no network.

The page inlines require.js, the ipywidgets html-manager (embed-amd.js) and anywidget's AMD
module (``assets.py``), then the widget state (``drop_defaults=False``, so ``_esm``/``_css``
travel with it). Live controls are off in the file; the selection, hover, details sent
so far (the top heads and neurons, and whatever was selected) and the exports still work.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ipywidgets.embed import dependency_state, embed_data

from dpa import Attribution, InputTypeError
from dpa.result import write_text

from .assets import ensure_assets
from .circuit import CircuitWidget

STATE_MIME = "application/vnd.jupyter.widget-state+json"
VIEW_MIME = "application/vnd.jupyter.widget-view+json"
OFFLINE = {"_live": False, "_busy": False, "_error": "", "_methods": ["dpa"]}


def _inline(source: str) -> str:
    """Script text safe inside <script>: no closing tag or comment opener can end it early."""
    return source.replace("</script", "<\\/script").replace("<!--", "<\\!--")


def _json(data) -> str:
    return json.dumps(data, allow_nan=False).replace("</", "<\\/")  # strict: a bare NaN would break the page


def page(widget: CircuitWidget, title: str = "dpa circuit inspector") -> str:
    """The standalone HTML text for ``widget``."""
    assets = ensure_assets()
    data = embed_data(views=[widget], drop_defaults=False, state=dependency_state([widget], drop_defaults=False))
    state = data["manager_state"]
    state["state"][widget.model_id]["state"].update(OFFLINE)
    # anywidget's AMD module calls an anonymous define(); name it "anywidget" for require.js.
    anywidget_amd = ("(function () {\n"
                     "var define = function (deps, factory) { window.define(\"anywidget\", deps, factory); };\n"
                     "define.amd = window.define.amd;\n" + assets.anywidget_amd.read_text() + "\n})();")
    scripts = [assets.require_js.read_text(), anywidget_amd, assets.embed_amd.read_text()]
    views = "\n".join(f'<script type="{VIEW_MIME}">{_json(v)}</script>' for v in data["view_specs"])
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(title)}</title>\n"
        + "".join(f"<script>\n{_inline(s)}\n</script>\n" for s in scripts)
        + f'<script type="{STATE_MIME}">{_json(state)}</script>\n'
        + "</head>\n<body>\n" + views + "\n</body>\n</html>\n"
    )


def save_html(widget_or_result: CircuitWidget | Attribution, path: str | Path, *,
              title: str = "dpa circuit inspector") -> Path:
    """Write a standalone HTML file showing the widget (or a new one for an ``Attribution``)."""
    if isinstance(widget_or_result, Attribution):
        widget = CircuitWidget(widget_or_result)
    elif isinstance(widget_or_result, CircuitWidget):
        widget = widget_or_result
    else:
        raise InputTypeError(f"save_html takes a CircuitWidget or a dpa.Attribution, got "
                             f"{type(widget_or_result).__name__}"
                             + (" (a batch gives a list: pass one of its results)" if isinstance(widget_or_result, list)
                                else ""))
    if not isinstance(title, str):
        raise InputTypeError(f"title must be a string, got {type(title).__name__}")
    path = Path(path)
    write_text(path, page(widget, title))  # atomic: a failure never leaves a truncated page
    return path
