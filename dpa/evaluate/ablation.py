"""Ablation forward passes: p(target) with units zeroed (method.md section 6).

* Input: a token's embedding replaced by the zero vector; positions and attention mask unchanged.
* Component: selected post-softmax attention probabilities set to zero (no renormalisation) and
  SiLU(s) set to zero for selected (position, neuron) pairs; see ``dpa.baselines.forward``.

The batched functions take *keep* masks (1 keep, 0 zero) with one row per ablated copy of the
same prompt and return p(target) for each row, in float32 (float64 for a float64 model). Component passes always run the
instrumented attention (also for rows that ablate nothing), so clean and ablated probabilities
come from the same arithmetic. The ``*_both`` variants also return p(target) from a softmax in
the model's own dtype (the paper's mode: its bfloat16 runs took the softmax in bfloat16); for a
float32 or float64 model the two are the same numbers.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from ..adapters import spec_for
from ..baselines.forward import instrumented, run


def _probs(model: nn.Module, hidden: Tensor, position: int, target_id: int) -> tuple[Tensor, Tensor]:
    """p(target) per row: softmax in float32 or better, and softmax in the model's dtype (returned in
    float32 or better)."""
    logits = model.lm_head(hidden[:, position])
    wide = torch.promote_types(logits.dtype, torch.float32)
    probs = logits.to(wide).softmax(-1)[:, target_id]
    return probs, probs if logits.dtype == wide else logits.softmax(-1)[:, target_id].to(wide)


def _ids(model: nn.Module, input_ids) -> Tensor:
    ids = torch.as_tensor(input_ids, device=model.lm_head.weight.device).long()
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError("ablation takes one prompt (input_ids of shape [pos] or [1 pos])")
        ids = ids[0]
    return ids


@torch.no_grad()
def input_ablation_probs_both(model: nn.Module, input_ids, keep: Tensor, target_position: int, target_id: int,
                              batch_size: int = 16) -> tuple[Tensor, Tensor]:
    """``input_ablation_probs`` and the same probabilities from a softmax in the model's dtype."""
    ids = _ids(model, input_ids)
    emb = model.model.embed_tokens(ids[None])  # [1 pos d_model]
    out = []
    for rows in keep.split(batch_size):
        embeds = emb * rows.to(device=emb.device, dtype=emb.dtype)[..., None]
        out.append(_probs(model, run(model, inputs_embeds=embeds), target_position, target_id))
    return torch.cat([a for a, _ in out]).cpu(), torch.cat([b for _, b in out]).cpu()


def input_ablation_probs(model: nn.Module, input_ids, keep: Tensor, target_position: int, target_id: int,
                         batch_size: int = 16) -> Tensor:
    """p(target) for each row of ``keep`` [rows pos] (0 = that token's embedding zeroed)."""
    return input_ablation_probs_both(model, input_ids, keep, target_position, target_id, batch_size)[0]


def input_ablation_prob(model: nn.Module, input_ids, zero_positions: Iterable[int], target_position: int,
                        target_id: int) -> float:
    """p(target) with the embeddings at ``zero_positions`` zeroed."""
    ids = _ids(model, input_ids)
    keep = torch.ones(1, len(ids))
    keep[0, list(zero_positions)] = 0
    return float(input_ablation_probs(model, ids, keep, target_position, target_id)[0])


@torch.no_grad()
def component_ablation_probs_both(model: nn.Module, input_ids, attn_keep: Tensor | None, neuron_keep: Tensor | None,
                                  target_position: int, target_id: int) -> tuple[Tensor, Tensor]:
    """``component_ablation_probs`` and the same probabilities from a softmax in the model's dtype."""
    ids = _ids(model, input_ids)
    spec = spec_for(model)
    rows = next((m.shape[0] for m in (attn_keep, neuron_keep) if m is not None), 1)
    device = model.lm_head.weight.device
    to = lambda m: m.to(device)  # noqa: E731
    attn = {l: None if attn_keep is None else to(attn_keep[:, l]) for l in range(spec.n_layers)}
    neurons = {} if neuron_keep is None else {l: to(neuron_keep[:, l]) for l in range(spec.n_layers)}
    with instrumented(model, attn=attn, neurons=neurons):
        hidden = run(model, ids[None].expand(rows, -1))
    clean, native = _probs(model, hidden, target_position, target_id)
    return clean.cpu(), native.cpu()


def component_ablation_probs(model: nn.Module, input_ids, attn_keep: Tensor | None, neuron_keep: Tensor | None,
                             target_position: int, target_id: int) -> Tensor:
    """p(target) for each row of the keep masks, in one forward pass.

    attn_keep [rows layer head query|1 key|1]; neuron_keep [rows layer pos|1 d_mlp]; either may be
    None (nothing of that kind ablated). Rows must agree between the two masks.
    """
    return component_ablation_probs_both(model, input_ids, attn_keep, neuron_keep, target_position, target_id)[0]


def component_ablation_prob(model: nn.Module, input_ids, edges: Iterable[tuple[int, int, int, int]],
                            neurons: Iterable[tuple[int, int, int]], target_position: int, target_id: int) -> float:
    """p(target) with ``edges`` (layer, head, query, key) and ``neurons`` (layer, pos, neuron) zeroed."""
    ids = _ids(model, input_ids)
    spec = spec_for(model)
    t = len(ids)
    attn_keep = torch.ones(1, spec.n_layers, spec.n_heads, t, t, dtype=torch.bool)
    for l, h, q, k in edges:
        attn_keep[0, l, h, q, k] = False
    neuron_keep = torch.ones(1, spec.n_layers, t, spec.d_mlp, dtype=torch.bool)
    for l, p, n in neurons:
        neuron_keep[0, l, p, n] = False
    return float(component_ablation_probs(model, ids, attn_keep, neuron_keep, target_position, target_id)[0])
