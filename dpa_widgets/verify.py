"""Verify an attribution by intervention: ablate units and read the target probability.

Tokens are ablated by zeroing their embeddings; heads by zeroing all their attention
probabilities; neurons by zeroing SiLU(s) at every position (``dpa.evaluate.ablation``).
"disrupt" ablates the chosen units, "recover" ablates every other unit of the same kind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpa import Attribution

MODES = ("disrupt", "recover")
UNITS = ("selection", "top_tokens", "top_components")
MAX_ABLATED = 5_000_000  # (layer, pos, neuron) triples; beyond this "recover" over neurons is refused


def _ablation():
    try:
        from dpa.evaluate import ablation
    except ImportError as e:
        raise NotImplementedError("verification needs dpa.evaluate.ablation, which this install lacks") from e
    return ablation


def head_edges(layer: int, head: int, n: int) -> list[tuple[int, int, int, int]]:
    """Every causal (layer, head, query, key) edge of one head over n positions."""
    return [(layer, head, q, k) for q in range(n) for k in range(q + 1)]


def neuron_sites(layer: int, neuron: int, n: int) -> list[tuple[int, int, int]]:
    """(layer, pos, neuron) at every position."""
    return [(layer, p, neuron) for p in range(n)]


def run(model: nn.Module, result: Attribution, *, mode: str, units: str, k: int,
        head: list[int] | None = None, neuron: list[int] | None = None, token: int | None = None) -> dict[str, Any]:
    """Ablate and return {mode, units (names), p_before, p_after, token}."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if units not in UNITS:
        raise ValueError(f"units must be one of {', '.join(UNITS)}, got {units!r}")
    t = result.target
    if t.token_id is None:
        raise ValueError("verification needs a token target (this result attributes a vector)")
    n = len(result.token_ids)
    if units == "top_tokens" or (units == "selection" and head is None and neuron is None and token is not None):
        chosen = _top_tokens(result, k) if units == "top_tokens" else [token]
        return _tokens(model, result, mode, chosen)
    if units == "selection":
        if head is None and neuron is None:
            raise ValueError("nothing is selected: click a head, neuron or token first")
        heads = [tuple(head)] if head is not None else []
        neurons = [tuple(neuron)] if neuron is not None else []
    else:
        top = result.top_components(k)["positive"]
        heads = [(c.layer, c.index) for c in top if c.kind == "head"]
        neurons = [(c.layer, c.index) for c in top if c.kind == "neuron"]
    return _components(model, result, mode, heads, neurons, n)


def _top_tokens(result: Attribution, k: int) -> list[int]:
    scores = result.token_scores.detach().double()
    return scores.topk(min(k, scores.numel())).indices.tolist()


def _ids(model: nn.Module, result: Attribution) -> torch.Tensor:
    return torch.tensor([list(result.token_ids)], device=next(model.parameters()).device)


def _tokens(model: nn.Module, result: Attribution, mode: str, chosen: list[int]) -> dict[str, Any]:
    n = len(result.token_ids)
    zero = chosen if mode == "disrupt" else [p for p in range(n) if p not in set(chosen)]
    t = result.target
    with torch.no_grad():
        p = _ablation().input_ablation_prob(model, _ids(model, result), sorted(zero), t.position, t.token_id)
    names = [f"token {p_} {result.tokens[p_]!r}" for p_ in chosen]
    return _report(mode, names, result, p)


def _components(model: nn.Module, result: Attribution, mode: str, heads: list[tuple[int, int]],
                neurons: list[tuple[int, int]], n: int) -> dict[str, Any]:
    n_layers, n_heads = result.head_scores.shape
    d_mlp = result.neuron_scores.shape[1]
    if mode == "recover":
        keep_h, keep_n = set(heads), set(neurons)
        if n_layers * d_mlp * n > MAX_ABLATED:
            raise ValueError(f"recover would ablate {n_layers * d_mlp * n:,} neuron sites; use disrupt for a prompt "
                             "this long")
        ablate_h = [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in keep_h]
        ablate_n = [(l, i) for l in range(n_layers) for i in range(d_mlp) if (l, i) not in keep_n]
    else:
        ablate_h, ablate_n = heads, neurons
    edges = [e for l, h in ablate_h for e in head_edges(l, h, n)]
    sites = [s for l, i in ablate_n for s in neuron_sites(l, i, n)]
    t = result.target
    with torch.no_grad():
        p = _ablation().component_ablation_prob(model, _ids(model, result), edges, sites, t.position, t.token_id)
    names = [f"L{l}.H{h}" for l, h in heads] + [f"L{l}.N{i}" for l, i in neurons]
    return _report(mode, names, result, p)


def _report(mode: str, names: list[str], result: Attribution, p_after: float) -> dict[str, Any]:
    return {"mode": mode, "units": names, "token": result.target.token,
            "p_before": float(result.target.probability), "p_after": float(p_after)}
