"""MIB's computational graph of a decoder model (book: circuit-discovery).

Writers (MIB's "forward" nodes): the input embedding, every attention head's output (its slice of the o_proj
input through o_proj, and through a post-norm with its scale frozen at the run's value), every MLP's output.
Readers ("backward" nodes): every head's query, key and value input (a grouped KV head is read by each of its
query heads separately), every MLP's input, the logits. An edge joins a writer to every reader above it;
positions are summed (an edge is not position-specific). Names follow the EAP-IG ``Graph`` so that its JSON can
be read by MIB's tools: ``input``, ``a3.h1``, ``m3``, ``logits``; an edge is ``a0.h1->a2.h3<q>``.

Indexing. Writer 0 is the input; layer l's heads are 1 + l (H + 1) + h, its MLP 1 + l (H + 1) + H. Layer l's
readers are l (3H + 1) + c H + h for c = 0, 1, 2 (q, k, v) and l (3H + 1) + 3H for its MLP; the logits are last.
``exists[w, r]``: whether the edge w -> r is in the graph. A parallel block (GPT-NeoX's parallel residual) has
no edge from a layer's heads to its own MLP. A model whose layers have no MLP (Mamba-2's) keeps the MLP nodes'
indices, without an edge; so does a layer of one block (Nemotron-H's) for the nodes of the block it lacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

QKV = "qkv"


@dataclass(frozen=True)
class Graph:
    """The graph's shape: ``n_layers`` layers of ``n_heads`` heads and one MLP each."""

    n_layers: int
    n_heads: int
    parallel: bool = False
    mlps: bool = True  # False: the layers have no MLP (Mamba-2's): its nodes keep their indices, with no edges
    absent: frozenset[tuple[int, int]] = frozenset()  # (layer, block) of a block a layer lacks where others have it
    # (Nemotron-H's: one block per layer, 0 its token mixer, 1 its MLP): its nodes keep their indices, with no edges

    @classmethod
    def of(cls, spec) -> Graph:
        """The graph of a checked model (``dpa.request.check_model``)."""
        mlps = bool(spec.d_mlp or spec.n_experts)
        absent = frozenset({(i, 0) for i in range(spec.n_layers) if not spec.mixes(i)}
                           | {(i, 1) for i in range(spec.n_layers) if mlps and not spec.has_mlp(i)}
                           ) if spec.parts.mlp_layers is not None else frozenset()  # (layers of one block)
        return cls(spec.n_layers, spec.row_width, bool(spec.parallel), mlps, absent)  # (a layer's units: its heads,
        # then the units of a mixer beside attention, Falcon-H1's SSM heads)

    # --- sizes and indices ---
    @property
    def n_writers(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_readers(self) -> int:
        return self.n_layers * (3 * self.n_heads + 1) + 1

    def head(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def reads(self, layer: int, c: int, head: int) -> int:
        """The reader index of head ``head``'s query (c = 0), key (1) or value (2) input."""
        return layer * (3 * self.n_heads + 1) + c * self.n_heads + head

    def mlp_reader(self, layer: int) -> int:
        return layer * (3 * self.n_heads + 1) + 3 * self.n_heads

    @property
    def logits(self) -> int:
        return self.n_readers - 1

    def attention_readers(self, layer: int) -> slice:
        """Layer ``layer``'s 3H attention readers, q of every head, then k, then v."""
        start = layer * (3 * self.n_heads + 1)
        return slice(start, start + 3 * self.n_heads)

    def below(self, layer: int, block: int) -> int:
        """How many writers lie below layer ``layer``'s attention (block 0) or MLP (1): every writer before them
        (a parallel MLP reads what its layer's attention reads)."""
        n = 1 + layer * (self.n_heads + 1)
        return n + self.n_heads if block == 1 and not self.parallel else n

    # --- the edges ---
    @cached_property
    def exists(self) -> Tensor:
        """[writer reader] bool: the edges of the graph."""
        out = torch.zeros(self.n_writers, self.n_readers, dtype=torch.bool)
        for layer in range(self.n_layers):
            out[:self.below(layer, 0), self.attention_readers(layer)] = True
            out[:self.below(layer, 1), self.mlp_reader(layer)] = self.mlps
        out[:, self.logits] = True
        if not self.mlps:  # no MLP writes either
            out[[self.mlp(layer) for layer in range(self.n_layers)]] = False
        for layer, block in self.absent:  # a block the layer lacks: neither read nor written
            writers = [self.head(layer, h) for h in range(self.n_heads)] if block == 0 else [self.mlp(layer)]
            out[writers] = False
            out[:, self.attention_readers(layer) if block == 0 else self.mlp_reader(layer)] = False
        return out

    @property
    def n_edges(self) -> int:
        return int(self.exists.sum())

    @cached_property
    def owner(self) -> Tensor:
        """[reader] long: the writer whose input each reader is (-1 for the logits)."""
        out = torch.full((self.n_readers,), -1, dtype=torch.long)
        for layer in range(self.n_layers):
            for c in range(3):
                for h in range(self.n_heads):
                    out[self.reads(layer, c, h)] = self.head(layer, h)
            out[self.mlp_reader(layer)] = self.mlp(layer)
        return out

    # --- names (the EAP-IG Graph's) ---
    @cached_property
    def writer_names(self) -> list[str]:
        out = ["input"]
        for layer in range(self.n_layers):
            out += [f"a{layer}.h{h}" for h in range(self.n_heads)] + [f"m{layer}"]
        return out

    @cached_property
    def reader_names(self) -> list[str]:
        out = []
        for layer in range(self.n_layers):
            out += [f"a{layer}.h{h}<{QKV[c]}>" for c in range(3) for h in range(self.n_heads)] + [f"m{layer}"]
        return out + ["logits"]

    def edge_name(self, w: int, r: int) -> str:
        return f"{self.writer_names[w]}->{self.reader_names[r]}"

    # --- circuits ---
    def top(self, scores: Tensor, n: int, absolute: bool) -> Tensor:
        """The circuit of the ``n`` best-scored edges [writer reader] bool, pruned (``prune``): by score
        (``absolute=False``, MIB's CPR) or by |score| (MIB's CMD). Ties keep the edges' order."""
        if scores.shape != self.exists.shape:
            raise ValueError(f"edge scores must be [writers readers] = {tuple(self.exists.shape)}, "
                             f"got {tuple(scores.shape)}")
        flat = scores.detach().to(torch.float64).flatten()
        key = flat.abs() if absolute else flat
        edges = self.exists.flatten().nonzero().flatten()
        if not bool(torch.isfinite(key[edges]).all()):
            raise ValueError("edge scores must be finite")
        order = edges[torch.argsort(key[edges], descending=True, stable=True)]
        kept = torch.zeros_like(flat, dtype=torch.bool)
        kept[order[:max(0, int(n))]] = True
        return self.prune(kept.view_as(scores))

    def prune(self, in_graph: Tensor) -> Tensor:
        """Drop the edges of a circuit that lie on no path from the input to the logits, as MIB does before
        it evaluates (EAP-IG's ``Graph.prune``): a writer stays while it has an edge out and (the input
        always) an edge into one of its readers; an edge stays while its writer stays and its reader's
        owner stays (the logits always). Repeated until nothing changes."""
        kept = in_graph & self.exists
        owner = self.owner
        readers_of = torch.zeros(self.n_writers, self.n_readers, dtype=torch.bool)
        has_owner = owner >= 0
        readers_of[owner[has_owner], has_owner.nonzero().flatten()] = True
        while True:
            out_any = kept.any(1)
            in_any = (readers_of & kept.any(0)[None]).any(1)
            in_any[0] = True
            nodes = out_any & in_any
            reader_ok = torch.ones(self.n_readers, dtype=torch.bool)
            reader_ok[has_owner] = nodes[owner[has_owner]]
            new = kept & nodes[:, None] & reader_ok[None]
            if torch.equal(new, kept):
                return kept
            kept = new

    def excluded(self, in_graph: Tensor) -> Tensor:
        """[writer reader] bool: the graph's edges a circuit leaves out (their readers see the counterfactual)."""
        return self.exists & ~in_graph

    # --- the EAP-IG Graph JSON, what MIB's leaderboard and tools read ---
    def to_json(self, scores: Tensor, in_graph: Tensor | None = None, d_model: int = 0) -> dict:
        """The EAP-IG ``Graph.to_json`` layout: ``cfg`` (n_layers, n_heads, parallel_attn_mlp, d_model), ``nodes``
        (name -> in_graph), ``edges`` ("a0.h1->a2.h3<q>" -> score, in_graph). ``in_graph`` [writer reader]: the
        circuit (default: every edge, as a scores-only submission is read)."""
        kept = self.exists if in_graph is None else (in_graph & self.exists)
        nodes_in = kept.any(1)
        nodes_in[0] = True
        nodes = {name: {"in_graph": bool(nodes_in[w])} for w, name in enumerate(self.writer_names)}
        nodes["logits"] = {"in_graph": True}
        where = self.exists.nonzero()
        ws, rs = where[:, 0], where[:, 1]
        values = scores.detach().to(torch.float64).cpu()[ws, rs].tolist()
        inside = kept.cpu()[ws, rs].tolist()
        edges = {self.edge_name(w, r): {"score": v, "in_graph": k}
                 for w, r, v, k in zip(ws.tolist(), rs.tolist(), values, inside)}
        cfg = {"n_layers": self.n_layers, "n_heads": self.n_heads, "parallel_attn_mlp": self.parallel,
               "d_model": int(d_model)}
        return {"cfg": cfg, "nodes": nodes, "edges": edges}

    @classmethod
    def from_json(cls, data: dict) -> tuple[Graph, Tensor, Tensor]:
        """(graph, scores [writer reader], in_graph) from the EAP-IG JSON layout (``to_json``)."""
        import math

        from ..errors import InputError

        cfg = data.get("cfg") if isinstance(data, dict) else None
        edges = data.get("edges") if isinstance(data, dict) else None
        sizes = [cfg.get(k) if isinstance(cfg, dict) else None for k in ("n_layers", "n_heads")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes) or not isinstance(
                edges, dict) or not isinstance(cfg.get("parallel_attn_mlp", False), bool):
            raise InputError("not an EAP-IG graph JSON: an object with cfg (n_layers and n_heads, positive ints; "
                             "parallel_attn_mlp, a bool) and edges (an object), as EAP-IG's Graph.to_json writes")
        graph = cls(sizes[0], sizes[1], cfg.get("parallel_attn_mlp", False))
        w_index = {n: i for i, n in enumerate(graph.writer_names)}
        r_index = {n: i for i, n in enumerate(graph.reader_names)}
        scores = torch.zeros(graph.exists.shape, dtype=torch.float64)
        kept = torch.zeros(graph.exists.shape, dtype=torch.bool)
        for name, info in edges.items():
            source, _, target = name.partition("->")
            if source not in w_index or target not in r_index or not graph.exists[w_index[source], r_index[target]]:
                raise InputError(f"edge {name!r} is not an edge of a graph with {graph.n_layers} layers of "
                                 f"{graph.n_heads} heads")
            score = info.get("score") if isinstance(info, dict) else None
            in_graph = info.get("in_graph", True) if isinstance(info, dict) else None
            if (not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score)
                    or not isinstance(in_graph, bool)):
                raise InputError(f"edge {name!r}: {info!r} is not an edge's entry (an object with a finite number "
                                 "score and a bool in_graph)")
            scores[w_index[source], r_index[target]] = float(score)
            kept[w_index[source], r_index[target]] = in_graph
        return graph, scores, kept
