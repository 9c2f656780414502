"""What a prompt may be, and its token ids: a string, token ids (a list, a 1-D tensor or numpy array), a batch of
them, or a tokenizer's output (its rows cut to their attention mask); anything else refused by name
(``request.build`` calls these first)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Sequence

import torch
from torch import Tensor, nn

from .errors import InputError, InputTypeError

Prompt = str | Sequence[int] | Tensor  # one prompt (a batch: a list of them, a 2-D tensor or a tokenizer's output)


def per_prompt(x, n: int, name: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            several = (" (a list gives one per prompt; a target of several tokens is a string, with "
                       "multi_token='sum')" if name in ("target", "contrast") else "")
            raise InputError(f"{name} has {len(x)} entries for {n} prompts{several}")
        return list(x)
    return [x] * n


def is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def numpy_tensor(x, what: str):
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
    x = numpy_tensor(x, what)
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (list, tuple)) and all(is_id(i) for i in x):
        return torch.tensor(x, dtype=torch.long)
    raise InputError(f"prompt: {what} must be a list or tensor of integers, got "
                     f"{type(x).__name__ if not isinstance(x, (list, tuple)) else 'a list holding ' + repr(x)[:40]}")


def canonical(tokenizer, prompt):
    """Prompt forms that are another form in disguise, as that form: numpy integer arrays as tensors; a
    tokenizer's output (``BatchEncoding`` or a dict with ``input_ids``) as its prompts, each row cut to
    its ``attention_mask`` (so left or right padding both give the unpadded prompt)."""
    prompt = numpy_tensor(prompt, "prompt")
    if isinstance(prompt, list):
        prompt = [numpy_tensor(p, f"prompt {n}") for n, p in enumerate(prompt)]
    if isinstance(prompt, Mapping):
        if "input_ids" not in prompt:
            raise InputError(f"prompt: a dict or BatchEncoding needs 'input_ids', got keys {sorted(prompt)}")
        _check_prompt_keys(prompt)
        ids, mask = prompt["input_ids"], prompt.get("attention_mask")
        ids = numpy_tensor(ids, "input_ids")
        batched = (isinstance(ids, Tensor) and ids.dim() == 2) or (
            isinstance(ids, (list, tuple)) and bool(ids) and not is_id(ids[0]))
        rows = [_ids_tensor(r, "input_ids") for r in ids] if batched else [_ids_tensor(ids, "input_ids")]
        if mask is not None:
            mask = numpy_tensor(mask, "attention_mask")
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
        return not bool(torch.as_tensor(numpy_tensor(value, "token_type_ids")).bool().any())
    except (TypeError, ValueError, RuntimeError):  # ragged, or not numbers
        return False


def is_batch(prompt) -> bool:
    if isinstance(prompt, Tensor):
        return prompt.dim() == 2
    if isinstance(prompt, (list, tuple)):
        first = prompt[0] if len(prompt) else None
        return first is not None and not is_id(first) and not (isinstance(first, Tensor) and first.dim() == 0)
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
    elif isinstance(prompt, (list, tuple)) and all(is_id(i) or (isinstance(i, Tensor) and i.dim() == 0
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
