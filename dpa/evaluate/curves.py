"""Disruption and recovery curves of one sample under one attribution (book: faithfulness).

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..checks import check_choice, check_float, check_int
from ..errors import InputError, InputTypeError, NonFiniteError
from ..request import check_model
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
    from .datasets import DATASETS, GENERATED

    check_choice("dataset", dataset, DATASETS + GENERATED)
    check_choice("unit", unit, ("input", "component"))
    if unit == "component":
        return COMPONENT_GRID
    return SIGMOID_GRID if dataset in ("squad_v2.0", "imdb") else KNOWN_GRID


def check_fractions(fractions) -> tuple[float, ...]:
    """The grid of a curve: at least one fraction, each a number in (0, 1] (k = ceil(f * n) ablates at least
    one unit, so f = 0 would measure one unit, not none)."""
    if (isinstance(fractions, (str, bytes, Mapping)) or not isinstance(fractions, Iterable)
            or (isinstance(fractions, Tensor) and fractions.dim() != 1)):
        raise InputTypeError(f"fractions must be a sequence of numbers in (0, 1] (e.g. fraction_grid(dataset, "
                             f"unit)), got {type(fractions).__name__}")
    out = tuple(check_float(f"fractions[{i}]", f) for i, f in enumerate(fractions))
    if not out:
        raise InputError("fractions is empty; give at least one fraction in (0, 1] (e.g. fraction_grid(dataset, "
                         "unit))")
    bad = next((i for i, f in enumerate(out) if not 0 < f <= 1), None)
    if bad is not None:
        raise InputError(f"fractions[{bad}] must be in (0, 1] (a fraction f ablates ceil(f * n) of the n units, at "
                         f"least one), got {out[bad]}")
    return out


def _check_sample(sample) -> Sample:
    if not isinstance(sample, Sample):
        raise InputTypeError(f"sample must be a dpa.evaluate.Sample (see encode_example), got "
                             f"{type(sample).__name__}")
    if len(sample.context) != len(sample.input_ids):
        raise InputError(f"sample {sample.id!r}: context has {len(sample.context)} entries for "
                         f"{len(sample.input_ids)} tokens (one True / False per token)")
    return sample


def _check_attribution(attribution, sample: Sample) -> Attribution:
    """The attribution must be of the sample: its prompt, its target position and its target token."""
    if not isinstance(attribution, Attribution):
        raise InputTypeError(f"attribution must be a dpa.Attribution, got {type(attribution).__name__}")
    ids, want = list(attribution.token_ids), list(sample.input_ids)
    if ids != want:
        diff = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        raise InputError(f"attribution is of another prompt than sample {sample.id!r}: {len(ids)} tokens against "
                         f"the sample's {len(want)}, first differing at position {diff}")
    if attribution.target.position != sample.position:
        raise InputError(f"attribution is of target position {attribution.target.position}; sample "
                         f"{sample.id!r} is measured at position {sample.position}")
    if attribution.target.token_id != sample.target_id:
        raise InputError(f"attribution is of target token {attribution.target.token_id}; the target of sample "
                         f"{sample.id!r} is token {sample.target_id}")
    return attribution


def _finite_scores(what: str, scores: Tensor) -> Tensor:
    if not torch.isfinite(scores).all():
        raise NonFiniteError(f"attribution's {what} hold NaN or infinite values: they cannot be ranked")
    return scores


def unit_count(f: float, n: int) -> int:
    """k = ceil(f * n), robust to float noise (0.3 * 10 is 3, not 4), at least 1, at most n."""
    return min(n, max(1, math.ceil(f * n - 1e-9)))


def rank(scores: Tensor, seed: int = 0) -> Tensor:
    """Indices of ``scores`` sorted by value, descending; ties in a seeded random order."""
    gen = torch.Generator().manual_seed(check_int("seed", seed))
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
        if not (math.isfinite(p_clean) and p_clean > 0):
            raise NonFiniteError(f"p(target) of the clean prompt is {p_clean} (in the model's dtype): the curves, "
                                 "100 * p_ablated / p_clean, are undefined")

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
    """Curves for token scores: context tokens' embeddings zeroed. The attribution must be of the sample
    (same prompt, target position and target token); ``fractions`` in (0, 1]."""
    sample = _check_sample(sample)
    _check_attribution(attribution, sample)
    fractions = check_fractions(fractions)
    seed = check_int("seed", seed)
    scores = attribution.token_scores
    if not isinstance(scores, Tensor) or tuple(scores.shape) != (sample.n_tokens,):
        raise InputError(f"attribution's token_scores must be a tensor [{sample.n_tokens}] (one score per token), "
                         f"got {tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__}")
    _finite_scores("token_scores", scores)
    positions = torch.tensor([i for i, c in enumerate(sample.context) if c], dtype=torch.long)
    n = len(positions)
    if n == 0:
        raise InputError(f"sample {sample.id!r} has no context tokens: there are no units to ablate")
    order = positions[rank(scores[positions], seed)]
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
                    protocol: Protocol = "clean", method: str | None = None,
                    layers: tuple[tuple[int, ...], ...] | None = None) -> ComponentUnits:
    """The units of a component run. ``edges`` and ``neurons`` are the fine units of one kind only:
    the other kind is never ablated (in recovery as in disruption). ``layers``: the layers with heads and the
    layers with neurons, where not every layer has both (``unit_layers``: Nemotron-H's one block per layer), and
    optionally each layer's neurons (a dense layer's fewer than the experts' row, Jamba's); the others' rows and
    columns hold no unit, so none of theirs is ranked, counted or ablated.

    ``protocol="paper"`` gives the paper's unit set for ``method`` (see the module docstring): fine
    edges over every (query, key) pair of context positions, and one kind only for a method in
    ``ONE_KIND``."""
    sample = _check_sample(sample)
    n_layers, n_heads, d_mlp = (check_int(name, v, low=1) for name, v in
                                (("n_layers", n_layers), ("n_heads", n_heads), ("d_mlp", d_mlp)))
    check_choice("granularity (component units)", granularity, GRANULARITIES)
    check_choice("protocol", protocol, ("clean", "paper"))
    if method is not None and not isinstance(method, str):
        raise InputTypeError(f"method must be a method name (a str) or None, got {method!r}")
    kind = granularity if granularity in ("edges", "neurons") else None
    if protocol == "paper" and method in ONE_KIND:
        if kind is not None and kind != ONE_KIND[method]:
            raise InputError(f"method {method} scores {ONE_KIND[method]} only; granularity {kind!r} leaves it no "
                             f"{kind} to rank")
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
    if layers is not None:  # only the units that exist: a row of a block the layer lacks holds none
        for name, shape, have in (("attn_index", units.attn_shape, layers[0]),
                                  ("neuron_index", units.neuron_shape, layers[1])):
            index = getattr(units, name)
            per_layer = math.prod(shape[1:])
            setattr(units, name, index[torch.isin(index // per_layer, torch.tensor(have, dtype=torch.long))])
        if len(layers) > 2:  # each layer's neurons: the first columns of its row
            index = units.neuron_index
            width = torch.tensor(layers[2], dtype=torch.long)[index // math.prod(units.neuron_shape[1:])]
            units.neuron_index = index[index % d_mlp < width]
    if kind == "edges":
        units.neuron_index = units.neuron_index[:0]
    elif kind == "neurons":
        units.attn_index = units.attn_index[:0]
    return units


def unit_layers(spec) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The layers with heads and the layers with neurons of a model where some layer lacks one of the two blocks
    (Nemotron-H's: a token mixer or an MLP per layer), and each layer's neurons where a dense layer has fewer than
    the row (a mixed layout's, Jamba's), for ``component_units``; None where every layer has both, all of them."""
    every = tuple(range(spec.n_layers))
    if spec.d_dense:
        return spec.mixing_layers, spec.neuron_layers, tuple(spec.neuron_width(i) for i in every)
    if spec.mixing_layers == every and spec.neuron_layers in (every, ()):
        return None
    return spec.mixing_layers, spec.neuron_layers


def component_scores(attribution: Attribution, units: ComponentUnits) -> Tensor:
    """The attribution's scores of the units, edges (or heads) first: [n_units]."""
    if not isinstance(attribution, Attribution):
        raise InputTypeError(f"attribution must be a dpa.Attribution, got {type(attribution).__name__}")
    _check_units(units)
    fine = units.attn_shape[-1] != 1
    attn = attribution.edge_scores if fine else attribution.head_scores
    neurons = attribution.neuron_position_scores if fine else attribution.neuron_scores
    if attn is None or neurons is None:
        raise InputError(f"attribution: method {attribution.method!r} gives no "
                         f"{'edge / position-level neuron' if fine else 'head / neuron'} scores")
    if attribution.beside is not None:  # the units are attention heads: a row's first columns (the SSM heads beside
        attn = attn[:, :attribution.beside[1]]  # them in Falcon-H1's are not the benchmark's units)
    names = ("edge_scores", "neuron_position_scores") if fine else ("head_scores", "neuron_scores")
    wants = ((units.attn_shape, units.neuron_shape) if fine
             else (units.attn_shape[:2], (units.neuron_shape[0], units.neuron_shape[2])))
    for name, got, want in zip(names, (attn, neurons), wants):
        if tuple(got.shape) != tuple(want):
            raise InputError(f"attribution's {name} have shape {tuple(got.shape)}; the units are of shape "
                             f"{tuple(want)} (an attribution of another model or prompt?)")
    scores = torch.cat([attn.flatten()[units.attn_index], neurons.flatten()[units.neuron_index]]).float()
    return _finite_scores(" / ".join(names), scores)


def _check_units(units) -> ComponentUnits:
    """Units as ``component_units`` makes them: 4-d and 3-d shapes, integer indices within them."""
    if not isinstance(units, ComponentUnits):
        raise InputTypeError(f"units must be a ComponentUnits (see component_units), got {type(units).__name__}")
    if len(units.attn_shape) != 4 or len(units.neuron_shape) != 3:
        raise InputError(f"units have shapes {units.attn_shape} and {units.neuron_shape}; they must be "
                         "[layer head query key] and [layer pos d_mlp] (see component_units)")
    for name, index, shape in (("attn_index", units.attn_index, units.attn_shape),
                               ("neuron_index", units.neuron_index, units.neuron_shape)):
        if (not isinstance(index, Tensor) or index.dim() != 1 or index.is_floating_point() or index.is_complex()
                or index.dtype == torch.bool):
            raise InputTypeError(f"units.{name} must be a 1-D integer tensor, got "
                                 f"{index.dtype if isinstance(index, Tensor) else type(index).__name__}")
        if len(index) and not (0 <= int(index.min()) and int(index.max()) < math.prod(shape)):
            raise InputError(f"units.{name} holds indices outside its mask of shape {shape}")
    return units


def component_curves(model: nn.Module, sample: Sample, attribution: Attribution, units: ComponentUnits, fractions,
                     *, seed: int = 0, batch_size: int = 8) -> Curves:
    """Curves for component scores: attention probabilities and SiLU(s) zeroed. The attribution must be of
    the sample, and the units of the sample and the model (``component_units``); ``fractions`` in (0, 1]."""
    spec = check_model(model)
    sample = _check_sample(sample)
    _check_attribution(attribution, sample)
    _check_units(units)
    fractions = check_fractions(fractions)
    seed = check_int("seed", seed)
    batch_size = check_int("batch_size", batch_size, low=1)
    t = sample.n_tokens
    fine = units.attn_shape[-1] != 1
    want = ((spec.n_layers, spec.n_heads, t if fine else 1, t if fine else 1),
            (spec.n_layers, t if fine else 1, spec.d_mlp))
    if (tuple(units.attn_shape), tuple(units.neuron_shape)) != want:
        raise InputError(f"units are of shapes {tuple(units.attn_shape)} and {tuple(units.neuron_shape)}; for this "
                         f"model and sample ({t} tokens) they must be {want[0]} and {want[1]} (build them with "
                         "component_units(sample, n_layers, n_heads, d_mlp, ...))")
    order = rank(component_scores(attribution, units), seed)
    n, n_attn = units.n, len(units.attn_index)
    if n == 0:
        raise InputError(f"units: sample {sample.id!r} has no component units (no context positions)")
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
