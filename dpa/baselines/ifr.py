"""Information Flow Routes (Ferrando & Voita, 2024), dense: no threshold pruning.

Every residual update is a sum of parts. After attention at position i:
``resid_mid_i = resid_pre_i + sum_{h,j} alpha_hij v_hj W_O^h`` (the residual and one part per
edge); after the GLU: ``resid_post_i = resid_mid_i + sum_n a_{n,i} w_D^n`` (the residual and one
part per neuron). A norm after a block (Gemma 3, OLMo 2) is frozen at its clean-forward scale,
so each part is what the unit writes through it: ``gain * r_i`` times the part (the parts then
still sum to the update). IFR weighs part z of a sum y by its proximity
``max(0, ||y||_1 - ||y - z||_1)``, normalised over the parts of that sum.

Importance flows from the target position at the top down through these weights: the GLU is
position-wise, so a position's importance passes to its mid-layer residual whole; attention
passes it to key positions through the edge weights (plus the residual weight to itself).
* input scores: the importance reaching each embedding;
* edge score: importance of the query's mid-layer residual x the edge's proximity weight;
* neuron score: importance of the position's layer output x the neuron's proximity weight.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..result import Attribution
from .common import Prompt, prepare, result
from .internals import Layer, forward_internals, frozen, head_values, require_layout

_CHUNK = 2 ** 25  # elements per intermediate tensor
_ROWS = 32  # query rows per attention chunk: smaller chunks skip more of the masked (future) keys


def _proximity(y: Tensor, parts: Tensor) -> Tensor:
    """max(0, ||y||_1 - ||y - z||_1) for parts [..., n, d] of y [..., d] -> [..., n]."""
    return (y.abs().sum(-1, keepdim=True) - (y[..., None, :] - parts).abs().sum(-1)).clamp_min(0)


def attention_weights(layer: Layer) -> tuple[Tensor, Tensor]:
    """Normalised proximity weights of one attention update: residual [query], edges [head query key]."""
    probs = layer.probs[0]  # [head query key]
    h, t, _ = probs.shape
    resid = layer.resid_pre[0]
    y = layer.resid_mid[0]  # [query d_model]
    vo = head_values(layer)  # [head key d_model]
    edges = torch.zeros_like(probs)
    step = max(1, min(_ROWS, _CHUNK // (h * t * y.shape[-1])))
    for start in range(0, t, step):
        stop = min(t, start + step)  # queries start..stop-1 see keys 0..stop-1 only (causal)
        parts = probs[:, start:stop, :stop, None] * vo[:, None, :stop]  # [head query key d_model]
        if layer.post_attn is not None:  # through the frozen post-norm of each query position
            parts = parts * layer.post_attn[None, start:stop, None].to(parts.dtype)
        prox = _proximity(y[start:stop], parts.permute(1, 0, 2, 3).reshape(stop - start, h * stop, -1))
        edges[:, start:stop, :stop] = prox.view(stop - start, h, stop).transpose(0, 1)
    own = _proximity(y, resid[:, None, :])[:, 0]  # [query]
    total = (own + edges.sum((0, 2))).clamp_min(1e-30)
    return own / total, edges / total[None, :, None]


def neuron_weights(layer: Layer) -> Tensor:
    """Normalised proximity weights of the neurons in one GLU update [pos d_mlp]."""
    act = layer.act[0] * layer.up[0]  # [pos d_mlp]
    down = layer.weights.down  # [d_model d_mlp]
    resid = layer.resid_mid[0]
    y = resid + layer.mlp_write  # [pos d_model]
    t, n = act.shape
    out = torch.empty_like(act)
    step = max(1, _CHUNK // (n * y.shape[-1]))
    for rows in torch.arange(t).split(step):
        parts = act[rows, :, None] * down.T[None]  # [pos d_mlp d_model]
        if layer.post_mlp is not None:
            parts = frozen(parts, layer.post_mlp[rows])
        out[rows] = _proximity(y[rows], parts)
    own = _proximity(y, resid[:, None, :])[:, 0]
    return out / (own + out.sum(-1)).clamp_min(1e-30)[:, None]


@torch.no_grad()
def _flow(model: nn.Module, tokenizer, prompt: Prompt, target, contrast, position, components: bool):
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    require_layout(req.spec, "ifr")
    layers = forward_internals(model, req, decompose=True).layers
    t = req.n_tokens
    importance = torch.zeros(t, dtype=layers[0].resid_pre.dtype, device=req.device)
    importance[req.position(0)] = 1.0  # of each position's residual, top layer first
    edge_scores, neuron_scores = [], []
    for layer in reversed(layers):
        if components:
            neuron_scores.append(importance[:, None] * neuron_weights(layer))
        own, edges = attention_weights(layer)  # the GLU passes importance to resid_mid whole
        if components:
            edge_scores.append(importance[None, :, None] * edges)
        importance = importance * own + torch.einsum("q,hqk->k", importance, edges)
    flip = lambda xs: torch.stack(xs[::-1]) if xs else None  # noqa: E731
    return req, importance, flip(edge_scores), flip(neuron_scores)


def ifr(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
        position: int | None = None) -> Attribution:
    """Input scores: the share of the target position's importance that reaches each token."""
    req, importance, _, _ = _flow(model, tokenizer, prompt, target, contrast, position, components=False)
    return result(model, req, "ifr", token_scores=importance)


def component_ifr(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                  position: int | None = None) -> Attribution:
    """Edge and position-level neuron scores: the importance flowing through each unit."""
    req, importance, edges, neurons = _flow(model, tokenizer, prompt, target, contrast, position, components=True)
    return result(model, req, "ifr", token_scores=importance, edge_scores=edges,
                  neuron_position_scores=neurons)
