"""Edge scores for MIB's graph [writer reader]: a read-out of one backward through the model run reader by reader.

Every gradient method here is the same computation with another backward (book: circuit-discovery):

    score(u -> r) = sum over pairs and positions of  a_u . g_r

with g_r the gradient of the metric at reader r's input and a_u what writer u's patching moves: Δ_u = out_u(clean)
- out_u(counterfactual), or out_u(clean) without a counterfactual. The backward is the model's own (EAP), the
same averaged over inputs interpolated between the counterfactual's embeddings and the clean ones (EAP-IG-inputs,
MIB's k = 5 points k/5, k = 0..4), or the linearised model's (DPA: ``dpa.instrument`` with path weights; GIM: the
same with its softmax temperature). ``exact`` patches each edge alone; ``random`` is the floor.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor, nn

from ..backward import Context, Readout, read_out
from ..checks import check_int
from ..errors import InputError, InputTypeError
from ..weights import PathWeights
from .forward import Batch, batch_of, batches
from .graph import Graph
from .pairs import Pairs

Method = Literal["dpa", "dpa-cf", "dpa-ig", "eap", "eap-ig", "gim", "exact", "random"]
METHODS: tuple[str, ...] = ("dpa", "dpa-cf", "dpa-ig", "eap", "eap-ig", "gim", "exact", "random")


def edge_scores(model: nn.Module, pairs: Pairs, method: Method = "dpa-cf", *, weights: PathWeights | None = None,
                temperature: float | None = None, steps: int = 5, batch_size: int = 8, seed: int = 0,
                edges: Tensor | None = None, progress: Callable[[float], None] | None = None) -> Tensor:
    """Scores [writer reader] (``Graph.of(spec)``'s indexing; 0 where there is no edge), summed over the pairs.

    method: ``dpa`` (out_u(clean) . g^DPA), ``dpa-cf`` (Δ_u . g^DPA), ``dpa-ig`` (Δ_u . g^DPA averaged over EAP-IG's
    ``steps`` points), ``eap``, ``eap-ig`` (``steps`` points),
    ``gim`` (Δ_u . g^DPA at softmax temperature ``temperature``, 2 by default, GIM's), ``exact`` (each edge
    patched alone: m(full) - m(full without it); ``edges`` [writer reader] bool limits it to some), ``random``.
    weights: DPA's path weights (default: dpa's defaults, which are GIM's too). ``progress(k)``: k more pairs."""
    from ..request import check_model

    method = check_method(method, weights, temperature)
    steps, batch_size = check_int("steps", steps, low=1), check_int("batch_size", batch_size, low=1)
    if edges is not None and method != "exact":
        raise InputError(f"edges limits the edges 'exact' patches one by one; {method!r} scores every edge at once")
    spec = check_model(model)
    if not isinstance(pairs, Pairs):
        raise InputTypeError(f"pairs must be a dpa.mib.Pairs (mib.read_pairs or mib.task_pairs), got "
                             f"{type(pairs).__name__}")
    pairs.check(spec)
    graph = Graph.of(spec)
    if edges is not None and (not isinstance(edges, Tensor) or edges.dtype != torch.bool
                              or tuple(edges.shape) != tuple(graph.exists.shape)):
        what = (f"a {edges.dtype} tensor of shape {tuple(edges.shape)}" if isinstance(edges, Tensor)
                else type(edges).__name__)
        raise InputError(f"edges must be a bool tensor [writer reader] of the graph's shape "
                         f"{tuple(graph.exists.shape)} (Graph.of(spec).exists'), got {what}")
    if method == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(graph.exists.shape, generator=g, dtype=torch.float64) * graph.exists
    if method == "exact":
        return _exact(model, pairs, graph, batch_size, edges, progress)
    total = torch.zeros(graph.exists.shape, dtype=torch.float64)
    rows = list(range(len(pairs)))
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        total += batch_scores(model, pairs, chunk, method, graph, weights=weights, temperature=temperature,
                              steps=steps)
        if progress is not None:
            progress(len(chunk))
    return total * graph.exists


def check_method(method: str, weights: PathWeights | None, temperature: float | None) -> str:
    """The method, checked with the options given for it."""
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if weights is not None and not isinstance(weights, PathWeights):
        raise InputTypeError(f"weights must be a dpa.PathWeights, got {type(weights).__name__}")
    if temperature is not None and method != "gim" and temperature != 1:
        raise InputError(f"a softmax temperature is GIM's rule: method='gim', not {method!r}")
    if method == "gim" and temperature is not None:
        (weights or PathWeights()).with_temperature(temperature)  # checked now, before any run (or folder) starts
    if weights is not None and method not in LINEARISED:
        raise InputError(f"{method} uses the model's own backward: path weights are for dpa, dpa-cf and gim")
    return method


LINEARISED = ("dpa", "dpa-cf", "dpa-ig", "gim")


def batch_scores(model: nn.Module, pairs: Pairs, rows: list[int], method: str, graph: Graph, *,
                 weights: PathWeights | None = None, temperature: float | None = None, steps: int = 5) -> Tensor:
    """One batch's edge scores [writer reader] (the pairs ``rows``), for a gradient method."""
    w = None
    if method in LINEARISED:
        w = weights or PathWeights()
        if method == "gim":
            w = w.with_temperature(2.0 if temperature is None else temperature)
    with batch_of(model, pairs, rows, weights=w, grad=True) as batch:
        return scores_in(batch, graph, method, steps)


def scores_in(batch: Batch, graph: Graph, method: str, steps: int = 5) -> Tensor:
    """A gradient method's edge scores [writer reader] on a batch already on the instrumented model (``batch_of``):
    the writers' moves a_u from plain runs, the readers' gradients from one backward of the summed metric (per
    interpolation point for EAP-IG), read out as a_u . g_r."""
    with torch.no_grad():
        clean = batch.run(graph, batch.clean, keep=True)
        if method == "dpa":
            moved = clean.writes
        else:
            moved = clean.writes - batch.run(graph, batch.counter, keep=True).writes
    points = [1.0]
    if method in ("eap-ig", "dpa-ig"):
        points = [k / steps for k in range(steps)]
    scores = torch.zeros(graph.exists.shape, dtype=torch.float64)
    for alpha in points:
        embeds = None
        if alpha != 1.0:  # the input writer between the counterfactual's (0) and the clean one (1)
            embeds = (clean.writes[0] - moved[0] * (1 - alpha)).detach()
        out = batch.run(graph, batch.clean, embeds=embeds, leaves=True)
        ctx = Context(batch.session.model, batch.session.request, batch.session, None, None, out.metric.detach(),
                      torch.float64)
        scores += read_out(ctx, out.metric.sum(), {"edges": GraphEdges(graph, moved, out.reads)})["edges"] / len(points)
    return scores


class GraphEdges(Readout):
    """MIB's edge scores as a read-out of one backward (``backward.read_out``): the gradients it reads are those at
    each reader's input in the graph's reader-by-reader run (``reads``: per layer the attention readers' [3 head
    batch pos d_model] and the MLP's, then the logits'), and it reads a_u . g_r summed over the batch and positions,
    for each reader's writers below it (``moved``: a_u [writer batch pos d_model])."""

    def __init__(self, graph: Graph, moved: Tensor, reads: list[Tensor]):
        self.graph, self.moved, self.reads = graph, moved, reads

    def tensors(self, rec, spec) -> list[Tensor]:
        return self.reads

    def read(self, ctx, grads: list[Tensor]) -> Tensor:
        return _read(self.graph, self.moved, grads)


def _read(graph: Graph, moved: Tensor, grads: list[Tensor]) -> Tensor:
    """[writer reader]: a_u . g_r summed over the batch and positions, for each reader's writers below it."""
    out = torch.zeros(graph.exists.shape, dtype=torch.float64)
    wide = torch.promote_types(moved.dtype, torch.float32)
    for i in range(graph.n_layers):
        att, mlp = grads[2 * i], grads[2 * i + 1]
        below = graph.below(i, 0)
        if (i, 0) not in graph.absent:  # (a layer without a token mixer: its readers read nothing)
            out[:below, graph.attention_readers(i)] = torch.einsum(
                "wbtd,rbtd->wr", moved[:below].to(wide), att.to(wide)).double()
        below = graph.below(i, 1)
        if graph.mlps and (i, 1) not in graph.absent:  # (without an MLP, its reader reads nothing)
            out[:below, graph.mlp_reader(i)] = torch.einsum("wbtd,btd->w", moved[:below].to(wide),
                                                            mlp.to(wide)).double()
    out[:, graph.logits] = torch.einsum("wbtd,btd->w", moved.to(wide), grads[-1].to(wide)).double()
    return out


def _exact(model: nn.Module, pairs: Pairs, graph: Graph, batch_size: int, edges: Tensor | None,
           progress) -> Tensor:
    """m(full) - m(full without the edge), summed over the pairs, edge by edge (one patched run each)."""
    chosen = graph.exists if edges is None else (edges.to(torch.bool) & graph.exists)
    pick = chosen.nonzero().tolist()
    out = torch.zeros(graph.exists.shape, dtype=torch.float64)
    with torch.no_grad():
        for batch in batches(model, pairs, batch_size):
            cf = batch.run(graph, batch.counter, keep=True)
            full = batch.run(graph, batch.clean).metric.double().sum()
            for w, r in pick:
                cut = torch.zeros_like(graph.exists)
                cut[w, r] = True
                out[w, r] += full - batch.run(graph, batch.clean, excluded=cut, other=cf.writes).metric.double().sum()
                if progress is not None:
                    progress(len(batch.rows) / len(pick))
    return out
