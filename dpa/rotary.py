"""A prompt's rotary embedding is the one it gets alone, whatever its batch (book: rope).

Where the rotary frequencies depend on the sequence length (``families.LENGTH_DEPENDENT_ROPE``: LongRoPE's short
or long factors, dynamic NTK's rescaled base), transformers reads the length from the whole padded batch, and
its dynamic NTK keeps the longest length it has seen. ``Session.forward`` runs the model inside
``each_prompt_alone`` for such models, so that a prompt's scores never depend on its batch-mates or on the
calls before it (tests/test_rope_scaling.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn


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

    state = _RotaryState(rotary)
    rotary.forward = forward
    try:
        yield
    finally:
        if had:
            rotary.forward = own
        else:
            del rotary.forward
        state.restore()


class _RotaryState:
    """What running the rotary module changes (dynamic NTK's ``inv_freq`` and cached length, LongRoPE's
    attributes), put back afterwards: the model's own next forward is what it would have been without dpa."""

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        self.buffers = {k: (v, v.clone()) for k, v in rotary._buffers.items() if v is not None}
        self.attrs = {k: v for k, v in vars(rotary).items() if not k.startswith("_") and k not in ("training", "forward")}

    def restore(self) -> None:
        r = self.rotary
        for k in [k for k in r._buffers if k not in self.buffers]:
            del r._buffers[k]
        for k, (tensor, values) in self.buffers.items():
            if not torch.equal(tensor, values):
                tensor.copy_(values)
            r._buffers[k] = tensor
        for k in [k for k in vars(r) if not k.startswith("_") and k not in ("training", "forward")
                  and k not in self.attrs]:
            delattr(r, k)
        for k, v in self.attrs.items():
            if vars(r).get(k, self) is not v:
                object.__setattr__(r, k, v)
