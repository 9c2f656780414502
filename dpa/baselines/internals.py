"""One recorded forward pass with each layer's attention internals recomputed (no gradients).

The decomposition baselines (DePass, IFR, norm-only, MLP-only, the attention maps) read the same
quantities DPA's sweep reads: residual streams, q/k/v, gate/up pre-activations and the attention
probabilities, all from ``dpa.capture`` and ``dpa.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..adapters import LayerWeights, layer_weights
from ..attention import AttentionInternals, attention_internals
from ..capture import ForwardCapture, attention_mask, capture
from .common import Problem, final_logits


@dataclass
class Layer:
    """One layer of the clean forward pass (batch of one; float tensors in the model's dtype)."""

    weights: LayerWeights
    attn: AttentionInternals  # q, k, v, probs [1 head query key]
    resid_pre: Tensor  # [1 pos d_model]
    resid_mid: Tensor
    gate: Tensor  # s [1 pos d_mlp]
    up: Tensor  # u


@torch.no_grad()
def forward_internals(model: nn.Module, problem: Problem) -> tuple[ForwardCapture, list[Layer]]:
    spec = problem.spec
    mask = torch.ones_like(problem.input_ids, dtype=torch.bool)
    cap = capture(model, spec, problem.input_ids, mask)
    problem.clean_logits = final_logits(model, cap.hidden, problem.position)[0]
    dtype = cap.embeddings.dtype
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=dtype, device=problem.device), cap.position_ids)
    layers = []
    masks: dict = {}
    for i, lc in enumerate(cap.layers):
        w = layer_weights(model, spec, i, dtype)
        window = spec.sliding_windows[i]
        if window not in masks:
            masks[window] = attention_mask(cap.mask, window)
        c = attention_internals(lc.q, lc.k, lc.v, w.attn, cos.to(dtype), sin.to(dtype), masks[window])
        layers.append(Layer(weights=w, attn=c, resid_pre=lc.resid_pre, resid_mid=lc.resid_mid, gate=lc.gate,
                            up=lc.up))
    return cap, layers


def probabilities(layers: list[Layer]) -> Tensor:
    """Attention probabilities of every layer [layer head query key] (batch of one)."""
    return torch.stack([layer.attn.probs[0] for layer in layers])


def head_values(layer: Layer) -> Tensor:
    """v_{h,j} W_O^h: what head h writes when it attends fully to key j  [head key d_model]."""
    w = layer.weights.attn
    v = layer.attn.v[0]  # [kv_head key d_head]
    v = v.repeat_interleave(w.group, dim=0)  # query head h reads kv head h // group
    o = w.o.view(w.o.shape[0], w.n_heads, w.d_head)  # [d_model head d_head]
    return torch.einsum("hjd,mhd->hjm", v, o)
