"""Perturbation baselines: one forward pass per unit, batched.

A unit's score is ``f(clean) - f(unit zeroed)`` (positive: the unit supports the target), with f
the target logit or logit difference. Zeroing means the same as in the ablation protocol:
* occlusion (input): the token's embedding set to zero (positions and mask unchanged);
* activation patching (component), the ground truth the cheap methods approximate:
  ``units="coarse"``: a head (all its attention probabilities zeroed) and a neuron (SiLU(s)
  zeroed at every position); ``units="fine"``: an edge (layer, head, query, key; causal only)
  and a position-level neuron (layer, position, neuron). Fine units number about
  layers * (heads * pos^2 / 2 + pos * d_mlp), so they are refused above ``max_units``.
"""

from __future__ import annotations

from typing import Iterator, Literal

import torch
from torch import Tensor, nn

from ..instrument import instrument
from ..result import Attribution
from ..checks import check_choice, check_int
from ..errors import InputError
from .common import Prompt, Request, causal, metric_at, prepare, result
from ..spec import one_mixer_per_layer


@torch.no_grad()
def occlusion(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None, batch_size: int = 32) -> Attribution:
    """f(clean) - f(token i's embedding zeroed), for every token."""
    _check_batch_size(batch_size)
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    t = req.n_tokens
    with instrument(model, req) as session:
        e = session.embed()
        clean = metric_at(model, req, session.forward())[0]
        scores = []
        for rows in torch.arange(t, device=e.device).split(batch_size):
            keep = torch.ones(len(rows), t, 1, dtype=e.dtype, device=e.device)
            keep[torch.arange(len(rows), device=e.device), rows] = 0
            scores.append(clean - metric_at(model, req, session.forward(inputs_embeds=e * keep)))
    return result(model, req, "occlusion", token_scores=torch.cat(scores))


def _check_batch_size(batch_size) -> None:
    check_int("batch_size", batch_size, low=1)


def _metric(model: nn.Module, req: Request, batch: int, attn: dict, neurons: dict) -> Tensor:
    with instrument(model, req, attn_keep=attn or None, neuron_keep=neurons) as session:
        hidden = session.forward(input_ids=req.input_ids.expand(batch, -1))
    return metric_at(model, req, hidden)


def _unit_batches(spec, t: int, units: str, batch_size: int, device) -> Iterator[tuple[str, Tensor]]:
    """(kind, flat indices) batches: kind 'attn' indexes [layer head (query key)], 'mlp' [layer (pos) d_mlp]; only
    the units a layer has (none of a block it lacks: Nemotron-H's layers of one block; no column past a dense
    layer's neurons in a mixed layout, Jamba's)."""
    if units == "coarse":
        attn = torch.arange(spec.n_layers * spec.n_heads, device=device)
        mlp = torch.arange(spec.n_layers * spec.d_mlp, device=device)
    else:
        attn = causal(t, device).expand(spec.n_layers, spec.n_heads, t, t).flatten().nonzero().flatten()
        mlp = torch.arange(spec.n_layers * t * spec.d_mlp, device=device)
    for kind, idx, has in (("attn", attn, spec.mixes), ("mlp", mlp, spec.has_mlp)):
        per_layer = max(1, (spec.n_heads * (1 if units == "coarse" else t * t)) if kind == "attn"
                        else spec.d_mlp * (1 if units == "coarse" else t))
        layers = torch.tensor([i for i in range(spec.n_layers) if has(i)], dtype=torch.long, device=device)
        idx = idx[torch.isin(idx // per_layer, layers)]
        if kind == "mlp" and spec.d_mlp:
            idx = idx[spec.neurons_that_exist.to(device)[idx // per_layer, idx % spec.d_mlp]]
        yield from ((kind, b) for b in idx.split(batch_size) if len(b))


def _keeps(kind: str, idx: Tensor, spec, t: int, units: str, dtype) -> dict[int, Tensor]:
    """Per-layer keep masks zeroing one unit per batch row."""
    b = len(idx)
    rows = torch.arange(b, device=idx.device)
    if kind == "attn":
        shape = (spec.n_heads, 1, 1) if units == "coarse" else (spec.n_heads, t, t)
    else:
        shape = (1, spec.d_mlp) if units == "coarse" else (t, spec.d_mlp)
    per_layer = int(torch.tensor(shape).prod())
    layer, inner = idx // per_layer, idx % per_layer
    keeps = {}
    for l in layer.unique().tolist():
        keep = torch.ones(b, per_layer, dtype=dtype, device=idx.device)
        mine = layer == l
        keep[rows[mine], inner[mine]] = 0
        keeps[l] = keep.view(b, *shape)
    return keeps


@torch.no_grad()
def activation_patching(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                        position: int | None = None, units: Literal["coarse", "fine"] = "coarse",
                        batch_size: int = 64, max_units: int = 100_000) -> Attribution:
    """f(clean) - f(unit zeroed), one forward per unit (batched)."""
    check_choice("units ('coarse': heads, neurons; 'fine': edges, position-level neurons)", units, ("coarse", "fine"))
    _check_batch_size(batch_size)
    max_units = check_int("max_units", max_units, low=1)
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    spec, t = req.spec, req.n_tokens
    one_mixer_per_layer(spec, "activation patching is")
    n = (spec.n_layers * (spec.n_heads + spec.d_mlp) if units == "coarse"
         else spec.n_layers * (spec.n_heads * t * (t + 1) // 2 + t * spec.d_mlp))
    if n > max_units:
        raise InputError(f"activation patching needs one forward pass per unit: this prompt has {n:,} {units} units "
                         f"({t} tokens), more than max_units={max_units:,}. "
                         + ("Use units='coarse' (heads and neurons), a shorter prompt, or raise max_units"
                            if units != "coarse" else "Raise max_units"))
    dtype = spec.embed(model).weight.dtype
    clean = _metric(model, req, 1, {}, {})[0]
    attn_scores = torch.zeros(spec.n_layers * spec.n_heads * (1 if units == "coarse" else t * t))
    mlp_scores = torch.zeros(spec.n_layers * spec.d_mlp * (1 if units == "coarse" else t))
    for kind, idx in _unit_batches(spec, t, units, batch_size, req.device):
        keeps = _keeps(kind, idx, spec, t, units, dtype)
        drop = (clean - _metric(model, req, len(idx), keeps if kind == "attn" else {},
                                keeps if kind == "mlp" else {})).float().cpu()
        (attn_scores if kind == "attn" else mlp_scores)[idx.cpu()] = drop
    if units == "coarse":
        return result(model, req, "activation_patching",
                      head_scores=attn_scores.view(spec.n_layers, spec.n_heads),
                      neuron_scores=mlp_scores.view(spec.n_layers, spec.d_mlp))
    return result(model, req, "activation_patching",
                  edge_scores=attn_scores.view(spec.n_layers, spec.n_heads, t, t),
                  neuron_position_scores=mlp_scores.view(spec.n_layers, t, spec.d_mlp))
