"""Circuit discovery measured the way the field measures it: MIB's circuit-localization protocol (the book:
circuit-discovery).

    from dpa import mib
    pairs = mib.task_pairs(model, tokenizer, "ioi")                 # or mib.read_pairs("pairs.jsonl", tokenizer)
    found = mib.discover(model, tokenizer, pairs, method="dpa-cf")  # every edge scored, CPR and CMD measured
    found.faithfulness.cpr, found.faithfulness.cmd, found.save_json("graph.json")
    mib.load("runs/mib")                                            # a finished discover(..., out="runs/mib")

``Graph``: MIB's graph (writers, readers, edges, EAP-IG names and JSON); ``edge_scores``: DPA (with and without
the counterfactual), EAP, EAP-IG-inputs, GIM's rules, exact patching, random, read out of one backward through the
model run reader by reader; ``evaluate``: f at MIB's ten sizes in one patched run per size, CPR and CMD.
"""

from .discover import Discovery, discover, load, read_pairs
from .evaluate import SIZES, Faithfulness, evaluate, paired_bootstrap
from .graph import Graph
from .methods import METHODS, edge_scores
from .pairs import Pairs
from .tasks import RULES, TASKS, candidates, task_pairs

__all__ = ["Discovery", "Faithfulness", "Graph", "METHODS", "Pairs", "RULES", "SIZES", "TASKS", "candidates",
           "discover", "edge_scores", "evaluate", "load", "paired_bootstrap", "read_pairs", "task_pairs"]
