"""Attention probabilities and output, recomputed in dpa's own readable code (book: softmax-taylor).

Shapes follow the field's names: ``batch head query_pos key_pos d_head``. Grouped-query attention is
handled by viewing the query heads as ``(kv_head, group)``: query head h reads KV head ``h // group``
(HF's ``repeat_kv``); keys and values are never repeated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functions import TemperedSoftmax
from .softcap import softcap as capped


def heads(x: Tensor, n: int) -> Tensor:
    """[batch pos n*d_head] -> [batch n pos d_head]"""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def merge(x: Tensor) -> Tensor:
    """[batch n pos d_head] -> [batch pos n*d_head]"""
    b, n, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, n * dh)


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


def softmax(x: Tensor, temperature: float = 1.0) -> Tensor:
    """softmax over the last dimension, with GIM's backward at ``temperature`` where it is not 1."""
    return torch.softmax(x, -1) if temperature == 1 else TemperedSoftmax.apply(x, temperature)


def attention_probs(q: Tensor, k: Tensor, scaling: float, mask: Tensor, softcap: float | None = None,
                    sinks: Tensor | None = None, temperature: float = 1.0) -> Tensor:
    """softmax(q k^T * scale) over keys: q [batch head query d_head], k [batch kv_head key d_head],
    mask [batch 1|head query key] (True = may attend) -> [batch head query key], 0 where masked.
    softcap: the scores become c tanh(score / c) first (Gemma 2). sinks [head]: one more logit per head in
    the softmax, attended to by no key (GPT-OSS): the row sums to less than one. temperature: GIM's
    backward (``TemperedSoftmax``)."""
    b, h, tq, dh = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, tq, dh)  # [batch kv_head group query d_head]
    scores = torch.einsum("bkgid,bkjd->bkgij", qg, k).reshape(b, h, tq, k.shape[2]) * scaling
    if softcap is not None:
        scores = capped(scores, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.device, scores.dtype).view(1, h, 1, 1).expand(b, h, tq, 1)
        return softmax(torch.cat([scores, sink], dim=-1), temperature)[..., :-1] * mask.any(-1, keepdim=True)
    return softmax(scores, temperature).nan_to_num(0.0)  # fully masked rows (padding) -> 0


def attention_output(probs: Tensor, v: Tensor) -> Tensor:
    """z = sum_j alpha_ij v_j per head: probs [batch head query key], v [batch kv_head key d_head]
    -> [batch pos head*d_head] (the input of o_proj)."""
    b, h, t, s = probs.shape
    kv = v.shape[1]
    z = torch.einsum("bkgij,bkjd->bkgid", probs.reshape(b, kv, h // kv, t, s), v)
    return merge(z.reshape(b, h, t, -1))
