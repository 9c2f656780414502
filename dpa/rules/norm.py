"""RMSNorm with a frozen scale: a diagonal linear map (book: rmsnorm)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def rms_scale(x: Tensor, eps: float) -> Tensor:
    """r = 1/sigma over the last axis, computed in float32 or better. [..., d] -> [..., 1]"""
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def apply_norm(x: Tensor, gamma: Tensor, scale: Tensor) -> Tensor:
    """The forward map gamma * r * x with the scale r given (frozen)."""
    return gamma * (x * scale)


# The diagonal a frozen norm multiplies by, besides r, from its weight: gamma (Llama's RMSNorm) or 1 + gamma
# (Gemma's, whose weights are stored as offsets from one).
GAIN = {
    "rms": lambda gamma: gamma,
    "rms_1p": lambda gamma: 1 + gamma,
    "layer": lambda gamma: gamma,  # LayerNorm: gamma after the mean-centring
}


def rms(x: Tensor, gamma: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """HF's Llama RMSNorm arithmetic, step for step: (weight * (x32 * r).to(dtype), r) with r in float32."""
    x32 = x.to(torch.float32)
    r = rms_scale(x32, eps)
    return gamma * (x32 * r).to(x.dtype), r


def rms_1p(x: Tensor, gamma: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """HF's Gemma RMSNorm arithmetic: ((x32 * r) * (1 + weight32)).to(dtype), with r in float32."""
    x32 = x.float()
    r = rms_scale(x32, eps)
    return ((x32 * r) * (1.0 + gamma.float())).type_as(x), r


def layer(x: Tensor, gamma: Tensor, eps: float, beta: Tensor | None = None) -> tuple[Tensor, None]:
    """LayerNorm, torch's own kernel (what nn.LayerNorm runs); r = 1/std is computed beside it."""
    return torch.nn.functional.layer_norm(x, gamma.shape, gamma, beta, eps), None


NORM_KINDS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {  # the forward arithmetic of each norm kind
    "rms": rms,  # Llama, Mistral, Qwen2, Qwen3 (and Qwen3's q/k norms)
    "rms_1p": rms_1p,  # Gemma 2 and 3 (every norm, q/k norms too)
    "layer": layer,  # GPT-2, GPT-NeoX: mean-centring (linear), 1/std frozen, the bias beta in the bias share
}
