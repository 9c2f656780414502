"""The explicit attention path: alpha recomputed in dpa's readable code, where alpha itself is needed.

DPA's scores come from the model's own fused attention (``instrument.py``). Three things need the
post-softmax probabilities as a tensor: edge scores ``[layer, head, query, key]``, the ablation masks
of the faithfulness protocol (zero chosen alpha, no renormalisation) and the widget's verify step.
For those, ``attention_forward`` replaces a layer's attention forward (inside ``instrument``, restored
on exit) by ``rules.attention`` on the outputs of the module's own projections, and
``edge_scores`` forms ``alpha * (lambda . v)`` from what a session recorded. The tests check both
against HF's logits and against the fused path (the forward oracle).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from .errors import UnsupportedModelError
from .families import LayerModules, ModelSpec, get
from .mixers import mixer_edges
from .request import Request
from .rules.attention import attention_mask, attention_output, attention_probs, heads
from .rules.norm import GAIN, rms_scale
from .rules.rope import apply_rope
from .scan_rules import scan_rule


def scaling(spec: ModelSpec, attn: nn.Module) -> float:
    """The attention scores' scale: the module's own, times the multiplier its forward puts on the keys where it has
    one (Falcon-H1's key_multiplier, ``Family.key_multiplier``)."""
    scale = float(getattr(attn, "scaling", spec.d_head ** -0.5))
    key = spec.parts.key_multiplier
    return scale if key is None else scale * float(getattr(attn, key))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [batch head pos d_head] with the rotary module's cos/sin [batch pos d_rot]: the first d_rot
    features of each head rotate, the rest pass (partial rotary, GPT-NeoX; d_rot = d_head elsewhere)."""
    d_rot = cos.shape[-1]
    cos, sin = (c[:, None].to(x.device, x.dtype) for c in (cos, sin))  # the rotary module's device may be another's
    turned = apply_rope(x[..., :d_rot], cos, sin)
    return turned if d_rot == x.shape[-1] else torch.cat([turned, x[..., d_rot:]], dim=-1)


def _per_feature(spec: ModelSpec, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin per rotated feature: GPT-OSS's rotary module gives one value per pair (first half, second half)."""
    if spec.parts.rope_pairs:
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos, sin


def attention_forward(spec: ModelSpec, request: Request, mods: LayerModules, index: int, keep: Tensor | None,
                      recording, temperature: float = 1.0) -> Callable:
    """A replacement for layer ``index``'s attention forward: the module's own projections (and head
    norms), dpa's RoPE and softmax (its backward at GIM's ``temperature``), alpha optionally multiplied by
    ``keep`` and recorded."""
    masks: dict = {}

    def forward(hidden_states: Tensor, position_embeddings=None, *args, **kwargs) -> tuple[Tensor, Tensor]:
        x = hidden_states  # [batch pos d_model], normalised by the decoder layer
        b, t = x.shape[:2]
        gate = None
        if mods.branches["query"] is mods.branches["value"]:  # one fused projection: called once, sliced
            out = mods.branches["query"](x)
            q, k, v = (mods.output(name, out) for name in ("query", "key", "value"))
        else:
            out = mods.branches["query"](x)
            q, k, v = mods.output("query", out), mods.project("key", x), mods.project("value", x)
            if "output_gate" in mods.columns:  # Qwen3-Next: each head's output times sigmoid of its gate
                gate = torch.sigmoid(mods.output("output_gate", out))
        if mods.head_norms and spec.parts.head_norms_over != "head":  # OLMo 2: over the whole projection
            q, k = mods.head_norms[0](q), mods.head_norms[1](k)
        q, k = q.view(b, t, spec.n_heads, -1), k.view(b, t, spec.n_kv_heads, -1)
        if mods.head_norms and spec.parts.head_norms_over == "head":
            q, k = mods.head_norms[0](q), mods.head_norms[1](k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if spec.rotates(index):
            cos, sin = _per_feature(spec, *(position_embeddings if position_embeddings is not None
                                            else recording.rope[index]))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        key = (b, t, x.device)
        if key not in masks:
            masks[key] = attention_mask(_row_mask(request, b, t, x.device), spec.sliding_windows[index])
        probs = attention_probs(q, k, scaling(spec, mods.attention), masks[key], spec.attn_softcap, mods.sinks,
                                temperature)
        if keep is not None:
            probs = probs * keep.to(probs.dtype)
        recording.probs[index] = probs
        z = attention_output(probs, heads(v, spec.n_kv_heads))
        return mods.heads(z if gate is None else z * gate), probs

    return forward


def _row_mask(request: Request, b: int, t: int, device) -> Tensor:
    """The request's padding mask, or all real when a method runs copies of one prompt."""
    if request.mask.shape == (b, t):
        return request.mask.to(device)
    if request.mask.shape[1] == t and bool(request.mask.all()):
        return torch.ones(b, t, dtype=torch.bool, device=device)
    raise ValueError(f"the explicit attention path got a batch of shape {(b, t)} for a request of shape "
                     f"{tuple(request.mask.shape)}")


def probs_from_recording(spec: ModelSpec, model: nn.Module, request: Request, recording, index: int) -> Tensor:
    """alpha of layer ``index`` [batch head query key] from the recorded q/k projection outputs (pure
    tensor arithmetic: no module is called)."""
    if spec.kind(index) != "attention":
        raise UnsupportedModelError(f"layers[{index}] is a {spec.kind(index)} layer ({spec.family}): it has no "
                                    "attention probabilities to recompute")
    parts = spec.parts
    layer = spec.layers(model)[index]
    device = request.device
    q, k = recording.branches[("query", index)].to(device), recording.branches[("key", index)].to(device)
    b, t = q.shape[:2]
    if parts.head_norms and parts.head_norms_over != "head":
        q, k = (_head_norm(get(layer, n), x, parts.norm_kind) for n, x in zip(parts.head_norms, (q, k)))
    q, k = q.view(b, t, spec.n_heads, -1), k.view(b, t, spec.n_kv_heads, -1)
    if parts.head_norms and parts.head_norms_over == "head":
        q, k = (_head_norm(get(layer, n), x, parts.norm_kind) for n, x in zip(parts.head_norms, (q, k)))
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if spec.rotates(index):
        cos, sin = _per_feature(spec, *recording.rope[index])
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    mask = attention_mask(request.mask, spec.sliding_windows[index])
    sinks = get(layer, parts.sinks.rsplit(".", 1)[0]).get_parameter(parts.sinks.rsplit(".", 1)[1]) if parts.sinks else None
    return attention_probs(q, k, scaling(spec, get(layer, parts.attention)), mask, spec.attn_softcap, sinks)


def _head_norm(norm: nn.Module, x: Tensor, kind: str) -> Tensor:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return (x * rms_scale(x, eps)).to(x.dtype) * GAIN[kind](norm.weight.detach().to(x.device))


def edge_scores(spec: ModelSpec, model: nn.Module, request: Request, recording, lam: dict[int, Tensor],
                dtype: torch.dtype) -> Tensor:
    """alpha_{h,i,j} (lambda_{h,i} . v_{h,j}) for every layer: [batch layer head query key].

    lam[l] is the gradient at layer l's o_proj input [batch pos head*d_head] (the target on each
    head's output, W_O^h^T t_mid), for each layer with a token mixer: a layer without (Nemotron-H's MLP layers)
    has no edges (zeros)."""
    out = []
    b, t = request.batch, request.n_tokens
    for i in range(spec.n_layers):
        if i not in lam:
            out.append(torch.zeros(b, spec.row_width, t, t, device=request.device, dtype=dtype))
            continue
        if ("beside", i) in lam:  # the mixer beside attention (Falcon-H1's Mamba-2 block): its units follow the heads
            h, mask = recording.branches[("scan", i)]
            block = get(spec.layers(model)[i], spec.parts.beside.module)
            beside = scan_rule(spec.parts.beside).scan_edges(block, h, mask, lam[("beside", i)].to(h.device),
                                                             spec.n_beside)
            out.append(torch.cat([_attention_edges(spec, model, request, recording, i, lam[i], dtype),
                                  beside.to(request.device, dtype)], dim=1))
            continue
        if spec.scans(i):  # a Mamba-2 or Mamba block: the terms of its scan, from its recorded input
            h, mask = recording.branches[("scan", i)]
            block = get(spec.layers(model)[i], spec.parts.mixer(spec.kind(i)).module)
            rule = scan_rule(spec.parts.mixer(spec.kind(i)))
            edges = rule.scan_edges(block, h, mask, lam[i].to(h.device), spec.n_heads)
            out.append(edges.to(request.device, dtype))
            continue
        if spec.kind(i) != "attention":  # a mixer layer (LFM2's convolution): its own token-to-token terms
            out.append(mixer_edges(spec, spec.layers(model)[i], recording, i, lam[i].to(request.device, dtype)))
            continue
        out.append(_attention_edges(spec, model, request, recording, i, lam[i], dtype))
    return torch.stack(out, dim=1)


def _attention_edges(spec: ModelSpec, model: nn.Module, request: Request, recording, i: int, lam: Tensor,
                     dtype: torch.dtype) -> Tensor:
    """Attention layer ``i``'s edges alpha_{h,ij} (lambda_{h,i} . v_{h,j}) [batch head query key]."""
    probs = probs_from_recording(spec, model, request, recording, i).to(dtype)  # [b h q k]
    v = heads(recording.branches[("value", i)].to(request.device, dtype), spec.n_kv_heads)  # [b kv k d]
    b, h, t, _ = probs.shape
    kv = spec.n_kv_heads
    lam_i = lam.to(request.device, dtype)
    gate = recording.branches.get(("output_gate", i))
    if gate is not None:  # the target on each head's output before its (frozen) gate
        lam_i = lam_i * torch.sigmoid(gate.to(request.device, dtype))
    lam_h = heads(lam_i, h).reshape(b, kv, h // kv, t, -1)  # [b kv g q d]
    lam_v = torch.einsum("bkgid,bkjd->bkgij", lam_h, v).reshape(b, h, t, t)
    return probs * lam_v
