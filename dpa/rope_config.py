"""What a config says about positions: its RoPE parameters per layer type, whether they depend on the sequence
length, the description without rotary where the config switches RoPE off, and the longest prompt."""

from __future__ import annotations

from torch import nn

from .errors import UnsupportedModelError
from .registry import LENGTH_DEPENDENT_ROPE, Family
from .spec import get


def rope_settings(config) -> list[dict]:
    """The RoPE parameters of each layer type: one dict for most models, one per layer type for Gemma 3
    (``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    return [dict(r) for r in rope.values()] if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]


def rope_depends_on_length(config) -> bool:
    """Whether the model's rotary frequencies depend on the sequence length (``LENGTH_DEPENDENT_ROPE``):
    transformers then takes them from the longest prompt of a padded batch, so dpa computes each prompt's
    rotary as for that prompt alone (``rotary.each_prompt_alone``)."""
    return any(r.get("rope_type", "default") in LENGTH_DEPENDENT_ROPE for r in rope_settings(config))


def rope_switched(model: nn.Module, config, family: Family) -> Family:
    """The description with no rotary where the config switches RoPE off (``Family.rope_switch``: Granite's
    position_embedding_type), after checking that the model has a rotary module exactly where the config asks for
    one: a model built one way and a config edited the other would have dpa rotate where the model does not."""
    if family.rope_switch is None:
        return family
    key, on = family.rope_switch
    wants = getattr(config, key, None) == on
    module = getattr(get(model, family.rotary.rsplit(".", 1)[0]), family.rotary.rsplit(".", 1)[1], None)
    if wants != isinstance(module, nn.Module):
        raise UnsupportedModelError(
            f"unsupported model: the config's {key}={getattr(config, key, None)!r} "
            f"{'asks for' if wants else 'switches off'} RoPE, while {family.rotary} is "
            f"{'None' if module is None else type(module).__name__}; the model rotates as its modules were built "
            "(a config edited after loading?): make the two agree, or load the model again")
    return family if wants else family.with_(rotary=None)


UNBOUNDED = 2 ** 62  # the context of a model that reads no position (Family.context_key None): no prompt too long


def context_length(config, max_position_embeddings: int | None = None) -> int:
    """The longest prompt dpa attributes: ``max_position_embeddings``, or, where every layer's RoPE is
    dynamic NTK scaling, ``factor`` times it: transformers rescales the rotary base for a sequence longer than
    ``max_position_embeddings`` (the scaling's purpose), up to the ``factor``-fold context it is configured for."""
    n = config.max_position_embeddings if max_position_embeddings is None else max_position_embeddings
    ropes = rope_settings(config)
    if all(r.get("rope_type", "default") == "dynamic" for r in ropes):
        return int(n * min(float(r.get("factor", 1.0)) for r in ropes))
    return n
