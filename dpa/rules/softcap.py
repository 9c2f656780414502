"""Soft-capping, c tanh(x / c) (Gemma 2: attention scores and final logits; book: soft-capping)."""

from __future__ import annotations

import torch
from torch import Tensor


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """c tanh(x / c) elementwise (the identity without a cap)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def softcap_ratio(x: Tensor, cap: float) -> Tensor:
    """rho(x) = c tanh(x / c) / x, so that softcap(x) = x * rho(x) (rho = 1 at x = 0): the factor the final cap's
    linearisation holds frozen."""
    return torch.where(x == 0, torch.ones_like(x), softcap(x, cap) / x)
