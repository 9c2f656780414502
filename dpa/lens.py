"""What a model predicts and what a neuron writes, read through the unembedding: the plain forward's next-token
distribution, and a neuron's logit lens. The widget's live view uses these (``dpa_widgets/live.py``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import request as requests
from .checks import check_int
from .errors import InputError
from .families import layer_modules, neuron_direction, spec_for
from .instrument import clean_logits
from .rules.norm import GAIN


@torch.no_grad()
def next_token_probabilities(model: nn.Module, tokenizer, token_ids: list[int]) -> Tensor:
    """The model's next-token distribution after ``token_ids`` [vocab] (float32): one plain forward pass under the
    request step's checks and the model's lock."""
    req = requests.build(model, tokenizer, list(token_ids), batch=False)
    return clean_logits(model, req)[0].float().softmax(-1)


@torch.no_grad()
def neuron_logit_effect(model: nn.Module, layer: int, neuron: int) -> Tensor:
    """How much one unit of neuron ``neuron``'s activation in layer ``layer`` raises each token's logit [vocab]
    (float32): its down-projection column, times the final norm's gain, read through the unembedding (a logit-lens
    view; the final norm's 1/rms is left out). On a mixture of experts, neuron e * d_expert + j is neuron j of
    routed expert e, then the shared expert's follow."""
    spec = spec_for(model)
    check_int("layer", layer, low=0, high=spec.n_layers - 1)
    check_int("neuron", neuron, low=0, high=spec.d_mlp - 1)
    if spec.lacks("neuron", layer, neuron):
        raise InputError(spec.lacks("neuron", layer, neuron))
    mods = layer_modules(model, spec)[layer]  # (what the layer puts on the MLP's output: Granite's residual
    down = neuron_direction(mods, spec, neuron) * spec.residual_multiplier * mods.scale("mlp_out")  # multiplier,
    # Falcon-H1's down multiplier)  [d_model]
    gamma = GAIN[spec.parts.norm_kind](spec.final_norm(model).weight)  # the final norm's diagonal
    unembed = spec.unembed(model).weight
    return spec.logits(unembed.float() @ (down.float() * gamma.float()).to(unembed.device))
