"""The gated linear unit: content (up) and control (gate) paths (book: glu).

Per position and neuron: ``s = x W_G^T``, ``u = x W_U^T``, ``a = SiLU(s) * u``,
``out = a W_D^T``. With ``lam = t W_D`` the target on each neuron's activation,

* the up path freezes the gate activation:      ``c_up   = lam * SiLU(s)``
* the gate path writes SiLU(s) = s * sigmoid(s)
  and freezes sigmoid(s) and u:                 ``c_gate = lam * sigmoid(s) * u``

Each path alone reproduces the block output: ``x . (c_up W_U) = x . (c_gate W_G) = lam . a``.
All functions take plain tensors; the weights use HF's [out, in] layout.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def glu_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute the block: returns (s, u, out) for x [batch pos d_model]."""
    s = x @ w_gate.T  # [batch pos d_mlp]
    u = x @ w_up.T
    out = (F.silu(s) * u) @ w_down.T
    return s, u, out


def propagate_glu(target: Tensor, s: Tensor, u: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  gamma: Tensor, scale: Tensor, *, up: float = 0.5, gate: float = 0.5) -> tuple[Tensor, Tensor]:
    """g_GLU(t) = (mu_up c_up W_U + mu_gate c_gate W_G) * gamma * r.

    Returns (g, lam): the target on the block's residual input and t W_D per neuron.
    """
    lam = target @ w_down  # [batch pos d_mlp]
    coef = 0.0
    if up:
        coef = (up * lam * F.silu(s)) @ w_up
    if gate:
        coef = coef + (gate * lam * torch.sigmoid(s) * u) @ w_gate
    if not isinstance(coef, Tensor):
        coef = torch.zeros_like(target)
    return coef * (gamma * scale), lam


def neuron_position_scores(s: Tensor, u: Tensor, neuron_target: Tensor) -> Tensor:
    """S_{n,i} = a_{n,i} (w_D^n . t_i): [batch pos d_mlp]."""
    return F.silu(s) * u * neuron_target
