"""Disruption and recovery curves of one sample under one attribution (method.md section 6).

Units are ranked by signed score, descending (ties broken by a seeded permutation). For each
fraction f of the grid, k = ceil(f * n_units):
* disruption ablates the top k units;
* recovery ablates every unit except the top k.
The curve value is 100 * p_ablated / p_clean. Unit sets:
* input: the context tokens (prompts.py);
* component, ``fine``: attention edges (layer, head, query, key) with key <= query and a context
  key, and position-level neurons (layer, position, neuron) at context positions, ranked jointly;
* component, ``coarse``: heads (every probability of the head) and neurons (SiLU(s) at every
  position), ranked jointly;
* component, ``edges`` or ``neurons``: the fine units of one kind alone (the other kind is left
  intact), to compare methods that score only one kind on their own ground.

Two protocols, one per AUC mode (auc.py):
* ``clean``: the unit sets above for every method, p(target) from a float32 softmax.
* ``paper``: the unit sets the authors' evaluation code uses, so that the paper's numbers can be
  reproduced. Fine edges are every (query, key) pair of context positions, the non-causal ones
  included: those are units whose ablation changes nothing (alpha is already 0 there), yet they
  count in n_units and so in k. A method that scores one kind only (``attn_only``: edges,
  ``mlp_only``: neurons; ``ONE_KIND``) is evaluated on that kind alone, the other never ablated:
  the reference code passes no scores for the other kind and leaves it out of the units. And
  p(target) comes from a softmax in the model's own dtype (bfloat16 in the paper's runs). Every
  dpa method scores a non-causal pair 0 (there is no such edge); the reference's gradient and
  random baselines give those pairs the gradient df/dalpha and a random draw instead. The
  reference also rounds scores to bfloat16 before ranking, which creates ties; dpa ranks the
  float32 scores in both protocols.
For input units the two protocols share the unit set and differ only in the softmax dtype, so one
set of forward passes gives both curves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..result import Attribution
from .ablation import component_ablation_probs_both, input_ablation_probs_both
from .prompts import Sample

Unit = Literal["input", "component"]
Protocol = Literal["clean", "paper"]
# Methods that score one kind of component only: the paper's protocol evaluates them on that kind alone.
ONE_KIND = {"attn_only": "edges", "mlp_only": "neurons"}
KNOWN_GRID = tuple(round(0.1 * i, 10) for i in range(1, 11))
SIGMOID_GRID = tuple(1 / (1 + math.exp(6 - 1.2 * i)) for i in range(11))  # sigmoid(x), x = -6, -4.8, ..., 6
COMPONENT_GRID = tuple(math.exp(-17 + 1.8 * i) for i in range(10))  # exp(x), x = -17, -15.2, ..., -0.8


def fraction_grid(dataset: str, unit: Unit) -> tuple[float, ...]:
    """The paper's grid: component units exp(x); SQuAD/IMDb inputs sigmoid(x); others 0.1 ... 1."""
    if unit == "component":
        return COMPONENT_GRID
    return SIGMOID_GRID if dataset in ("squad_v2.0", "imdb") else KNOWN_GRID


def unit_count(f: float, n: int) -> int:
    """k = ceil(f * n), robust to float noise (0.3 * 10 is 3, not 4), at least 1, at most n."""
    return min(n, max(1, math.ceil(f * n - 1e-9)))


def rank(scores: Tensor, seed: int = 0) -> Tensor:
    """Indices of ``scores`` sorted by value, descending; ties in a seeded random order."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(scores.numel(), generator=gen)
    order = torch.sort(scores.flatten().cpu().double()[perm], descending=True, stable=True).indices
    return perm[order]


@dataclass
class Curves:
    disruption: list[float]  # 100 * p / p_clean per grid fraction
    recovery: list[float]
    p_clean: float
    n_units: int
    native: Curves | None = None  # the same ablations, p(target) from a softmax in the model's dtype


def _rows(fractions, n: int) -> tuple[list[tuple[str, int]], dict[tuple[str, int], int]]:
    """The distinct ablations (mode, k) a grid needs; recovery of every unit is the clean prompt."""
    needed = {(mode, unit_count(f, n)) for f in fractions for mode in ("disruption", "recovery")}
    needed.discard(("recovery", n))
    rows = sorted(needed)
    return rows, {row: i for i, row in enumerate(rows)}


def _curves(fractions, n: int, rows, index, probs: tuple[Tensor, Tensor]) -> Curves:
    """Curves from the probabilities of [clean, *rows] in both softmax dtypes."""
    def one(p: Tensor) -> Curves:
        p_clean = float(p[0])

        def value(mode: str, k: int) -> float:
            q = p_clean if (mode, k) == ("recovery", n) else float(p[1 + index[(mode, k)]])
            return 100.0 * q / p_clean

        return Curves(disruption=[value("disruption", unit_count(f, n)) for f in fractions],
                      recovery=[value("recovery", unit_count(f, n)) for f in fractions], p_clean=p_clean, n_units=n)

    out = one(probs[0])
    out.native = one(probs[1])
    return out


def _chosen(order: Tensor, mode: str, k: int) -> Tensor:
    return order[:k] if mode == "disruption" else order[k:]


def input_curves(model: nn.Module, sample: Sample, attribution: Attribution, fractions, *, seed: int = 0,
                 batch_size: int = 16) -> Curves:
    """Curves for token scores: context tokens' embeddings zeroed."""
    positions = torch.tensor([i for i, c in enumerate(sample.context) if c])
    n = len(positions)
    order = positions[rank(attribution.token_scores[positions], seed)]
    rows, index = _rows(fractions, n)
    keep = torch.ones(len(rows), sample.n_tokens)
    for r, (mode, k) in enumerate(rows):
        keep[r, _chosen(order, mode, k)] = 0
    clean = torch.ones(1, sample.n_tokens)
    probs = input_ablation_probs_both(model, sample.input_ids, torch.cat([clean, keep]), sample.position,
                                      sample.target_id, batch_size)
    return _curves(fractions, n, rows, index, probs)


@dataclass
class ComponentUnits:
    """Flat indices of the units into the attention keep mask and the neuron keep mask."""

    attn_shape: tuple[int, ...]  # per row: [layer head query key] (fine) or [layer head 1 1] (coarse)
    neuron_shape: tuple[int, ...]  # per row: [layer pos d_mlp] (fine) or [layer 1 d_mlp] (coarse)
    attn_index: Tensor  # [n_attn] into the flattened attention mask
    neuron_index: Tensor  # [n_neuron] into the flattened neuron mask

    @property
    def n(self) -> int:
        return len(self.attn_index) + len(self.neuron_index)

    def same_as(self, other: ComponentUnits) -> bool:
        return (self.attn_shape == other.attn_shape and self.neuron_shape == other.neuron_shape
                and torch.equal(self.attn_index, other.attn_index)
                and torch.equal(self.neuron_index, other.neuron_index))


GRANULARITIES = ("fine", "coarse", "edges", "neurons")


def component_units(sample: Sample, n_layers: int, n_heads: int, d_mlp: int,
                    granularity: Literal["fine", "coarse", "edges", "neurons"] = "fine", *,
                    protocol: Protocol = "clean", method: str | None = None) -> ComponentUnits:
    """The units of a component run. ``edges`` and ``neurons`` are the fine units of one kind only:
    the other kind is never ablated (in recovery as in disruption).

    ``protocol="paper"`` gives the paper's unit set for ``method`` (see the module docstring): fine
    edges over every (query, key) pair of context positions, and one kind only for a method in
    ``ONE_KIND``."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"component units must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    if protocol not in ("clean", "paper"):
        raise ValueError(f"protocol must be 'clean' or 'paper', got {protocol!r}")
    kind = granularity if granularity in ("edges", "neurons") else None
    if protocol == "paper" and method in ONE_KIND:
        if kind is not None and kind != ONE_KIND[method]:
            raise ValueError(f"{method} scores {ONE_KIND[method]} only; it has no {kind} to rank")
        kind = ONE_KIND[method]
    t = sample.n_tokens
    if granularity == "coarse":
        units = ComponentUnits((n_layers, n_heads, 1, 1), (n_layers, 1, d_mlp),
                               torch.arange(n_layers * n_heads), torch.arange(n_layers * d_mlp))
    else:
        context = torch.tensor(sample.context)
        i = torch.arange(t)
        if protocol == "paper":
            edge = context[:, None] & context[None, :]  # [query key]: context query and key, both triangles
        else:
            edge = (i[None, :] <= i[:, None]) & context[None, :]  # [query key]: causal, context key
        attn = edge.expand(n_layers, n_heads, t, t).flatten().nonzero().flatten()
        neuron = context[None, :, None].expand(n_layers, t, d_mlp).flatten().nonzero().flatten()
        units = ComponentUnits((n_layers, n_heads, t, t), (n_layers, t, d_mlp), attn, neuron)
    if kind == "edges":
        units.neuron_index = units.neuron_index[:0]
    elif kind == "neurons":
        units.attn_index = units.attn_index[:0]
    return units


def component_scores(attribution: Attribution, units: ComponentUnits) -> Tensor:
    """The attribution's scores of the units, edges (or heads) first: [n_units]."""
    fine = units.attn_shape[-1] != 1
    attn = attribution.edge_scores if fine else attribution.head_scores
    neurons = attribution.neuron_position_scores if fine else attribution.neuron_scores
    if attn is None or neurons is None:
        raise ValueError(f"method {attribution.method!r} gives no "
                         f"{'edge / position-level neuron' if fine else 'head / neuron'} scores")
    return torch.cat([attn.flatten()[units.attn_index], neurons.flatten()[units.neuron_index]]).float()


def component_curves(model: nn.Module, sample: Sample, attribution: Attribution, units: ComponentUnits, fractions,
                     *, seed: int = 0, batch_size: int = 8) -> Curves:
    """Curves for component scores: attention probabilities and SiLU(s) zeroed."""
    order = rank(component_scores(attribution, units), seed)
    n, n_attn = units.n, len(units.attn_index)
    if n == 0:
        raise ValueError("the sample has no component units (no context positions)")
    rows, index = _rows(fractions, n)
    plan = [None, *rows]  # first row: nothing ablated (p_clean through the same arithmetic)
    probs = []
    for start in range(0, len(plan), batch_size):
        chunk = plan[start:start + batch_size]
        attn = torch.ones(len(chunk), math.prod(units.attn_shape), dtype=torch.bool)
        neurons = torch.ones(len(chunk), math.prod(units.neuron_shape), dtype=torch.bool)
        for r, row in enumerate(chunk):
            if row is None:
                continue
            chosen = _chosen(order, *row)
            attn[r, units.attn_index[chosen[chosen < n_attn]]] = False
            neurons[r, units.neuron_index[chosen[chosen >= n_attn] - n_attn]] = False
        probs.append(component_ablation_probs_both(model, sample.input_ids,
                                                   attn.view(len(chunk), *units.attn_shape),
                                                   neurons.view(len(chunk), *units.neuron_shape), sample.position,
                                                   sample.target_id))
    return _curves(fractions, n, rows, index, (torch.cat([a for a, _ in probs]), torch.cat([b for _, b in probs])))
