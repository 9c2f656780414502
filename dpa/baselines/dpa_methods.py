"""DPA itself, in the baselines' calling convention (so the benchmark can swap methods)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .. import prompts, request
from ..attribute import attribute as _attribute
from ..result import Attribution
from ..weights import PathWeights
from .common import Prompt


def attribute(model: nn.Module, tokenizer, prompt: Prompt, target=None, **kwargs) -> Attribution:
    """``dpa.attribute`` for one prompt, as every baseline takes (a batch is refused, not returned as a list)."""
    if prompts.is_batch(prompts.canonical(tokenizer, prompt)):
        raise request.InputError("this method takes one prompt, not a batch (dpa.attribute takes batches)")
    return _attribute(model, tokenizer, prompt, target, **kwargs)


def dpa_input(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None, weights: PathWeights | None = None,
              multi_token: str = "error") -> Attribution:
    """``dpa.attribute``: token scores (head and neuron scores come with them). Of the methods here, DPA alone
    takes a target of several tokens (``multi_token="sum"``)."""
    return attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights,
                     multi_token=multi_token)


def dpa_component(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                  position: int | None = None, weights: PathWeights | None = None,
                  multi_token: str = "error") -> Attribution:
    """``dpa.attribute`` with edge and position-level neuron scores; neurons scored against the
    layer-output target t^(l) (the paper's Algorithm 1, dpa's default)."""
    return attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights,
                     edges=True, neuron_positions=True, multi_token=multi_token)


def dpa_mid(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
            position: int | None = None, weights: PathWeights | None = None,
            multi_token: str = "error") -> Attribution:
    """As ``dpa_component`` but neurons scored against the mid-layer target t_mid^(l): what the
    authors' reference code computes, so what produced the paper's tables."""
    out = attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights,
                    edges=True, neuron_positions=True, neuron_target="mid", multi_token=multi_token)
    return replace(out, method="dpa_mid")
