"""Activation-magnitude component baselines: MLP-only and norm-only.

* MLP-only scores each (layer, position, neuron) by its gate activation SiLU(s); edges get 0.
* Norm-only scores each unit by the L2 norm of what it writes to the residual stream: an edge
  (layer, head, query i, key j) writes alpha_ij v_j W_O^h, a neuron writes a_{n,i} w_D^n with
  a = SiLU(s) u, so its norm is |a_{n,i}| ||w_D^n||.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..result import Attribution
from .common import Prompt, prepare, result
from .internals import require_pre_norm_swiglu, forward_internals, head_values, probabilities


def mlp_only(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
             position: int | None = None) -> Attribution:
    """Each position-level neuron scored by SiLU(s); attention edges score 0."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_pre_norm_swiglu(req.spec, "mlp_only")
    layers = forward_internals(model, req).layers
    neurons = torch.stack([F.silu(layer.gate[0]) for layer in layers])  # [layer pos d_mlp]
    spec = req.spec
    edges = torch.zeros(spec.n_layers, spec.n_heads, req.n_tokens, req.n_tokens)
    return result(model, req, "mlp_only", edge_scores=edges, neuron_position_scores=neurons)


def norm_only(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None) -> Attribution:
    """Each edge and position-level neuron scored by the L2 norm of its residual-stream write."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_pre_norm_swiglu(req.spec, "norm_only")
    layers = forward_internals(model, req).layers
    probs = probabilities(layers)  # [layer head query key]
    value_norms = torch.stack([head_values(layer).norm(dim=-1) for layer in layers])  # [layer head key]
    edges = probs * value_norms[:, :, None, :]
    neurons = torch.stack([
        (F.silu(layer.gate[0]) * layer.up[0]).abs() * layer.weights.down.norm(dim=0) for layer in layers
    ])  # [layer pos d_mlp]
    return result(model, req, "norm_only", edge_scores=edges, neuron_position_scores=neurons)
