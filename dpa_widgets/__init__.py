"""JupyterLab widgets for dpa: ``CircuitWidget`` and ``save_html`` (a standalone HTML export), and
``DiscoveryWidget`` (a MIB circuit from ``dpa.mib.discover`` at a chosen size, with its faithfulness)."""

from .circuit import CircuitWidget
from .discovery import DiscoveryWidget
from .export import save_html

__all__ = ["CircuitWidget", "DiscoveryWidget", "save_html"]
