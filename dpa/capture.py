"""The one forward pass: module-boundary tensors recorded with ordinary forward hooks.

Hooks sit only at module boundaries that every supported family shares (the decoder
layers' two RMSNorms, the final norm, and the nn.Linear projections); everything the
rules need beyond that (RoPE, probabilities) is recomputed in ``attention.py`` and
checked against HF's logits in the tests (the forward oracle).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from .adapters import ModelSpec


class NonFiniteError(FloatingPointError):
    """The forward pass produced NaN or infinite activations."""


@dataclass
class LayerCapture:
    """Tensors at one decoder layer's module boundaries (model dtype, [batch pos ...])."""

    resid_pre: Tensor  # input of the layer = input of input_layernorm   [batch pos d_model]
    resid_mid: Tensor | None = None  # input of post_attention_layernorm [batch pos d_model]
    q: Tensor | None = None  # q_proj output [batch pos head*d_head]   (None in lean mode)
    k: Tensor | None = None  # k_proj output [batch pos kv_head*d_head]
    v: Tensor | None = None  # v_proj output
    gate: Tensor | None = None  # gate_proj output [batch pos d_mlp]
    up: Tensor | None = None  # up_proj output


@dataclass
class ForwardCapture:
    input_ids: Tensor  # [batch pos]
    mask: Tensor  # [batch pos] bool, True on real tokens
    position_ids: Tensor  # [batch pos]
    layers: list[LayerCapture]
    resid_final: Tensor  # input of the final norm [batch pos d_model]
    hidden: Tensor  # output of the final norm [batch pos d_model]

    @property
    def embeddings(self) -> Tensor:
        return self.layers[0].resid_pre


@contextmanager
def _hooks(model: nn.Module, store: dict, projections: bool) -> Iterator[None]:
    handles = []

    def pre(key):
        def hook(_module, args):
            store[key] = args[0].detach()
        return hook

    def post(key):
        def hook(_module, _args, output):
            store[key] = output.detach()
        return hook

    try:
        for i, layer in enumerate(model.model.layers):
            handles.append(layer.input_layernorm.register_forward_pre_hook(pre(("pre", i))))
            handles.append(layer.post_attention_layernorm.register_forward_pre_hook(pre(("mid", i))))
            if projections:
                a, m = layer.self_attn, layer.mlp
                for name, mod in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj),
                                  ("gate", m.gate_proj), ("up", m.up_proj)):
                    handles.append(mod.register_forward_hook(post((name, i))))
        handles.append(model.model.norm.register_forward_pre_hook(pre(("final", None))))
        yield
    finally:
        for h in handles:
            h.remove()


def position_ids_for(mask: Tensor) -> Tensor:
    """Positions that ignore padding on either side: cumsum(mask) - 1, clamped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def capture(model: nn.Module, spec: ModelSpec, input_ids: Tensor, mask: Tensor, *,
            projections: bool = True) -> ForwardCapture:
    """Run the model once and record residual streams (and projection outputs unless lean)."""
    device = model.model.embed_tokens.weight.device
    input_ids, mask = input_ids.to(device), mask.to(device).bool()
    position_ids = position_ids_for(mask)
    store: dict = {}
    with _hooks(model, store, projections):
        out = model.model(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=False)
    pad = ~mask[..., None]
    for key, x in store.items():  # padded positions may hold NaN (fully masked rows); they must not leak
        store[key] = x.masked_fill(pad, 0)
    layers = [
        LayerCapture(resid_pre=store[("pre", i)], resid_mid=store[("mid", i)],
                     **({k: store[(k, i)] for k in ("q", "k", "v", "gate", "up")} if projections else {}))
        for i in range(spec.n_layers)
    ]
    cap = ForwardCapture(input_ids=input_ids, mask=mask, position_ids=position_ids, layers=layers,
                         resid_final=store[("final", None)], hidden=out.last_hidden_state.detach())
    check_finite(cap)
    return cap


def check_finite(cap: ForwardCapture) -> None:
    """Raise ``NonFiniteError`` naming the first layer whose residual stream is not finite."""
    real = cap.mask[..., None]
    if torch.isfinite(cap.resid_final.masked_fill(~real, 0)).all():
        return
    streams = [("the embeddings (layer 0 input)", cap.embeddings)]
    for i, layer in enumerate(cap.layers):
        streams.append((f"layer {i} after attention", layer.resid_mid))
        streams.append((f"layer {i} output", cap.layers[i + 1].resid_pre if i + 1 < len(cap.layers) else cap.resid_final))
    for where, x in streams:
        if not torch.isfinite(x.masked_fill(~real, 0)).all():
            raise NonFiniteError(f"non-finite activations (NaN or inf) in {where}; the model's weights or dtype "
                                 "overflow on this input (try float32)")
    raise NonFiniteError("non-finite activations in the final residual stream")


def attention_mask(mask: Tensor, window: int | None) -> Tensor:
    """Boolean [batch 1 query key]: causal, no padding keys or queries, optional sliding window.

    HF's sliding window lets query i see key j when ``i - window < j <= i``.
    """
    t = mask.shape[-1]
    i = torch.arange(t, device=mask.device)
    allowed = i[None, :] <= i[:, None]  # [query key]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    return allowed[None, None] & mask[:, None, None, :] & mask[:, None, :, None]
