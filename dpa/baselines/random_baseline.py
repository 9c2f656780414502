"""The random baseline: seeded uniform scores, reproducible per prompt.

The generator is seeded from ``seed`` and the prompt's token ids, so the same prompt always gets
the same ranking and different prompts get different ones.
"""

from __future__ import annotations

import torch
from torch import nn

from ..result import Attribution
from ..checks import check_int
from .common import Prompt, causal, prepare, result, seed_for
from ..spec import one_mixer_per_layer


def random_input(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                 position: int | None = None, seed: int = 0) -> Attribution:
    """Uniform random token scores."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    gen = torch.Generator().manual_seed(seed_for(req, check_int("seed", seed)))
    return result(model, req, "random", token_scores=torch.rand(req.n_tokens, generator=gen))


def random_component(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
                     position: int | None = None, seed: int = 0) -> Attribution:
    """Uniform random scores for every causal edge and position-level neuron."""
    req = prepare(model, tokenizer, prompt, target, contrast, position)
    spec, t = req.spec, req.n_tokens
    one_mixer_per_layer(spec, "the random component baseline is")
    gen = torch.Generator().manual_seed(seed_for(req, check_int("seed", seed)))
    edges = torch.rand(spec.n_layers, spec.n_heads, t, t, generator=gen) * causal(t)
    neurons = torch.rand(spec.n_layers, t, spec.d_mlp, generator=gen)
    for i in range(spec.n_layers):  # none for a unit a layer lacks (Nemotron-H's layers of one block)
        edges[i] *= spec.mixes(i)
    neurons *= spec.neurons_that_exist[:, None, :]  # (nor past a dense layer's neurons in a mixed layout)
    return result(model, req, "random", edge_scores=edges, neuron_position_scores=neurons)
