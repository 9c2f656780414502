"""Rotary position embeddings, HF's convention: ``rot(q) = q * cos + rotate_half(q) * sin`` (book: rope)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., pos, d_head] with cos/sin broadcastable to it."""
    return x * cos + rotate_half(x) * sin


@contextmanager
def each_prompt_alone(rotary: nn.Module) -> Iterator[None]:
    """While open, the model's rotary module gives every row of a batch the (cos, sin) it gives that prompt alone.

    Where the frequencies depend on the sequence length (LongRoPE's short or long factors, dynamic NTK's base:
    ``families.LENGTH_DEPENDENT_ROPE``), transformers reads the length as the largest position id + 1 of the
    whole batch. A row's positions (``Request.position_ids``: 0 .. n-1, then n-1 again on its right padding) say
    its own length n; the rows of each length are run through the module's own forward together, each group
    after a call at the single position 0, which is transformers' own reset of dynamic NTK to the original
    frequencies (it otherwise keeps the largest length seen, so that a prompt's rotary would depend on the
    calls before it). Each row's (cos, sin) is thus the module's own for that prompt on a freshly loaded model."""
    had = "forward" in vars(rotary)
    own = rotary.forward

    def forward(x: Tensor, position_ids: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        lengths = position_ids.amax(-1) + 1
        cos = sin = None
        for n in lengths.unique().tolist():
            rows = (lengths == n).nonzero().flatten()
            own(x, position_ids[:1, :1].new_zeros(1, 1), *args, **kwargs)  # transformers' reset (see above)
            c, s = own(x, position_ids[rows], *args, **kwargs)
            if cos is None:
                cos = c.new_empty((position_ids.shape[0], *c.shape[1:]))
                sin = s.new_empty((position_ids.shape[0], *s.shape[1:]))
            cos[rows], sin[rows] = c, s
        return cos, sin

    rotary.forward = forward
    try:
        yield
    finally:
        if had:
            rotary.forward = own
        else:
            del rotary.forward
