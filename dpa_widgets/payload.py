"""An ``Attribution`` as the JSON the view draws (the ``_data`` and ``_details`` traits).

Only what the view needs is sent: head scores in full, per-layer MLP totals, the top
neurons of each layer (not all d_mlp of them), and per-head or per-neuron details on
demand. Floats are rounded to a few significant digits to keep long prompts light.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dpa import Attribution

DIGITS = 5


def rounded(x: Tensor | float | None, digits: int = DIGITS) -> Any:
    """A tensor or number as (nested) JSON floats with ``digits`` significant digits."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        x = x.detach().double().cpu().tolist()
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    return float(f"{float(x):.{digits}g}")


def view_payload(result: Attribution, *, top_neurons: int = 32, routes: int = 8,
                 predictions: list[tuple[str, float]] | None = None) -> dict[str, Any]:
    """The ``_data`` trait: everything the main view draws, for one attribution."""
    n_layers, n_heads = result.head_scores.shape
    neurons = result.neuron_scores.detach().double()
    k = min(top_neurons, neurons.shape[1])
    index = neurons.abs().topk(k, dim=1).indices  # [layer k]
    target = result.target
    return {
        "tokens": list(result.tokens),
        "token_scores": rounded(result.token_scores),
        "special": list(result.special) if result.special is not None else [False] * len(result.tokens),
        "target": {f: getattr(target, f) for f in
                   ("kind", "position", "token", "token_id", "contrast", "contrast_id", "probability", "logprob")},
        "target_logit": rounded(result.target_logit),
        "completeness_gap": rounded(result.completeness_gap),
        "caveats": result.caveats,
        "weights": {"query": result.weights.query, "key": result.weights.key, "value": result.weights.value,
                    "gate": result.weights.gate, "up": result.weights.up},
        "method": result.method,
        "model_name": result.model_name,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": result.n_kv_heads or n_heads,
        "d_mlp": neurons.shape[1],
        "head_scores": rounded(result.head_scores),
        "mlp_totals": rounded(neurons.sum(1)),
        "neurons": {"index": index.tolist(), "score": rounded(neurons.gather(1, index))},
        "top_predictions": [[t, rounded(p)] for t, p in (predictions or result.top_predictions)],
        "token_routes": token_routes(result, routes),
    }


def token_routes(result: Attribution, k: int = 8) -> list[dict[str, list]] | None:
    """Per position, the k heads and k neurons that carry the most of that token's score.

    A head's share of key position j is the sum of its edge scores over queries (the part of
    its contribution read from j); a neuron's share at j is its position-level score. None
    when the result has no edge or neuron-position scores.
    """
    if result.edge_scores is None or result.neuron_position_scores is None:
        return None
    by_key = result.edge_scores.detach().double().sum(2)  # [layer head key]
    npos = result.neuron_position_scores.detach().double()  # [layer pos d_mlp]
    n_layers, n_heads, n_pos = by_key.shape
    d_mlp = npos.shape[2]
    heads = by_key.permute(2, 0, 1).reshape(n_pos, -1)  # [pos layer*head]
    neurons = npos.permute(1, 0, 2).reshape(n_pos, -1)  # [pos layer*d_mlp]
    hi = heads.abs().topk(min(k, heads.shape[1]), dim=1).indices  # [pos k]
    ni = neurons.abs().topk(min(k, neurons.shape[1]), dim=1).indices
    hv, nv = rounded(heads.gather(1, hi)), rounded(neurons.gather(1, ni))
    return [{
        "heads": [[i // n_heads, i % n_heads, v] for i, v in zip(hi[j].tolist(), hv[j])],
        "neurons": [[i // d_mlp, i % d_mlp, v] for i, v in zip(ni[j].tolist(), nv[j])],
    } for j in range(n_pos)]


def head_detail(result: Attribution, layer: int, head: int) -> dict[str, Any]:
    """One head: its score and, when the result has them, its [query][key] edge scores."""
    _check_index(result.head_scores, layer, head, "head")
    edges = None if result.edge_scores is None else result.edge_scores[layer, head].detach().double()
    return {
        "kind": "head", "layer": layer, "index": head, "score": rounded(result.head_scores[layer, head]),
        "edges": None if edges is None else rounded(edges),
        "by_key": None if edges is None else rounded(edges.sum(0)),
    }


def neuron_detail(result: Attribution, layer: int, neuron: int,
                  vocab: tuple[list[tuple[str, float]], list[tuple[str, float]]] | None = None) -> dict[str, Any]:
    """One neuron: its score, its per-position scores, and the tokens it promotes/suppresses."""
    _check_index(result.neuron_scores, layer, neuron, "neuron")
    npos = result.neuron_position_scores
    promotes, suppresses = vocab if vocab is not None else (None, None)
    return {
        "kind": "neuron", "layer": layer, "index": neuron, "score": rounded(result.neuron_scores[layer, neuron]),
        "by_pos": None if npos is None else rounded(npos[layer, :, neuron]),
        "promotes": None if promotes is None else [[t, rounded(v)] for t, v in promotes],
        "suppresses": None if suppresses is None else [[t, rounded(v)] for t, v in suppresses],
    }


def detail_key(kind: str, layer: int, index: int) -> str:
    return f"{kind}:{layer}:{index}"


def _check_index(scores: Tensor, layer: int, index: int, what: str) -> None:
    n_layers, width = scores.shape
    if not (0 <= layer < n_layers and 0 <= index < width):
        raise IndexError(f"{what} ({layer}, {index}) is outside [0, {n_layers}) x [0, {width})")


def top_heads(result: Attribution, k: int) -> list[tuple[int, int]]:
    """The k heads with the largest |score| as (layer, head)."""
    flat = result.head_scores.detach().double().flatten()
    width = result.head_scores.shape[1]
    return [(i // width, i % width) for i in flat.abs().topk(min(k, flat.numel())).indices.tolist()]


def top_neurons(result: Attribution, k: int) -> list[tuple[int, int]]:
    """The k neurons with the largest |score| over all layers as (layer, neuron)."""
    flat = result.neuron_scores.detach().double().flatten()
    width = result.neuron_scores.shape[1]
    return [(i // width, i % width) for i in flat.abs().topk(min(k, flat.numel())).indices.tolist()]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation of two score vectors (average ranks for ties); NaN if constant."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError(f"need two score vectors of the same length >= 2, got {a.numel()} and {b.numel()}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.pow(2).sum() * rb.pow(2).sum()).sqrt()
    return float(ra @ rb / denom) if denom > 0 else float("nan")


def _ranks(x: Tensor) -> Tensor:
    """Average ranks (1 = smallest)."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # average of the ranks each distinct value spans
    return mean_rank[inverse]
