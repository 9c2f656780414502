"""``dpa circuit --html``'s page: a circuit graph as one standalone HTML file, drawn by ``static/src/graph.js``
(the widget's graph view) inlined, with a table of the top edges that reads without scripts too.

The core's CLI finds ``circuit_html`` through the entry point ``dpa.views`` / ``circuit_html`` (pyproject.toml),
so that ``dpa`` itself carries no JavaScript and never imports this package.
"""

from __future__ import annotations

import html
from pathlib import Path

from dpa.report import circuit_lines, node_text, page_head, script_json, top_edges

GRAPH_JS = Path(__file__).parent / "static" / "src" / "graph.js"
CSS = "body { max-width: 100rem; } #graph { margin: 1em 0; overflow: auto; }"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def circuit_html(circ, *, prompt: str | None = None, top: int = 20) -> str:
    """The standalone page of ``circ`` (a ``dpa.Circuit``): inline script and style, no network."""
    script = GRAPH_JS.read_text(encoding="utf-8").replace("</script", "<\\/script")
    data = script_json(circ.to_json())
    info = "\n".join(f"<dt>{_esc(label)}</dt><dd>{_esc(text)}</dd>" for label, text in circuit_lines(circ))
    rows = "\n".join(f"<tr><td class='num'>{e:+.4f}</td><td>{_esc(node_text(circ, s))}</td>"
                     f"<td>{_esc(node_text(circ, d))}</td></tr>" for s, d, e in top_edges(circ, top))
    title = f"DPA circuit: {prompt if prompt is not None else ''.join(circ.tokens)}"
    return f"""{page_head(title, CSS)}
<body>
<h1>Circuit graph</h1>
<dl class="info">
{info}
</dl>
<p class="note">Nodes: tokens (bottom), heads and neurons by layer (rows) and position (columns), the target (top).
Edges: direct effects in logit units, red raises the destination's score, blue lowers it. Hover a node for its
inputs and outputs, click it for its flows; the slider prunes by influence on the target.</p>
<div id="graph"></div>
<h2>Top direct effects</h2>
<table><tr><th>effect</th><th>from</th><th>to</th></tr>
{rows}
</table>
<p class="note">written by dpa: direct effects in the linearised model
(the dpa book, chapter <em>Circuits as graphs</em>).</p>
<script type="module">
{script}
renderGraph(document.getElementById("graph"), {data}, {{}});
</script>
</body>
</html>
"""
