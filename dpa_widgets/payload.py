"""An ``Attribution`` as the JSON the view draws (the ``_data`` and ``_details`` traits).

Only what the view needs is sent: head scores in full, per-layer MLP totals, the top
neurons of each layer (not all d_mlp of them), and per-head or per-neuron details on
demand. Floats are rounded to a few significant digits to keep long prompts light.

On a mixture-of-experts model (``result.expert_scores`` set) the payload also carries the
expert scores in full ([layer][slot]: the routed experts, then the shared expert where there is
one), the slot names, and ``n_experts`` / ``d_expert`` so that the view can name neuron n of a
layer as neuron n % d_expert of expert n // d_expert; expert details (per-position scores) come
on demand as head and neuron details do. A dense result's payload has none of these keys.

A row of head scores may hold more than attention heads (``unit_layout``): a hybrid's rows of convolution or scan
units (``layer_kinds``), or beside attention on every layer the units of a second token mixer from column
``beside[1]`` on (Falcon-H1's SSM heads: ``beside == ["scan", 4]``, column 5 is unit L0.S1). Heads and units are
sent, selected and detailed by their column (``head:layer:column``: a head and a scan unit of a layer never share
a key); ``unit_at`` and ``unit_label`` name them, ``top_heads`` ranks one kind's own columns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dpa import Attribution, InputError

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


def expert_layout(result: Attribution,
                  experts: tuple[int, int | None] | None = None) -> tuple[int, int | None] | None:
    """(routed experts, neurons per routed expert or None) of a mixture-of-experts result; None if dense.

    ``experts`` (from ``dpa.spec_for(model)``: ``(spec.n_experts, spec.d_expert)``) is used as given when
    it fits the result. Without it the layout is read off the result's shapes: ``slots`` expert columns and
    ``d_mlp`` neurons per layer. Routed experts alone share d_mlp evenly (Mixtral, OLMoE, Qwen3-MoE); when
    slots does not divide d_mlp the last slot is a shared expert (Qwen2-MoE, whose shared expert is wider),
    and the routed experts' width is then unknown (None: the view names neurons by layer only). A shared
    expert exactly as wide as a routed one cannot be told from one more routed expert: pass ``experts``.
    """
    if result.expert_scores is None:
        return None
    slots, d_mlp = result.expert_scores.shape[1], result.neuron_scores.shape[1]
    if experts is None and result.d_expert:  # the result records its experts' width (dpa.attribute does), and how
        experts = (result.n_experts or (slots if slots * result.d_expert == d_mlp else slots - 1),  # many are routed
                   result.d_expert)  # (a file without n_experts: read off the shapes)
    if experts is not None:
        n, d = int(experts[0]), None if experts[1] is None else int(experts[1])
        shared = n == slots - 1
        if n not in (slots, slots - 1) or (d is not None and (d < 1 or (n * d < d_mlp) != shared or n * d > d_mlp)):
            raise InputError(f"experts {experts} do not fit this result: {slots} expert slots and {d_mlp} neurons "
                             "per layer")
        return n, d
    if d_mlp % slots == 0:
        return slots, d_mlp // slots
    return slots - 1, None


def expert_names(n_experts: int, slots: int) -> list[str]:
    """The slots' names: "E0" .. "E{n-1}" for the routed experts, then "shared" (the shared expert)."""
    return [f"E{e}" for e in range(n_experts)] + ["shared"] * (slots - n_experts)



def view_payload(result: Attribution, *, top_neurons: int = 32, routes: int = 8,
                 predictions: list[tuple[str, float]] | None = None,
                 experts: tuple[int, int | None] | None = None) -> dict[str, Any]:
    """The ``_data`` trait: everything the main view draws, for one attribution.

    ``experts``: (routed experts, neurons per routed expert) of a mixture-of-experts model, when the
    model is at hand (see ``expert_layout``); unused for a dense result.
    """
    n_layers, n_heads = result.head_scores.shape
    neurons = result.neuron_scores.detach().double()
    k = min(top_neurons, neurons.shape[1])
    index = neurons.abs().topk(k, dim=1).indices  # [layer k]
    real = result.neurons_that_exist().gather(1, index).tolist()  # (a dense layer of a mixed layout: its top
    top = {"index": [[n for n, r in zip(row, keep) if r] for row, keep in zip(index.tolist(), real)],  # neurons
           "score": [[s for s, r in zip(row, keep) if r]  # among its own columns)
                     for row, keep in zip(rounded(neurons.gather(1, index)), real)]}
    target = result.target
    data = {
        "tokens": list(result.tokens),
        "token_scores": rounded(result.token_scores),
        "special": list(result.special) if result.special is not None else [False] * len(result.tokens),
        "target": {f: getattr(target, f) for f in
                   ("kind", "position", "token", "token_id", "contrast", "contrast_id", "probability", "logprob")}
        | {"terms": None if not target.terms else [  # a target of several tokens: each token's share
            {"position": t.position, "token": t.token, "value": rounded(t.value), "probability": t.probability,
             "contrast": t.contrast}
            for t in target.terms]},
        "target_logit": rounded(result.target_logit),
        "completeness_gap": rounded(result.completeness_gap),
        "caveats": result.caveats,
        "weights": result.weights.to_dict(),
        "method": result.method,
        "model_name": result.model_name,
        "n_layers": n_layers,
        "n_heads": n_heads,  # the row's width: beside attention (Falcon-H1's) its attention heads, then the other
        "n_kv_heads": result.n_kv_heads or (result.beside[1] if result.beside else n_heads),  # mixer's units
        **unit_layout(result),
        "d_mlp": neurons.shape[1],
        "head_scores": rounded(result.head_scores),
        "mlp_totals": rounded(neurons.sum(1)),
        "neurons": top,
        "top_predictions": [[t, rounded(p)] for t, p in (predictions or result.top_predictions)],
        "token_routes": token_routes(result, routes),
    }
    layout = expert_layout(result, experts)
    if layout is not None:
        n_experts, d_expert = layout
        data.update({
            "n_experts": n_experts,
            "d_expert": d_expert,
            "expert_names": expert_names(n_experts, result.expert_scores.shape[1]),
            "expert_scores": rounded(result.expert_scores),
        })
        if result.dense_layers is not None:  # a mixed layout (Jamba's): layers without experts, their neurons
            data.update(dense_layers=list(result.dense_layers), d_dense=result.d_dense)  # the first d_dense
    return data



def unit_layout(result: Attribution) -> dict[str, Any]:
    """What the columns of each row of head scores are, for the heatmap to say it; {} on a model of attention alone.

    On a hybrid of one kind per layer (``layer_kinds``): each layer's unit kind and, per kind, how many channels of
    the residual stream a unit holds where that is what it is (a convolution's: ``d_model / n_heads``, where the
    result's effective targets give d_model; a Mamba-2 block's units group its inner channels, not the residual
    stream's). Beside attention (``beside``, Falcon-H1's): the mixer's kind and the first column of its units (every
    row: the attention heads, then those units). Both: the kinds in order and each kind's letter in labels."""
    if result.layer_kinds is None and result.beside is None:
        return {}
    from dpa.registry import MIXER_RULES, UNIT_LETTERS

    out: dict[str, Any] = {"unit_kinds": list(result.unit_kinds),
                           "unit_letters": {k: UNIT_LETTERS[k] for k in result.unit_kinds}}
    if result.beside is not None:
        return out | {"beside": [result.beside[0], int(result.beside[1])]}
    targets = result.effective_targets
    width = None if targets is None else targets.shape[-1] // result.head_scores.shape[1]
    return {"layer_kinds": list(result.layer_kinds), **out,
            "unit_widths": {k: width for k in result.unit_kinds if MIXER_RULES.get(k) == "product" and width}}


def unit_at(result: Attribution, layer: int, column: int) -> tuple[str, int]:
    """(kind, index among that kind's units of the layer) of ``head_scores[layer, column]``: ("head", 2), a hybrid's
    ("conv", 3) on a convolution row, ("scan", 1) at column 5 beside four attention heads (Falcon-H1's); raises
    IndexError outside the scores."""
    _check_index(result.head_scores, layer, column, "unit")
    return result.unit_at(layer, column)


def unit_label(result: Attribution, layer: int, column: int) -> str:
    """``head_scores[layer, column]`` as the view names it: "L0.H2", a hybrid's "L0.C3", beside attention "L0.S1"."""
    from dpa.registry import UNIT_LETTERS

    kind, index = unit_at(result, layer, column)
    return f"L{layer}.{UNIT_LETTERS.get(kind, 'U')}{index}"  # (U: a row with no unit, Nemotron-H's MLP layer)


def token_routes(result: Attribution, k: int = 8) -> list[dict[str, list]] | None:
    """Per position, the k heads and k neurons (and k experts, on a mixture of experts) that carry the
    most of that token's score. A head is [layer, column of head_scores, score]: on a hybrid or beside attention
    (Falcon-H1's SSM heads from column ``beside[1]``) every unit of the row ranks with the heads (``unit_at``
    names it).

    A head's share of key position j is the sum of its edge scores over queries (the part of
    its contribution read from j); a neuron's (an expert's) share at j is its position-level score.
    None when the result has no edge or neuron-position scores. "experts" ([layer, slot, score]) only
    when the result has expert-position scores.
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
    real = result.neurons_that_exist().flatten()  # (a dense
    ni = neurons.abs().masked_fill(~real, -1.0).topk(min(k, int(real.sum())), dim=1).indices  # layer's own columns)
    hv, nv = rounded(heads.gather(1, hi)), rounded(neurons.gather(1, ni))
    out = [{
        "heads": [[i // n_heads, i % n_heads, v] for i, v in zip(hi[j].tolist(), hv[j])],
        "neurons": [[i // d_mlp, i % d_mlp, v] for i, v in zip(ni[j].tolist(), nv[j])],
    } for j in range(n_pos)]
    if result.expert_position_scores is not None:
        epos = result.expert_position_scores.detach().double()  # [layer pos slot]
        slots = epos.shape[2]
        experts = epos.permute(1, 0, 2).reshape(n_pos, -1)  # [pos layer*slot]
        real = torch.tensor([i not in (result.dense_layers or ()) for i in range(n_layers)]).repeat_interleave(slots)
        ei = experts.abs().masked_fill(~real, -1.0).topk(min(k, int(real.sum())), dim=1).indices  # (none on a dense
        # layer)
        ev = rounded(experts.gather(1, ei))
        for j, route in enumerate(out):
            route["experts"] = [[i // slots, i % slots, v] for i, v in zip(ei[j].tolist(), ev[j])]
    return out


def head_detail(result: Attribution, layer: int, head: int) -> dict[str, Any]:
    """One unit of the heads' grid, by its column ``head``: its score, its kind, index among its kind and label
    (``unit_at``: a head, a hybrid's or Falcon-H1's scan unit) and, when the result has them, its [query][key] edge
    scores."""
    kind, index = unit_at(result, layer, head)
    edges = None if result.edge_scores is None else result.edge_scores[layer, head].detach().double()
    return {
        "kind": "head", "layer": layer, "index": head, "score": rounded(result.head_scores[layer, head]),
        "unit": kind, "unit_index": index, "label": unit_label(result, layer, head),
        "edges": None if edges is None else rounded(edges),
        "by_key": None if edges is None else rounded(edges.sum(0)),
    }


def neuron_detail(result: Attribution, layer: int, neuron: int,
                  vocab: tuple[list[tuple[str, float]], list[tuple[str, float]]] | None = None,
                  no_vocab: str | None = None) -> dict[str, Any]:
    """One neuron: its score, its per-position scores, and the tokens it promotes/suppresses (``no_vocab``: why
    there are none with the model at hand, where dpa refuses the lens by name)."""
    _check_index(result.neuron_scores, layer, neuron, "neuron")
    npos = result.neuron_position_scores
    promotes, suppresses = vocab if vocab is not None else (None, None)
    return {
        "kind": "neuron", "layer": layer, "index": neuron, "score": rounded(result.neuron_scores[layer, neuron]),
        "by_pos": None if npos is None else rounded(npos[layer, :, neuron]),
        "promotes": None if promotes is None else [[t, rounded(v)] for t, v in promotes],
        "suppresses": None if suppresses is None else [[t, rounded(v)] for t, v in suppresses],
        **({"no_vocab": no_vocab} if no_vocab else {}),
    }


def expert_detail(result: Attribution, layer: int, slot: int) -> dict[str, Any]:
    """One expert (slot: a routed expert, or the shared one last): its score and, when the result has
    them, its per-position scores."""
    if result.expert_scores is None:
        raise IndexError("this result has no expert scores (the model has no mixture of experts)")
    _check_index(result.expert_scores, layer, slot, "expert")
    epos = result.expert_position_scores
    return {
        "kind": "expert", "layer": layer, "index": slot, "score": rounded(result.expert_scores[layer, slot]),
        "by_pos": None if epos is None else rounded(epos[layer, :, slot]),
    }


def detail_key(kind: str, layer: int, index: int) -> str:
    return f"{kind}:{layer}:{index}"


def _check_index(scores: Tensor, layer: int, index: int, what: str) -> None:
    n_layers, width = scores.shape
    if not (0 <= layer < n_layers and 0 <= index < width):
        raise IndexError(f"{what} ({layer}, {index}) is outside [0, {n_layers}) x [0, {width})")


def top_heads(result: Attribution, k: int, kind: str | None = None) -> list[tuple[int, int]]:
    """The k units of the heads' grid with the largest |score| as (layer, column); with ``kind`` ("head", a hybrid's
    or Falcon-H1's "scan", ...: one of ``result.unit_kinds``), only that kind's."""
    scores = result.head_scores.detach().double()
    width = scores.shape[1]
    keep = ~scores.isnan()  # (a baseline's unscored units, Falcon-H1's SSM heads under a gradient: never ranked)
    if kind is not None:
        if kind not in result.unit_kinds:
            raise ValueError(f"this result has no {kind} units: its kinds are {', '.join(result.unit_kinds)}")
        keep &= result.unit_columns(kind)[0]
    flat = scores.abs().masked_fill(~keep, -1.0).flatten()
    return [(i // width, i % width) for i in flat.topk(min(k, int(keep.sum()))).indices.tolist()]


def top_units(result: Attribution, k: int) -> list[tuple[int, int]]:
    """The k units of each kind the heads' grid holds (``top_heads`` per kind: the heads, then a hybrid's or
    Falcon-H1's scan units) as (layer, column): what a page sends the details of up front."""
    return [unit for kind in result.unit_kinds for unit in top_heads(result, k, kind)]


def top_neurons(result: Attribution, k: int) -> list[tuple[int, int]]:
    """The k neurons with the largest |score| over all layers as (layer, neuron)."""
    flat = result.neuron_scores.detach().double().flatten()
    width = result.neuron_scores.shape[1]
    return [(i // width, i % width) for i in flat.abs().topk(min(k, flat.numel())).indices.tolist()]


def top_experts(result: Attribution, k: int) -> list[tuple[int, int]]:
    """The k experts with the largest |score| as (layer, slot); [] for a dense result."""
    if result.expert_scores is None:
        return []
    flat = result.expert_scores.detach().double().flatten()
    width = result.expert_scores.shape[1]
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
