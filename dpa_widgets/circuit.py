"""``CircuitWidget``: a two-way JupyterLab view of one attribution (heads, neurons, experts, tokens), and of its
circuit graph (a ``dpa.Circuit``: direct effects between tokens, heads, neurons and the target).

Traits are snake_case on both sides (static/src/model.js has the matching ``@typedef Model``).
Underscored traits carry data only the view reads; the plain ones are the user-facing,
two-way state: set them from Python to drive the view, read them to see what was clicked.
With ``model`` and ``tokenizer`` the controls recompute in the kernel, once the view's
``{"action": "hello"}`` message has been answered (``_on_message``): on a static page nothing
answers, and the view keeps those controls off with the reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anywidget
import torch
import traitlets as t

import dpa
from dpa import Attribution, request
from dpa.checks import check_int
from dpa.spec import lacking, narrower

from . import graph, live, payload, verify
from .bundle import bundle

STATIC = Path(__file__).parent / "static"
PRESETS = ("default", "custom", "control_content", "attention", "query_key", "mlp")  # custom: the result's own
# Keyword arguments the constructor takes besides result, model and tokenizer.
USER_TRAITS = ("selected_head", "selected_neuron", "selected_expert", "selected_token", "target", "contrast",
               "weights_preset", "weights_p", "method", "top_k", "view", "selected_node", "selected_edge",
               "graph_threshold")
SELECTION_TRAITS = ("selected_head", "selected_neuron", "selected_expert", "selected_token")
LIVE_TRAITS = ("target", "contrast", "weights_preset", "weights_p", "method")
GRAPH_TRAITS = ("view", "selected_node", "selected_edge", "graph_threshold")  # set once the graph is on view
VIEWS = ("scores", "graph")
STATIC_DETAILS = 8  # heads, neurons (and experts) whose details are sent up front (and kept by save_html)
EDGE_BUDGET = 120_000  # at most this many edge cells sent up front


class TraitValueError(dpa.InputError, t.TraitError):
    """A widget trait set to a value it cannot take (a dpa error and a ``traitlets.TraitError``)."""


class TraitTypeError(dpa.InputTypeError, t.TraitError):
    """A widget trait set to a value of the wrong type or shape (traitlets' own check)."""


class UserTraits:
    """A widget whose user-facing traits (``_user_traits``) turn traitlets' type errors into dpa's, naming the
    trait and the value."""

    _user_traits: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except t.TraitError as e:
            if isinstance(e, dpa.DPAError) or name not in self._user_traits:
                raise
            raise TraitTypeError(f"{e} (setting {name} = {value!r})") from None


class CircuitWidget(UserTraits, anywidget.AnyWidget):
    """Inspect ``result`` (a ``dpa.Attribution``); pass ``model`` and ``tokenizer`` for live controls.

    ``top_neurons``: how many neurons per layer the view receives (by |score|).
    ``circuit``: a ``dpa.Circuit`` of the same prompt, target and path weights (from ``dpa.circuit``), or
    ``True`` to compute one (its 64 largest units at a position; needs the model). The view then has a circuit
    graph (``view="graph"``, on show first): prune it with the slider (``graph_threshold``), select a node
    (``selected_node``) or an edge (``selected_edge``) and verify the edge by path patching (``verify_edge``).
    With a model, a new target or path weights recompute the graph too (as many units, same ``positions``).
    Any trait below may also be given as a keyword argument.
    """

    _esm = bundle()  # static/src/*.js as one module (dpa_widgets/bundle.py)
    _css = STATIC / "circuit.css"

    _user_traits = USER_TRAITS
    _data = t.Dict().tag(sync=True)
    _details = t.Dict().tag(sync=True)
    _live = t.Bool(False).tag(sync=True)
    _busy = t.Bool(False).tag(sync=True)
    _error = t.Unicode("").tag(sync=True)
    _methods = t.List(t.Unicode(), default_value=["dpa"]).tag(sync=True)
    _presets = t.List(t.Unicode(), default_value=[p for p in PRESETS if p != "custom"]).tag(sync=True)
    _comparison = t.Dict().tag(sync=True)
    _verify = t.Dict().tag(sync=True)
    _graph = t.Dict().tag(sync=True)  # Circuit.to_json() and "verifiable"; {} without a circuit
    _graph_verify = t.Dict().tag(sync=True)  # Circuit.verify results by "source->destination"

    selected_head = t.List(t.Int(), default_value=None, allow_none=True, minlen=2, maxlen=2,
                           help="The locked head as [layer, head], or None.").tag(sync=True)
    selected_neuron = t.List(t.Int(), default_value=None, allow_none=True, minlen=2, maxlen=2,
                             help="The locked neuron as [layer, neuron], or None.").tag(sync=True)
    selected_expert = t.List(t.Int(), default_value=None, allow_none=True, minlen=2, maxlen=2,
                             help="The locked expert as [layer, slot] (mixture of experts: the routed experts, "
                                  "then the shared one), or None.").tag(sync=True)
    selected_token = t.Int(None, allow_none=True, help="The locked token position, or None.").tag(sync=True)
    selection = t.Dict(help="The current selection with its scores, as the view exports it.").tag(sync=True)
    target = t.Unicode("", help="The target token ('' = the model's own prediction).").tag(sync=True)
    contrast = t.Unicode("", help="A contrast foil token ('' = none).").tag(sync=True)
    weights_preset = t.Unicode("default", help=f"Path weights: one of {', '.join(PRESETS)}.").tag(sync=True)
    weights_p = t.Float(0.5, help="p of the sensitivity family, in [0, 1].").tag(sync=True)
    method = t.Unicode("dpa", help="'dpa' or a baseline from dpa.baselines, compared by rank.").tag(sync=True)
    top_k = t.Int(10, help="How many tokens or components 'top-k' verification ablates.").tag(sync=True)
    view = t.Unicode("scores", help="'scores' (tokens, heads, neurons) or 'graph' (the circuit graph: needs "
                                    "circuit=).").tag(sync=True)
    selected_node = t.Unicode("", help="The graph's selected node by label ('L2.H1@5', 'tok3', 'target'), or ''."
                              ).tag(sync=True)
    selected_edge = t.List(t.Unicode(), default_value=None, allow_none=True, minlen=2, maxlen=2,
                           help="The graph's selected edge as [source label, destination label], or None."
                           ).tag(sync=True)
    graph_threshold = t.Float(1.0, help="The graph's pruning: keep the fewest heads and neurons whose influence "
                                        "on the target adds up to this share of theirs (Circuit.prune); 1 keeps "
                                        "all.").tag(sync=True)

    @staticmethod
    def _check_arguments(result, model, tokenizer, top_neurons, circuit, kwargs: dict) -> int:
        """Refuse what the widget cannot show truly, before anything is built; returns top_neurons."""
        unknown = sorted(set(kwargs) - set(USER_TRAITS))
        if unknown:
            raise dpa.InputTypeError(f"CircuitWidget got unexpected keyword argument(s) {', '.join(unknown)}; "
                            f"it takes {', '.join(USER_TRAITS)} besides result, model, tokenizer, top_neurons "
                            "and circuit")
        if not isinstance(result, Attribution):
            raise dpa.InputTypeError(f"result must be a dpa.Attribution (one prompt), got {type(result).__name__}"
                                     + (" (a batch gives a list: pass one of its results)"
                                        if isinstance(result, list) else ""))
        if result.neuron_scores is None or result.head_scores is None:
            raise dpa.InputError(f"result has no {'head' if result.head_scores is None else 'neuron'} scores" + (
                f" (it keeps only the top {result.neuron_top.k} neurons of each sign per layer: saved with "
                "top_neurons, as dpa attribute --json does by default; save every neuron with --json-neurons all "
                "or to_json() without top_neurons)" if result.neuron_top is not None else "") +
                "; show a full DPA attribution")
        top_neurons = check_int("top_neurons", top_neurons, low=1)
        bad = [n for n in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores",
                           "expert_scores", "expert_position_scores")
               if getattr(result, n) is not None and not bool(torch.isfinite(getattr(result, n)).all())]
        if bad:
            raise dpa.NonFiniteError(f"result's {bad[0]} hold NaN or infinite values (read back from a file with "
                                     "nulls?): there is nothing sound to show")
        if model is not None:
            live.check_fits(model, result)
            request.check_tokenizer(tokenizer)
        if model is None and any(k in kwargs for k in LIVE_TRAITS):
            raise dpa.InputError(f"{', '.join(k for k in LIVE_TRAITS if k in kwargs)} need model and tokenizer")
        if circuit is True:  # computed from the model: without one, or on Falcon-H1's, refused before any work
            graph.check_model(model)
        if circuit is not None and not isinstance(circuit, bool):
            graph.check_matches(circuit, result)
        return top_neurons

    def __init__(self, result: Attribution, model=None, tokenizer=None, *, top_neurons: int = 32,
                 circuit: dpa.Circuit | bool | None = None, **kwargs: Any):
        top_neurons = self._check_arguments(result, model, tokenizer, top_neurons, circuit, kwargs)
        self.circuit: dpa.Circuit | None = None
        self.model, self.tokenizer, self.top_neurons = model, tokenizer, top_neurons
        spec = None if model is None else dpa.spec_for(model)
        # (routed experts, neurons per expert) from the model; without it the payload reads them off the result
        self._experts = (spec.n_experts, spec.d_expert) if spec is not None and spec.n_experts else None
        # Path weights that are neither the defaults nor a preset stay the result's own ("custom") through
        # every recompute (a new target, contrast or method) until another preset is chosen.
        # (the defaults on a mixture of experts fill in the balanced router and expert weights: not custom)
        defaults = (dpa.PathWeights(), dpa.PathWeights().for_model(True))
        self._custom = None if result.weights in defaults else result.weights
        self._predictions: list[live.Prediction] = []
        self._computed: tuple | None = None
        live_kwargs = {k: kwargs.pop(k) for k in LIVE_TRAITS if k in kwargs}
        selection = {k: kwargs.pop(k) for k in SELECTION_TRAITS if k in kwargs}
        graph_kwargs = {k: kwargs.pop(k) for k in GRAPH_TRAITS if k in kwargs}
        if self._custom is not None:
            kwargs.setdefault("weights_preset", "custom")
        super().__init__(
            target=result.target.token or "", contrast=result.target.contrast or "",
            _live=model is not None, _presets=[p for p in PRESETS if p != "custom" or self._custom is not None],
            **kwargs)
        if model is not None and result.target.kind != "vector" and (
                result.edge_scores is None or result.neuron_position_scores is None) and not any(
                t.contrast for t in result.target.terms or []):  # (a contrast of several tokens has none)
            result = live.recompute(model, tokenizer, result, target=live.same_target(result.target),
                                    contrast=live.same_contrast(result.target), weights=result.weights)
        self._show(result)
        self._computed = self._settings()
        if circuit is True:
            circuit = graph.compute(model, tokenizer, self.result)
        if circuit:
            self._graph_nodes = len(circuit.units)  # a recompute keeps as many units
            self._show_circuit(circuit)
            graph_kwargs.setdefault("view", "graph")
        for name, value in {**selection, **graph_kwargs}.items():  # validated against the data now on view
            setattr(self, name, value)
        self._add_selected_details()  # (the observer that sends them on selection is not on yet)
        if spec is not None:  # the baselines that handle this model's family
            self._methods = ["dpa", *live.baseline_methods(spec)]
        self.on_msg(self._on_message)
        self.observe(self._on_settings, names=list(LIVE_TRAITS[:4]))
        self.observe(self._on_method, names=["method"])
        self.observe(self._on_select, names=["selected_head", "selected_neuron", "selected_expert"])
        if live_kwargs:
            with self.hold_trait_notifications():
                for name, value in live_kwargs.items():
                    setattr(self, name, value)
            if self._error:
                raise dpa.InputError(self._error)

    # ------------------------------------------------------------------ state

    def _show(self, result: Attribution) -> None:
        """Make ``result`` the one on view: payload, static details, selection still valid."""
        self.result = result
        if self.model is not None and not self._predictions:  # the prompt and position never change
            self._predictions = live.predictions(self.model, self.tokenizer, list(result.token_ids),
                                                 result.target.position)
        preds = [(p.token, p.probability) for p in self._predictions] or None
        with self.hold_trait_notifications():
            self._data = payload.view_payload(result, top_neurons=self.top_neurons, predictions=preds,
                                              experts=self._experts)
            details = {}
            for layer, head in payload.top_units(result, self._static_heads(result)):  # each kind's own top
                details[payload.detail_key("head", layer, head)] = payload.head_detail(result, layer, head)
            for layer, neuron in payload.top_neurons(result, STATIC_DETAILS):
                details[payload.detail_key("neuron", layer, neuron)] = self._neuron_detail(layer, neuron)
            for layer, slot in payload.top_experts(result, STATIC_DETAILS):
                details[payload.detail_key("expert", layer, slot)] = payload.expert_detail(result, layer, slot)
            self._details = details
            self._verify = {}
        self._add_selected_details()

    def _show_circuit(self, circ: dpa.Circuit) -> None:
        """Make ``circ`` the graph on view; a selected node or edge it lacks is cleared."""
        self.circuit = circ
        with self.hold_trait_notifications():
            self._graph = graph.payload(circ)
            self._graph_verify = {}
            names = graph.labels(self._graph)
            if self.selected_node not in names:
                self.selected_node = ""
            if self.selected_edge is not None and not set(self.selected_edge) <= names:
                self.selected_edge = None

    def _static_heads(self, result: Attribution) -> int:
        n = len(result.tokens)  # (the budget shared by each kind of unit: a hybrid's, Falcon-H1's heads and scan units)
        per_kind = EDGE_BUDGET // (n * n * len(result.unit_kinds))
        return min(STATIC_DETAILS, max(1, per_kind)) if result.edge_scores is not None else STATIC_DETAILS

    def _neuron_detail(self, layer: int, neuron: int) -> dict:
        return payload.neuron_detail(self.result, layer, neuron,
                                     *live.neuron_vocab_or_reason(self.model, self.tokenizer, layer, neuron))

    def _add_selected_details(self) -> None:
        details = dict(self._details)
        if self.selected_head is not None:
            key = payload.detail_key("head", *self.selected_head)
            if key not in details:
                details[key] = payload.head_detail(self.result, *self.selected_head)
        if self.selected_neuron is not None:
            key = payload.detail_key("neuron", *self.selected_neuron)
            if key not in details:
                details[key] = self._neuron_detail(*self.selected_neuron)
        if self.selected_expert is not None and self.result.expert_scores is not None:
            key = payload.detail_key("expert", *self.selected_expert)
            if key not in details:
                details[key] = payload.expert_detail(self.result, *self.selected_expert)
        if len(details) != len(self._details):
            self._details = details

    def _settings(self) -> tuple:
        p = None if self.weights_preset in ("default", "custom") else round(self.weights_p, 6)
        return (self.target, self.contrast, self.weights_preset, p)

    # ------------------------------------------------------------------ validation

    @t.validate("selected_head")
    def _valid_head(self, proposal):
        value = self._in_range(proposal["value"], self._data.get("n_layers", 0), self._data.get("n_heads", 0), "head")
        return self._exists(value, "head")

    @t.validate("selected_neuron")
    def _valid_neuron(self, proposal):
        value = self._in_range(proposal["value"], self._data.get("n_layers", 0), self._data.get("d_mlp", 0), "neuron")
        return self._exists(value, "neuron")

    def _exists(self, value, what: str):
        """A unit of a block its layer has (Nemotron-H's layers hold one block; a dense layer of a mixed layout has
        no experts and fewer neurons than the experts' row): known from the model, or, on a static page, from the
        layer's kind (a head) and the dense layers (an expert)."""
        if value is None:
            return value
        if self.model is not None:
            missing = dpa.spec_for(self.model).lacks(what, value[0], value[1])
        else:
            kinds, dense = self._data.get("layer_kinds") or [], self._data.get("dense_layers") or []
            width = self._data.get("d_dense")
            missing = (lacking(what, value[0], dense=what == "expert")
                       if what == "head" and value[0] < len(kinds) and kinds[value[0]] == "mlp"
                       or what == "expert" and value[0] in dense else
                       narrower(value[0], width, value[1]) if what == "neuron" and value[0] in dense
                       and value[1] >= width else None)
        if missing:
            raise TraitValueError(f"selected_{what} {list(value)}: {missing}")
        return value

    @t.validate("selected_expert")
    def _valid_expert(self, proposal):
        value, slots = proposal["value"], len(self._data.get("expert_names", []))
        if value is not None and self._data and not slots:
            raise TraitValueError(f"selected_expert {list(value)}: this model has no mixture of experts")
        return self._exists(self._in_range(value, self._data.get("n_layers", 0), slots, "expert"), "expert")

    @staticmethod
    def _in_range(value, n_layers: int, width: int, what: str):
        if value is not None and n_layers and not (0 <= value[0] < n_layers and 0 <= value[1] < width):
            raise TraitValueError(f"selected_{what} {list(value)} is outside [0, {n_layers}) x [0, {width})")
        return value

    @t.validate("selected_token")
    def _valid_token(self, proposal):
        p, n = proposal["value"], len(self._data.get("tokens", []))
        if p is not None and n and not 0 <= p < n:
            raise TraitValueError(f"selected_token {p} is outside the prompt's {n} positions")
        return p

    @t.validate("view")
    def _valid_view(self, proposal):
        value = proposal["value"]
        if value not in VIEWS:
            raise TraitValueError(f"view must be one of {', '.join(VIEWS)}, got {value!r}")
        if value == "graph" and not self._graph:
            raise TraitValueError("view 'graph' needs a circuit graph: pass circuit= to CircuitWidget (a dpa.Circuit, "
                                  "or True to compute one)")
        return value

    def _graph_label(self, name: str, label: str) -> None:
        if not self._graph:
            raise TraitValueError(f"{name}: there is no circuit graph (pass circuit= to CircuitWidget)")
        if label not in graph.labels(self._graph):
            some = [n["label"] for n in self._graph["nodes"] if n["kind"] in ("head", "neuron", "expert")][:6]
            raise TraitValueError(f"{name}: {label!r} is not a node of the circuit graph (its units include "
                                  f"{', '.join(some)}; tokens are tok0, tok1, ..., and 'target')")

    @t.validate("selected_node")
    def _valid_node(self, proposal):
        if proposal["value"]:
            self._graph_label("selected_node", proposal["value"])
        return proposal["value"]

    @t.validate("selected_edge")
    def _valid_edge(self, proposal):
        edge = proposal["value"]
        if edge is not None:
            for label in edge:
                self._graph_label("selected_edge", label)
            if edge[0] == edge[1]:
                raise TraitValueError(f"selected_edge {list(edge)}: an edge joins two different nodes")
        return edge

    @t.validate("graph_threshold")
    def _valid_threshold(self, proposal):
        value = proposal["value"]
        if not (math.isfinite(value) and 0 <= value <= 1):
            raise TraitValueError(f"graph_threshold must lie in [0, 1], got {value}")
        return value

    @t.validate("weights_preset")
    def _valid_preset(self, proposal):
        allowed = [p for p in PRESETS if p != "custom" or getattr(self, "_custom", None) is not None]
        if proposal["value"] not in allowed:
            raise TraitValueError(f"weights_preset must be one of {', '.join(allowed)}, got {proposal['value']!r}"
                               + (" ('custom' is for a result computed with its own path weights)"
                                  if proposal["value"] == "custom" else ""))
        return proposal["value"]

    @t.validate("weights_p")
    def _valid_p(self, proposal):
        p = proposal["value"]
        if not (math.isfinite(p) and 0 <= p <= 1):
            raise TraitValueError(f"weights_p must lie in [0, 1], got {p}")
        return p

    @t.validate("top_k")
    def _valid_k(self, proposal):
        if proposal["value"] < 1:
            raise TraitValueError(f"top_k must be at least 1, got {proposal['value']}")
        return proposal["value"]

    @t.validate("method")
    def _valid_method(self, proposal):
        methods = ["dpa", *live.baseline_methods(None if self.model is None else dpa.spec_for(self.model))]
        if proposal["value"] not in methods:
            raise TraitValueError(f"method must be one of {', '.join(methods)}, got {proposal['value']!r}")
        if proposal["value"] != "dpa" and self.result.target.kind == "vector":
            raise TraitValueError("method: baselines attribute a token and cannot be compared with this vector target")
        return proposal["value"]

    # ------------------------------------------------------------------ kernel-side work

    def _busy_while(self, work) -> bool:
        """Run ``work()`` with the busy flag up; show a dpa or value error in the view. True on success."""
        self._busy = True
        try:
            work()
            self._error = ""
            return True
        except Exception as e:  # noqa: BLE001  shown in the view, never a stale picture with no word
            self._error = f"{type(e).__name__}: {e}"
            return False
        finally:
            self._busy = False

    def _on_settings(self, _change=None) -> None:
        if self._settings() == self._computed:
            return
        if self.model is None:
            self._error = "changing the target or weights needs the model and tokenizer"
            return

        def work():
            weights = self._custom if self.weights_preset == "custom" else live.weights_for(self.weights_preset,
                                                                                            self.weights_p)
            target = self._resolve(self.target)
            contrast = self._resolve(self.contrast)
            result = live.recompute(self.model, self.tokenizer, self.result, target=target, contrast=contrast,
                                    weights=weights)
            circ = None if self.circuit is None else graph.compute(self.model, self.tokenizer, result,
                                                                   nodes=self._graph_nodes,
                                                                   positions=self.circuit.positions)
            self._show(result)
            if circ is not None:
                self._show_circuit(circ)
            if self.method != "dpa":
                self._comparison = live.compare(self.model, self.tokenizer, result, self.method)

        self._computed = self._settings()  # also on failure: retrying the same inputs would fail the same way
        self._busy_while(work)

    def _resolve(self, token: str) -> str | int | None:
        """'' -> None; a shown prediction -> its id (no re-tokenising); else the string itself."""
        if token == "":
            return None
        for p in self._predictions:
            if p.token == token:
                return p.token_id
        if token == self.result.target.token:
            return live.same_target(self.result.target)
        if token == self.result.target.contrast:
            return live.same_contrast(self.result.target)
        if self.tokenizer is None and token.strip().isdigit():  # no tokenizer: tokens are shown as ids
            return int(token)
        return token

    def _on_method(self, change) -> None:
        if change["new"] == "dpa":
            self._comparison = {}
            self._error = ""
            return
        if self.model is None:
            self._error = "baselines need the model and tokenizer"
            return
        self._busy_while(lambda: setattr(self, "_comparison",
                                         live.compare(self.model, self.tokenizer, self.result, change["new"])))

    def _on_select(self, _change) -> None:
        self._add_selected_details()

    def _on_message(self, _widget, content, _buffers) -> None:
        """The view's custom messages: "hello" (is a kernel there?), "verify" and "verify_edge" (the graph's).

        A view treats the widget as live only once this kernel answers its hello: saved widget state
        (a book page, a reopened notebook) keeps ``_live`` true with no kernel behind it, and there
        nothing answers, so the view keeps the controls that need a kernel off and says why.
        """
        if isinstance(content, dict) and content.get("action") == "hello":
            self.send({"action": "hello", "live": self.model is not None})
        elif isinstance(content, dict) and content.get("action") == "verify":
            self._busy_while(lambda: self.verify(content.get("mode", "disrupt"), content.get("units", "selection")))
        elif isinstance(content, dict) and content.get("action") == "verify_edge":
            self._busy_while(lambda: self.verify_edge(content.get("edge")))

    def verify(self, mode: str = "disrupt", units: str = "selection") -> dict[str, Any]:
        """Ablate units and measure the target probability (also shown in the view).

        mode: "disrupt" ablates the units, "recover" ablates everything else.
        units: "selection" (the selected head, neuron or token; not an expert), "top_tokens" or
        "top_components" (the ``top_k`` highest-scoring ones by DPA).
        """
        if self.model is None:
            raise dpa.InputError("verification runs the model: pass model and tokenizer to the widget")
        if (units == "selection" and self.selected_expert is not None and self.selected_head is None
                and self.selected_neuron is None and self.selected_token is None):
            raise dpa.InputError("verification cannot ablate a whole expert yet: select a head, neuron or token "
                                 "(one of the expert's neurons, say)")
        out = verify.run(self.model, self.result, mode=mode, units=units, k=self.top_k,
                         head=self.selected_head, neuron=self.selected_neuron, token=self.selected_token)
        self._verify = out
        return out

    def verify_edge(self, edge=None) -> dict[str, Any]:
        """Path patching on one edge of the circuit graph (``Circuit.verify``; also shown in the view).

        edge: (source, destination) as labels or node indices; the selected edge (``selected_edge``) by default.
        Returns what ``Circuit.verify`` does (the edge, the measured change of the destination's score and of the
        target, their ratio to the prediction), non-finite numbers as None; kept in ``_graph_verify`` by
        "source->destination" for the view.
        """
        if self.circuit is None:
            raise dpa.InputError("there is no circuit graph: pass circuit= to CircuitWidget")
        if self.model is None:
            raise dpa.InputError("verifying an edge runs the model: pass model and tokenizer to the widget")
        edge = self.selected_edge if edge is None else edge
        if edge is None:
            raise dpa.InputError("no edge selected: click an edge of the graph, or pass (source, destination)")
        out = graph.verify_edge(self.circuit, self.model, self.tokenizer, edge)
        self._graph_verify = {**self._graph_verify, graph.edge_key(out["source"], out["destination"]): out}
        return out
