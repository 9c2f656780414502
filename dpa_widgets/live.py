"""What the widget computes in the kernel when a model is attached: recomputed attributions,
next-token predictions, the tokens a neuron promotes, baselines and ablation checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import dpa
from dpa import Attribution, PathWeights, request
from dpa.lens import neuron_logit_effect, next_token_probabilities
from dpa.targets import token_text

from .payload import spearman


@dataclass(frozen=True)
class Prediction:
    token: str
    probability: float
    token_id: int


@torch.no_grad()
def predictions(model: nn.Module, tokenizer, token_ids: list[int], position: int, k: int = 10) -> list[Prediction]:
    """The model's top-k next tokens after ``token_ids[: position + 1]``, with probabilities."""
    probs = next_token_probabilities(model, tokenizer, token_ids[: position + 1])
    top = probs.topk(min(k, probs.numel()))
    return [Prediction(token_text(tokenizer, int(i)) if tokenizer is not None else str(int(i)), float(p), int(i))
            for p, i in zip(top.values, top.indices)]


def check_fits(model: nn.Module, result: Attribution) -> None:
    """A live widget recomputes ``result`` on ``model``: refuse a result from another model (its sizes or
    token ids do not fit), and one from a baseline (the live view recomputes DPA: it would be replaced)."""
    spec = request.check_model(model)
    if result.method != "dpa":
        raise dpa.InputError(f"result is a {result.method!r} attribution; a widget with a model shows DPA and "
                             "compares baselines with its method control: pass a dpa.attribute result (or leave "
                             "out model and tokenizer to view this one as it is)")
    layers, heads = result.head_scores.shape  # a row: the heads, then the units beside them (Falcon-H1's SSM heads)
    d_mlp = None if result.neuron_scores is None else result.neuron_scores.shape[1]
    theirs = (layers, heads, d_mlp, tuple(result.beside) if result.beside else None)
    ours = (spec.n_layers, spec.row_width, spec.d_mlp if d_mlp is not None else None,
            (spec.beside_kind, spec.n_heads) if spec.n_beside else None)
    if theirs != ours or any(not 0 <= i < spec.vocab_size for i in result.token_ids):
        raise dpa.InputError(f"result does not fit this model: it has {layers} layers x {_row(heads, result.beside)}"
                             + (f" x {d_mlp} neurons" if d_mlp is not None else "") + f", the model {spec.n_layers} x "
                             f"{_row(spec.row_width, ours[3])} x {spec.d_mlp}"
                             + ("" if theirs != ours else f" and a vocabulary of {spec.vocab_size}")
                             + "; pass the model the result was computed on")


def _row(width: int, beside: tuple | None) -> str:
    """A row of head scores in words: "4 heads", or beside attention "(4 heads + 4 scan units)"."""
    return f"{width} heads" if not beside else f"({beside[1]} heads + {width - beside[1]} {beside[0]} units)"


def weights_for(preset: str, p: float) -> PathWeights:
    """The path weights of a sensitivity family at p, or the defaults for "default"."""
    return PathWeights() if preset == "default" else PathWeights.preset(preset, p)


def same_target(target) -> str | int:
    """What attributes ``target`` (a result's ``TargetInfo``) again: its id, or for several tokens its text."""
    return target.token if target.terms and any(not t.contrast for t in target.terms[1:]) else target.token_id


def same_contrast(target) -> str | int | None:
    """What attributes the contrast of ``target`` again: its id, or for several tokens its text."""
    return target.contrast if target.terms and any(t.contrast for t in target.terms) else target.contrast_id


def recompute(model: nn.Module, tokenizer, result: Attribution, *, target: str | int | None,
              contrast: str | int | None, weights: PathWeights) -> Attribution:
    """``result``'s prompt and position attributed again (with edges and neuron positions). A target of several
    tokens is attributed whole (``multi_token="sum"``, teacher forcing): the prompt is the result's up to its
    target position (a result of several target tokens holds them after it)."""
    if result.target.kind == "vector":
        raise dpa.TargetError("a vector target cannot be changed from the widget; recompute it with dpa.attribute")
    position = result.target.position
    # a contrast of several tokens is read in a sequence of its own: no edges or position-level neurons beside it
    finer = not (isinstance(contrast, str) and tokenizer is not None
                 and len(tokenizer.encode(contrast, add_special_tokens=False)) > 1)
    return dpa.attribute(
        model, tokenizer, list(result.token_ids[: position + 1]), target=target, contrast=contrast,
        kind="logprob" if result.target.kind == "logprob" else "logit", multi_token="sum",
        weights=weights, edges=finer, neuron_positions=finer, neuron_target=result.neuron_target)


def neuron_vocab_or_reason(model: nn.Module | None, tokenizer, layer: int,
                           neuron: int) -> tuple[tuple[list, list] | None, str | None]:
    """``neuron_vocab``'s tokens and None, or None and why the model's neurons are not read through the lens (where
    dpa refuses it by name); without a model, (None, None)."""
    if model is None:
        return None, None
    try:
        return neuron_vocab(model, tokenizer, layer, neuron), None
    except dpa.UnsupportedModelError as e:
        return None, str(e)


@torch.no_grad()
def neuron_vocab(model: nn.Module, tokenizer, layer: int, neuron: int,
                 k: int = 8) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The tokens whose logits the neuron's output direction raises and lowers the most.

    The direction is its down-projection column, scaled by the final norm's gamma and read
    through the unembedding (a logit-lens view; the final norm's 1/rms is left out).
    """
    effect = neuron_logit_effect(model, layer, neuron)  # [vocab]
    name = (lambda i: token_text(tokenizer, i)) if tokenizer is not None else str
    up, down_ = effect.topk(k), (-effect).topk(k)
    return ([(name(int(i)), float(v)) for v, i in zip(up.values, up.indices)],
            [(name(int(i)), float(-v)) for v, i in zip(down_.values, down_.indices)])


def baseline_methods(spec=None) -> dict[str, tuple[str, Any]]:
    """Baselines from ``dpa.baselines`` by widget name: "tokens:<name>" for input methods and
    "components:<name>" for component methods (the two families share some names); with ``spec``, only
    those that handle its family. Empty when ``dpa.baselines`` is not installed; DPA itself is left out
    (it is the reference)."""
    try:
        from dpa import baselines
    except ImportError:
        return {}
    out: dict[str, tuple[str, Any]] = {}
    tables = (("input", "tokens", "INPUT_METHODS"), ("component", "components", "COMPONENT_METHODS"))
    for level, prefix, table in tables:
        for name, fn in getattr(baselines, table, {}).items():
            if name != "dpa" and (spec is None or baselines.supports(fn, spec)):
                out[f"{prefix}:{name}"] = (level, fn)
    return out


def compare(model: nn.Module, tokenizer, result: Attribution, method: str) -> dict[str, Any]:
    """A baseline on the same prompt and target, and its Spearman rank correlation with DPA.

    Input methods are compared on token scores; component methods on head scores (and on
    neuron scores as ``rho_neurons`` when the method gives them). A method that scores only the attention heads of
    a row that also holds the units of a mixer beside them (Falcon-H1's) is ranked on the heads, and its row is
    sent with None in those units' place.
    """
    methods = baseline_methods()
    if method not in methods:
        raise dpa.InputError(f"unknown method {method!r}; choose one of dpa, {', '.join(methods)}")
    level, fn = methods[method]
    t = result.target
    if t.kind == "vector":
        raise dpa.TargetError("baselines attribute a token: they cannot be compared with this vector target")
    if t.terms:
        raise dpa.TargetError(f"baselines attribute one target token; {t.token!r} is {len(t.terms)} tokens, whose "
                              "sum only DPA attributes here")
    other = fn(model, tokenizer, list(result.token_ids), t.token_id, contrast=t.contrast_id, position=t.position)
    if level == "input":
        return {"method": method, "level": level, "token_scores": other.token_scores.double().tolist(),
                "rho": _finite(spearman(result.token_scores, other.token_scores))}
    ours, theirs = result.head_scores.double(), other.head_scores.double()
    scored = ~theirs.isnan()  # a baseline of the attention heads alone (Falcon-H1's gradient ones) leaves the units
    # beside them unscored (NaN): ranked on the units it scores, the others sent as None
    out = {"method": method, "level": level, "rho": _finite(spearman(ours[scored], theirs[scored])),
           "head_scores": [[None if v != v else v for v in row] for row in theirs.tolist()]}
    if (other.neuron_scores is not None and other.neuron_scores.shape == result.neuron_scores.shape
            and other.neuron_scores.numel() > 1):  # (a model without an MLP has none to rank)
        out["rho_neurons"] = _finite(spearman(result.neuron_scores, other.neuron_scores))
    return out


def _finite(x: float) -> float | None:
    """JSON has no NaN: a rank correlation with a constant side is None."""
    return x if x == x else None
