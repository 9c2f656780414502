"""Human-readable reports of an ``Attribution``: terminal text (24-bit colour or plain) and a standalone HTML page.

Colours: ColorBrewer RdBu (colour-blind safe), blue for scores that lower the target, red for
scores that raise it, white at zero, on a symmetric scale set by the largest |score| among the
ordinary tokens (special tokens such as BOS are clipped so they do not wash out the rest).
"""

from __future__ import annotations

import html
import json
import math
import os
from itertools import zip_longest
from typing import TYPE_CHECKING, TextIO

import torch

from .registry import UNIT_LETTERS

if TYPE_CHECKING:  # annotations only: result imports this module (Attribution's reports)
    from .result import Attribution, Component


# RdBu anchors from -1 to +1 in equal steps; the middle one is pure white (zero).
RDBU = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#ffffff", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")
RGB = tuple(tuple(int(h[i:i + 2], 16) for i in (1, 3, 5)) for h in RDBU)


def diverging_rgb(value: float, scale: float) -> tuple[int, int, int]:
    """The colour of ``value`` on the symmetric scale [-scale, scale] (clipped beyond it)."""
    x = 0.0 if scale <= 0 else max(-1.0, min(1.0, value / scale))
    pos = (x + 1) / 2 * (len(RGB) - 1)
    i = min(int(pos), len(RGB) - 2)
    f = pos - i
    return tuple(math.floor(a + (b - a) * f + 0.5) for a, b in zip(RGB[i], RGB[i + 1]))  # JS Math.round


def ink_for(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """Black or white text, whichever reads better on ``rgb``."""
    luminance = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
    return (0, 0, 0) if luminance > 140 else (255, 255, 255)


def hex_rgb(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def color_scale(res: Attribution) -> float:
    """max |token score| over the non-special tokens (all tokens if every one is special); 1 if all zero."""
    scores = res.token_scores.tolist()
    special = res.special or [False] * len(scores)
    ordinary = [abs(s) for s, sp in zip(scores, special) if not sp] or [abs(s) for s in scores]
    top = max(ordinary, default=0.0)
    return top if top > 0 else 1.0


def show_token(token: str) -> str:
    """Make whitespace-only and control characters visible, keep ordinary spaces."""
    return token.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t") or "∅"


def wants_color(stream: TextIO) -> bool:
    """Colour when ``stream`` is a terminal and neither NO_COLOR nor TERM=dumb says otherwise."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def ranked(res: Attribution, top: int) -> tuple[dict[str, list[Component]], str]:
    """The top components and what they are: heads and neurons, or heads alone when the neuron scores were
    not saved, or not enough of them (``to_json(top_neurons=k)`` keeps k of each sign per layer)."""
    if res.neuron_scores is None and (res.neuron_top is None or top > res.neuron_top.k):
        why = ("neuron scores not saved" if res.neuron_top is None else
               f"only the top {res.neuron_top.k} neurons of each sign per layer were saved")
        return res.top_components(top, kinds=res.unit_kinds), f"{_listed(unit_words(res))}; {why}"
    experts = ["experts"] if getattr(res, "expert_scores", None) is not None else []
    neurons = ["MLP neurons"] if res.neuron_scores is None or res.neuron_scores.shape[1] else []  # (Mamba-2: none)
    return res.top_components(top), f"{_listed(unit_words(res) + experts + neurons)} ranked together"


def unit_words(res: Attribution) -> list[str]:
    """What the head scores hold: attention heads, and on a hybrid its mixers' units (``conv units``)."""
    return ["attention heads" if k == "head" else f"{k} units" for k in res.unit_kinds]


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def component_label(c: Component) -> str:
    """``head L3 H2``, ``neuron L5 N812``, ``expert L1 E3``, a hybrid's convolution unit ``conv L0 C3``."""
    return f"{c.kind} L{c.layer} {UNIT_LETTERS[c.kind]}{c.index}"


def teacher_forced(res: Attribution) -> dict[int, str]:
    """The positions that hold a target's own tokens (a target of several tokens: all but its last are input), and
    a contrast's of several tokens: position -> "target" or "contrast"."""
    terms = getattr(res.target, "terms", None) or []
    out = {}
    for side, mine in (("target", [t for t in terms if not t.contrast]), ("contrast", [t for t in terms if t.contrast])):
        out.update({term.position: side for term in mine[1:]})
    return out


def describe_target(res: Attribution) -> str:
    """What was attributed and its value, named: for logprob both log p and the attributed quantity."""
    t = res.target
    where = f"after position {t.position} ({show_token(res.tokens[t.position])!r})"
    p = f" (p = {t.probability:.4f})" if t.token is not None and t.probability is not None else ""
    value = f"{res.target_logit:.4f} logit units"
    if getattr(t, "terms", None):  # a target of several tokens, under teacher forcing
        each = ", ".join(f"{'minus ' if term.contrast else ''}{term.token!r} after position {term.position} "
                         f"{term.value:+.4f}" for term in t.terms)
        what = "logit - expected logit (p held fixed)" if t.kind == "logprob" else "logits"
        theirs = sum(term.contrast for term in t.terms)
        foil = ("" if t.kind != "contrast" else f" minus those of {t.contrast!r}, {theirs} tokens" if theirs else
                f" - logit({t.contrast!r}) at the first")
        n_mine = len(t.terms) - theirs
        logp = f" (log p = {t.logprob:.4f}, p = {t.probability:.4g})" if t.logprob is not None else ""
        return f"sum of the {what} of {t.token!r}, {n_mine} tokens{foil} ({each}){logp} = {value}"
    if t.kind == "logprob":
        logp = f"log p({t.token!r}) = {t.logprob:.4f}{p}" if t.logprob is not None else f"log p({t.token!r})"
        return f"{logp} {where}; attributed: logit({t.token!r}) - expected logit, p held fixed = {value}"
    what = {
        "token": f"logit({t.token!r})",
        "contrast": f"logit({t.token!r}) - logit({t.contrast!r})",
        "vector": "a direction in the final normalised residual",
    }.get(t.kind, t.kind)
    return f"{what} {where} = {value}{p}"


def describe_weights(res: Attribution) -> str:
    """The five path weights, named (and the router's and experts' on a mixture of experts)."""
    w = res.weights
    return (f"query {w.query:g}, key {w.key:g}, value {w.value:g}, gate {w.gate:g}, up {w.up:g}"
            + (f", router {w.router:g}, expert {w.expert:g}" if w.moe else "")
            + (" (the paper's default)" if w == type(w)() else ""))


def by_path_weights(res: Attribution) -> bool:
    """Whether ``res`` was attributed with path weights (DPA, the reference code's mid-layer neurons), not by a
    baseline, whose reports say nothing of weights or of a gap they predict."""
    return res.method in ("dpa", "dpa_mid")


def completeness_lines(res: Attribution) -> list[str]:
    if not by_path_weights(res) and not bool(res.token_scores.any()):
        return [f"no token scores: {res.method} scores components; target {res.target_logit:.4f} (logit units)"]
    total = float(res.token_scores.sum())
    shares = " + position and bias shares" if res.position_scores is not None else " + bias share" if res.bias_share else ""
    lines = [f"sum of token scores {total:.4f}{shares} = target {res.target_logit:.4f} + gap "
             f"{res.completeness_gap:+.3g} (logit units)"]
    if res.position_scores is not None:
        lines.append(f"position share (learned position embeddings) {res.position_share:+.4f}")
    if res.bias_share:
        lines.append(f"bias share (biases no token owns) {res.bias_share:+.4f}")
    if not by_path_weights(res):  # a baseline explains the model's own logit: after its cap, where it has one
        return lines
    if res.target.capped_logit is not None:
        lines.append(f"the model soft-caps its logits: target {res.target_logit:.4f} before the cap, "
                     f"{res.target.capped_logit:.4f} after (dpa attributes the pre-cap value, linear in the residual)")
    if not res.conserves:
        lines.append("  (a gap is expected: only q=k=0, v=1, gate+up=1 conserves the target exactly)"
                     if res.layer_kinds is None or "head" in res.layer_kinds else
                     "  (a gap is expected: on these layers, q+k+v=1 with gate+up=1 conserves the target exactly)")
    if not res.weights.constrained:
        lines.append("  note: " + res.caveats[0])
    return lines


def summary_lines(res: Attribution) -> list[tuple[str, str]]:
    """(label, text) pairs shared by the terminal and HTML reports."""
    layers, width = res.head_scores.shape
    kinds = ' or '.join(unit_words(res)).replace('attention ', '')
    heads = f"{width} {'heads' if res.unit_kinds == ('head',) else kinds}"
    if res.beside:  # every layer: attention heads, then the units of the mixer beside them (Falcon-H1's SSM heads)
        heads = f"{res.beside[1]} attention heads beside {width - res.beside[1]} {res.beside[0]} units"
    sizes = (f"{heads} per layer, no MLP" if res.neuron_scores is not None and not res.neuron_scores.shape[1] else
             f"{heads} and {res.neuron_scores.shape[1]} neurons per layer" if res.neuron_scores is not None
             else f"{heads} and {res.neuron_top.d_mlp} neurons per layer; the top {res.neuron_top.k} neurons of "
             "each sign saved" if res.neuron_top is not None else f"{heads} per layer; neuron scores not saved")
    if res.dense_layers:  # a mixed layout (Jamba's): the dense layers' MLPs are narrower
        sizes += f" ({res.d_dense} on the dense layer{'s' if len(res.dense_layers) > 1 else ''} " \
                 f"{', '.join(str(i) for i in res.dense_layers)}, without experts)"
    rows = [("model", f"{res.model_name} ({layers} layers, {sizes})")]
    if res.top_predictions:
        (tok, p), rest = res.top_predictions[0], res.top_predictions[1:]
        rows.append(("predicted", f"{tok!r} p={p:.3f}   next: " + ", ".join(f"{t!r} {q:.3f}" for t, q in rest)))
    rows.append(("target", describe_target(res)))
    if by_path_weights(res):
        rows.append(("weights μ", describe_weights(res)))
    return rows


def generation_report(gen, top: int = 3) -> str:
    """``dpa generate``'s output: the prompt and the generation, then each step's value, probability, the sources
    that raise it most and its top component (``gen``: a ``dpa.Generation``)."""
    first = gen.steps[0]
    n = gen.prompt_length
    out = [f"{'model':<11}{first.model_name}",
           f"{'prompt':<11}{gen.text[0]!r} ({n} tokens)",
           f"{'generated':<11}{gen.text[1]!r} ({len(gen.steps)} tokens, {gen.generated_by})",
           f"{'weights μ':<11}{describe_weights(first)}", "",
           f"each generated token: its {'log p (attributed: logit - expected logit)' if first.target.kind == 'logprob' else 'logit'}, "
           f"p, the {top} sources that raise it most and its top component:",
           f"  {'step':>4}  {'token':<14}{'value':>9}  {'p':>6}  sources"]
    for j, step in enumerate(gen.steps):
        row = gen.scores[j, :n + j]
        best = row.topk(min(top, len(row))).indices.tolist()
        sources = ", ".join(f"{show_token(gen.tokens[i])!r}@{i} {float(row[i]):+.3f}" for i in best)
        comps = step.top_components(1)["positive"]
        comp = f" | {component_label(comps[0])} {comps[0].score:+.3f}" if comps else ""
        p = step.target.probability
        out.append(f"  {j:>4}  {show_token(gen.generated[j])!r:<14}{step.target_logit:>9.3f}  "
                   f"{'' if p is None else f'{p:.3f}':>6}  {sources}{comp}")
    out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- terminal


def _paint(text: str, rgb: tuple[int, int, int]) -> str:
    fg = ink_for(rgb)
    return f"\x1b[48;2;{rgb[0]};{rgb[1]};{rgb[2]}m\x1b[38;2;{fg[0]};{fg[1]};{fg[2]}m{text}\x1b[0m"


def terminal_report(res: Attribution, *, color: bool, top: int = 10) -> str:
    """The CLI's output: summary, tokens coloured by score (or a score table), completeness, top components."""
    out = [f"{label:<11}{text}" for label, text in summary_lines(res)]
    scale = color_scale(res)
    special = res.special or [False] * len(res.tokens)
    scores = res.token_scores.tolist()
    forced = teacher_forced(res)
    out.append("")
    if color:
        out.append("input attribution, in logit units (red raises the target, blue lowers it):")
        out.append("  " + "".join(_paint(show_token(t), diverging_rgb(s, scale)) for t, s in zip(res.tokens, scores)))
        bar = "".join(_paint(" ", diverging_rgb(scale * (i - 10) / 10, scale)) for i in range(21))
        note = " (special tokens clipped)" if any(special) else ""
        out.append(f"  scale {-scale:+.4f} {bar} {scale:+.4f}{note}")
    else:
        out.append("input attribution, in logit units (positive raises the target, negative lowers it):")
        out.append(f"  {'pos':>4}  {'score':>10}  token")
        for i, (t, s) in enumerate(zip(res.tokens, scores)):
            out.append(f"  {i:>4}  {s:>+10.4f}  {show_token(t)!r}{'  (special)' if special[i] else ''}"
                       f"{f'  ({forced[i]}, teacher-forced)' if i in forced else ''}")
    out.append("")
    out.extend(completeness_lines(res))
    out.append("")
    comps, what = ranked(res, top)
    out.append(f"top {top} components, in logit units ({what}):")
    out.append(f"  {'positive':<28}{'negative'}")
    for p, n in zip_longest(comps["positive"], comps["negative"]):
        left = f"{component_label(p):<18}{p.score:>+9.4f}" if p else ""
        right = f"{component_label(n):<18}{n.score:>+9.4f}" if n else ""
        out.append(f"  {left:<28}{right}".rstrip())
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- HTML

def esc(text: object) -> str:
    """``text`` escaped for HTML (attribute values too)."""
    return html.escape(str(text), quote=True)


def token_spans(res: Attribution, inline: bool = False) -> list[str]:
    """One coloured ``<span>`` per token (hover: position, token, score); ``inline``: every style in the span
    itself (a notebook's output has no page stylesheet), else the page's classes."""
    scale = color_scale(res)
    special = res.special or [False] * len(res.tokens)
    spans = []
    for i, (tok, s) in enumerate(zip(res.tokens, res.token_scores.tolist())):
        rgb = diverging_rgb(s, scale)
        style = f"background:{hex_rgb(rgb)};color:{hex_rgb(ink_for(rgb))}"
        if inline:
            style += (";padding:1px 2px;margin:0 1px;border-radius:3px;white-space:pre;font-family:monospace"
                      + (";outline:1px dashed #888" if special[i] else "")
                      + (";text-decoration:underline" if i == res.target.position else ""))
            classes = ""
        else:
            classes = " class='tok" + (" special" if special[i] else "") + (" target" if i == res.target.position
                                                                               else "") + "'"
        spans.append(f"<span{classes} style='{style}' title='{i}: {esc(repr(tok))} {s:+.4f}'>"
                     f"{esc(show_token(tok))}</span>")
    return spans


# ---------------------------------------------------------------------------------------------- circuit graphs


def node_text(circ, i: int) -> str:
    """A node's label with the token where it sits: ``L3.H2@5 (' John')``, ``tok5 (' John')``, ``target``."""
    n = circ.nodes[i]
    if n.position is None or n.kind == "target":
        return n.label
    return f"{n.label} ({show_token(circ.tokens[n.position])!r})"


def top_edges(circ, top: int) -> list[tuple[int, int, float]]:
    """The ``top`` edges by |effect| between tokens, units and the target (rest nodes left out)."""
    real = torch.tensor([n.kind != "rest" for n in circ.nodes])
    e = circ.edges * real[:, None]
    k = min(top, int((e != 0).sum()))
    idx = torch.topk(e.abs().flatten(), k).indices.tolist() if k else []
    n = len(circ.nodes)
    return [(j // n, j % n, float(circ.edges[j // n, j % n])) for j in idx]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def circuit_lines(circ) -> list[tuple[str, str]]:
    """(label, text) pairs about a circuit graph, shared by the terminal and HTML pages."""
    letters = {letter: kind for kind, letter in UNIT_LETTERS.items()}  # a hybrid's units in heads' place: L0.C3 conv
    kinds = [letters[n.label.split(".")[1][0]] for n in circ.nodes if n.kind == "head"]
    mixers = {k: kinds.count(k) for k in dict.fromkeys(kinds) if k != "head"}
    heads = kinds.count("head")
    neurons = sum(1 for n in circ.nodes if n.kind == "neuron")
    experts = sum(1 for n in circ.nodes if n.kind == "expert")
    units = circ.units
    where = "at a position" if circ.positions else "over all positions"
    edges = int((circ.edges != 0).sum())
    scores = circ.scores[units]
    total = float(scores.abs().sum()) or 1.0
    rest = sum(abs(float(circ.edges[i, n.of])) for i, n in enumerate(circ.nodes) if n.kind == "rest" and n.of in units)
    gap = float(circ.in_gap[units].abs().sum())
    return [("model", circ.model_name), ("target", describe_target(circ)), ("weights μ", describe_weights(circ)),
            ("graph", f"{_count(len(units), 'unit')} ({_kinds_counted(heads, mixers, neurons, experts)}) {where}, "
                      f"{_count(len(circ.tokens), 'token')}, {_count(edges, 'edge')}"),
            ("in-flow", f"of the units' |scores|, {rest / total:.1%} comes from units left out (rest nodes) and "
                        f"{gap / total:.1%} from the control paths (query/key, gate"
                        + (", router" if experts else "") + ": the in-flow gap)")]


def _kinds_counted(heads: int, mixers: dict[str, int], neurons: int, experts: int) -> str:
    """"3 heads, 8 scan units, 19 experts": each kind the graph holds (heads and neurons also at zero where the
    model has no other kind in their place)."""
    parts = [("head", heads, not mixers), *((f"{k} unit", n, False) for k, n in mixers.items()),
             ("expert", experts, False), ("neuron", neurons, not experts and not mixers)]
    return ", ".join(_count(n, what) for what, n, always in parts if n or always) or "none"


def circuit_report(circ, *, top: int = 10) -> str:
    lines = ["dpa circuit graph"] + [f"  {label:<10} {text}" for label, text in circuit_lines(circ)]
    lines.append(f"top {top} direct effects (logit units):")
    for s, d, e in top_edges(circ, top):
        lines.append(f"  {e:+9.4f}  {node_text(circ, s)} -> {node_text(circ, d)}")
    return "\n".join(lines) + "\n"


def script_json(data) -> str:
    """``data`` as strict JSON (a bare NaN would break the page) that is safe inside an HTML ``<script>``: every
    ``<``, ``>`` and ``&`` written as a JSON escape, so no token text ("</script>", "<!--") can end or
    re-open the script early."""
    return (json.dumps(data, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


# ---------------------------------------------------------------------------------------------- in Python


def _top_tokens(res: Attribution, k: int) -> list[tuple[int, float]]:
    """The k tokens with the largest |score|, special tokens (BOS, template) left out when others exist."""
    special = res.special or [False] * len(res.tokens)
    order = sorted(range(len(res.tokens)), key=lambda i: -abs(float(res.token_scores[i])))
    ordinary = [i for i in order if not special[i]] or order
    return [(i, float(res.token_scores[i])) for i in ordinary[:k]]


def attribution_repr(res: Attribution) -> str:
    """A few lines: what was attributed, the top tokens and components (``repr(res)``; the report: ``summary()``)."""
    comps, _ = ranked(res, 3)
    tokens = ", ".join(f"{show_token(res.tokens[i])!r} {s:+.3f}" for i, s in _top_tokens(res, 3))
    units = ", ".join(f"{component_label(c)} {c.score:+.3f}" for c in comps["positive"])
    lines = [f"<dpa.Attribution {res.method} of {describe_target(res)}",
             f"  model {res.model_name or '?'}, {len(res.tokens)} tokens"
             + (f", weights {describe_weights(res)}" if by_path_weights(res) else ""),
             f"  top tokens: {tokens}", f"  top components: {units or 'none'}",
             "  (res.summary() prints the full report; res.token_scores, head_scores, "
             + ("neuron_scores hold the scores)>" if res.neuron_top is None or res.neuron_scores is not None else
                f"neuron_top (the top {res.neuron_top.k} neurons of each sign per layer) hold the scores)>")]
    return "\n".join(lines)


def attribution_html(res: Attribution, top: int = 5) -> str:
    """A notebook's rich view of a result: the target, the coloured tokens and the top components (inline
    styles, no scripts)."""
    comps, what = ranked(res, top)
    rows = "".join(
        f"<tr><td style='text-align:left'>{esc(component_label(p)) if p else ''}</td>"
        f"<td style='text-align:right'>{f'{p.score:+.4f}' if p else ''}</td>"
        f"<td style='text-align:left'>{esc(component_label(n)) if n else ''}</td>"
        f"<td style='text-align:right'>{f'{n.score:+.4f}' if n else ''}</td></tr>"
        for p, n in zip_longest(comps["positive"], comps["negative"]))
    return (f"<div class='dpa-attribution'><div><b>dpa</b> {esc(res.method)} of {esc(describe_target(res))}</div>"
            f"<div style='color:#666'>{esc(res.model_name)}"
            f"{f'; weights {esc(describe_weights(res))}' if by_path_weights(res) else ''}; red raises "
            f"the target, blue lowers it</div><div style='margin:6px 0;line-height:1.9'>{''.join(token_spans(res, inline=True))}</div>"
            f"<table><tr><th colspan=2 style='text-align:left'>raises the target</th>"
            f"<th colspan=2 style='text-align:left'>lowers it</th></tr>{rows}</table>"
            f"<div style='color:#666'>top {top} {esc(what)}; res.summary() for the full report</div></div>")


def circuit_repr(circ) -> str:
    """A few lines: the target, the graph's size and its strongest edges."""
    lines = [f"<dpa.Circuit of {describe_target(circ)}"]
    info = circuit_lines(circ)
    lines += [f"  {label}: {text}" for label, text in (info[0], info[3])]  # the model and the graph
    lines += [f"  {e:+.3f}  {node_text(circ, s)} -> {node_text(circ, d)}" for s, d, e in top_edges(circ, 3)]
    lines.append("  (circ.summary() prints the report; circ.edges [source, destination] holds every direct effect)>")
    return "\n".join(lines)


def circuit_html_fragment(circ, top: int = 10) -> str:
    """A notebook's rich view of a circuit graph: what it is and its strongest edges (the graph itself: the widget
    or ``dpa circuit --html``)."""
    info = "".join(f"<tr><td style='text-align:left'><b>{esc(label)}</b></td><td style='text-align:left'>"
                   f"{esc(text)}</td></tr>" for label, text in circuit_lines(circ))
    rows = "".join(f"<tr><td style='text-align:right'>{e:+.4f}</td><td style='text-align:left'>"
                   f"{esc(node_text(circ, s))}</td><td style='text-align:left'>{esc(node_text(circ, d))}</td></tr>"
                   for s, d, e in top_edges(circ, top))
    return (f"<div class='dpa-circuit'><table>{info}</table><table><tr><th>effect</th><th style='text-align:left'>"
            f"from</th><th style='text-align:left'>to</th></tr>{rows}</table><div style='color:#666'>the {top} "
            "strongest direct effects (logit units); circ.summary() for the report</div></div>")
