"""Ablation forward passes: p(target) with units zeroed (book: faithfulness).

* Input: a token's embedding replaced by the zero vector; positions and attention mask unchanged.
* Component: selected post-softmax attention probabilities set to zero (no renormalisation) and
  SiLU(s) set to zero for selected (position, neuron) pairs (the explicit attention path of
  ``dpa.explicit`` and a keep mask on the GLU activation, both set up by ``dpa.instrument``).

The batched functions take *keep* masks (1 keep, 0 zero) with one row per ablated copy of the
same prompt and return p(target) for each row, in float32 (float64 for a float64 model). Component passes always run the
instrumented attention (also for rows that ablate nothing), so clean and ablated probabilities
come from the same arithmetic. The ``*_both`` variants also return p(target) from a softmax in
the model's own dtype (the paper's mode: its bfloat16 runs took the softmax in bfloat16); for a
float32 or float64 model the two are the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from .. import request as requests
from ..checks import check_int, show
from ..errors import InputError, InputTypeError
from ..instrument import instrument, unembed
from ..request import Request
from ..spec import one_mixer_per_layer


def _probs(model: nn.Module, req: Request, hidden: Tensor, position: int, target_id: int) -> tuple[Tensor, Tensor]:
    """p(target) per row: softmax in float32 or better, and softmax in the model's dtype (returned in
    float32 or better)."""
    logits = unembed(model, req, hidden[:, position])  # the model's own logits (Gemma 2's final soft-cap)
    wide = torch.promote_types(logits.dtype, torch.float32)
    probs = logits.to(wide).softmax(-1)[:, target_id]
    return probs, probs if logits.dtype == wide else logits.softmax(-1)[:, target_id].to(wide)


def _one_prompt(input_ids):
    """``input_ids`` of one prompt as the request step takes it: [pos] (a list of ints, an integer tensor or
    numpy array); a batch of one ([1 pos]) unwrapped; a batch of several, or no token ids at all, refused."""
    if type(input_ids).__module__ == "numpy" and hasattr(input_ids, "dtype"):
        input_ids = torch.as_tensor(input_ids)  # a float array stays float: refused by the request step
    if isinstance(input_ids, (str, bytes)):
        raise InputTypeError(f"input_ids must be token ids (a list of ints or an integer tensor [pos]); the "
                             f"ablation helpers take no tokenizer, got the string {show(input_ids)}")
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise InputError(f"ablation takes one prompt (input_ids of shape [pos] or [1 pos]), got a batch "
                                 f"of shape {tuple(input_ids.shape)}")
            input_ids = input_ids[0]
        return input_ids
    if not isinstance(input_ids, (list, tuple)):
        raise InputTypeError(f"input_ids must be token ids (a list of ints or an integer tensor [pos]), got "
                             f"{type(input_ids).__name__}")
    rows = [r for r in input_ids if isinstance(r, (list, tuple)) or (isinstance(r, Tensor) and r.dim() > 0)]
    if rows and len(rows) == len(input_ids):  # a batch given as a list of prompts
        if len(input_ids) != 1:
            raise InputError(f"ablation takes one prompt (input_ids of shape [pos] or [1 pos]), got a list of "
                             f"{len(input_ids)} prompts")
        return input_ids[0]
    return input_ids


def _request(model: nn.Module, input_ids, target_position: int, target_id: int) -> Request:
    """The one-prompt request of an ablation: ids [pos] or [1 pos], a position and a target id, checked by the
    request step (integer ids in the vocabulary, a position in the prompt, a target id in the vocabulary)."""
    ids = _one_prompt(input_ids)
    try:
        ids = requests.encode_prompt(None, ids)
    except InputError as err:  # the request step's message, said of this argument
        raise type(err)(f"input_ids: {err}") from None
    if target_id is None or isinstance(target_id, Mapping):
        raise InputTypeError(f"target_id must be one token id (an int), got {show(target_id)}")
    req = requests.build(model, None, ids, target_id, position=target_position, batch=False)
    if req.targets[0].kind != "token" or req.targets[0].token_id is None:  # a vector target
        raise InputTypeError(f"target_id must be one token id (an int), got {show(target_id)}")
    return req


def _mask(name: str, mask, shape: tuple) -> Tensor:
    """A keep mask of ``shape`` (None: any number of rows, at least one; a pair: either size), holding
    0 (ablate) and 1 (keep) only; refused with its name."""
    if not isinstance(mask, Tensor):
        raise InputTypeError(f"{name} must be a tensor, got {type(mask).__name__}")
    ok = mask.dim() == len(shape) and all(
        want is None or got in (want if isinstance(want, tuple) else (want,)) for got, want in zip(mask.shape, shape))
    if not ok:
        show = ", ".join("rows" if w is None else "|".join(map(str, w)) if isinstance(w, tuple) else str(w)
                         for w in shape)
        raise InputError(f"{name} has shape {tuple(mask.shape)}; it must be [{show}]")
    if shape[0] is None and mask.shape[0] == 0:
        raise InputError(f"{name} has 0 rows; it needs at least one (one row per ablated copy of the prompt)")
    if mask.is_complex():
        raise InputTypeError(f"{name} must be a real or bool tensor (1 keep, 0 ablate), got {mask.dtype}")
    if mask.is_floating_point() and not torch.isfinite(mask).all():
        raise InputError(f"{name} holds NaN or infinite values")
    if mask.dtype != torch.bool and not ((mask == 0) | (mask == 1)).all():
        raise InputError(f"{name} must hold 1 (keep) and 0 (ablate) only, got values such as "
                         f"{mask[(mask != 0) & (mask != 1)][0].item()!r}")
    return mask


def _units(name: str, units) -> list:
    """An iterable of ablated units (positions, or tuples of indices) as a list; refused with its name."""
    if isinstance(units, Tensor) and units.dim() == 0:
        raise InputTypeError(f"{name} must be a list (an empty one for none), got a 0-d tensor {show(units)}")
    if isinstance(units, (str, bytes, Mapping)) or not isinstance(units, Iterable):
        raise InputTypeError(f"{name} must be a list (an empty one for none), got {show(units)}")
    return list(units)


def _unit(name: str, unit, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """One ablated unit: len(sizes) ints, each in range (negative counts from the end, as in indexing)."""
    if isinstance(unit, Tensor) and unit.dim() == 1:
        unit = unit.tolist()
    if not isinstance(unit, (tuple, list)) or len(unit) != len(sizes):
        raise InputError(f"each {name} must be {len(sizes)} ints, got {unit!r}")
    return tuple(check_int(f"{name} {tuple(unit)!r}", i, low=-n, high=n - 1) % n for i, n in zip(unit, sizes))


@torch.no_grad()
def input_ablation_probs_both(model: nn.Module, input_ids, keep: Tensor, target_position: int, target_id: int,
                              batch_size: int = 16) -> tuple[Tensor, Tensor]:
    """``input_ablation_probs`` and the same probabilities from a softmax in the model's dtype."""
    req = _request(model, input_ids, target_position, target_id)
    batch_size = check_int("batch_size", batch_size, low=1)
    keep = _mask("keep", keep, (None, req.n_tokens))
    position, target_id = req.position(0), req.targets[0].token_id
    out = []
    with instrument(model, req) as session:
        emb = session.embed()  # [1 pos d_model]
        for rows in keep.split(batch_size):
            embeds = emb * rows.to(device=emb.device, dtype=emb.dtype)[..., None]
            out.append(_probs(model, req, session.forward(inputs_embeds=embeds), position, target_id))
    return torch.cat([a for a, _ in out]).cpu(), torch.cat([b for _, b in out]).cpu()


def input_ablation_probs(model: nn.Module, input_ids, keep: Tensor, target_position: int, target_id: int,
                         batch_size: int = 16) -> Tensor:
    """p(target) for each row of ``keep`` [rows pos] (0 = that token's embedding zeroed)."""
    return input_ablation_probs_both(model, input_ids, keep, target_position, target_id, batch_size)[0]


def input_ablation_prob(model: nn.Module, input_ids, zero_positions: Iterable[int], target_position: int,
                        target_id: int) -> float:
    """p(target) with the embeddings at ``zero_positions`` zeroed."""
    req = _request(model, input_ids, target_position, target_id)
    keep = torch.ones(1, req.n_tokens)
    t = req.n_tokens
    zero = [check_int(f"zero_positions: position {p!r} (of a prompt of {t} tokens)", p, low=-t, high=t - 1)
            for p in _units("zero_positions", zero_positions)]
    keep[0, zero] = 0
    return float(input_ablation_probs(model, req.input_ids[0], keep, target_position, target_id)[0])


@torch.no_grad()
def component_ablation_probs_both(model: nn.Module, input_ids, attn_keep: Tensor | None, neuron_keep: Tensor | None,
                                  target_position: int, target_id: int) -> tuple[Tensor, Tensor]:
    """``component_ablation_probs`` and the same probabilities from a softmax in the model's dtype."""
    req = _request(model, input_ids, target_position, target_id)
    spec, t = req.spec, req.n_tokens
    if attn_keep is not None:
        attn_keep = _mask("attn_keep", attn_keep, (None, spec.n_layers, spec.n_heads, (t, 1), (t, 1)))
        if not bool(attn_keep.all()):  # (neurons alone: any model)
            one_mixer_per_layer(spec, "ablating heads is")
    if neuron_keep is not None:
        neuron_keep = _mask("neuron_keep", neuron_keep, (None, spec.n_layers, (t, 1), spec.d_mlp))
    if attn_keep is not None and neuron_keep is not None and attn_keep.shape[0] != neuron_keep.shape[0]:
        raise InputError(f"attn_keep has {attn_keep.shape[0]} rows and neuron_keep {neuron_keep.shape[0]}: "
                                  "the rows (one ablation each) must agree")
    rows = next((m.shape[0] for m in (attn_keep, neuron_keep) if m is not None), 1)
    to = lambda m: m.to(req.device)  # noqa: E731
    attn = {l: None if attn_keep is None else to(attn_keep[:, l]) for l in range(spec.n_layers)}
    neurons = {} if neuron_keep is None else {l: to(neuron_keep[:, l]) for l in range(spec.n_layers)}
    with instrument(model, req, attn_keep=attn, neuron_keep=neurons) as session:
        hidden = session.forward(input_ids=req.input_ids.expand(rows, -1))
        clean, native = _probs(model, req, hidden, req.position(0), req.targets[0].token_id)
    return clean.cpu(), native.cpu()


def component_ablation_probs(model: nn.Module, input_ids, attn_keep: Tensor | None, neuron_keep: Tensor | None,
                             target_position: int, target_id: int) -> Tensor:
    """p(target) for each row of the keep masks, in one forward pass.

    attn_keep [rows layer head query|1 key|1]; neuron_keep [rows layer pos|1 d_mlp]; either may be
    None (nothing of that kind ablated). Rows must agree between the two masks.
    """
    return component_ablation_probs_both(model, input_ids, attn_keep, neuron_keep, target_position, target_id)[0]


def component_ablation_prob(model: nn.Module, input_ids, edges: Iterable[tuple[int, int, int, int]],
                            neurons: Iterable[tuple[int, int, int]], target_position: int, target_id: int) -> float:
    """p(target) with ``edges`` (layer, head, query, key) and ``neurons`` (layer, pos, neuron) zeroed."""
    req = _request(model, input_ids, target_position, target_id)
    spec, ids = req.spec, req.input_ids[0]
    t = len(ids)
    attn_keep = torch.ones(1, spec.n_layers, spec.n_heads, t, t, dtype=torch.bool)
    edges = _units("edges", edges)
    if edges:  # (neurons alone: any model)
        one_mixer_per_layer(spec, "ablating heads is")
    for edge in edges:
        l, h, q, k = _unit("edge (layer, head, query, key)", edge, (spec.n_layers, spec.n_heads, t, t))
        attn_keep[0, l, h, q, k] = False
    neuron_keep = torch.ones(1, spec.n_layers, t, spec.d_mlp, dtype=torch.bool)
    for unit in _units("neurons", neurons):
        l, p, n = _unit("neuron (layer, position, neuron)", unit, (spec.n_layers, t, spec.d_mlp))
        neuron_keep[0, l, p, n] = False
    return float(component_ablation_probs(model, ids, attn_keep, neuron_keep, target_position, target_id)[0])
