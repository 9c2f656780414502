"""Attention: the value (content) path and the query/key (control) paths (book: softmax-taylor).

Shapes follow the field's names: ``batch head query_pos key_pos d_head``. Grouped-query
attention is handled by viewing the query heads as ``(kv_head, group)``: query head h
reads KV head ``h // group`` (HF's ``repeat_kv``); cached keys, values and weights are
never repeated. All functions take plain tensors; weights use HF's [out, in] layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .norm import rms_scale
from .rope import apply_rope, apply_rope_transpose


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's projections, HF layout. Biases only for Qwen2; q/k norms only for Qwen3."""

    q: Tensor  # [head*d_head, d_model]
    k: Tensor  # [kv_head*d_head, d_model]
    v: Tensor  # [kv_head*d_head, d_model]
    o: Tensor  # [d_model, head*d_head]
    n_heads: int
    n_kv_heads: int
    scaling: float
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    q_norm: Tensor | None = None  # [d_head] gamma of Qwen3's per-head RMSNorm
    k_norm: Tensor | None = None
    qk_norm_eps: float = 1e-6

    @property
    def d_head(self) -> int:
        return self.q.shape[0] // self.n_heads

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class AttentionInternals:
    """What the propagation rules need from one layer's forward pass."""

    q: Tensor  # [batch head pos d_head], post-norm, post-RoPE
    k: Tensor  # [batch kv_head pos d_head], post-norm, post-RoPE
    v: Tensor  # [batch kv_head pos d_head]
    probs: Tensor | None  # [batch head query_pos key_pos], zero where masked; None = form per query block
    q_pull: Tensor | None  # gamma_q * r_q [batch head pos d_head] (Qwen3) else None
    k_pull: Tensor | None  # gamma_k * r_k [batch kv_head pos d_head]
    mask: Tensor | None = None  # [batch 1|head query_pos key_pos]

    def probs_rows(self, w: AttentionWeights, rows: slice) -> Tensor:
        """Probabilities of the query positions ``rows`` [batch head rows key_pos]."""
        if self.probs is not None:
            return self.probs[:, :, rows]
        return attention_probs(self.q[:, :, rows], self.k, w, self.mask[:, :, rows])


def _heads(x: Tensor, n: int) -> Tensor:
    """[batch pos n*d_head] -> [batch n pos d_head]"""
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def _merge(x: Tensor) -> Tensor:
    """[batch n pos d_head] -> [batch pos n*d_head]"""
    b, n, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, n * dh)


def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return x @ w.T if b is None else torch.addmm(b, x.flatten(0, 1), w.T).view(*x.shape[:-1], -1)


def _head_norm(x: Tensor, gamma: Tensor | None, eps: float) -> tuple[Tensor, Tensor | None]:
    """Qwen3's RMSNorm over d_head; returns (normalised x, gamma * r) or (x, None)."""
    if gamma is None:
        return x, None
    pull = gamma * rms_scale(x, eps)
    return (x * pull).to(x.dtype), pull.to(x.dtype)


def attention_internals(q: Tensor, k: Tensor, v: Tensor, w: AttentionWeights, cos: Tensor, sin: Tensor,
                        mask: Tensor, *, probs: bool = True) -> AttentionInternals:
    """Queries, keys and probabilities from the q/k/v projection outputs [batch pos heads*d_head].

    cos/sin [batch pos d_head] come from the model's own rotary module; mask is a
    boolean [batch 1|head query_pos key_pos] (True = may attend). With ``probs=False``
    the [head, pos, pos] map is not formed here: ``propagate_attention`` then builds it
    block by block over query positions (the memory-lean mode).
    """
    q, q_pull = _head_norm(_heads(q, w.n_heads), w.q_norm, w.qk_norm_eps)
    k, k_pull = _head_norm(_heads(k, w.n_kv_heads), w.k_norm, w.qk_norm_eps)
    cos, sin = cos[:, None], sin[:, None]  # head axis: [batch 1 pos d_head]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return AttentionInternals(q=q, k=k, v=_heads(v, w.n_kv_heads), probs=attention_probs(q, k, w, mask) if probs
                              else None, q_pull=q_pull, k_pull=k_pull, mask=mask)


def attention_probs(q: Tensor, k: Tensor, w: AttentionWeights, mask: Tensor) -> Tensor:
    """softmax(q k^T * scale) over keys for q [batch head query d_head], k [batch kv_head key d_head]."""
    b, h, tq, dh = q.shape
    qg = q.reshape(b, w.n_kv_heads, w.group, tq, dh)  # [batch kv_head group query d_head]
    scores = torch.einsum("bkgid,bkjd->bkgij", qg, k).reshape(b, h, tq, k.shape[2]) * w.scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows (padding) -> 0


def attention_output(c: AttentionInternals, w: AttentionWeights) -> Tensor:
    """The block output sum_j alpha_ij v_j W_O^T  [batch pos d_model]."""
    b, h, t, dh = c.q.shape
    probs = c.probs_rows(w, slice(None))
    z = torch.einsum("bkgij,bkjd->bkgid", probs.view(b, w.n_kv_heads, w.group, t, t), c.v)
    return _merge(z.reshape(b, h, t, dh)) @ w.o.T


def attention_forward(x: Tensor, w: AttentionWeights, cos: Tensor, sin: Tensor,
                      mask: Tensor) -> tuple[AttentionInternals, Tensor]:
    """Recompute one attention block from its normalised input x [batch pos d_model]."""
    c = attention_internals(_project(x, w.q, w.q_bias), _project(x, w.k, w.k_bias), _project(x, w.v, w.v_bias),
                            w, cos, sin, mask)
    return c, attention_output(c, w)


@dataclass(frozen=True)
class AttentionPropagation:
    target: Tensor  # g_MHSA on the normalised input (before gamma * r)  [batch pos d_model]
    head_scores: Tensor  # sum_i lam_{h,i} . z_{h,i}               [batch head]
    edge_scores: Tensor | None  # alpha * (lam . v)                  [batch head query_pos key_pos]
    value_bias_share: Tensor  # sum_{h,i} lam_{h,i} . (sum_j alpha) b_v  [batch]


def propagate_attention(target: Tensor, c: AttentionInternals, w: AttentionWeights, cos: Tensor, sin: Tensor,
                        *, query: float = 0.25, key: float = 0.25, value: float = 0.5,
                        edges: bool = False, block: int | None = None) -> AttentionPropagation:
    """mu_v g_V + mu_q g_Q + mu_k g_K for ``target`` [batch pos d_model] on the block output.

    The result is the target on the normalised input; multiply by gamma * r (norm.py)
    to get g_MHSA on the residual stream. ``block`` processes that many query positions
    at a time, so only a [head, block, pos] slice of the attention map is ever live.
    """
    b, h, t, dh = c.q.shape
    kv, g = w.n_kv_heads, w.group
    lam_all = _heads(target @ w.o, h)  # W_O^h^T t_i  [batch head query d_head]
    g_v = torch.zeros_like(c.v)  # [batch kv_head key d_head]
    g_k = torch.zeros_like(c.v)
    g_q = torch.zeros_like(c.q)  # [batch head query d_head]
    head_scores = target.new_zeros(b, h)
    share = target.new_zeros(b)
    edge_rows = []
    step = block or t
    for i0 in range(0, t, step):
        rows = slice(i0, min(i0 + step, t))
        n = rows.stop - rows.start
        lam = lam_all[:, :, rows].reshape(b, kv, g, n, dh)  # [batch kv group query d_head]
        probs = c.probs_rows(w, rows).reshape(b, kv, g, n, t)
        lam_v = torch.einsum("bkgid,bkjd->bkgij", lam, c.v)  # lam_{h,i} . v_{h,j}
        contrib = probs * lam_v  # edge scores alpha * (lam . v)
        lam_z = contrib.sum(-1)  # lam_{h,i} . z_{h,i}   [batch kv group query]
        head_scores += lam_z.sum(-1).reshape(b, h)
        if edges:
            edge_rows.append(contrib.reshape(b, h, n, t))
        if value:
            g_v += torch.einsum("bkgij,bkgid->bkjd", probs, lam)  # sum over group and queries
        if query or key:
            delta = probs * (lam_v - lam_z[..., None]) * w.scaling  # softmax sensitivity, score scale folded in
            if query:
                g_q[:, :, rows] = torch.einsum("bkgij,bkjd->bkgid", delta, c.k).reshape(b, h, n, dh)
            if key:
                g_k += torch.einsum("bkgij,bkgid->bkjd", delta, c.q[:, :, rows].reshape(b, kv, g, n, dh))
        if w.v_bias is not None:
            share += (probs.sum(-1, keepdim=True) * lam * w.v_bias.view(1, kv, 1, 1, dh)).sum((1, 2, 3, 4))
    out = value * (_merge(g_v) @ w.v) if value else torch.zeros_like(target)
    cos, sin = cos[:, None], sin[:, None]
    if query:
        g_q = apply_rope_transpose(g_q, cos, sin)
        out = out + query * (_merge(g_q if c.q_pull is None else g_q * c.q_pull) @ w.q)
    if key:
        g_k = apply_rope_transpose(g_k, cos, sin)
        out = out + key * (_merge(g_k if c.k_pull is None else g_k * c.k_pull) @ w.k)
    return AttentionPropagation(target=out, head_scores=head_scores,
                                edge_scores=torch.cat(edge_rows, dim=2) if edges else None, value_bias_share=share)
