"""Rotary position embeddings and their transpose (book: rope).

HF's convention: ``rot(q) = q * cos + rotate_half(q) * sin``. ``rotate_half`` is
antisymmetric (its transpose is its negative), so the transpose of ``rot`` is
``a * cos - rotate_half(a * sin)``; for HF's cos/sin (the two halves carry the same
frequencies) this is also the inverse rotation.
"""

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


def apply_rope_transpose(a: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R^T a: pull a target on the rotated vector back to the unrotated one."""
    return a * cos - rotate_half(a * sin)
