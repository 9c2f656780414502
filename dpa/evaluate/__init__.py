"""The faithfulness benchmark of the DPA paper (book: faithfulness): data, prompts, the sample
filter, ablations, disruption / recovery curves, AUCs, and the ``evaluate`` / ``sweep`` runners."""

from .ablation import component_ablation_prob, component_ablation_probs, input_ablation_prob, input_ablation_probs
from .auc import auc, auc_summary
from .curves import COMPONENT_GRID, KNOWN_GRID, SIGMOID_GRID, fraction_grid
from .datasets import DATASETS, DataError, Example, find_data_dir, load_examples, load_records
from .ioi import generate_ioi
from .prompts import Sample, encode_example
from .runner import evaluate, sweep
from .settings import Settings

__all__ = [
    "COMPONENT_GRID", "DATASETS", "DataError", "Example", "KNOWN_GRID", "SIGMOID_GRID", "Sample", "Settings", "auc",
    "auc_summary", "component_ablation_prob", "component_ablation_probs", "encode_example", "evaluate",
    "find_data_dir", "fraction_grid", "generate_ioi", "input_ablation_prob", "input_ablation_probs",
    "load_examples", "load_records", "sweep",
]
