"""MIB's faithfulness of circuits (book: circuit-discovery): f per size, CPR and CMD.

A circuit is the top n edges of a ranking, pruned (``Graph.top``); it is evaluated in one patched run per batch
(``forward.run``): every excluded edge's reader sees the counterfactual writer. With m the mean metric,

    f(C) = (m(C) - m(empty)) / (m(full) - m(empty))

at MIB's ten sizes n = int(p #edges); CPR is the trapezoid area of f over p (edges ranked by signed score), CMD
that of |1 - f| (ranked by |score|). m(full) and m(empty) are runs of the same code with nothing, and with
everything, excluded: the model's forward and the counterfactual's.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import InputError, InputTypeError, NonFiniteError
from .forward import batches
from .graph import Graph
from .pairs import Pairs

SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def check_size(size, empty: bool = False) -> float:
    """A share of the graph's edges, in (0, 1] (``empty``: [0, 1], 0 the empty circuit)."""
    from ..checks import check_float

    p = check_float("size", size)
    if not (0 <= p <= 1 if empty else 0 < p <= 1):
        raise InputError(f"size is a share of the edges, in {'[0' if empty else '(0'}, 1]; got {p}")
    return p


def check_sizes(sizes, empty: bool = False, areas: bool = False) -> tuple[float, ...]:
    """MIB's sizes to evaluate at: shares of the edges in (0, 1], increasing (CPR and CMD are areas over them:
    ``areas`` asks for two at least)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise InputTypeError(f"sizes must be a sequence of shares of the edges, got {type(sizes).__name__}")
    out = tuple(check_size(p, empty) for p in sizes)
    if not out:
        raise InputError("sizes is empty: give the shares of the edges to evaluate at (default: MIB's ten)")
    if areas and len(out) < 2:
        raise InputError(f"CPR and CMD are areas over the sizes: give two sizes or more, got {list(out)}")
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise InputError(f"sizes must increase (CPR and CMD are areas over them), got {list(out)}")
    return out


@dataclass
class Curve:
    """f at each size for one ranking: ``edges`` asked for (int(p #edges)), ``kept`` after pruning, per-pair
    metrics ``values`` [size pair] (for paired intervals), and the area (CPR or CMD)."""

    absolute: bool
    sizes: tuple[float, ...]
    edges: list[int]
    kept: list[int]
    values: Tensor  # [size pair]
    full: Tensor  # [pair]
    empty: Tensor  # [pair]

    @property
    def f(self) -> Tensor:
        return faithfulness(self.values, self.full, self.empty)

    @property
    def area(self) -> float:
        return area(self.f, self.sizes, self.absolute)


@dataclass
class Faithfulness:
    """Both of MIB's curves for one set of edge scores: ``cpr`` (signed ranking) and ``cmd`` (|score|)."""

    cpr_curve: Curve
    cmd_curve: Curve
    n_edges: int
    extra: dict = field(default_factory=dict)

    @property
    def cpr(self) -> float:
        return self.cpr_curve.area

    @property
    def cmd(self) -> float:
        return self.cmd_curve.area

    def save(self, path) -> None:
        """Every pair's metric at every size, both rankings (``torch.save``): what paired intervals need."""
        curves = (self.cpr_curve, self.cmd_curve)
        save_whole(Path(path), {"cpr": curves[0].values, "cmd": curves[1].values, "full": curves[0].full,
                                "empty": curves[0].empty, "sizes": curves[0].sizes, "n_edges": self.n_edges,
                                "edges": [c.edges for c in curves], "kept": [c.kept for c in curves]})

    @classmethod
    def load(cls, path) -> Faithfulness:
        """What ``save`` wrote."""
        d = torch.load(path, weights_only=True)
        sizes = tuple(d["sizes"])
        edges, kept = d.get("edges", [[], []]), d.get("kept", [[], []])
        return cls(Curve(False, sizes, edges[0], kept[0], d["cpr"], d["full"], d["empty"]),
                   Curve(True, sizes, edges[1], kept[1], d["cmd"], d["full"], d["empty"]), d.get("n_edges", 0))


def save_whole(path: Path, value) -> None:
    """``torch.save``, whole or not at all: written beside ``path``, then renamed over it (an interrupted save
    leaves the old file, or none, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)


def faithfulness(values: Tensor, full: Tensor, empty: Tensor) -> Tensor:
    """f per size from per-pair metrics [size pair], [pair], [pair]: the means' ratio, as MIB computes it."""
    m_full, m_empty = full.mean(), empty.mean()
    if not bool(m_full != m_empty):
        raise InputError(f"the full model and the empty circuit give the same mean metric ({float(m_full):.6g}) on "
                         "these pairs: f = (m(C) - m(empty)) / (m(full) - m(empty)) is undefined")
    return (values.mean(-1) - m_empty) / (m_full - m_empty)


def area(f: Tensor, sizes=SIZES, absolute: bool = False) -> float:
    """The trapezoid area over the sizes on a linear axis: of f (CPR), or of |1 - f| (CMD, ``absolute``); an area
    needs two sizes at least (over one it would be 0, a perfect CMD)."""
    if len(sizes) < 2:
        raise InputError(f"{'CMD' if absolute else 'CPR'} is an area over the sizes; this evaluation has "
                         f"{len(sizes)} ({list(sizes)}): evaluate at two sizes or more (MIB's ten by default)")
    y = (1 - f).abs() if absolute else f
    x = torch.tensor(sizes, dtype=y.dtype)
    return float(((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2).sum())


def evaluate(model: nn.Module, pairs: Pairs, scores: Tensor, *, sizes=SIZES, batch_size: int = 8,
             progress=None) -> Faithfulness:
    """CPR and CMD of edge scores [writer reader] on the pairs (see the module docstring). ``progress(k)``: k more
    pairs evaluated."""
    from ..checks import check_int
    from ..request import check_model
    from .forward import check_graph_run

    spec = check_model(model)
    check_graph_run(model, spec)
    batch_size = check_int("batch_size", batch_size, low=1)
    sizes = check_sizes(sizes, empty=True)
    if not isinstance(pairs, Pairs):
        raise InputTypeError(f"pairs must be a dpa.mib.Pairs (mib.read_pairs or mib.task_pairs), got "
                             f"{type(pairs).__name__}")
    pairs.check(spec)
    graph = Graph.of(spec)
    if not isinstance(scores, Tensor):
        raise InputTypeError(f"scores must be a tensor [writer reader] (dpa.mib.edge_scores), got "
                             f"{type(scores).__name__}")
    if tuple(scores.shape) != tuple(graph.exists.shape):
        raise InputError(f"scores are {tuple(scores.shape)}; this model's graph has [writers readers] "
                         f"{tuple(graph.exists.shape)}")
    if not bool(torch.isfinite(scores[graph.exists]).all()):
        raise NonFiniteError("the edge scores hold NaN or infinite values: no circuit can be ranked")
    plan = Plan.of(graph, scores, sizes)
    results = []
    for batch in batches(model, pairs, batch_size):
        results.append((batch.rows, plan.metrics(batch)))
        if progress is not None:
            progress(len(batch.rows))
    return plan.collect(results, len(pairs))


@dataclass
class Plan:
    """The circuits to evaluate for one set of scores: each (ranking, size) and the distinct circuits they make."""

    graph: Graph
    sizes: tuple[float, ...]
    rows: list[tuple[bool, float, int, int, int]]  # (absolute, p, edges asked, edges kept, circuit index)
    circuits: list[Tensor]

    @classmethod
    def of(cls, graph: Graph, scores: Tensor, sizes=SIZES) -> Plan:
        n = graph.n_edges
        circuits: list[Tensor] = []
        index: dict[bytes, int] = {}
        rows = []
        for absolute in (False, True):
            for p in sizes:
                kept = graph.top(scores, int(p * n), absolute)
                key = kept.numpy().tobytes()
                if key not in index:
                    index[key] = len(circuits)
                    circuits.append(kept)
                rows.append((absolute, p, int(p * n), int(kept.sum()), index[key]))
        return cls(graph, tuple(sizes), rows, circuits)

    def metrics(self, batch) -> dict[str, Tensor]:
        """One batch's metrics: ``full`` and ``empty`` [pair], ``circuits`` [circuit pair]."""
        graph = self.graph
        with torch.no_grad():
            cf = batch.run(graph, batch.counter, keep=True)
            full = batch.run(graph, batch.clean).metric.double().cpu()
            empty = batch.run(graph, batch.clean, excluded=graph.exists, other=cf.writes).metric.double().cpu()
            each = [batch.run(graph, batch.clean, excluded=graph.excluded(kept), other=cf.writes).metric.double().cpu()
                    for kept in self.circuits]
        out = {"full": full, "empty": empty, "circuits": torch.stack(each)}
        if not all(bool(torch.isfinite(v).all()) for v in out.values()):
            raise NonFiniteError(f"the task metric is not finite (NaN or infinite) on the pairs {batch.rows} with "
                                 "the full model, the empty circuit or a circuit: the model's activations overflow, "
                                 "or hold NaN, on them; f is undefined")
        return out

    def collect(self, results: list[tuple[list[int], dict[str, Tensor]]], n_pairs: int) -> Faithfulness:
        """Both curves from every batch's metrics (``metrics``), by pair."""
        full = torch.zeros(n_pairs, dtype=torch.float64)
        empty = torch.zeros(n_pairs, dtype=torch.float64)
        each = torch.zeros(len(self.circuits), n_pairs, dtype=torch.float64)
        for rows, m in results:
            r = torch.tensor(rows)
            full[r], empty[r], each[:, r] = m["full"], m["empty"], m["circuits"]

        def curve(absolute: bool) -> Curve:
            mine = [row for row in self.rows if row[0] == absolute]
            return Curve(absolute, self.sizes, [row[2] for row in mine], [row[3] for row in mine],
                         each[[row[4] for row in mine]], full, empty)
        return Faithfulness(curve(False), curve(True), self.graph.n_edges)


def paired_bootstrap(a: Faithfulness, b: Faithfulness, *, resamples: int = 2000, seed: int = 0) -> dict:
    """CPR and CMD of ``a`` minus ``b`` (the same pairs), with 95% intervals from resampling the pairs: one resample
    draws the same pairs for both, and f is recomputed from the resampled means, as MIB computes it."""
    n = a.cpr_curve.full.numel()
    if b.cpr_curve.full.numel() != n:
        raise ValueError("a paired bootstrap needs both methods evaluated on the same pairs")
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, n, (resamples, n), generator=g)
    out = {}
    for name, absolute in (("cpr", False), ("cmd", True)):
        ca, cb = getattr(a, f"{name}_curve"), getattr(b, f"{name}_curve")
        diffs = sorted(area(faithfulness(ca.values[:, r], ca.full[r], ca.empty[r]), ca.sizes, absolute)
                       - area(faithfulness(cb.values[:, r], cb.full[r], cb.empty[r]), cb.sizes, absolute)
                       for r in draws)
        point = getattr(a, name) - getattr(b, name)
        out[name] = {"difference": point, "interval": (diffs[int(0.025 * resamples)],
                                                       diffs[int(0.975 * resamples) - 1])}
    return out
