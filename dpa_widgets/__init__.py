"""JupyterLab widgets for dpa: ``CircuitWidget`` and ``save_html`` (a standalone HTML export), and
``GenerationWidget`` (a generation attributed step by step: the [generated x source] matrix, each step's heads
and neurons) and ``DiscoveryWidget`` (a MIB circuit from ``dpa.mib.discover`` at a chosen size, with its faithfulness)."""

from .circuit import CircuitWidget
from .discovery import DiscoveryWidget
from .export import save_html
from .generation import GenerationWidget

__all__ = ["CircuitWidget", "DiscoveryWidget", "GenerationWidget", "save_html"]
