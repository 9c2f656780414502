"""An independent forward pass for the tests: the *modified model* of book: modified-backward.

Written from HF's public functions (apply_rotary_pos_emb, repeat_kv), not from dpa's rules:
(a) every RMSNorm scale 1/sigma is detached, (b) SiLU(s) = s * detach(sigmoid(s)) on the gate
path, (c) the gradient entering each of the five branches is multiplied by its mu. The gradient
of a target with respect to the embeddings is then DPA's effective target t^(0).
With ``modified=False`` and all mu = 1 it is the ordinary model (checked against HF's logits).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mu):
        ctx.mu = mu
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.mu, None


def scale_grad(x, mu: float):
    return _ScaleGrad.apply(x, mu)


def rms(x, gamma, eps, modified):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * (x * (r.detach() if modified else r))


def reference_forward(model, embeds, mask=None, mu=(1, 1, 1, 1, 1), modified=True, record=None):
    """Final normalised residual [batch pos d_model]. ``record`` (a list) receives x, x_mid per layer."""
    mq, mk, mv, mg, mu_up = mu
    cfg = model.config
    b, t, _ = embeds.shape
    mask = torch.ones(b, t, dtype=torch.bool) if mask is None else mask.bool()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    cos, sin = model.model.rotary_emb(embeds, pos)
    x = embeds
    for li, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        eps = layer.input_layernorm.variance_epsilon
        if record is not None:
            record.append(x)
        xn = rms(x, layer.input_layernorm.weight, eps, modified)
        q = a.q_proj(scale_grad(xn, mq)).view(b, t, h, -1)
        k = a.k_proj(scale_grad(xn, mk)).view(b, t, kv, -1)
        v = a.v_proj(scale_grad(xn, mv)).view(b, t, kv, -1).transpose(1, 2)
        if hasattr(a, "q_norm"):
            q = rms(q, a.q_norm.weight, a.q_norm.variance_epsilon, modified)
            k = rms(k, a.k_norm.weight, a.k_norm.variance_epsilon, modified)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        k, v = repeat_kv(k, h // kv), repeat_kv(v, h // kv)
        scores = q @ k.transpose(-1, -2) * a.scaling
        i = torch.arange(t)
        allowed = (i[None, :] <= i[:, None])
        window = getattr(a, "sliding_window", None) or (cfg.sliding_window if cfg.model_type == "mistral" else None)
        if window:
            allowed = allowed & (i[:, None] - i[None, :] < window)
        allowed = allowed[None, None] & mask[:, None, None, :] & mask[:, None, :, None]
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        z = (probs @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + a.o_proj(z)
        if record is not None:
            record.append(x)
        xn = rms(x, layer.post_attention_layernorm.weight, eps, modified)
        s = m.gate_proj(scale_grad(xn, mg))
        u = m.up_proj(scale_grad(xn, mu_up))
        act = s * torch.sigmoid(s).detach() if modified else F.silu(s)
        x = x + m.down_proj(act * u)
    if record is not None:
        record.append(x)
    return rms(x, model.model.norm.weight, model.model.norm.variance_epsilon, modified)
