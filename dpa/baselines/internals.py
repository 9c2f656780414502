"""One recorded forward pass with each layer's internals, for the decomposition baselines.

DePass, IFR, norm-only, MLP-only and the attention maps read residual streams, the branch outputs
(q/k/v, gate/up pre-activations) and the attention probabilities. The forward pass is the model's
own (fused attention), recorded by ``dpa.instrument``; alpha is then recomputed from the recorded
queries and keys by ``dpa.explicit`` (pure tensor arithmetic), where it is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..explicit import probs_from_recording
from ..families import layer_modules
from ..instrument import instrument, logits_at
from ..request import Request
from ..rules.attention import heads


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights (HF layout [out, in]) in the model's dtype."""

    attn_norm: Tensor  # gamma of the pre-attention norm [d_model]
    mlp_norm: Tensor  # gamma of the pre-MLP norm
    v: Tensor  # [kv_head*d_head d_model]
    o: Tensor  # [d_model head*d_head]
    gate: Tensor  # [d_mlp d_model]
    up: Tensor
    down: Tensor  # [d_model d_mlp]
    n_heads: int
    n_kv_heads: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def d_head(self) -> int:
        return self.o.shape[1] // self.n_heads


@dataclass
class Layer:
    """One layer of the clean forward pass (batch of one)."""

    weights: LayerWeights
    probs: Tensor  # [1 head query key]
    v: Tensor  # [1 kv_head key d_head] value projection output
    resid_pre: Tensor  # [1 pos d_model]
    resid_mid: Tensor
    gate: Tensor  # s [1 pos d_mlp]
    up: Tensor  # u


@dataclass
class Internals:
    layers: list[Layer]
    embeddings: Tensor  # [1 pos d_model]
    resid_final: Tensor  # input of the final norm [1 pos d_model]


PRE_NORM_SWIGLU = ("rms", "silu", 2)  # norm kind, activation, norms per layer: the structure written out below


def is_pre_norm_swiglu(parts) -> bool:
    """Llama's layer layout: one RMSNorm before each block and none after, SiLU-gated MLP."""
    kinds = {kind for _, kind in parts.activation_config[1]}
    return ((parts.norm_kind, *kinds, len(parts.norms)) == PRE_NORM_SWIGLU and parts.gated and not parts.fused
            and not parts.biases and parts.moe is None and tuple(parts.block_inputs) == tuple(parts.norms))


def require_pre_norm_swiglu(spec, method: str) -> None:
    """The methods that recompute a layer from its weights (DePass, IFR, the activation-based ones) are written
    for pre-norm SwiGLU layers with Llama's RMSNorm: refuse, by name, a family they would get wrong."""
    parts = spec.parts
    if not is_pre_norm_swiglu(parts):
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(f"{method} recomputes each layer from its weights and is written for pre-norm "
                                    f"SwiGLU layers (llama, mistral, qwen2, qwen3), not for {spec.family} "
                                    f"({spec.activation}, {parts.norm_kind} norms, {len(parts.norms)} per layer)")


@torch.no_grad()
def forward_internals(model: nn.Module, req: Request) -> Internals:
    """Record every layer of one clean forward pass (and keep the clean logits in ``req``)."""
    spec = req.spec
    with instrument(model, req, record={"resid", "mid", "branches", "rope"}) as session:
        hidden = session.forward()
        req.clean_logits = logits_at(model, req, hidden)
        rec = session.recording
        probs = [probs_from_recording(spec, model, req, rec, i) for i in range(spec.n_layers)]
    layers = []
    for i, mods in enumerate(layer_modules(model, spec)):
        w = LayerWeights(attn_norm=mods.norms[0].weight, mlp_norm=getattr(mods.mid, "weight", None), v=mods.branches["value"].weight,
                         o=mods.heads.weight, gate=mods.branches["gate"].weight, up=mods.branches["up"].weight,
                         down=mods.neurons.weight, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads)
        layers.append(Layer(weights=w, probs=probs[i], v=heads(rec.branches[("value", i)], spec.n_kv_heads),
                            resid_pre=rec.resid[i], resid_mid=rec.mid[i], gate=rec.branches[("gate", i)],
                            up=rec.branches[("up", i)]))
    return Internals(layers=layers, embeddings=rec.resid[0], resid_final=rec.resid[spec.n_layers])


def probabilities(layers: list[Layer]) -> Tensor:
    """Attention probabilities of every layer [layer head query key] (batch of one)."""
    return torch.stack([layer.probs[0] for layer in layers])


def head_values(layer: Layer) -> Tensor:
    """v_{h,j} W_O^h: what head h writes when it attends fully to key j  [head key d_model]."""
    w = layer.weights
    v = layer.v[0].repeat_interleave(w.group, dim=0)  # [head key d_head]: query head h reads kv head h // group
    o = w.o.view(w.o.shape[0], w.n_heads, w.d_head)  # [d_model head d_head]
    return torch.einsum("hjd,mhd->hjm", v, o)
