"""``save_html``: the widget as one standalone HTML file that renders with no kernel and no network.

The page holds the widget's own bundle (its ``_esm``) and style (``_css``), its traits as JSON, and
``static/host.js``, a few lines that render the bundle with those traits (the calls a widget manager would
answer, and no kernel): a page of what the widget shows, not of a notebook's widget manager (which weighed
about 3.7 MB). Live controls are off in the file; the selection, hover, details sent so far (the top heads
and neurons, and whatever was selected) and the exports still work.
"""

from __future__ import annotations

import html
from pathlib import Path

from dpa import Attribution, Generation, InputTypeError
from dpa.report import script_json
from dpa.result import write_text

from .circuit import CircuitWidget
from .generation import GenerationWidget

STATE_MIME = "application/vnd.jupyter.widget-state+json"
VIEW_MIME = "application/vnd.jupyter.widget-view+json"
OFFLINE = {"_live": False, "_busy": False, "_error": "", "_methods": ["dpa"]}


def _inline(source: str) -> str:
    """Script text safe inside <script>: no closing tag or comment opener can end it early."""
    return source.replace("</script", "<\\/script").replace("<!--", "<\\!--")


def _json(data) -> str:
    return script_json(data)


HOST = Path(__file__).parent / "static" / "host.js"


def page(widget: CircuitWidget | GenerationWidget, title: str = "dpa circuit inspector") -> str:
    """The standalone HTML text for ``widget``."""
    state = dict(widget.get_state())
    state = {k: v for k, v in state.items() if not k.startswith("_model_") and not k.startswith("_view_")
             and k not in ("layout", "_dom_classes", "tabbable", "tooltip", "_anywidget_id")}
    esm, css = state.pop("_esm"), state.pop("_css", "")
    if isinstance(widget, CircuitWidget):
        state.update(OFFLINE)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{html.escape(title)}</title>\n"
        f"<style>\nbody {{ margin: 12px; }}\n{_inline(css)}\n</style>\n"
        "</head>\n<body>\n<div id=\"dpa-view\"></div>\n"
        f'<script type="application/json" id="dpa-state">{_json(state)}</script>\n'
        f'<script type="text/plain" id="dpa-esm">{_inline(esm)}</script>\n'
        f'<script type="module">\n{_inline(HOST.read_text(encoding="utf-8"))}\n</script>\n'
        "<noscript>This page draws the dpa circuit inspector with JavaScript: turn it on to see it.</noscript>\n"
        "</body>\n</html>\n"
    )


def save_html(widget_or_result: CircuitWidget | GenerationWidget | Attribution | Generation, path: str | Path, *,
              title: str = "dpa circuit inspector") -> Path:
    """Write a standalone HTML file showing the widget (or a new one for an ``Attribution`` or a ``Generation``)."""
    if isinstance(widget_or_result, Attribution):
        widget = CircuitWidget(widget_or_result)
    elif isinstance(widget_or_result, Generation):
        widget = GenerationWidget(widget_or_result)
    elif isinstance(widget_or_result, (CircuitWidget, GenerationWidget)):
        widget = widget_or_result
    else:
        raise InputTypeError(f"save_html takes a CircuitWidget, a GenerationWidget, a dpa.Attribution or a "
                             f"dpa.Generation, got "
                             f"{type(widget_or_result).__name__}"
                             + (" (a batch gives a list: pass one of its results)" if isinstance(widget_or_result, list)
                                else ""))
    if not isinstance(title, str):
        raise InputTypeError(f"title must be a string, got {type(title).__name__}")
    write_text(path, page(widget, title))  # atomic: a failure never leaves a truncated page; checks the path
    return Path(path)
