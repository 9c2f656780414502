"""Attention-map baselines: last-layer attention, mean attention, attention rollout, attention-only.

All read the post-softmax probabilities alpha [layer head query key] of one clean forward pass.
Input methods score key tokens from the target position's query row; the component method scores
each attention edge by its probability (neurons get 0, so they rank after every edge with alpha > 0).
"""

from __future__ import annotations

import torch
from torch import nn

from ..result import Attribution
from .common import Prompt, prepare, result
from .internals import forward_internals, probabilities


def _probs(model: nn.Module, tokenizer, prompt: Prompt, target, contrast, position):
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    layers = forward_internals(model, req).layers
    return req, probabilities(layers).float()  # [layer head query key]


def last_layer_attention(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                         position: int | None = None) -> Attribution:
    """The last layer's attention from the target position, averaged over heads."""
    req, probs = _probs(model, tokenizer, prompt, target, contrast, position)
    scores = probs[-1, :, req.position(0)].mean(0)
    return result(model, req, "last_layer_attention", token_scores=scores)


def mean_attention(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                   position: int | None = None) -> Attribution:
    """Attention from the target position, averaged over all layers and heads."""
    req, probs = _probs(model, tokenizer, prompt, target, contrast, position)
    scores = probs[:, :, req.position(0)].mean((0, 1))
    return result(model, req, "mean_attention", token_scores=scores)


def attention_rollout(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                      position: int | None = None) -> Attribution:
    """Abnar & Zuidema's rollout: A_l = (mean_h alpha + I) / 2, multiplied from the top layer down;
    the target position's row."""
    req, probs = _probs(model, tokenizer, prompt, target, contrast, position)
    eye = torch.eye(req.n_tokens, device=probs.device)
    rollout = eye
    for a in probs.mean(1):  # [query key], bottom layer first
        rollout = (0.5 * a + 0.5 * eye) @ rollout
    return result(model, req, "attention_rollout", token_scores=rollout[req.position(0)])


def attn_only(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None) -> Attribution:
    """Component baseline: each edge (layer, head, query, key) scored by its probability alpha."""
    req, probs = _probs(model, tokenizer, prompt, target, contrast, position)
    spec = req.spec
    neurons = torch.zeros(spec.n_layers, req.n_tokens, spec.d_mlp)
    return result(model, req, "attn_only", edge_scores=probs, neuron_position_scores=neurons)
