"""The circuit graph in the widget: a ``dpa.Circuit`` checked against the attribution on view (or computed
from it), sent to the view as ``Circuit.to_json()``, and its edges verified by path patching in the kernel.
The view draws it with ``static/src/graph.js`` (the same file as ``dpa circuit --html``'s page,
``page.py``)."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

import dpa
from dpa import Attribution, Circuit

NODES = 64  # units in a graph the widget computes itself (circuit=True): dpa.circuit's default


def check_matches(circ: Circuit, result: Attribution) -> None:
    """Refuse a circuit of another prompt, target or path weights than ``result``: the two views would disagree."""
    if not isinstance(circ, Circuit):
        raise dpa.InputTypeError(f"circuit must be a dpa.Circuit (from dpa.circuit) or True (compute one), got "
                                 f"{type(circ).__name__}")
    if list(circ.token_ids) != list(result.token_ids):
        raise dpa.InputError("circuit is of another prompt than result (their token ids differ): compute both on "
                             "the same prompt")
    a, b = circ.target, result.target
    if (a.kind, a.position, a.token_id, a.contrast_id) != (b.kind, b.position, b.token_id, b.contrast_id):
        raise dpa.InputError(f"circuit attributes another target ({a.kind} {a.token!r} at position {a.position}) "
                             f"than result ({b.kind} {b.token!r} at position {b.position})")
    if circ.weights != result.weights:
        raise dpa.InputError(f"circuit was computed with other path weights ({circ.weights}) than result "
                             f"({result.weights})")


def check_model(model: nn.Module | None) -> None:
    """What ``circuit=True`` computes the graph on: refuse no model, before any work."""
    if model is None:
        raise dpa.InputError("circuit=True computes the circuit graph: pass model and tokenizer (or pass a "
                             "dpa.Circuit)")


def compute(model: nn.Module, tokenizer, result: Attribution, *, nodes: int = NODES,
            positions: bool = True) -> Circuit:
    """The circuit graph of ``result``'s prompt, target and path weights (its ``nodes`` largest units)."""
    t = result.target
    if t.kind == "vector" or t.token_id is None:
        raise dpa.InputError("a circuit graph of a vector target is not computed by the widget: pass one from "
                             "dpa.circuit")
    if t.terms:
        raise dpa.InputError(f"a circuit graph attributes one target token; {t.token!r} is {len(t.terms)} tokens "
                             "(their sum is in the token, head and neuron views): pick one of them as the target")
    return dpa.circuit(model, tokenizer, list(result.token_ids), target=t.token_id, contrast=t.contrast_id,
                       kind="logprob" if t.kind == "logprob" else "logit", position=t.position,
                       weights=result.weights, nodes=nodes, positions=positions)


def payload(circ: Circuit) -> dict[str, Any]:
    """What the view draws: ``Circuit.to_json()``, and whether the kernel can verify its edges (a circuit
    holds the tensors path patching needs unless it was built without them)."""
    return {**circ.to_json(), "verifiable": circ.verifiable}


def labels(data: dict) -> set[str]:
    """The labels of the nodes a selection can name (tokens, units, the target; not the rest nodes)."""
    return {n["label"] for n in data.get("nodes", []) if n["kind"] != "rest"}


def edge_key(source: str, destination: str) -> str:
    """The key of a verified edge, as graph.js's edgeKey."""
    return f"{source}->{destination}"


def verify_edge(circ: Circuit, model: nn.Module, tokenizer, edge) -> dict[str, Any]:
    """``Circuit.verify`` on one edge, with non-finite numbers (a ratio to a zero edge) as None for JSON."""
    out = circ.verify(model, tokenizer, tuple(edge))
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}
