"""Circuit graphs: the direct effect of every kept unit on every other, from one DPA call (book: circuits-as-graphs;
book: circuits-as-graphs).

A *unit* is a head at a query position or a neuron at a position (or a component over all positions,
``positions=False``); ``out_u`` is what it writes into the residual stream (a head's slice of the o_proj input
through o_proj, a neuron's activation times its down-projection column; through any post-norm, frozen). For a
unit v with DPA score S_v = z_v . G_v (z_v its slice of the o_proj or down input, G_v the gradient the DPA
backward brought there), g_v is the gradient of S_v, G_v held fixed, with respect to the residual stream at the
input of v's block, through that block only, in the linearised model with its mu-weighted branches. Then

    E(u -> v) = out_u . g_v        E(token i -> v) = x_i . g_v[i]        E(u -> target) = out_u . t^(L)

g_v comes from running v's block again on its recorded input (one batch row per unit, the model's own modules,
linearised as in ``dpa.attribute``) and one backward from G_v: the cost is the DPA call plus one block per kept
unit. Two identities make it testable: every score is the sum of the unit's outgoing direct effects (out-flow),
and a unit's incoming effects, with its tokens' and biases', add up to its score under conservative weights
(in-flow; otherwise the difference is the control paths' part, ``in_gap``). Units left out of a graph go to one
"rest" node per kept node, so every kept node's in-flow still adds up.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import backward
from . import request as requests
from .checks import check_bool
from .errors import InputError, ModelStateError
from .families import ModelSpec
from .request import Prompt
from .result import TargetInfo
from .weights import PathWeights
from .circuit_graph import BLOCKS, CPU, LETTER, MAX_UNITS, GraphReadout, Node, assemble  # noqa: F401 (re-exported)


@dataclass
class Circuit:
    """A circuit graph: ``nodes`` (tokens, units, the target, then one rest node per unit and the target),
    ``edges[source, destination]`` the direct effects, ``scores[node]`` each node's DPA score (the target's: the
    attributed value; a rest node's: the in-flow it carries), ``in_gap[node]`` the part of the score its
    in-flow does not explain (the control paths; 0 under conservative weights), ``bias_in[node]`` the in-flow
    no token or unit owns (biases, learned positions), ``out_rest[node]`` the out-flow to units left out,
    ``in_positions[node, pos]`` its in-flow by the position it reads (a head's: where its keys and values read)."""

    nodes: list[Node]
    edges: Tensor  # [node node]
    scores: Tensor  # [node]
    in_gap: Tensor  # [node]
    bias_in: Tensor  # [node]
    out_rest: Tensor  # [node]
    in_positions: Tensor  # [node pos]: each node's in-flow by the residual position it is read at
    tokens: list[str]
    token_ids: list[int]
    target: TargetInfo
    target_logit: float
    weights: PathWeights
    positions: bool
    model_name: str = ""
    _writes: Tensor | None = field(default=None, repr=False)  # [unit pos d_model]: out_u of the units
    _embeddings: Tensor | None = field(default=None, repr=False)  # [pos d_model]: the tokens' writes
    _reads: dict = field(default_factory=dict, repr=False)  # unit node -> G_v [pos width] at its tap
    _direction: Tensor | None = field(default=None, repr=False)  # the target direction u [d_model]
    _spec: ModelSpec | None = field(default=None, repr=False)
    _model: ModelIdentity | None = field(default=None, repr=False)  # what verify and patch_read must be given

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, node: int | str | Node) -> int:
        """A node's index from its label ("L3.H2@5", "tok5", "target", "rest:L3.H2@5"), itself or its index."""
        if isinstance(node, bool) or not isinstance(node, (int, str, Node)):
            raise InputError(f"a node is an index, a label or a Node, got {type(node).__name__}")
        if isinstance(node, int):
            if not -len(self.nodes) <= node < len(self.nodes):
                raise InputError(f"node index {node} out of range for {len(self.nodes)} nodes")
            return node % len(self.nodes)
        label = node.label if isinstance(node, Node) else node
        for i, n in enumerate(self.nodes):
            if n.label == label:
                return i
        near = [n.label for n in self.nodes if n.kind not in ("rest",)][:12]
        raise InputError(f"no node {label!r} in this circuit; nodes include {near}")

    def score(self, node) -> float:
        return float(self.scores[self.index(node)])

    def edge(self, source, destination) -> float:
        return float(self.edges[self.index(source), self.index(destination)])

    @property
    def verifiable(self) -> bool:
        """Whether ``verify`` and ``patch_read`` can run: the circuit holds the writes and gradients they need."""
        return self._writes is not None

    @property
    def units(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.kind in LETTER]

    @property
    def target_index(self) -> int:
        return next(i for i, n in enumerate(self.nodes) if n.kind == "target")

    def influence(self) -> Tensor:
        """Each node's share of the target through the graph [node]: the target's 1, split among its sources in
        proportion to |edge| (over every source, rests and tokens included), then down again, node by node."""
        return influence(self.edges, self.target_index)

    def prune(self, threshold: float = 0.8) -> Circuit:
        """The graph with the fewest units whose influence on the target (``influence``) adds up to ``threshold``
        of all units' (tokens and the target always stay); what the dropped units sent goes to the rest nodes."""
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise InputError(f"threshold must be a number in [0, 1], got {threshold!r}")
        keep = set(prune_units(self.influence(), self.units, float(threshold)))
        return self._subgraph([i for i in self.units if i in keep])

    def _subgraph(self, units: list[int]) -> Circuit:
        """This graph keeping only ``units`` (indices of unit nodes): the others' effects join the rests."""
        nodes = self.nodes
        tokens = [i for i, n in enumerate(nodes) if n.kind == "token"]
        t = self.target_index
        dropped = [i for i in self.units if i not in set(units)]
        rest_of = {n.of: i for i, n in enumerate(nodes) if n.kind == "rest"}
        dests = units + [t]
        keep = tokens + units + [t]
        rest = torch.stack([self.edges[rest_of[d], d] + self.edges[dropped, d].sum() for d in dests])
        out_rest = self.out_rest.clone()
        out_rest[keep] = self.out_rest[keep] + self.edges[keep][:, dropped].sum(1)
        new = [nodes[i] for i in keep]
        return assemble(self, new, self.edges[keep][:, keep], self.scores[keep], rest, self.in_gap[keep],
                         self.bias_in[keep], out_rest[keep], keep)

    def __repr__(self) -> str:
        """A few lines: the target, the graph's size and its strongest edges (``summary()``: the report)."""
        from .report import circuit_repr

        return circuit_repr(self)

    def _repr_html_(self) -> str:
        from .report import circuit_html_fragment

        return circuit_html_fragment(self)

    def summary(self, top: int = 10) -> str:
        """The report ``dpa circuit`` prints: the target, the graph and its ``top`` strongest direct effects."""
        from .report import circuit_report

        return circuit_report(self, top=top)

    def to_json(self) -> dict[str, Any]:
        """Everything the widget and the CLI's page draw: nodes with their scores, gaps and influence (and, for a
        unit or the target, ``in_positions``: its in-flow by the position read, the non-zero entries as
        [position, value]), and the non-zero edges as [source, destination, effect]."""
        infl = self.influence()
        nodes = [dict(id=i, kind=n.kind, label=n.label, layer=n.layer, index=n.index, position=n.position,
                      of=n.of, score=_num(self.scores[i]), in_gap=_num(self.in_gap[i]), bias_in=_num(self.bias_in[i]),
                      out_rest=_num(self.out_rest[i]), influence=_num(infl[i]),
                      **({"in_positions": _sparse(self.in_positions[i])} if n.kind in LETTER or
                         n.kind == "target" else {})) for i, n in enumerate(self.nodes)]
        nz = self.edges.nonzero().tolist()
        edges = [[s, d, _num(self.edges[s, d])] for s, d in nz]
        return dict(kind="circuit", model=self.model_name, tokens=self.tokens, token_ids=self.token_ids,
                    target=_target_json(self.target), target_logit=self.target_logit,
                    weights=self.weights.to_dict(), positions=self.positions, nodes=nodes, edges=edges)

    def save_json(self, path) -> None:
        """Write ``to_json()`` to ``path`` (atomically: a full disk leaves an existing file whole; ``-``, a device
        or a FIFO written straight; see ``dpa.files``); a failure is a ``dpa.OutputError`` naming the path."""
        from .files import write_text

        write_text(path, json.dumps(self.to_json()))

    def verify(self, model: nn.Module, tokenizer, edge) -> dict[str, float]:
        """Path patching on the real model: remove out_u from the residual stream *as read by v's block only*
        and measure the change of S_v = z_v . G_v (G_v held at its DPA value) and of the target through v (v's
        write replaced by its patched one, everything else clean). ``edge`` is (source, destination), each an
        index, a label or a Node. Returns the edge, both changes and their ratios to it."""
        from .verify_circuit import path_patch

        return path_patch(self, model, tokenizer, edge)

    def patch_read(self, model: nn.Module, tokenizer, node, position: int, corrupt) -> dict[str, float]:
        """Path patching from a position: ``node``'s block reads the residual stream at ``position`` from a run
        on ``corrupt`` (the prompt with a token swapped; same length), all else clean. Returns S_v clean and
        patched, the change, and the node's DPA in-flow from that position (``in_positions``) to compare."""
        from .verify_circuit import patch_read

        return patch_read(self, model, tokenizer, node, position, corrupt)


class ModelIdentity:
    """The model a circuit was computed on, with the weights it had: the object itself (a weak reference: a copy,
    even with equal weights, is another model) and, per parameter, its name, shape, dtype, device, storage and
    version counter (an in-place edit, a replaced parameter, ``model.to`` all change one of them), and a few of its
    values spread over it (an edit through ``.data``, which the version counter does not count, where it lands on
    one of them). Reading it costs one small gather per parameter."""

    SAMPLES = 16

    def __init__(self, model: nn.Module):
        self.ref = weakref.ref(model)
        self.params = self._read(model)

    @classmethod
    def _read(cls, model: nn.Module) -> list[tuple]:
        from .files import module_settings, sampled_bits

        tensors = [*model.named_parameters(), *(("buffer " + n, b) for n, b in model.named_buffers())]
        out = [(name, tuple(p.shape), p.dtype, p.device, p.data_ptr(), p._version, sampled_bits(p, cls.SAMPLES))
               for name, p in tensors]
        settings = [(f"setting {name}", v) for name, v in module_settings(model)]  # a norm's eps, an attention's scaling
        config = getattr(model, "config", None)
        return out + settings + [("config", repr(sorted(vars(config).items())) if config is not None else None)]

    def __getstate__(self) -> dict:  # a pickled circuit keeps its weights' record, not the object: unpickled (in
        return {"params": self.params}  # another process, say) it is verified on no model

    def __setstate__(self, state: dict) -> None:
        self.params, self.ref = state["params"], lambda: None

    def check(self, model: nn.Module) -> None:
        """Refuse ``model`` unless it is the model the circuit was computed on, its weights unchanged since."""
        if self.ref() is not model:
            raise InputError("model: this circuit was computed on another model (an object with the same sizes, or a "
                             "copy; an unpickled circuit keeps no model); verify it on the model dpa.circuit was "
                             "given, or compute the circuit again on this one")
        now = self._read(model)
        if [p[0] for p in now] != [p[0] for p in self.params]:
            raise ModelStateError("model: its parameters, buffers or module settings changed since the circuit was "
                                  "computed (added, removed or renamed); compute the circuit again")
        for was, new in zip(self.params, now):
            if was != new:
                how = ("value" if len(was) == 2 else "shape" if was[1] != new[1] else "dtype" if was[2] != new[2]
                       else "device" if was[3] != new[3] else "storage" if was[4] != new[4] else "values")
                raise ModelStateError(f"model: {new[0]} (its {how}) changed since the circuit was computed (edited in "
                                      "place, replaced or moved): the circuit's edges are not this model's; compute "
                                      "the circuit again")


def _sparse(row: Tensor) -> list[list]:
    """The non-zero entries of a row as [index, value] (a long prompt's in-flow by position is mostly zeros)."""
    return [[p, _num(row[p])] for p in row.nonzero().flatten().tolist()]


def _num(x) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None


def _target_json(t: TargetInfo) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(t)


def influence(edges: Tensor, target: int) -> Tensor:
    """infl[target] = 1, infl[s] = sum_d |E[s, d]| / sum_s' |E[s', d]| * infl[d]: a node's share of the target
    through every path of the graph (the graph is acyclic: len(edges) rounds reach a fixed point)."""
    a = edges.abs().double()
    total = a.sum(0, keepdim=True)
    a = torch.where(total > 0, a / total.clamp_min(1e-300), torch.zeros_like(a))
    e = torch.zeros(len(edges), dtype=torch.float64)
    e[target] = 1
    infl = e.clone()
    for _ in range(len(edges)):
        nxt = e + a @ infl
        if torch.equal(nxt, infl):
            break
        infl = nxt
    return infl


def prune_units(infl: Tensor, units: list[int], threshold: float) -> list[int]:
    """The fewest ``units`` whose influence adds up to ``threshold`` of theirs in total (ties: the lower index);
    a threshold of 1 keeps every unit, those of no influence too (nothing is pruned)."""
    if threshold >= 1:
        return sorted(units)
    if not units:
        return []
    values = infl[units]
    total = float(values.sum())
    if total <= 0:
        return []
    order = sorted(range(len(units)), key=lambda k: (-float(values[k]), units[k]))
    kept, running = [], 0.0
    for k in order:
        if running >= threshold * total * (1 - 1e-12):
            break
        kept.append(units[k])
        running += float(values[k])
    return sorted(kept)


def circuit(model: nn.Module, tokenizer, prompt: Prompt, target=None, *, contrast=None,
            kind: Literal["logit", "logprob"] = "logit", position: int | None = None,
            weights: PathWeights | None = None, nodes: int | None = 64, positions: bool = True,
            multi_token: Literal["error", "first"] = "error") -> Circuit:
    """The circuit graph of ``target`` at the end of ``prompt``: the ``nodes`` units (heads and neurons, at a
    position, or per component with ``positions=False``) with the largest |DPA score| (``None``: every unit),
    the tokens and the target, and every direct effect between them. One DPA call (the same request step and
    instrumented model as ``dpa.attribute``) plus one block per kept unit (the book: *Circuits as graphs*).

    model, tokenizer, prompt (one prompt), target, contrast, kind ("logit" or "logprob"), position, weights and
    multi_token ("error" or "first"): as in ``dpa.attribute``.
    nodes: how many heads and neurons to keep, by |DPA score| (default 64; None: every unit).
    positions: True (default) keeps a unit at a position (a head at one query position, a neuron at one
        position); False one node per head or neuron, summed over positions.

    Returns a ``Circuit``: ``edges``, ``scores``, ``prune``, ``verify`` (path patching on the model),
    ``to_json`` and ``save_json``."""
    positions = check_bool("positions", positions)
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise InputError(f"nodes must be a positive int (how many units to keep) or None (all), got {nodes!r}")
    req = requests.build(model, tokenizer, prompt, target, contrast=contrast, kind=kind, position=position,
                         weights=weights, multi_token=multi_token, batch=False)
    spec = req.spec
    identity = ModelIdentity(model)
    done = backward.run(model, req, {"graph": GraphReadout(nodes, positions, spec.n_experts > 0 and not spec.d_dense)})
    info = backward.attribution(model, req, done, 0)
    g = done.out["graph"]
    return Circuit(nodes=g["nodes"], edges=g["edges"], scores=g["scores"], in_gap=g["in_gap"], bias_in=g["bias_in"],
                   out_rest=g["out_rest"], in_positions=g["in_positions"], tokens=info.tokens,
                   token_ids=info.token_ids, target=info.target, target_logit=info.target_logit, weights=req.weights,
                   positions=positions, model_name=info.model_name, _writes=g["writes"], _embeddings=g["embeddings"],
                   _reads=g["reads"], _direction=g["direction"], _spec=spec, _model=identity)
