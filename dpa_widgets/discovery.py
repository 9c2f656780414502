"""``DiscoveryWidget``: a MIB circuit (``dpa.mib.Discovery``) kept at a chosen size, with its faithfulness f.

The view (static/discovery.js) shows the f curve of both rankings (log x axis) with the chosen point marked,
and a layered diagram of the circuit at (``size``, ``ranking``): the input, every head and MLP by layer, the
logits, and the kept edges (at most ``max_edges``, the strongest by |score|), each entering a head at its
query, key or value input.

The circuits at the discovery's sizes (MIB's ten: 0.1% ... 100%) are sent up front for both rankings, so the
size and ranking controls need no kernel; f there is ``discovery.faithfulness``'s, exactly. Another size needs
``model`` and ``pairs`` (the ones the discovery was made from): the widget evaluates f there in the kernel
(``dpa.mib.evaluate`` at that one size, both rankings; patched forward passes) and keeps it. Without them the
size is refused, and the view offers only the evaluated sizes. A discovery made with ``evaluate=False`` is shown
too, f unknown (with ``model`` and ``pairs``, evaluated size by size as it is chosen).

Traits are snake_case on both sides: ``size`` and ``ranking`` are the user-facing two-way state; the
underscored ones carry what only the view reads.
"""

from __future__ import annotations

import math
from pathlib import Path

import anywidget
import torch
import traitlets as t

import dpa
from dpa.checks import check_int
from dpa.mib.discover import Discovery
from dpa.mib.evaluate import SIZES, Faithfulness, check_size, evaluate
from dpa.mib.graph import QKV, Graph
from dpa.mib.pairs import Pairs

from .circuit import TraitValueError, UserTraits

STATIC = Path(__file__).parent / "static"
RANKINGS = ("signed", "absolute")  # MIB's CPR ranks edges by score, CMD by |score|
MAX_EDGES = 300  # edges drawn at most (the strongest by |score|): thousands of edges draw nothing readable
GOOD_F = 0.8  # the default size: the smallest evaluated size whose f reaches this
FALLBACK_SIZE = 0.05
USER_TRAITS = ("size", "ranking")


def _finite(x) -> float | None:
    """A number for JSON: None where it is not finite (JSON has no NaN; the view says "unknown")."""
    x = float(x)
    return x if math.isfinite(x) else None


class DiscoveryWidget(UserTraits, anywidget.AnyWidget):
    """Show ``discovery`` (a ``dpa.mib.Discovery``): its f curve and its circuit at ``size`` and ``ranking``.

    ``size``: the share of the graph's edges kept, in (0, 1]; by default the smallest evaluated size whose f on
    the ranking is at least 0.8 (the smallest circuit that recovers 80% of the model's behaviour on the pairs),
    else 0.05. ``ranking``: "signed" (edges by score: MIB's CPR) or "absolute" (by |score|: CMD).
    ``model`` and ``pairs`` (both or neither; the discovery's own): evaluate f at any other size on demand
    (``batch_size`` pairs a run). ``max_edges``: how many edges the diagram draws (the strongest by |score|).
    ``name``: the model's name in the header (default: the model's, when given).
    """

    _user_traits = USER_TRAITS
    _esm = STATIC / "discovery.js"
    _css = STATIC / "discovery.css"

    _data = t.Dict().tag(sync=True)  # the graph, the curves, the circuits at the evaluated sizes
    _points = t.List(t.Dict()).tag(sync=True)  # sizes evaluated on demand: {size, signed, absolute, error}
    _live = t.Bool(False).tag(sync=True)  # model and pairs given: other sizes can be evaluated
    _busy = t.Bool(False).tag(sync=True)
    _error = t.Unicode("").tag(sync=True)

    size = t.Float(FALLBACK_SIZE, help="The share of edges kept, in (0, 1].").tag(sync=True)
    ranking = t.Unicode("signed", help="'signed' (by score, MIB's CPR) or 'absolute' (by |score|, CMD)."
                        ).tag(sync=True)

    def __init__(self, discovery: Discovery, *, model=None, pairs: Pairs | None = None, batch_size: int = 8,
                 max_edges: int = MAX_EDGES, name: str | None = None, size: float | None = None,
                 ranking: str = "signed"):
        self._check(discovery, model, pairs, name)
        self.discovery, self.model, self.pairs = discovery, model, pairs
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.max_edges = check_int("max_edges", max_edges, low=1)
        self._cache: dict[float, Faithfulness] = {}
        f = discovery.faithfulness
        self._sizes = tuple(float(p) for p in (f.cpr_curve.sizes if f is not None else SIZES))
        if name is None and model is not None:
            name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        live = model is not None
        ranking = self._ranking(ranking)
        super().__init__(_live=live, _data=self._payload(name or ""), ranking=ranking,
                         size=self._default_size(ranking) if size is None else size)
        self.on_msg(self._on_message)
        self.observe(self._on_change, names=["size", "ranking"])
        self._on_change()
        if self._error:  # a size given here that could not be evaluated: said at once
            raise dpa.InputError(self._error)

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _check(discovery, model, pairs, name) -> None:
        if not isinstance(discovery, Discovery):
            raise dpa.InputTypeError(f"discovery must be a dpa.mib.Discovery (from dpa.mib.discover), got "
                                     f"{type(discovery).__name__}")
        graph = discovery.graph
        if tuple(discovery.scores.shape) != tuple(graph.exists.shape):
            raise dpa.InputError(f"the discovery's scores are {tuple(discovery.scores.shape)}, its graph's edges "
                                 f"[writers readers] {tuple(graph.exists.shape)}")
        if not bool(torch.isfinite(discovery.scores[graph.exists]).all()):
            raise dpa.NonFiniteError("the discovery's edge scores hold NaN or infinite values: no ranking to show")
        if (model is None) != (pairs is None):
            raise dpa.InputError("pass model and pairs together (the discovery's own: f at other sizes is evaluated "
                                 "on them), or neither")
        if pairs is not None and not isinstance(pairs, Pairs):
            raise dpa.InputTypeError(f"pairs must be a dpa.mib.Pairs (mib.read_pairs or mib.task_pairs), got "
                                     f"{type(pairs).__name__}")
        if model is not None:
            from dpa.mib.forward import check_graph_run
            from dpa.request import check_model

            spec = check_model(model)
            check_graph_run(model, spec)  # f is evaluated on MIB's graph run: a model it cannot run is refused now
            mine = Graph.of(spec)
            if mine != graph:
                raise dpa.InputError(f"the model's graph ({mine.n_layers} layers x {mine.n_heads} heads"
                                     f"{', parallel' if mine.parallel else ''}) is not the discovery's "
                                     f"({graph.n_layers} x {graph.n_heads}"
                                     f"{', parallel' if graph.parallel else ''}): pass the model it was made on")
            pairs.check(spec)  # pairs the model cannot read (ids past its vocabulary, prompts past its context)
            discovery.check_made_on(model, pairs)  # another model or pairs of the same shape: f would not be its
        if name is not None and not isinstance(name, str):
            raise dpa.InputTypeError(f"name must be a string, got {type(name).__name__}")

    @staticmethod
    def _ranking(value) -> str:
        if value not in RANKINGS:
            raise TraitValueError(f"ranking must be 'signed' (edges by score, MIB's CPR) or 'absolute' (by |score|, "
                                  f"CMD), got {value!r}")
        return value

    def _evaluated(self, p: float) -> float | None:
        """The evaluated size ``p`` is (within rounding), or None."""
        return next((s for s in self._sizes if math.isclose(p, s, rel_tol=1e-9)), None)

    @t.validate("ranking")
    def _valid_ranking(self, proposal):
        return self._ranking(proposal["value"])

    @t.validate("size")
    def _valid_size(self, proposal):
        p = proposal["value"]
        if not (math.isfinite(p) and 0 < p <= 1):
            raise TraitValueError(f"size is the share of edges kept, in (0, 1], got {p}")
        snapped = self._evaluated(p)
        if snapped is not None:
            return snapped
        if self.model is None:
            shown = ", ".join(f"{s:g}" for s in self._sizes)
            known = "f is known only at the evaluated sizes" if self.discovery.faithfulness is not None else \
                "the circuits are shown at MIB's sizes"
            raise TraitValueError(f"size {p:g}: {known} ({shown}); pass model= and pairs= to DiscoveryWidget to "
                                  "evaluate f at other sizes")
        return p

    # ------------------------------------------------------------------ payload

    def _default_size(self, ranking: str) -> float:
        f = self.discovery.faithfulness
        if f is not None:
            curve = f.cpr_curve if ranking == "signed" else f.cmd_curve
            for p, value in zip(curve.sizes, curve.f.tolist()):
                if math.isfinite(value) and value >= GOOD_F:
                    return float(p)
        if self._evaluated(FALLBACK_SIZE) is not None or self.model is not None:
            return FALLBACK_SIZE
        return min(self._sizes, key=lambda s: abs(math.log(s / FALLBACK_SIZE)))

    def _payload(self, name: str) -> dict:
        d, graph = self.discovery, self.discovery.graph
        f = d.faithfulness
        writers = [[n, -1, -1] for n in graph.writer_names[:1]]
        for layer in range(graph.n_layers):
            writers += [[f"a{layer}.h{h}", layer, h] for h in range(graph.n_heads)] + [[f"m{layer}", layer, -1]]
        owner = graph.owner.tolist()
        readers = []
        for r, n in enumerate(graph.reader_names):
            letter = n[-2] if n.endswith(">") else ""
            readers.append([n, owner[r], letter if letter in QKV else ""])
        curves = None
        if f is not None:
            curves = {ranking: {"sizes": [float(p) for p in c.sizes], "edges": list(c.edges), "kept": list(c.kept),
                                "f": [_finite(x) for x in c.f.tolist()]}
                      for ranking, c in (("signed", f.cpr_curve), ("absolute", f.cmd_curve))}
        circuits = {}
        for ranking in RANKINGS:
            curve = None if f is None else (f.cpr_curve if ranking == "signed" else f.cmd_curve)
            circuits[ranking] = [self._circuit(p, ranking, None if curve is None else curve.f[k])
                                 for k, p in enumerate(self._sizes)]
        return {
            "method": d.method, "model": name, "n_layers": graph.n_layers, "n_heads": graph.n_heads,
            "parallel": graph.parallel, "n_edges": graph.n_edges, "writers": writers, "readers": readers,
            "sizes": list(self._sizes), "evaluated": f is not None, "max_edges": self.max_edges,
            "cpr": None if f is None else _finite(f.cpr), "cmd": None if f is None else _finite(f.cmd),
            "curves": curves, "circuits": circuits,
        }

    def _circuit(self, p: float, ranking: str, f) -> dict:
        """The circuit at size ``p`` on ``ranking``: edges asked and kept (after pruning), f (None: unknown), its
        writers (``nodes``), and its strongest ``max_edges`` edges [writer, reader, score] by |score|."""
        graph, scores = self.discovery.graph, self.discovery.scores
        kept = self.discovery.circuit(p, ranking == "absolute")
        w, r = kept.nonzero(as_tuple=True)
        s = scores[w, r].detach().to(torch.float64)
        order = torch.argsort(s.abs(), descending=True, stable=True)[:self.max_edges].tolist()
        w, r, s = w.tolist(), r.tolist(), s.tolist()
        return {"size": p, "ranking": ranking, "asked": int(p * graph.n_edges), "kept": len(s),
                "f": None if f is None else _finite(f), "nodes": kept.any(1).nonzero().flatten().tolist(),
                "edges": [[w[i], r[i], s[i]] for i in order]}

    # ------------------------------------------------------------------ what is on view

    def _point(self, p: float) -> dict | None:
        return next((q for q in self._points if math.isclose(q["size"], p, rel_tol=1e-9)), None)

    @property
    def current(self) -> dict:
        """The circuit on view (what the view draws): size, ranking, ``asked`` and ``kept`` (edges, after pruning),
        ``f`` (None: unknown), ``nodes`` (writer indices), ``edges`` [writer, reader, score] (the strongest
        ``max_edges`` by |score|) and ``names`` ("a0.h1->a2.h3<q>" of each of them)."""
        point = self._point(self.size)
        if point is not None:
            entry = point[self.ranking]
        else:
            entry = self._data["circuits"][self.ranking][self._sizes.index(self.size)]
        graph = self.discovery.graph
        return {**entry, "names": [graph.edge_name(w, r) for w, r, _ in entry["edges"]]}

    @property
    def f(self) -> float | None:
        """f of the circuit on view; None where it is not known."""
        return self.current["f"]

    # ------------------------------------------------------------------ kernel-side work

    def _on_change(self, _change=None) -> None:
        """A new size or ranking: the circuits at evaluated sizes are in the payload; another size is evaluated
        once (both rankings) and kept in ``_points``."""
        known = self._evaluated(self.size) is not None and self.discovery.faithfulness is not None
        point = self._point(self.size)
        if known or self.model is None:
            self._error = ""
            return
        if point is not None:
            self._error = point["error"]
            return
        p = self.size
        point = {"size": p, "signed": self._circuit(p, "signed", None),
                 "absolute": self._circuit(p, "absolute", None), "error": ""}
        self._points = [*self._points, point]  # the circuit at once; f when it is evaluated
        self._busy = True
        try:
            found = self.evaluate(p)
            point = {**point, "signed": {**point["signed"], "f": _finite(found.cpr_curve.f[0])},
                     "absolute": {**point["absolute"], "f": _finite(found.cmd_curve.f[0])}}
            self._error = ""
        except Exception as e:  # noqa: BLE001  shown in the view, never lost in a comm handler's log
            point = {**point, "error": f"{type(e).__name__}: {e}"}
            self._error = point["error"]
        finally:
            self._points = [point if math.isclose(q["size"], p, rel_tol=1e-9) else q for q in self._points]
            self._busy = False

    def evaluate(self, size: float) -> Faithfulness:
        """f of the circuits at ``size`` on both rankings (``dpa.mib.evaluate`` on the widget's model and pairs;
        kept, so a size is evaluated once)."""
        if self.model is None:
            raise dpa.InputError("evaluating f at a size runs the model: pass model= and pairs= to DiscoveryWidget")
        size = check_size(size)
        if size not in self._cache:
            self._cache[size] = evaluate(self.model, self.pairs, self.discovery.scores, sizes=(size,),
                                         batch_size=self.batch_size)
        return self._cache[size]

    def _on_message(self, _widget, content, _buffers) -> None:
        """The view's "hello": a kernel is there (and says whether it can evaluate other sizes). Saved widget
        state (a reopened notebook, a book page) has no kernel behind it: nothing answers, and the view keeps the
        other-size box off."""
        if isinstance(content, dict) and content.get("action") == "hello":
            self.send({"action": "hello", "live": self.model is not None})


__all__ = ["DiscoveryWidget"]
