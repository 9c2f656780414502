"""Dual Path Attribution for SwiGLU language models (Llama, Mistral, Qwen2, Qwen3)."""

from .adapters import ModelSpec, UnsupportedModelError, spec_for
from .capture import NonFiniteError
from .propagate import InputError, attribute
from .result import Attribution, Component, TargetInfo
from .targets import TargetError
from .weights import PathWeights

__all__ = [
    "Attribution", "Component", "InputError", "ModelSpec", "NonFiniteError", "PathWeights", "TargetError",
    "TargetInfo", "UnsupportedModelError", "attribute", "load_model", "spec_for",
]
__version__ = "0.1.0"


def load_model(name: str | None = None, **kwargs):
    """Load a model and tokenizer: the default SmolLM2-135M-Instruct, an HF id or a folder."""
    from .models import load_model as _load

    return _load(name, **kwargs)
