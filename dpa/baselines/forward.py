"""An instrumented forward pass: attention probabilities and GLU activations exposed and editable.

Inside ``instrumented(model, ...)`` the chosen attention modules run dpa's own recomputation
(``dpa.attention.attention_internals`` / ``attention_output`` on the module's q/k/v projection
outputs), so the post-softmax probabilities exist as a tensor that can be recorded (with its
autograd graph) and multiplied by a mask. The GLU activation ``a = SiLU(s) * u`` is read and
edited at the input of ``down_proj`` with an ordinary pre-hook; multiplying ``a`` by a 0/1 mask
is the same as zeroing SiLU(s) for those (position, neuron) pairs. No HF-internal variable is
touched: only module boundaries and the modules' own projections.

Batches must be unpadded (every row the same length), which is how the baselines and the
ablation protocol use it: one prompt, repeated with different edits.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
from torch import Tensor, nn

from ..adapters import ModelSpec, layer_weights, spec_for
from ..attention import attention_internals, attention_output
from ..capture import attention_mask


@dataclass
class Recording:
    """Per-layer tensors of the last instrumented forward pass, in the autograd graph."""

    probs: dict[int, Tensor] = field(default_factory=dict)  # [batch head query key], after edits
    acts: dict[int, Tensor] = field(default_factory=dict)  # a = SiLU(s) * u [batch pos d_mlp], after edits


def _rope(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    b, t = x.shape[:2]
    position_ids = torch.arange(t, device=x.device)[None].expand(b, t)
    return model.model.rotary_emb(x, position_ids)


def _attention_forward(model: nn.Module, spec: ModelSpec, index: int, keep: Tensor | None,
                       rec: Recording | None, cache: dict):
    attn = model.model.layers[index].self_attn

    def forward(hidden_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        x = hidden_states  # [batch pos d_model], already normalised by the decoder layer
        b, t = x.shape[:2]
        window = spec.sliding_windows[index]
        key = (b, t, window, x.device, x.dtype)
        if key not in cache:
            cos, sin = _rope(model, x)
            mask = attention_mask(torch.ones(b, t, dtype=torch.bool, device=x.device), window)
            cache[key] = (cos.to(x.dtype), sin.to(x.dtype), mask)
        cos, sin, mask = cache[key]
        w = layer_weights(model, spec, index, x.dtype).attn
        c = attention_internals(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), w, cos, sin, mask)
        if keep is not None:
            c = replace(c, probs=c.probs * keep.to(c.probs.dtype))
        if rec is not None:
            rec.probs[index] = c.probs
        return attention_output(c, w), c.probs

    return forward


def _neuron_hook(index: int, keep: Tensor | None, rec: Recording | None):
    def hook(_module, args):
        a = args[0]
        if keep is not None:
            a = a * keep.to(a.dtype)
        if rec is not None:
            rec.acts[index] = a
        return (a, *args[1:])

    return hook


@contextmanager
def instrumented(model: nn.Module, *, attn: dict[int, Tensor] | None = None, neurons: dict[int, Tensor] | None = None,
                 record: bool = False) -> Iterator[Recording | None]:
    """Run forward passes with edited attention probabilities and GLU activations.

    attn: layer -> keep multiplier broadcastable to [batch head query key] (0 zeroes a probability;
    no renormalisation). neurons: layer -> keep multiplier broadcastable to [batch pos d_mlp]
    (0 zeroes SiLU(s) there). record=True instruments every layer and yields a ``Recording``.
    """
    spec = spec_for(model)
    attn, neurons = attn or {}, neurons or {}
    rec = Recording() if record else None
    layers = model.model.layers
    every = range(spec.n_layers)
    attn_layers = list(every) if record else sorted(attn)
    mlp_layers = list(every) if record else sorted(neurons)
    cache: dict = {}
    handles = []
    try:
        for i in attn_layers:
            layers[i].self_attn.forward = _attention_forward(model, spec, i, attn.get(i), rec, cache)
        for i in mlp_layers:
            handles.append(layers[i].mlp.down_proj.register_forward_pre_hook(_neuron_hook(i, neurons.get(i), rec)))
        yield rec
    finally:
        for h in handles:
            h.remove()
        for i in attn_layers:
            layers[i].self_attn.__dict__.pop("forward", None)


def run(model: nn.Module, input_ids: Tensor | None = None, *, inputs_embeds: Tensor | None = None) -> Tensor:
    """The base model's last hidden state [batch pos d_model] (no logits over all positions)."""
    return model.model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
