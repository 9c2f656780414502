"""The one request step: prompts, targets, positions, path weights and the model checked and encoded.

Every entry point (``dpa.attribute``, the baselines, the evaluation runner, the CLI, the widget) builds
a ``Request`` here, so a bad argument gets the same clear error everywhere and a good one the same
encoding: token ids padded into one batch, the target position of each prompt, its target resolved to
token ids (or a direction), checked against the model's vocabulary and context length.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Literal, Sequence

import torch
from torch import Tensor, nn

from .checks import check_int
from .errors import InputError, InputTypeError, ModelStateError, TargetError, UnsupportedModelError
from .families import ModelSpec, context_length, spec_for
from .guard import check_loaded
from .targets import TargetSpec, token_ids, token_text
from .weights import PathWeights

Prompt = str | Sequence[int] | Tensor
Kind = Literal["logit", "logprob"]
MULTI_TOKEN = ("error", "first", "sum")  # what a target string of several tokens does (dpa.attribute's docstring)


@dataclass
class Request:
    """A checked, encoded request: one row per prompt, padded on the right (so no padded query row is
    ever fully masked; the scores do not depend on where a caller would pad).

    ``targets[b].token_id`` is None for "the model's own prediction" until ``resolve`` fills it from
    the logits of the forward pass that the method runs anyway.
    """

    spec: ModelSpec
    input_ids: Tensor  # [batch pos] long, on the model's device
    mask: Tensor  # [batch pos] bool, True on real tokens
    positions: Tensor  # [batch] long: the target position of each row in the padded batch
    targets: list[TargetSpec]
    weights: PathWeights
    batched: bool  # a list of prompts was given (one result per prompt)
    contrast_rows: list[int | None] = field(default_factory=list)  # per prompt: the row of its contrast of several
    # tokens (after the prompts' rows), or None; empty: one row per prompt
    tokenizer: Any = None
    clean_logits: Tensor | None = field(default=None, repr=False)  # [batch vocab] at the positions, once known

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_prompts(self) -> int:
        """How many prompts (results): the rows but those of contrasts of several tokens."""
        return len(self.contrast_rows) or self.batch

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def real(self, b: int) -> Tensor:
        """Row b's real positions in the padded batch (CPU)."""
        return self.mask[b].nonzero().flatten().cpu()

    def token_ids(self, b: int) -> list[int]:
        return self.input_ids[b, self.real(b)].tolist()

    def position(self, b: int) -> int:
        """Row b's target position within its own prompt."""
        return int(self.positions[b]) - int(self.real(b)[0])

    @property
    def position_ids(self) -> Tensor:
        """Positions that ignore padding on either side: cumsum(mask) - 1, clamped at 0. [batch pos]"""
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    def terms(self) -> tuple[list[int], list[int]]:
        """Where the targets are read: for every term (one a target token; a target of several tokens has one per
        token, under teacher forcing: its j-th token at the position after its (j-1)-th) its row and its position
        in the padded batch, flat, row by row. ``targets[row].term(j)`` is the term's one-token target."""
        rows, at = [], []
        for b, t in enumerate(self.targets):
            start = int(self.positions[b])
            rows += [b] * t.n_terms
            at += range(start, start + t.n_terms)
        return rows, at

    def resolve(self, logits: Tensor) -> None:
        """Fill the targets left to the model's prediction from logits [batch vocab] at the positions."""
        self.clean_logits = logits.detach()
        predicted = logits.argmax(-1).tolist()
        for b, t in enumerate(self.targets):
            if t.kind != "vector" and t.token_id is None:
                if t.contrast_id is not None and not t.contrast_tokens and predicted[b] == t.contrast_id:
                    raise TargetError(f"prompt {b}: the model's prediction is the contrast token itself")
                self.targets[b] = dataclasses.replace(t, token_id=predicted[b])

    def metric(self, logits: Tensor) -> Tensor:
        """The attributed logit (minus the contrast logit) from logits [rows vocab] of a one-prompt request."""
        t = self.targets[0]
        value = logits[:, t.token_id]
        return value if t.contrast_id is None else value - logits[:, t.contrast_id]

    def decode(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(i) for i in ids]
        return [token_text(self.tokenizer, i) for i in ids]

    def special(self, ids: list[int]) -> list[bool]:
        special_ids = set(getattr(self.tokenizer, "all_special_ids", None) or [])
        return [i in special_ids for i in ids]


def _as_list(x, n: int, name: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            several = (" (a list gives one per prompt; a target of several tokens is a string, with "
                       "multi_token='sum')" if name in ("target", "contrast") else "")
            raise InputError(f"{name} has {len(x)} entries for {n} prompts{several}")
        return list(x)
    return [x] * n


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _numpy(x, what: str):
    """A numpy array or scalar as the torch tensor it holds (integers for ids, floats for a vector target);
    anything else unchanged."""
    if type(x).__module__ != "numpy" or not hasattr(x, "dtype"):
        return x
    import numpy as np

    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise InputError(f"{what}: a numpy array must hold integer token ids (or floats for a vector target), "
                         f"got dtype {x.dtype}")
    return torch.as_tensor(np.asarray(x))


def _ids_tensor(x, what: str) -> Tensor:
    """``input_ids`` or ``attention_mask`` of a tokenizer's output (a tensor, array or list) as a tensor."""
    x = _numpy(x, what)
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (list, tuple)) and all(_is_id(i) for i in x):
        return torch.tensor(x, dtype=torch.long)
    raise InputError(f"prompt: {what} must be a list or tensor of integers, got "
                     f"{type(x).__name__ if not isinstance(x, (list, tuple)) else 'a list holding ' + repr(x)[:40]}")


def _canonical(tokenizer, prompt):
    """Prompt forms that are another form in disguise, as that form: numpy integer arrays as tensors; a
    tokenizer's output (``BatchEncoding`` or a dict with ``input_ids``) as its prompts, each row cut to
    its ``attention_mask`` (so left or right padding both give the unpadded prompt)."""
    prompt = _numpy(prompt, "prompt")
    if isinstance(prompt, list):
        prompt = [_numpy(p, f"prompt {n}") for n, p in enumerate(prompt)]
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise InputError(f"prompt: a dict or BatchEncoding needs 'input_ids', got keys {sorted(prompt)}")
        _check_prompt_keys(prompt)
        ids, mask = prompt["input_ids"], prompt.get("attention_mask")
        ids = _numpy(ids, "input_ids")
        batched = (isinstance(ids, Tensor) and ids.dim() == 2) or (
            isinstance(ids, (list, tuple)) and bool(ids) and not _is_id(ids[0]))
        rows = [_ids_tensor(r, "input_ids") for r in ids] if batched else [_ids_tensor(ids, "input_ids")]
        if mask is not None:
            mask = _numpy(mask, "attention_mask")
            if isinstance(mask, str) or not isinstance(mask, (list, tuple, Tensor)):
                raise InputError(f"prompt: attention_mask must be a list or tensor of 0s and 1s, got "
                                 f"{type(mask).__name__}")
            masks = [_ids_tensor(m, "attention_mask") for m in mask] if batched else [_ids_tensor(mask, "attention_mask")]
            if len(masks) != len(rows) or any(m.shape != r.shape for m, r in zip(masks, rows)):
                raise InputError("prompt: input_ids and attention_mask have different shapes")
            for n, m in enumerate(masks):
                on = m.flatten().bool().nonzero().flatten()
                if len(on) and int(on[-1] - on[0]) + 1 != len(on):
                    raise InputError(f"prompt: attention_mask row {n} has a 0 between its 1s; dpa takes padding "
                                     "at either end only (a masked token inside the text would shift the positions "
                                     "of those after it)")
            rows = [r[m.bool()] for r, m in zip(rows, masks)]
        return rows if batched else rows[0]
    if isinstance(prompt, Tensor) and prompt.dim() == 2 and tokenizer is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is not None and prompt.shape[0] > 1 and ((prompt[:, 0] == pad).any() or (prompt[:, -1] == pad).any()):
            raise InputError(f"prompt: this [batch pos] tensor looks padded (token {pad}, the tokenizer's pad "
                             "token, at an edge of a row); pass the tokenizer's output with its attention_mask, "
                             "or a list of unpadded prompts, so that padding is not attributed as text")
    return prompt


# A tokenizer's output keys that do not change the model's forward: kept out of it, harmlessly.
_INERT_KEYS = frozenset({"input_ids", "attention_mask", "offset_mapping", "special_tokens_mask", "length",
                         "overflow_to_sample_mapping", "num_truncated_tokens"})


def _check_prompt_keys(prompt: Mapping) -> None:
    """Refuse a dict prompt's keys that would change the model's forward (position_ids, inputs_embeds,
    past_key_values, token types other than 0...): dpa runs the model on the token ids and mask alone, so it would
    attribute another computation than the one the dict describes."""
    for key in prompt:
        if key in _INERT_KEYS:
            continue
        value = prompt[key]
        if key == "token_type_ids" and _all_zero(value):
            continue  # what the model assumes without them
        raise InputError(f"prompt: dpa does not take {key!r} in a prompt dict: it runs the model on input_ids and "
                         f"attention_mask alone (positions 0..n-1 from the first real token, no cache), so the "
                         f"attribution would not be of the forward this dict describes; remove {key!r}")


def _all_zero(value) -> bool:
    try:
        return not bool(torch.as_tensor(_numpy(value, "token_type_ids")).bool().any())
    except (TypeError, ValueError, RuntimeError):  # ragged, or not numbers
        return False


def _is_batch(prompt) -> bool:
    if isinstance(prompt, Tensor):
        return prompt.dim() == 2
    if isinstance(prompt, (list, tuple)):
        first = prompt[0] if len(prompt) else None
        return first is not None and not _is_id(first) and not (isinstance(first, Tensor) and first.dim() == 0)
    return False


def encode_prompt(tokenizer, prompt: Prompt, n: int | None = None) -> list[int]:
    """Token ids of one prompt: a string (tokenised as the tokenizer does, BOS included when it adds
    one), a sequence of ints or a 1-D integer tensor. ``n``: its index in a batch (for messages)."""
    which = "the prompt" if n is None else f"prompt {n}"
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError("a string prompt needs a tokenizer; pass token ids instead")
        if not prompt.strip():
            raise InputError(f"{which} is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InputError(f"{which} is not valid Unicode text: {err.reason} at character {err.start} "
                             f"({prompt[err.start:err.end]!r})") from None
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise InputError(f"{which}: a tensor prompt must hold integer token ids, got {prompt.dtype}")
        if prompt.dim() != 1:
            raise InputError(f"{which}: a tensor prompt must be 1-D [pos] (or 2-D [batch pos] for a batch), "
                             f"got shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)) and all(_is_id(i) or (isinstance(i, Tensor) and i.dim() == 0
                                                                  and not i.is_floating_point() and not i.is_complex()
                                                                  and i.dtype != torch.bool) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise InputError(f"{which} must be a string, a list of token ids or a 1-D LongTensor, "
                         f"got {type(prompt).__name__}")
    if not ids:
        raise InputError(f"{which} is empty (no tokens)")
    return ids


def check_tokenizer(tokenizer) -> None:
    """None (token ids only) or a transformers tokenizer: callable, with ``decode``; not a model."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (nn.Module, str)) or not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise InputTypeError(f"tokenizer must be a transformers tokenizer (or None with token-id prompts), got "
                             f"{type(tokenizer).__name__}"
                             + (" (a model: were model and tokenizer swapped?)" if isinstance(tokenizer, nn.Module)
                                else " (load it with transformers.AutoTokenizer or dpa.load_model)"
                                if isinstance(tokenizer, str) else ""))


def check_model(model: nn.Module) -> ModelSpec:
    """The model's spec, after the checks every call needs (family, device)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a transformers *ForCausalLM model, got {type(model).__name__}")
    check_loaded(model)
    spec = spec_for(model)
    if spec.device(model).type == "meta":
        raise ModelStateError("the model's weights are on the meta device (not loaded); load them before attributing")
    check_attention(model, spec)
    return spec


# Where dpa's backward (and the plain forward) run through the model's own attention kernel: the implementations
# whose kernel has a backward on the CPU. FlexAttention has none there (and no float64): torch raises.
CPU_ATTENTION = ("eager", "sdpa")


def check_attention(model: nn.Module, spec: ModelSpec) -> None:
    """An attention implementation dpa can run and differentiate where the model is: on the CPU, eager or sdpa."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None or impl in CPU_ATTENTION:
        return
    for i, layer in enumerate(spec.layers(model)):
        p = next(layer.parameters(), None)
        if p is not None and p.device.type == "cpu":
            raise UnsupportedModelError(
                f"attn_implementation={impl!r} on the CPU (layers[{i}] is there): dpa's scores are a backward pass "
                f"through the model's attention kernel, and {impl} has none on the CPU; load the model with "
                f"attn_implementation in {CPU_ATTENTION} (what dpa supports on the CPU), or run it on a GPU")


@dataclass(frozen=True)
class Encoded:
    """A request's inputs checked and encoded, before any model is needed: one row of ids per prompt."""

    rows: list[list[int]]
    positions: list[int]  # the target position within each row
    targets: list[TargetSpec]
    batched: bool
    contrast_rows: list[int | None] = dataclasses.field(default_factory=list)  # as Request's


def build(model: nn.Module, tokenizer, prompt: Prompt | list[Prompt], target=None, *, contrast=None,
          kind: Kind = "logit", position: int | list[int] | None = None, weights: PathWeights | None = None,
          multi_token: Literal["error", "first", "sum"] = "error", batch: bool | None = None,
          multi_options: tuple[str, ...] = MULTI_TOKEN[:2],
          continuation: Sequence[int] | None = None) -> Request:
    """Check and encode a request. ``batch=False`` refuses a batch (the baselines take one prompt);
    ``multi_options``: the values of ``multi_token`` the caller offers (``MULTI_TOKEN``: ``dpa.attribute``'s; the
    baselines offer none but "error"), which its errors name. ``continuation``: token ids that follow the one
    prompt, attributed as one target of several tokens (a generation; ``target`` is then None)."""
    spec = check_model(model)
    check_tokenizer(tokenizer)
    weights = PathWeights() if weights is None else weights
    if not isinstance(weights, PathWeights):
        raise InputError(f"weights must be a dpa.PathWeights, got {type(weights).__name__}")
    weights = weights.for_model(spec.n_experts > 0, spec.family)
    enc = encode(tokenizer, spec, prompt, target, contrast=contrast, kind=kind, position=position,
                 multi_token=multi_token, batch=batch, multi_options=multi_options,
                 continuation=continuation)
    device = spec.device(model)
    with torch.inference_mode(False):  # normal tensors even when called inside inference mode (autograd needs them)
        t = max(map(len, enc.rows))
        input_ids = torch.zeros(len(enc.rows), t, dtype=torch.long)
        mask = torch.zeros(len(enc.rows), t, dtype=torch.bool)
        for b, ids in enumerate(enc.rows):  # right padding, whatever the tokenizer's padding_side: see Request
            input_ids[b, :len(ids)] = torch.tensor(ids)
            mask[b, :len(ids)] = True
        return Request(spec=spec, input_ids=input_ids.to(device), mask=mask.to(device),
                       positions=torch.tensor(enc.positions, device=device), targets=enc.targets, weights=weights,
                       batched=enc.batched, tokenizer=tokenizer, contrast_rows=enc.contrast_rows)


def encode(tokenizer, sizes, prompt: Prompt | list[Prompt], target=None, *, contrast=None, kind: Kind = "logit",
           position: int | list[int] | None = None, multi_token: str = "error",
           batch: bool | None = None, multi_options: tuple[str, ...] = MULTI_TOKEN[:2],
           continuation: Sequence[int] | None = None) -> Encoded:
    """The model-free part of ``build``: prompts, positions and targets checked against ``sizes`` (anything
    with ``vocab_size``, ``max_positions`` and ``d_model``: a ``ModelSpec``, or ``sizes_of(config)`` so that
    the CLI can refuse a bad request before it loads the weights)."""
    check_tokenizer(tokenizer)
    if kind not in ("logit", "logprob"):
        raise InputError(f"kind must be 'logit' or 'logprob', got {kind!r}")
    if multi_token not in multi_options:
        raise InputError(f"multi_token must be {' or '.join(map(repr, multi_options))}"
                         + (" here: a target of several tokens is attributed as a sum by dpa.attribute (and the "
                            "commands built on it)" if multi_token in MULTI_TOKEN else "") + f", got {multi_token!r}")
    prompt = _canonical(tokenizer, prompt)
    batched = _is_batch(prompt)
    if batched and batch is False:
        raise InputError("this method takes one prompt, not a batch")
    prompts = (list(prompt.unbind(0)) if isinstance(prompt, Tensor) else list(prompt)) if batched else [prompt]
    if not prompts:
        raise InputError("no prompts given")
    rows = [encode_prompt(tokenizer, p, n if batched else None) for n, p in enumerate(prompts)]
    for n, ids in enumerate(rows):
        which = f"prompt {n}" if batched else "the prompt"
        if len(ids) > sizes.max_positions:
            raise InputError(f"{which} has {len(ids)} tokens, more than the model's context of "
                             f"{sizes.max_positions}")
        bad = [i for i in ids if not 0 <= i < sizes.vocab_size]
        if bad:
            raise InputError(f"{which}: token id {bad[0]} is outside the vocabulary (size {sizes.vocab_size})")
    positions = [_position(p, len(ids)) for p, ids in zip(_as_list(position, len(rows), "position"), rows)]
    targets = _targets(tokenizer, sizes, len(rows), target, contrast, kind, multi_token, multi_options)
    if continuation is not None:  # a generation: its tokens are the target, each after the one before
        if batched or target is not None or contrast is not None:
            raise InputError("a continuation is attributed after one prompt, with no other target or contrast")
        ids = [_scalar_id(t, "continuation token") for t in continuation]
        if not ids or any(not isinstance(i, int) or not 0 <= i < sizes.vocab_size for i in ids):
            raise InputError(f"the continuation must be one or more token ids in the vocabulary (size "
                             f"{sizes.vocab_size}), got {list(continuation)[:8]!r}")
        targets = [TargetSpec("logprob" if kind == "logprob" else "token", token_id=ids[0],
                              tokens=tuple(ids) if len(ids) > 1 else ())]
    contrast_rows: list[int | None] = [None] * len(rows)
    for n, (ids, t) in enumerate(zip(list(rows), list(targets))):  # several tokens: teacher forcing
        if len(t.tokens) < 2 and not t.contrast_tokens:
            continue
        which = f"prompt {n}" if batched else "the prompt"
        if positions[n] != len(ids) - 1:
            raise InputError(f"{which}: a target of several tokens is read after the whole prompt (its first token at "
                             f"the last position, {len(ids) - 1}, each next one after it), not at position "
                             f"{positions[n]}: cut the prompt there instead")
        for what, forced in (("target", t.tokens), ("contrast", t.contrast_tokens)):
            if len(ids) + len(forced) - 1 > sizes.max_positions:
                raise InputError(f"{which} and its {what} of {len(forced)} tokens (teacher forcing: the prompt and "
                                 f"every {what} token but the last) have {len(ids) + len(forced) - 1} tokens, more "
                                 f"than the model's context of {sizes.max_positions}")
        if t.contrast_tokens:  # the contrast in a row of its own, its direction negated
            c = t.contrast_tokens
            contrast_rows[n] = len(rows)
            rows.append(ids + list(c[:-1]))
            positions.append(positions[n])
            targets.append(TargetSpec("token", token_id=c[0], tokens=c, negate=True))
        rows[n] = ids + list(t.tokens[:-1])
    if not any(r is not None for r in contrast_rows):
        contrast_rows = []
    return Encoded(rows=rows, positions=positions, targets=targets, batched=batched, contrast_rows=contrast_rows)


@dataclass(frozen=True)
class Sizes:
    """What ``encode`` checks a request against, read from a config (no weights loaded)."""

    vocab_size: int
    max_positions: int
    d_model: int


def sizes_of(config) -> Sizes:
    """The sizes from a config, also a generic one read without its class (the CLI's early checks): a key the
    family's config class names otherwise (GPT-2's ``n_positions``) is read through that class's attribute map."""
    def read(key: str):
        if hasattr(config, key):
            return getattr(config, key)
        from .families import FAMILIES

        family = FAMILIES.get(getattr(config, "model_type", None))
        if family is not None:
            import transformers

            alias = getattr(getattr(transformers, family.config_class), "attribute_map", {}).get(key)
            if alias is not None and hasattr(config, alias):
                return getattr(config, alias)
        raise UnsupportedModelError(f"the model's config has no {key}")

    return Sizes(vocab_size=read("vocab_size"), max_positions=context_length(config, read("max_position_embeddings")),
                 d_model=read("hidden_size"))


def _position(position, length: int) -> int:
    if position is None:
        return length - 1
    if isinstance(position, Tensor) and position.numel() != 1:
        raise InputError(f"position must be one int (negative counts from the end), got a tensor of shape "
                         f"{tuple(position.shape)}")
    position = check_int("position (negative counts from the end)", position)
    p = position + length if position < 0 else position
    if not 0 <= p < length:
        raise InputError(f"target position {position} is outside the prompt of {length} tokens")
    return p


def _targets(tokenizer, spec, n: int, target, contrast, kind: str, multi_token: str,
             multi_options: tuple[str, ...]) -> list[TargetSpec]:
    out = []
    target, contrast = (_numpy(x, what) if not isinstance(x, (list, tuple)) else [_numpy(v, what) for v in x]
                        for x, what in ((target, "target"), (contrast, "contrast")))
    for tg, foil in zip(_as_list(target, n, "target"), _as_list(contrast, n, "contrast")):
        if isinstance(tg, Tensor) and (tg.is_floating_point() or tg.is_complex()):
            if kind != "logit" or foil is not None:
                raise TargetError("a vector target cannot be combined with a contrast or the logprob kind")
            if tg.is_complex() or tuple(tg.shape) != (spec.d_model,):  # [1, d_model] too: no silent flattening
                raise TargetError(f"a vector target must be a real 1-D [d_model={spec.d_model}] tensor (one "
                                  f"direction; a batch takes a list of them, one per prompt), got {tg.dtype} of "
                                  f"shape {tuple(tg.shape)}")
            if tg.device.type == "meta":  # any other device: moved to the model's (targets.target_direction)
                raise TargetError("the vector target is on the meta device (a tensor without values); pass it "
                                  "with its values, on any device")
            if not torch.isfinite(tg).all():
                raise TargetError("the vector target holds NaN or infinite values")
            out.append(TargetSpec("vector", vector=tg.detach()))
            continue
        resolve = lambda t, what: token_ids(  # noqa: E731
            tokenizer, _scalar_id(t, what), spec.vocab_size, multi_token=multi_token, what=what,
            options=multi_options)
        ys = () if tg is None else resolve(tg, "target")
        foils = () if foil is None else resolve(foil, "contrast")
        y, foil_id = (ys[0] if ys else None), (foils[0] if foils else None)
        if foil_id is not None and kind == "logprob":
            raise TargetError("the logprob target takes no contrast (it already contrasts with every token)")
        if foil_id is not None and foil_id == y:
            raise TargetError("contrast and target are the same token")
        kind_name = "contrast" if foil_id is not None else ("logprob" if kind == "logprob" else "token")
        out.append(TargetSpec(kind_name, token_id=y, contrast_id=foil_id, text=tg if isinstance(tg, str) else None,
                              contrast_text=foil if isinstance(foil, str) else None,
                              tokens=ys if len(ys) > 1 else (), contrast_tokens=foils if len(foils) > 1 else ()))
    return out


def _scalar_id(t, what: str):
    if isinstance(t, Tensor):
        if t.numel() != 1:
            raise TargetError(f"a tensor {what} must hold one token id, got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TargetError(f"a tensor {what} must hold an integer token id, got {t.dtype} (a float vector "
                              f"target must be [d_model])")
        return int(t)
    if _is_id(t):
        return int(t)
    if isinstance(t, float):
        raise TargetError(f"{what} must be a token string or an int id, got the float {t!r}")
    return t
