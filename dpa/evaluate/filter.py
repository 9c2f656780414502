"""The paper's sample filter: keep a sample only where the model already gets it right.

A sample is valid when the model's argmax next token is the target, p(target) > 0.1, the prompt
has at most 400 tokens, and the target token is more than one character (whitespace aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import request as requests
from ..checks import check_bool, check_float, check_int
from ..instrument import clean_logits
from .prompts import Sample


@dataclass(frozen=True)
class Verdict:
    valid: bool
    reason: str  # "ok" or why the sample was dropped
    probability: float  # p(target) on the clean prompt (float32), NaN when not run
    n_tokens: int
    predicted: int | None = None  # the model's argmax token


@torch.no_grad()
def check(model: nn.Module, tokenizer, sample: Sample, *, max_tokens: int = 400,
          min_probability: float = 0.1, correct_only: bool = True) -> Verdict:
    """Run the clean prompt once and apply the filter. ``correct_only=False`` keeps only the length
    and context checks (for smoke runs on models that rarely get a dataset right)."""
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    min_probability = check_float("min_probability", min_probability, low=0, high=1)
    correct_only = check_bool("correct_only", correct_only)
    n = sample.n_tokens
    if n > max_tokens:
        return Verdict(False, f"longer than {max_tokens} tokens", float("nan"), n)
    if not any(sample.context):
        return Verdict(False, "no context tokens", float("nan"), n)
    if correct_only and len(tokenizer.decode([sample.target_id]).strip()) <= 1:
        return Verdict(False, "target token is one character", float("nan"), n)
    req = requests.build(model, None, list(sample.input_ids), sample.target_id, batch=False)
    probs = clean_logits(model, req).float().softmax(-1)[0]
    p, top = float(probs[sample.target_id]), int(probs.argmax())
    if not correct_only:
        return Verdict(True, "ok", p, n, top)
    if top != sample.target_id:
        return Verdict(False, "argmax is not the target", p, n, top)
    if p <= min_probability:
        return Verdict(False, f"p(target) <= {min_probability}", p, n, top)
    return Verdict(True, "ok", p, n, top)
