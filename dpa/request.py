"""The one request step: prompts, targets, positions, path weights and the model checked and encoded.

Every entry point (``dpa.attribute``, the baselines, the evaluation runner, the CLI, the widget) builds
a ``Request`` here, so a bad argument gets the same clear error everywhere and a good one the same
encoding: token ids padded into one batch, the target position of each prompt, its target resolved to
token ids (or a direction), checked against the model's vocabulary and context length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch
from torch import Tensor, nn

from .checks import check_int
from .errors import InputError, ModelStateError, TargetError, UnsupportedModelError
from .families import FAMILIES, ModelSpec, context_length, spec_for
from .rope_config import UNBOUNDED
from .state_checks import check_loaded
from .prompts import Prompt, canonical, check_tokenizer, encode_prompt, is_batch, is_id, numpy_tensor, per_prompt
from .targets import TargetSpec, token_ids, token_text
from .weights import PathWeights

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
    prompt = canonical(tokenizer, prompt)
    batched = is_batch(prompt)
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
    positions = [_position(p, len(ids)) for p, ids in zip(per_prompt(position, len(rows), "position"), rows)]
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
    family's config class names otherwise (GPT-2's ``n_positions``) is read through that class's attribute map. A
    model that reads no position (Mamba-2's, ``Family.context_key`` None) takes a prompt of any length."""
    family = FAMILIES.get(getattr(config, "model_type", None))

    def read(key: str):
        if hasattr(config, key):
            return getattr(config, key)
        if family is not None:
            import transformers

            alias = getattr(getattr(transformers, family.config_class), "attribute_map", {}).get(key)
            if alias is not None and hasattr(config, alias):
                return getattr(config, alias)
        raise UnsupportedModelError(f"the model's config has no {key}")

    unbounded = family is not None and family.context_key is None  # a recurrent model reads no position
    return Sizes(vocab_size=read("vocab_size"),
                 max_positions=UNBOUNDED if unbounded else context_length(config, read("max_position_embeddings")),
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
    target, contrast = (numpy_tensor(x, what) if not isinstance(x, (list, tuple)) else [numpy_tensor(v, what) for v in x]
                        for x, what in ((target, "target"), (contrast, "contrast")))
    for tg, foil in zip(per_prompt(target, n, "target"), per_prompt(contrast, n, "contrast")):
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
    if is_id(t):
        return int(t)
    if isinstance(t, float):
        raise TargetError(f"{what} must be a token string or an int id, got the float {t!r}")
    return t
