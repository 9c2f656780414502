"""``GenerationWidget``: a generation attributed step by step (``dpa.attribute_generation``).

The view (static/generation.js) draws the [generated x source] matrix: one row per generated token, one column
per token before it (prompt and generated), each cell its token score at that step (each row on its own colour
scale: a step's logit sets its size), the cells at and after a row's own position empty. Clicking a row opens
that step: its target, value and probability, its heads as a [layer x head] heat map, its top neurons and
sources. Everything is in the widget's state, so a page written by ``save_html`` works the same with no kernel.

``step`` (the row opened, or None) is the one user-facing trait, two-way.
"""

from __future__ import annotations

from pathlib import Path

import anywidget
import traitlets as t

import dpa
from dpa.checks import check_int
from dpa.generation import Generation

from .circuit import TraitValueError, UserTraits
from .payload import rounded, unit_layout

STATIC = Path(__file__).parent / "static"
TOP = 10  # neurons and sources listed per step, of each sign


class GenerationWidget(UserTraits, anywidget.AnyWidget):
    """Show ``generation`` (a ``dpa.Generation``): its matrix of token scores, and one step's heads, neurons
    and sources at a click. ``step``: the step opened first (default: the first). ``top``: neurons and sources
    listed per step, of each sign."""

    _user_traits = ("step",)
    _esm = STATIC / "generation.js"
    _css = STATIC / "generation.css"
    _data = t.Dict().tag(sync=True)
    step = t.Int(None, allow_none=True, help="The step (row) opened: 0 for the first generated token.").tag(sync=True)

    def __init__(self, generation: Generation, *, step: int | None = 0, top: int = TOP):
        if not isinstance(generation, Generation):
            raise dpa.InputTypeError(f"GenerationWidget shows a dpa.Generation (from dpa.attribute_generation), got "
                                     f"{type(generation).__name__}")
        top = check_int("top", top, low=1)
        if not all(bool(s.token_scores.isfinite().all()) and bool(s.head_scores.isfinite().all()) and
                   (s.neuron_scores is None or bool(s.neuron_scores.isfinite().all())) for s in generation.steps):
            raise dpa.InputError("the generation holds NaN or infinite scores (a file with null scores?): the view "
                                 "has nothing to colour them by")
        missing = [j for j, s in enumerate(generation.steps) if s.neuron_scores is None and s.neuron_top is None]
        if missing:
            raise dpa.InputError(f"step {missing[0]} of the generation has no neuron scores (null, and no top_neurons "
                                 "kept): the view has no neurons to show for it")
        self.generation = generation
        super().__init__(_data=payload(generation, top))
        self.step = step

    @t.validate("step")
    def _check_step(self, proposal):
        value = proposal["value"]
        n = len(self.generation.steps)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n):
            raise TraitValueError(f"step must be None or a step of the generation, 0 to {n - 1}, got {value!r}")
        return value


def payload(gen: Generation, top: int = TOP) -> dict:
    """What the view draws, as JSON: the tokens, the matrix rows, and per step its target, heads, top neurons and
    top sources (each neuron as [layer, index, score], each source as [position, score])."""
    first = gen.steps[0]
    n = gen.prompt_length
    steps = []
    for j, s in enumerate(gen.steps):
        row = gen.scores[j, :n + j]
        order = row.argsort(descending=True).tolist()
        steps.append({
            "token": gen.generated[j], "position": s.target.position, "value": rounded(s.target_logit),
            "probability": s.target.probability, "head_scores": rounded(s.head_scores),
            "neurons": _top_neurons(s, top),
            "sources": {"positive": [[i, rounded(row[i])] for i in order[:top] if row[i] > 0],
                        "negative": [[i, rounded(row[i])] for i in reversed(order[-top:]) if row[i] < 0]},
        })
    return {
        "model_name": first.model_name, "kind": first.target.kind, "generated_by": gen.generated_by,
        "tokens": list(gen.tokens), "prompt_length": n, "text": list(gen.text), "weights": first.weights.to_dict(),
        "rows": [rounded(gen.scores[j, :n + j]) for j in range(len(gen.steps))], "steps": steps,
        "n_layers": first.head_scores.shape[0], "n_heads": first.head_scores.shape[1],
        **unit_layout(first),  # a hybrid: what each row of the heads' grid is (LFM2's convolution units)
    }


def _top_neurons(res: dpa.Attribution, top: int) -> dict[str, list]:
    """The ``top`` most positive and most negative neurons as [layer, index, score], from every neuron's score or
    from those a saved result kept (``neuron_top``: exact up to its k)."""
    if res.neuron_scores is not None:
        d = res.neuron_scores.shape[1]
        found = [(i // d, i % d, float(v)) for i, v in enumerate(res.neuron_scores.flatten().tolist())]
    else:  # exact up to the k of each sign each layer kept
        kept = res.neuron_top
        top = min(top, kept.k)
        found = [(layer, i, v) for layer, (idx, sc) in enumerate(zip(kept.index, kept.score)) for i, v in zip(idx, sc)]
    found.sort(key=lambda x: -x[2])
    return {"positive": [[a, b, rounded(v)] for a, b, v in found[:top] if v > 0],
            "negative": [[a, b, rounded(v)] for a, b, v in reversed(found[-top:]) if v < 0]}
