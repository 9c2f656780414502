"""Activation-magnitude component baselines: MLP-only and norm-only.

* MLP-only scores each (layer, position, neuron) by its gate activation act(s) (SiLU(s), or Gemma's
  tanh GELU: the factor the component ablation zeroes); edges get 0.
* Norm-only scores each unit by the L2 norm of what it writes to the residual stream: an edge
  (layer, head, query i, key j) writes alpha_ij v_j W_O^h, a neuron writes a_{n,i} w_D^n with
  a = act(s) u, so its norm is |a_{n,i}| ||w_D^n||. Where a norm follows the block (Gemma 3, OLMo 2),
  the write passes through it frozen at its clean-forward scale, the diagonal D_i = gain * r_i of
  the query's (the neuron's) position: ||D_i (alpha_ij v_j W_O^h)|| and |a_{n,i}| ||D_i w_D^n||.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..result import Attribution
from .common import Prompt, prepare, result
from .internals import Layer, forward_internals, head_values, require_layout


def mlp_only(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
             position: int | None = None) -> Attribution:
    """Each position-level neuron scored by act(s); attention edges score 0."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_layout(req.spec, "mlp_only")
    layers = forward_internals(model, req, decompose=True).layers
    neurons = torch.stack([layer.act[0] for layer in layers])  # [layer pos d_mlp]
    spec = req.spec
    edges = torch.zeros(spec.n_layers, spec.n_heads, req.n_tokens, req.n_tokens)
    return result(model, req, "mlp_only", edge_scores=edges, neuron_position_scores=neurons)


def _write_norms(vectors: Tensor, diagonal: Tensor | None) -> Tensor:
    """||D_i w|| for vectors w [..., n, d_model] and positions i of the diagonal D [pos d_model] -> [..., pos, n];
    without a norm (D = None), ||w|| [..., 1, n]."""
    if diagonal is None:
        return vectors.norm(dim=-1).unsqueeze(-2)
    d2 = diagonal.to(vectors.dtype).pow(2)
    return torch.einsum("...nd,id->...in", vectors.pow(2), d2).clamp_min(0).sqrt()


def _edge_norms(layer: Layer) -> Tensor:
    """||alpha_ij D_i v_j W_O^h|| [head query key]."""
    return layer.probs[0] * _write_norms(head_values(layer), layer.post_attn)  # [head key d] -> [head query key]


def _neuron_norms(layer: Layer) -> Tensor:
    """|a_{n,i}| ||D_i w_D^n|| [pos d_mlp]."""
    a = layer.act[0] * layer.up[0]  # [pos d_mlp]
    return a.abs() * _write_norms(layer.weights.down.T, layer.post_mlp)  # [d_mlp d] -> [1|pos d_mlp]


def norm_only(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None) -> Attribution:
    """Each edge and position-level neuron scored by the L2 norm of its residual-stream write."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_layout(req.spec, "norm_only")
    layers = forward_internals(model, req, decompose=True).layers
    edges = torch.stack([_edge_norms(layer) for layer in layers])  # [layer head query key]
    neurons = torch.stack([_neuron_norms(layer) for layer in layers])  # [layer pos d_mlp]
    return result(model, req, "norm_only", edge_scores=edges, neuron_position_scores=neurons)
