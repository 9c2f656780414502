"""Rotary position embeddings, HF's convention: ``rot(q) = q * cos + rotate_half(q) * sin`` (book: rope)."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., pos, d_head] with cos/sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin
