"""RMSNorm with a frozen scale: a diagonal linear map (book: rmsnorm)."""

from __future__ import annotations

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
