"""``attribute``: one forward pass, then one top-down sweep of effective targets (book: end-to-end).

    t^(L)     = initial target (targets.py)
    t_mid^(l) = t^(l)     + g_GLU^(l)(t^(l))          glu.py
    t^(l-1)   = t_mid^(l) + g_MHSA^(l)(t_mid^(l))     attention.py

Token scores are x^(0) . t^(0); head and neuron scores are formed inside the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor, nn

from .adapters import ModelSpec, layer_weights, spec_for
from .attention import attention_internals, propagate_attention
from .capture import ForwardCapture, attention_mask, capture
from .glu import neuron_position_scores, propagate_glu
from .norm import rms_scale
from .result import Attribution, TargetInfo
from .targets import TargetError, TargetSpec, initial_target, target_direction, token_id
from .weights import PathWeights

Prompt = str | Sequence[int] | Tensor


class InputError(ValueError):
    """A prompt that cannot be attributed (empty, too long, wrong type)."""


@dataclass
class Sweep:
    """Raw outputs of the top-down sweep, batched: [batch ...]."""

    token_scores: Tensor  # [batch pos]
    head_scores: Tensor  # [batch layer head]
    neuron_scores: Tensor  # [batch layer d_mlp]
    bias_share: Tensor  # [batch]
    edge_scores: Tensor | None  # [batch layer head query key]
    neuron_position_scores: Tensor | None  # [batch layer pos d_mlp]
    effective_targets: Tensor | None  # [batch layer+1 pos d_model]


def _encode(tokenizer, prompts: list[Prompt], max_positions: int, side: str = "right") -> tuple[Tensor, Tensor]:
    """Token ids [batch pos] and a real-token mask, padded on ``side``."""
    rows: list[list[int]] = []
    for n, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise InputError("a string prompt needs a tokenizer; pass token ids instead")
            if not p.strip():
                raise InputError(f"prompt {n} is empty")
            ids = tokenizer(p)["input_ids"]
        elif isinstance(p, Tensor):
            if p.dtype not in (torch.int64, torch.int32):
                raise InputError(f"prompt {n}: a tensor prompt must hold token ids (int64), got {p.dtype}")
            ids = p.flatten().tolist()
        else:
            ids = list(p)
        if len(ids) == 0:
            raise InputError(f"prompt {n} is empty (no tokens)")
        if len(ids) > max_positions:
            raise InputError(f"prompt {n} has {len(ids)} tokens, more than the model's context of {max_positions}")
        rows.append(ids)
    t = max(map(len, rows))
    input_ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for b, ids in enumerate(rows):
        cols = slice(0, len(ids)) if side == "right" else slice(t - len(ids), t)
        input_ids[b, cols] = torch.tensor(ids)
        mask[b, cols] = True
    return input_ids, mask


def _as_list(x, n: int, name: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise InputError(f"{name} has {len(x)} entries for {n} prompts")
        return list(x)
    return [x] * n


@torch.no_grad()
def sweep(model: nn.Module, spec: ModelSpec, cap: ForwardCapture, target: Tensor, weights: PathWeights, *,
          dtype: torch.dtype, edges: bool = False, neuron_positions: bool = False, keep_targets: bool = False,
          neuron_target: Literal["output", "mid"] = "output", block: int | None = None) -> Sweep:
    """Propagate ``target`` [batch pos d_model] from the top of the model to the embeddings.

    Layers whose projections were not captured (lean mode) are recomputed from their residual
    input; ``block`` forms each attention map that many query rows at a time.
    """
    b, t, _ = target.shape
    device0 = target.device
    rotary = model.model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=cap.position_ids.device), cap.position_ids)
    cos, sin = cos.to(device0, dtype), sin.to(device0, dtype)
    masks: dict[int | None, Tensor] = {}
    heads, neurons, edge_list, npos_list, targets = [], [], [], [], [target] if keep_targets else []
    bias = torch.zeros(b, dtype=dtype, device=device0)
    mu = weights
    for l in reversed(range(spec.n_layers)):
        lc = cap.layers[l]
        w = layer_weights(model, spec, l, dtype)
        dev = w.attn.q.device
        target, cos_l, sin_l = target.to(dev), cos.to(dev), sin.to(dev)
        cast = lambda x: x.to(device=dev, dtype=dtype)  # noqa: E731
        # GLU block: t^(l) -> t_mid^(l)
        x_mid = cast(lc.resid_mid)
        s, u = (cast(lc.gate), cast(lc.up)) if lc.gate is not None else _glu_inputs(x_mid, w, spec)
        g, lam = propagate_glu(target, s, u, w.mlp.gate, w.mlp.up, w.mlp.down, w.mlp_norm,
                               rms_scale(x_mid, spec.rms_eps), up=mu.up, gate=mu.gate)
        t_mid = target + g
        if neuron_target == "mid":
            lam = t_mid @ w.mlp.down
        npos = neuron_position_scores(s, u, lam)  # [batch pos d_mlp]
        neurons.append(npos.sum(1).to(device0))
        if neuron_positions:
            npos_list.append(npos.to(device0))
        # attention block: t_mid^(l) -> t^(l-1)
        x_in = cast(lc.resid_pre)
        r_in = rms_scale(x_in, spec.rms_eps)
        window = spec.sliding_windows[l]
        if window not in masks:
            masks[window] = attention_mask(cap.mask.to(dev), window)
        if lc.q is not None:
            q, k, v = cast(lc.q), cast(lc.k), cast(lc.v)
        else:
            q, k, v = _qkv_inputs(x_in * r_in * w.attn_norm, w)
        internals = attention_internals(q, k, v, w.attn, cos_l, sin_l, masks[window].to(dev), probs=block is None)
        prop = propagate_attention(t_mid, internals, w.attn, cos_l, sin_l, query=mu.query, key=mu.key,
                                   value=mu.value, edges=edges, block=block)
        target = t_mid + prop.target * (w.attn_norm * r_in)
        heads.append(prop.head_scores.to(device0))
        bias = bias + prop.value_bias_share.to(device0)
        if edges:
            edge_list.append(prop.edge_scores.to(device0))
        if keep_targets:
            targets.append(target.to(device0))
    target = target.to(device0)
    emb = cap.embeddings.to(device=device0, dtype=dtype)
    flip = lambda xs: torch.stack(xs[::-1], dim=1) if xs else None  # noqa: E731  top-down -> layer order
    return Sweep(
        token_scores=(emb * target).sum(-1),
        head_scores=flip(heads), neuron_scores=flip(neurons), bias_share=bias,
        edge_scores=flip(edge_list), neuron_position_scores=flip(npos_list),
        effective_targets=flip(targets),
    )


def _glu_inputs(x_mid: Tensor, w, spec: ModelSpec) -> tuple[Tensor, Tensor]:
    x = x_mid * rms_scale(x_mid, spec.rms_eps) * w.mlp_norm
    return x @ w.mlp.gate.T, x @ w.mlp.up.T


def _qkv_inputs(x: Tensor, w) -> tuple[Tensor, Tensor, Tensor]:
    a = w.attn
    proj = lambda m, bias: x @ m.T if bias is None else x @ m.T + bias  # noqa: E731
    return proj(a.q, a.q_bias), proj(a.k, a.k_bias), proj(a.v, a.v_bias)


def _target_specs(tokenizer, vocab: int, n: int, target, contrast, kind: str, multi_token: str,
                  predicted: Tensor) -> list[TargetSpec]:
    specs = []
    for b, (tg, foil) in enumerate(zip(_as_list(target, n, "target"), _as_list(contrast, n, "contrast"))):
        if isinstance(tg, Tensor) and tg.is_floating_point():
            if kind not in ("logit", "vector") or foil is not None:
                raise TargetError("a vector target cannot be combined with a contrast or the logprob kind")
            specs.append(TargetSpec("vector", vector=tg.flatten()))
            continue
        if isinstance(tg, Tensor):
            tg = int(tg)
        y = int(predicted[b]) if tg is None else token_id(tokenizer, tg, vocab, multi_token=multi_token)
        if foil is not None:
            if kind == "logprob":
                raise TargetError("the logprob target takes no contrast (it already contrasts with every token)")
            foil_id = token_id(tokenizer, int(foil) if isinstance(foil, Tensor) else foil, vocab,
                               multi_token=multi_token, what="contrast")
            if foil_id == y:
                raise TargetError("contrast and target are the same token")
            specs.append(TargetSpec("contrast", token_id=y, contrast_id=foil_id))
        else:
            specs.append(TargetSpec("logprob" if kind == "logprob" else "token", token_id=y))
    return specs


@torch.no_grad()
def attribute(model: nn.Module, tokenizer, prompt: Prompt | list[Prompt], target=None, *, contrast=None,
              kind: Literal["logit", "logprob"] = "logit", position: int | list[int] | None = None,
              weights: PathWeights | None = None, edges: bool = False, neuron_positions: bool = False,
              effective_targets: bool = False, neuron_target: Literal["output", "mid"] = "output",
              multi_token: Literal["error", "first"] = "error", memory: Literal["auto", "full", "lean"] = "auto",
              padding_side: Literal["right", "left"] = "right", block: int | None = None,
              dtype: torch.dtype | None = None) -> Attribution | list[Attribution]:
    """Dual Path Attribution of ``target`` at the end of ``prompt``.

    prompt: a string, a list/LongTensor of token ids, or a list of those (a batch; one
    ``Attribution`` per prompt). target: a token string or id (default: the model's own
    prediction), or a float tensor [d_model] (a direction on the final normalised
    residual). contrast: a foil token (target minus foil logit). kind="logprob"
    attributes log p(target) with p held fixed. position: the target position (default:
    the last token; negative counts from the end). memory: "full" caches every layer's
    projections, "lean" keeps only residual streams and recomputes one layer at a time (with
    attention maps formed ``block`` query rows at a time), "auto" (default) picks full mode
    when it fits in half the free memory. See the book for every option.
    """
    spec = spec_for(model)
    weights = weights or PathWeights()
    if not isinstance(weights, PathWeights):
        raise TypeError(f"weights must be a dpa.PathWeights, got {type(weights).__name__}")
    if neuron_target not in ("output", "mid"):
        raise ValueError(f"neuron_target must be 'output' or 'mid', got {neuron_target!r}")
    if kind not in ("logit", "logprob"):
        raise ValueError(f"kind must be 'logit' or 'logprob', got {kind!r}")
    batched = isinstance(prompt, list) and (len(prompt) == 0 or not isinstance(prompt[0], int))
    prompts = list(prompt) if batched else [prompt]
    if not prompts:
        raise InputError("no prompts given")
    input_ids, mask = _encode(tokenizer, prompts, spec.max_positions, padding_side)
    lengths = mask.sum(-1)
    offsets = (~mask).long().cumsum(-1)[:, -1] if padding_side == "left" else torch.zeros_like(lengths)
    positions = torch.tensor([int(o) + _position(p, int(n)) for p, n, o in
                              zip(_as_list(position, len(prompts), "position"), lengths, offsets)])
    if memory not in ("auto", "full", "lean"):
        raise ValueError(f"memory must be 'auto', 'full' or 'lean', got {memory!r}")
    plan = plan_memory(spec, *input_ids.shape, model.model.embed_tokens.weight, memory)
    if block is not None:  # an explicit query block size: lean mode with that block
        if block < 1:
            raise ValueError(f"block must be a positive number of query positions, got {block}")
        plan = MemoryPlan(False, block)
    cap = capture(model, spec, input_ids, mask, projections=plan.cache_projections)
    dtype = dtype or (torch.float64 if model.dtype == torch.float64 else torch.float32)
    device = cap.resid_final.device
    positions = positions.to(device)
    rows = torch.arange(len(prompts), device=device)
    unembed = model.lm_head.weight
    hidden = cap.hidden[rows, positions]  # [batch d_model], HF's own final norm output
    logits = (hidden.to(unembed) @ unembed.T).to(dtype)  # [batch vocab]
    probs = logits.float().softmax(-1)
    specs = _target_specs(tokenizer, spec.vocab_size, len(prompts), target, contrast, kind, multi_token,
                          logits.argmax(-1))
    final_norm = model.model.norm
    u = torch.stack([target_direction(s, unembed.detach().to(device=device, dtype=dtype), probs[b])
                     for b, s in enumerate(specs)])
    t0, value = initial_target(u, cap.resid_final.to(dtype), final_norm.weight.detach().to(dtype),
                               spec.rms_eps, positions)
    out = sweep(model, spec, cap, t0, weights, dtype=dtype, edges=edges, neuron_positions=neuron_positions,
                keep_targets=effective_targets, neuron_target=neuron_target, block=plan.block)
    results = [
        _result(b, tokenizer, cap, out, specs[b], probs[b], int(positions[b] - offsets[b]), float(value[b]), weights,
                spec, model, neuron_target)
        for b in range(len(prompts))
    ]
    return results if batched else results[0]


@dataclass(frozen=True)
class MemoryPlan:
    """Full mode caches every layer's q/k/v/gate/up projections; lean mode only residual streams,
    recomputes each layer during the sweep and forms its attention map ``block`` query rows at a time."""

    cache_projections: bool
    block: int | None


def plan_memory(spec: ModelSpec, batch: int, pos: int, weight: Tensor, memory: str,
                budget: int | None = None) -> MemoryPlan:
    """Choose the mode: ``auto`` takes full mode when its cache fits in half the free memory."""
    bytes_per = 4 if weight.element_size() < 4 else weight.element_size()
    maps = 5 * batch * spec.n_heads * pos * pos * bytes_per  # live [head, pos, pos] tensors of one layer
    cache = spec.n_layers * batch * pos * ((spec.n_heads + 2 * spec.n_kv_heads) * spec.d_head + 2 * spec.d_mlp)
    cache *= weight.element_size()
    free = budget if budget is not None else _free_memory(weight.device)
    if memory == "full" or (memory == "auto" and cache + maps < free // 2):
        return MemoryPlan(True, None)
    row_bytes = 5 * batch * spec.n_heads * pos * bytes_per
    limit = min(free // 8, 512 * 2**20)  # one layer's map slices stay well inside the free memory
    block = None if row_bytes * pos <= limit else max(1, limit // row_bytes)
    return MemoryPlan(False, block)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:  # pragma: no cover - psutil ships with the dev extras
        return 8 * 2**30


def _position(position: int | None, length: int) -> int:
    if position is None:
        return length - 1
    p = position + length if position < 0 else position
    if not 0 <= p < length:
        raise InputError(f"target position {position} is outside the prompt of {length} tokens")
    return p


def _decode(tokenizer, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _result(b: int, tokenizer, cap: ForwardCapture, out: Sweep, ts: TargetSpec, probs: Tensor, position: int,
            value: float, weights: PathWeights, spec: ModelSpec, model: nn.Module, neuron_target: str) -> Attribution:
    real = cap.mask[b].nonzero().flatten().cpu()  # this sample's positions in the padded batch
    n = len(real)
    ids = cap.input_ids[b, real].tolist()
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    top = probs.topk(5)
    name = lambda i: None if i is None else _decode(tokenizer, [i])[0]  # noqa: E731
    info = TargetInfo(
        kind=ts.kind, position=position, token=name(ts.token_id), token_id=ts.token_id,
        contrast=name(ts.contrast_id), contrast_id=ts.contrast_id,
        probability=None if ts.token_id is None else float(probs[ts.token_id]),
        logprob=None if ts.token_id is None else float(probs[ts.token_id].clamp_min(1e-45).log()),
    )
    token_scores = out.token_scores[b].cpu()[real]
    first = int(real[0])
    keep = slice(first, first + n)
    pick = lambda x, *index: None if x is None else x[(b, *index)].cpu()  # noqa: E731
    return Attribution(
        tokens=_decode(tokenizer, ids), token_ids=ids, token_scores=token_scores,
        head_scores=out.head_scores[b].cpu(), neuron_scores=out.neuron_scores[b].cpu(),
        target_logit=value, target=info, weights=weights,
        completeness_gap=float(token_scores.sum()) - value, bias_share=float(out.bias_share[b]),
        n_kv_heads=spec.n_kv_heads, special=[i in special_ids for i in ids],
        top_predictions=[(name(int(i)), float(p)) for p, i in zip(top.values, top.indices)],
        model_name=getattr(model.config, "_name_or_path", "") or spec.family, neuron_target=neuron_target,
        edge_scores=pick(out.edge_scores, slice(None), slice(None), keep, keep),
        neuron_position_scores=pick(out.neuron_position_scores, slice(None), keep),
        effective_targets=pick(out.effective_targets, slice(None), keep),
    )
