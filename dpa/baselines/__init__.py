"""The paper's baselines, each called like ``dpa.attribute`` and returning a ``dpa.Attribution``.

``INPUT_METHODS`` fill ``token_scores``; ``COMPONENT_METHODS`` fill ``edge_scores`` [layer head
query key] and ``neuron_position_scores`` [layer pos d_mlp] (and their sums ``head_scores`` and
``neuron_scores``), except coarse activation patching, which fills only the sums. Every function
has the signature ``fn(model, tokenizer, prompt, target=None, *, contrast=None, position=None, **kw)``.
"""

from __future__ import annotations

from .activations import mlp_only, norm_only
from .attention import attention_rollout, attn_only, last_layer_attention, mean_attention
from .depass import depass
from .dpa_methods import dpa_component, dpa_input, dpa_mid
from .gradient import atp, component_gradient, gradient, input_x_gradient, integrated_gradients
from .ifr import component_ifr, ifr
from .perturbation import activation_patching, occlusion
from .random_baseline import random_component, random_input

INPUT_METHODS = {
    "dpa": dpa_input,
    "random": random_input,
    "last_layer_attention": last_layer_attention,
    "mean_attention": mean_attention,
    "attention_rollout": attention_rollout,
    "gradient": gradient,
    "input_x_gradient": input_x_gradient,
    "integrated_gradients": integrated_gradients,
    "depass": depass,
    "ifr": ifr,
    "occlusion": occlusion,
}

COMPONENT_METHODS = {
    "dpa": dpa_component,
    "dpa_mid": dpa_mid,
    "random": random_component,
    "attn_only": attn_only,
    "mlp_only": mlp_only,
    "norm_only": norm_only,
    "gradient": component_gradient,
    "atp": atp,
    "ifr": component_ifr,
    "activation_patching": activation_patching,
}

# Methods that recompute each layer from its weights, with its norms placed by the family description (before
# and/or after each block; internals.Layout). They refuse, by name, a family whose layers they do not read
# (internals.layout_problem: LayerNorm, fused or biased projections, a non-gated MLP, parallel blocks).
RECOMPUTE_LAYERS = frozenset({depass, ifr, component_ifr, mlp_only, norm_only})
# Methods that read every layer's attention probabilities (alpha, through dpa's explicit attention path): a hybrid's
# mixer layers (LFM2's convolutions) have none, so they refuse such a model by name (explicit.py, instrument.py).
READ_ATTENTION = frozenset({last_layer_attention, mean_attention, attention_rollout, attn_only, component_gradient,
                            atp, activation_patching}) | RECOMPUTE_LAYERS
# Methods that ablate or draw one token mixer's units per layer: a model with a mixer beside attention (Falcon-H1's)
# has two, and they refuse it by name (spec.one_mixer_per_layer)
ONE_MIXER = frozenset({activation_patching, random_component})


def supports(method, spec) -> bool:
    """Whether ``method`` (a function of ``INPUT_METHODS`` / ``COMPONENT_METHODS``, or a partial of one) handles
    the family of ``spec``. dpa_mid reads the residual stream between attention and the MLP and each neuron's
    down projection: a model with parallel blocks (GPT-NeoX) or experts has neither, one without an MLP (Mamba-2)
    no neurons at all."""
    from .internals import recomputes

    fn = getattr(method, "func", method)
    if spec.mixed and fn in READ_ATTENTION or spec.n_beside and fn in ONE_MIXER:
        return False
    if fn is dpa_mid:
        return not spec.parallel and not spec.n_experts and spec.d_mlp > 0
    return fn not in RECOMPUTE_LAYERS or recomputes(spec)


__all__ = [
    "COMPONENT_METHODS", "INPUT_METHODS", "ONE_MIXER",
    "READ_ATTENTION", "RECOMPUTE_LAYERS", "activation_patching", "atp", "attention_rollout", "attn_only",
    "component_gradient", "component_ifr", "depass", "dpa_component", "dpa_input", "dpa_mid", "gradient", "ifr",
    "input_x_gradient", "integrated_gradients", "last_layer_attention", "mean_attention", "mlp_only", "norm_only",
    "supports",
    "occlusion", "random_component", "random_input",
]
