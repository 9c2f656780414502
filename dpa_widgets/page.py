"""The standalone HTML pages: ``dpa attribute --html``'s report of an ``Attribution`` (``html_report``: no script)
and ``dpa circuit --html``'s circuit graph (``circuit_html``), drawn by ``static/src/graph.js`` (the widget's graph
view) inlined, with a table of the top edges that reads without scripts too.

The core's CLI finds both through the entry points ``dpa.views`` (pyproject.toml), so that ``dpa`` builds no page,
carries no JavaScript and never imports this package.
"""

from __future__ import annotations

from itertools import zip_longest
from pathlib import Path

from dpa.report import (RDBU, circuit_lines, color_scale, completeness_lines, component_label, esc, node_text, ranked,
                        script_json, summary_lines, teacher_forced, token_spans, top_edges)

GRAPH_JS = Path(__file__).parent / "static" / "src" / "graph.js"
CSS = "body { max-width: 100rem; } #graph { margin: 1em 0; overflow: auto; }"


PAGE_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 2rem auto;
       max-width: 60rem; padding: 0 1rem; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
dl.info { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; }
dl.info dt { font-weight: 600; } dl.info dd { margin: 0; font-family: ui-monospace, monospace; }
.tokens { font-family: ui-monospace, monospace; font-size: 1.05rem; line-height: 2.2; }
.tok { white-space: pre; padding: .15rem 0; margin-right: 1px; border-radius: 2px; }
.tok.special { outline: 1px dashed #888; }
.tok.target { box-shadow: inset 0 -3px 0 #222; }
.legend { display: flex; align-items: center; gap: .5rem; margin-top: .8rem; font-family: ui-monospace, monospace; }
.legend .bar { width: 16rem; height: .9rem; border: 1px solid #aaa; }
table { border-collapse: collapse; margin-top: .5rem; }
th, td { padding: .15rem .7rem; text-align: left; } td.num { text-align: right; font-family: ui-monospace, monospace; }
tr:nth-child(even) td { background: #f6f6f6; }
p.note { color: #555; font-size: .9rem; }
"""


def component_rows(comps: dict) -> str:
    rows = []
    for rank, (p, n) in enumerate(zip_longest(comps["positive"], comps["negative"]), start=1):
        cells = [f"<td>{rank}</td>"]
        for c in (p, n):
            cells.append(f"<td>{esc(component_label(c))}</td><td class='num'>{c.score:+.4f}</td>" if c
                         else "<td></td><td></td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(rows)


def page_head(title: str, css: str = "") -> str:
    """A standalone page's opening, up to its body: inline CSS, no network (both pages here)."""
    return ('<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{esc(title[:120])}</title>\n<style>{PAGE_CSS}{chr(10) + css if css else ''}</style>\n</head>")


def html_report(res, *, top: int = 10, prompt: str | None = None) -> str:
    """``dpa attribute --html``'s page: a standalone report of an ``Attribution``, inline CSS, no scripts, no
    network."""
    scale = color_scale(res)
    special = res.special or [False] * len(res.tokens)
    spans = token_spans(res)
    comps, what = ranked(res, top)
    forced = teacher_forced(res)
    table = [f"<tr><td>{i}</td><td><code>{esc(repr(tok))}</code>{' (special)' if special[i] else ''}"
             f"{f' ({forced[i]}, teacher-forced)' if i in forced else ''}</td>"
             f"<td class='num'>{s:+.4f}</td></tr>" for i, (tok, s) in enumerate(zip(res.tokens, res.token_scores.tolist()))]
    gradient = ", ".join(RDBU)
    info = "\n".join(f"<dt>{esc(label)}</dt><dd>{esc(text)}</dd>" for label, text in summary_lines(res))
    completeness = "<br>".join(esc(line.strip()) for line in completeness_lines(res))
    preds = "\n".join(f"<tr><td><code>{esc(repr(t))}</code></td><td class='num'>{p:.4f}</td></tr>"
                      for t, p in res.top_predictions)
    title = f"DPA: {prompt if prompt is not None else ''.join(res.tokens)}"
    clipped = " Special tokens (dashed outline) are clipped to the scale." if any(special) else ""
    return f"""{page_head(title)}
<body>
<h1>Dual Path Attribution</h1>
<dl class="info">
{info}
</dl>
<h2>Input attribution</h2>
<p class="note">Each token's share of the target: red raises it, blue lowers it, white is zero.
The underlined token is the target position.{clipped} Hover a token for its score.</p>
<div class="tokens">{''.join(spans)}</div>
<div class="legend"><span>{-scale:+.4f}</span><span class="bar" style="background:linear-gradient(to right, {gradient})">
</span><span>{scale:+.4f}</span></div>
<p>{completeness}</p>
<details><summary>token scores</summary>
<table><tr><th>pos</th><th>token</th><th>score</th></tr>
{''.join(table)}
</table></details>
<h2>Top components</h2>
<p class="note">{esc(what[0].upper() + what[1:])} ([layer, head], [layer, neuron]), by score.</p>
<table><tr><th>#</th><th>positive</th><th>score</th><th>negative</th><th>score</th></tr>
{component_rows(comps)}
</table>
<h2>Top predictions</h2>
<table><tr><th>token</th><th>p</th></tr>
{preds}
</table>
<p class="note">method {esc(res.method)}; neuron target {esc(res.neuron_target)}; written by dpa.</p>
</body>
</html>
"""


def circuit_html(circ, *, prompt: str | None = None, top: int = 20) -> str:
    """The standalone page of ``circ`` (a ``dpa.Circuit``): inline script and style, no network."""
    script = GRAPH_JS.read_text(encoding="utf-8").replace("</script", "<\\/script")
    data = script_json(circ.to_json())
    info = "\n".join(f"<dt>{esc(label)}</dt><dd>{esc(text)}</dd>" for label, text in circuit_lines(circ))
    rows = "\n".join(f"<tr><td class='num'>{e:+.4f}</td><td>{esc(node_text(circ, s))}</td>"
                     f"<td>{esc(node_text(circ, d))}</td></tr>" for s, d, e in top_edges(circ, top))
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
