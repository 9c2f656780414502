"""Scalars a model's forward multiplies by (``Family.multipliers``, Granite's): the embeddings by
``embedding_multiplier``, each block's output by ``residual_multiplier`` before it joins the residual stream, and the
logits divided by ``logits_scaling`` (or, Falcon-H1's, multiplied by ``lm_head_multiplier``). Autograd sees them in
the model's own forward, so the scores need nothing; what dpa computes itself does (``ModelSpec.embeddings``, the
logits and target directions, the circuit graphs' and MIB's sums of writes, the neuron readouts): read here from the
config, and checked against the modules' own copies, which the forward uses."""

from __future__ import annotations

import math

from torch import nn

from .errors import UnsupportedModelError
from .registry import Family

FIELDS = {"embedding": "embedding_multiplier", "residual": "residual_multiplier", "logits": "logits_scaling",
          "lm_head": "logits_multiplier", "ids_only": "ids_only_multiplier"}


def multipliers(config, family: Family) -> dict[str, float]:
    """The family's multipliers from ``config``, as ``ModelSpec`` fields: finite numbers (the logits' divisor not
    zero), or ``UnsupportedModelError`` naming the setting."""
    out = {}
    for which, key in family.multipliers:
        value = getattr(config, key, None)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or (which == "logits" and value == 0)):
            raise UnsupportedModelError(
                f"unsupported config setting {key}={value!r}: the {family.model_type} description reads it as a "
                f"finite number {'(not zero) ' if which == 'logits' else ''}that the model's forward "
                f"{'divides the logits by' if which == 'logits' else 'multiplies by'}")
        out[FIELDS[which]] = float(value)
    return out


_ABSENT = object()


def check_copies(model: nn.Module, family: Family, spec) -> None:
    """The modules' own copies of the multipliers (what their forwards multiply by: the decoder stack's embedding
    multiplier, each layer's residual multiplier) are the config's, which dpa reads; a copy edited alone would have
    dpa's sums of writes differ from the model's, so it is refused by name. So is a copy that is not a plain number
    (a tensor): one changed in place after a first call would go unseen by the checks' cache, which keys on numbers."""
    stack = [(family.layers.rsplit(".", 1)[0], spec.base(model))]  # (Falcon-H1's lm_head multiplier is the stack's)
    owners = {"embedding": stack, "lm_head": stack, "ids_only": stack,
              "residual": [(f"layers[{i}]", layer) for i, layer in enumerate(spec.layers(model))]}
    for which, key in family.multipliers:
        for where, module in owners.get(which, ()):
            have = getattr(module, key, _ABSENT)
            if have is not _ABSENT and (isinstance(have, bool) or not isinstance(have, (int, float))):
                raise UnsupportedModelError(
                    f"unsupported model: {where}.{key} is a {type(have).__name__}, not a number; the model's forward "
                    "multiplies by it, and dpa reads multipliers as numbers (checked once, and again when a number "
                    f"changes): set it to float({key})")
            if have is not _ABSENT and have != getattr(spec, FIELDS[which]):
                raise UnsupportedModelError(
                    f"unsupported model: {where}.{key} is {have!r}, while the config's {key} is "
                    f"{getattr(model.config, key)!r}; dpa reads the config's, and the module multiplies by its own "
                    "(edited after loading?): make the two agree, or load the model again")
