"""DPA itself, in the baselines' calling convention (so the benchmark can swap methods)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..attribute import attribute
from ..result import Attribution
from ..weights import PathWeights
from .common import Prompt


def dpa_input(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
              position: int | None = None, weights: PathWeights | None = None) -> Attribution:
    """``dpa.attribute``: token scores (head and neuron scores come with them)."""
    return attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights)


def dpa_component(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                  position: int | None = None, weights: PathWeights | None = None) -> Attribution:
    """``dpa.attribute`` with edge and position-level neuron scores; neurons scored against the
    layer-output target t^(l) (the paper's Algorithm 1, dpa's default)."""
    return attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights,
                     edges=True, neuron_positions=True)


def dpa_mid(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
            position: int | None = None, weights: PathWeights | None = None) -> Attribution:
    """As ``dpa_component`` but neurons scored against the mid-layer target t_mid^(l): what the
    authors' reference code computes, so what produced the paper's tables."""
    out = attribute(model, tokenizer, prompt, target, contrast=contrast, position=position, weights=weights,
                    edges=True, neuron_positions=True, neuron_target="mid")
    return replace(out, method="dpa_mid")
