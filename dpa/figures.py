"""Figures of an ``Attribution`` (matplotlib, imported when a figure is asked for): the token scores, the head
scores as a [layer, head] heatmap, and the top components. Each returns the matplotlib ``Figure`` (drawn into
``ax`` when one is given), in the colours of the reports: ColorBrewer RdBu, red raises the target, blue lowers it,
on a scale symmetric about zero."""

from __future__ import annotations

from .errors import InputError
from .registry import UNIT_LETTERS
from .report import color_scale, component_label, ranked, show_token, unit_words


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("the figures need matplotlib: pip install matplotlib (or dpa[eval])") from None
    return plt


def _axes(ax, size):
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=size, constrained_layout=True)
        return fig, ax
    return ax.figure, ax


def _colors(values, scale: float):
    from matplotlib import colormaps

    cmap = colormaps["RdBu_r"]
    return [cmap(0.5 + 0.5 * max(-1.0, min(1.0, v / scale))) for v in values]


def plot_tokens(res, ax=None):
    """Each token's score as a bar, the tokens as labels; the target position marked."""
    scores = res.token_scores.float().tolist()
    fig, ax = _axes(ax, (max(4.0, 0.45 * len(scores) + 1.5), 3.2))
    ax.bar(range(len(scores)), scores, color=_colors(scores, color_scale(res)), edgecolor="#444", linewidth=0.4)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(scores)), [repr(show_token(t))[1:-1] for t in res.tokens], rotation=60, ha="right",
                  fontsize=8)
    ax.get_xticklabels()[res.target.position].set_fontweight("bold")
    ax.set_ylabel("score (logit units)")
    ax.set_title(f"input attribution: {res.target.token if res.target.token is not None else res.target.kind!s}"
                 f" (total {sum(scores):+.2f})", fontsize=10)
    return fig


def plot_heads(res, ax=None):
    """The head scores as a [layer, head] heatmap (layer 0 at the bottom), symmetric about zero; on a hybrid the title
    names each kind of unit, and where a mixer's units sit beside the attention heads in every row (Falcon-H1's) a
    rule parts them and the ticks name them (H0.., S0..)."""
    h = res.head_scores.float()
    fig, ax = _axes(ax, (max(3.5, 0.35 * h.shape[1] + 2.0), max(3.0, 0.18 * h.shape[0] + 1.2)))
    scale = float(h.abs().max()) or 1.0
    image = ax.imshow(h.numpy(), cmap="RdBu_r", vmin=-scale, vmax=scale, origin="lower", aspect="auto",
                      interpolation="nearest")
    ax.set_xlabel("head" if res.unit_kinds == ("head",) else "unit")
    ax.set_ylabel("layer")
    gap = " " if res.unit_kinds == ("head",) else "\n"  # (a hybrid's kinds: the words on a line of their own)
    ax.set_title(f"{' | '.join(unit_words(res))}{gap}(summed over positions)", fontsize=10)
    if res.beside:  # the heads, then the units beside them: a rule between, each named by its letter
        kind, first = res.beside
        ax.axvline(first - 0.5, color="black", linewidth=1.2)
        letter = UNIT_LETTERS[kind]
        ax.set_xticks(range(h.shape[1]), [f"H{c}" if c < first else f"{letter}{c - first}" for c in range(h.shape[1])],
                      fontsize=7)
    fig.colorbar(image, ax=ax, label="score (logit units)")
    return fig


def plot_components(res, k: int = 10, ax=None):
    """The k most positive and k most negative heads and neurons, ranked together, as horizontal bars."""
    comps, what = ranked(res, k)
    items = comps["positive"][::-1] + comps["negative"]
    items = sorted(items, key=lambda c: c.score)
    fig, ax = _axes(ax, (5.5, 0.28 * max(len(items), 1) + 1.2))
    values = [c.score for c in items]
    scale = max((abs(v) for v in values), default=1.0) or 1.0
    ax.barh(range(len(items)), values, color=_colors(values, scale), edgecolor="#444", linewidth=0.4)
    ax.set_yticks(range(len(items)), [component_label(c) for c in items], fontsize=8)
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_xlabel("score (logit units)")
    ax.set_title(f"top {k} components ({what})", fontsize=10)
    return fig
