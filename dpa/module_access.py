"""Reading a model's modules: a submodule by its dotted path, whether a module is a plain projection (whose weight
is what it computes), whether a forward is transformers' own, a projection's weight as [out, in], a norm's epsilon.
``spec.py`` re-exports them (the checks and rules import them from there)."""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from .errors import UnsupportedModelError


def get(root: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path (``"self_attn.q_proj"``)."""
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _projection_classes() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def is_projection(module: nn.Module) -> bool:
    """nn.Linear, or GPT-2's Conv1D (the same map with its weight stored [in, out]), or a subclass of either
    that keeps its forward (a parametrization, a marker class): a module that computes exactly what its
    ``weight`` and ``bias`` say, which dpa may read instead of running it. A subclass with a forward of its
    own (a LoRA written as a Linear) computes something else: not a projection (``why_not_projection``)."""
    return any(isinstance(module, base) and type(module).forward is base.forward for base in _projection_classes())


def own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class has a forward of its own (a subclass's, a patch's), not transformers': some code
    on its chain of wrappers is not in transformers' files. ``functools.wraps`` copies a name and a module, not the
    code, and keeps the wrapped function as ``__wrapped__``: a patch wrapping transformers' forward has its own code,
    and transformers' wrappers (``GradientCheckpointingLayer`` wraps every subclass's forward) keep a subclass's."""
    forward, seen = type(module).forward, set()
    while forward is not None and id(forward) not in seen:
        seen.add(id(forward))
        code = getattr(forward, "__code__", None)
        if code is None or not os.path.abspath(code.co_filename).startswith(_transformers_dir()):
            return True  # a callable object, a builtin or code of someone else's: nothing vouches for it
        forward = getattr(forward, "__wrapped__", None)
    return False


@functools.lru_cache(maxsize=1)
def _transformers_dir() -> str:
    import transformers  # on first use: ``import dpa`` does not import transformers

    return os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep


def why_not_projection(module: nn.Module) -> str:
    """What a module that is not a projection is, for the refusal that names it."""
    name = type(module).__name__
    if isinstance(module, _projection_classes()):
        return (f"a {name}, a subclass of {type(module).__mro__[1].__name__} with a forward of its own (an "
                "adapter such as LoRA?), so its weight is not what it computes")
    return f"a {name}, not a Linear (an adapter wrapping one, such as LoRA?)"


def weight_rows(module: nn.Module) -> torch.Tensor:
    """A projection's weight as [out, in] (nn.Linear's layout) whatever its class: what ``is_projection``
    vouches the module computes."""
    if not is_projection(module):
        raise UnsupportedModelError(f"unsupported module: {why_not_projection(module)}; dpa reads its weight")
    return module.weight if isinstance(module, nn.Linear) else module.weight.T


def in_features(module: nn.Module) -> int:
    return weight_rows(module).shape[1]


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` in Llama-like code, ``eps`` elsewhere)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise UnsupportedModelError(f"unsupported norm module {type(norm).__name__}: no epsilon attribute")
    return float(eps)
