"""JupyterLab widgets for dpa: ``CircuitWidget`` and ``save_html`` (a standalone HTML export)."""

from .circuit import CircuitWidget
from .export import save_html

__all__ = ["CircuitWidget", "save_html"]
