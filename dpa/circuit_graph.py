"""The circuit graph built inside one DPA run: its nodes, the kept units' pull-backs (each block run again, once
per batch of units), their writes, and every direct effect among tokens, units and the target (book: circuits as
graphs). ``dpa.circuit`` reads it out of ``backward.run`` with ``GraphReadout``; ``verify_circuit`` runs a unit's
block again with ``pullback`` to check an edge by path patching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from . import backward
from .errors import InputError, UnsupportedModelError
from .families import ModelSpec, layer_modules, norm_eps, weight_rows
from .registry import UNIT_LETTERS
from .rules.norm import GAIN, rms_scale

BLOCKS = ("attention", "mlp")
LETTER = {k: UNIT_LETTERS[k] for k in ("head", "neuron", "expert")}  # the unit kinds, and their letter in labels
MAX_UNITS = 20000  # nodes=None on a model this size or a prompt this long: the dense edge matrix would not fit

# The graph is assembled on the CPU whatever devices the model is on (a device map may spread its layers): what
# the DPA run recorded is copied here; a block runs again where its weights are, its gradient copied back.
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Node:
    """One node of a circuit graph. ``kind``: token, head, neuron, target or rest. ``index``: the head or
    neuron (for a token, its position); ``position``: where the unit reads and writes (None for a component over
    all positions); ``of``: for a rest node, the node whose in-flow it completes."""

    kind: str
    label: str
    layer: int | None = None
    index: int | None = None
    position: int | None = None
    of: int | None = None

    @property
    def block(self) -> int | None:
        """0 for a head (attention), 1 for a neuron or an expert (MLP), None otherwise."""
        return {"head": 0, "neuron": 1, "expert": 1}.get(self.kind)


def assemble(parent: Any, nodes: list[Node], edges: Tensor, scores: Tensor, rest: Tensor,
              in_gap: Tensor, bias_in: Tensor, out_rest: Tensor, keep: list[int] | None = None, **fields) -> Any:
    """Append one rest node per unit and the target to ``nodes`` (sources of ``rest``, in the same order) and
    build the Circuit (from ``parent``'s other fields, ``keep`` its kept nodes) or the fields' dict."""
    dests = [i for i, n in enumerate(nodes) if n.kind in LETTER or n.kind == "target"]
    n, r = len(nodes), len(dests)
    full = torch.zeros(n + r, n + r, dtype=edges.dtype)
    full[:n, :n] = edges
    rests = []
    for k, d in enumerate(dests):
        full[n + k, d] = rest[k]
        rests.append(Node("rest", f"rest:{nodes[d].label}", nodes[d].layer, None, nodes[d].position, of=d))
    pad = lambda x, fill=0.0: torch.cat([x, torch.full((r,), fill, dtype=x.dtype)])  # noqa: E731
    out = dict(nodes=nodes + rests, edges=full, scores=torch.cat([scores, rest.to(scores.dtype)]),
               in_gap=pad(in_gap), bias_in=pad(bias_in), out_rest=pad(out_rest))
    if "in_positions" in fields or parent is not None:
        ip = fields.pop("in_positions") if parent is None else parent.in_positions[keep]
        out["in_positions"] = torch.cat([ip, ip.new_zeros(r, ip.shape[1])])
    if parent is None:
        return {**out, **fields}
    from dataclasses import replace

    first = len(parent.tokens)  # units follow the tokens in both graphs
    writes = None if parent._writes is None else parent._writes[[i - first for i in keep if parent.nodes[i].kind in LETTER]]
    reads = {keep.index(i): v for i, v in parent._reads.items() if i in keep}
    return replace(parent, **out, _writes=writes, _reads=reads)


class GraphReadout(backward.Readout):
    """The read-out of one DPA run (``backward.run``) that builds the graph inside its session."""

    def __init__(self, nodes: int | None, positions: bool, experts: bool):
        self.n_units, self.positions = nodes, positions
        self.record = frozenset({"resid", "mid", "head_inputs", "calls"} | (set() if experts else {"neuron_inputs"}))

    def tensors(self, rec, spec: ModelSpec) -> list[Tensor]:
        """Whose gradients the DPA backward must return: the final residual (t^(L)), every o_proj and down input
        (``_taps``: of the layers that have them)."""
        heads, mlps = _taps(spec)
        mlp = [rec.resid[i + 1] if spec.has_experts(i) else rec.neuron_inputs[i]  # an expert's G: t at the layer's
               for i in mlps]  # output; a neuron's: at the down input
        beside = [rec.head_inputs[("beside", i)] for i in heads] if spec.n_beside else []  # (last: Falcon-H1's)
        return [rec.resid[spec.n_layers]] + [rec.head_inputs[i] for i in heads] + mlp + beside

    def read(self, ctx: backward.Context, grads: list[Tensor]) -> dict:
        return build_graph(ctx.session, grads, ctx.directions[0], float(ctx.values[0]), self.n_units, self.positions)


@dataclass
class _Recorded:
    """What the DPA run left for the graph, by layer, in the graph's dtype: each block's input residual
    (``resid``: layer inputs and the final norm's; ``mid``: the MLP's), attention's other arguments, each tap's
    input z and its DPA gradient G (``big``, keyed (layer, block)), t^(L), and the unit scores ``per[block]``
    [layer pos unit]. A snapshot: running the blocks again overwrites the recording."""

    resid: dict
    mid: dict
    calls: dict
    z: dict
    big: dict
    t_final: Tensor
    per: dict


def _taps(spec: ModelSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The layers with a unit tap in each block: a token mixer's (all but Nemotron-H's MLP layers), an MLP's or
    experts' (none in Mamba-2's layers, Nemotron-H's MLP layers alone)."""
    return spec.mixing_layers, spec.neuron_layers


def _recorded(session, grads: list[Tensor], dtype) -> _Recorded:
    spec, rec, L = session.spec, session.recording, session.spec.n_layers
    t_len = session.request.n_tokens
    heads, mlps = _taps(spec)
    z = {(i, 0): rec.head_inputs[i][0].detach().to(CPU, dtype) for i in heads}
    big = {key: g[0].to(CPU, dtype) for key, g in zip([(i, 0) for i in heads] + [(i, 1) for i in mlps], grads[1:])}
    if spec.n_beside:  # a layer's tap is both mixers' output projections' inputs, [attention's | the beside block's]
        for i, g in zip(heads, grads[1 + len(heads) + len(mlps):]):
            z[(i, 0)] = torch.cat([z[(i, 0)], rec.head_inputs[("beside", i)][0].detach().to(CPU, dtype)], -1)
            big[(i, 0)] = torch.cat([big[(i, 0)], g[0].to(CPU, dtype)], -1)
    experts = [i for i in mlps if spec.has_experts(i)]
    if spec.residual_multiplier != 1:  # an expert's G at the block's output: t^(i+1) times the scale the layer
        big.update({(i, 1): big[(i, 1)] * spec.residual_multiplier for i in experts})  # puts on it
    none = lambda width: torch.zeros(t_len, width, dtype=dtype)  # noqa: E731  (a layer without the block)
    per = {0: torch.stack([_unit_sums(spec, i, z[(i, 0)] * big[(i, 0)]) if i in heads else none(spec.row_width)
                           for i in range(L)])}
    z.update({(i, 1): rec.neuron_inputs[i][0].detach().to(CPU, dtype) for i in mlps if i not in experts})
    width = max((spec.mlp_units(i)[1] for i in range(L)), default=0)  # a row as wide as the widest layer's units
    # (layers without an MLP, Mamba-2's, have none; a dense layer of a mixed layout, its neurons in the first columns)
    per[1] = torch.stack([torch.nn.functional.pad(
        session.scores.expert_positions[0, i].to(CPU, dtype) if i in experts  # an expert's score from its router
        else z[(i, 1)] * big[(i, 1)] if i in mlps else none(0), (0, width - spec.mlp_units(i)[1] * (i in mlps)))
        for i in range(L)])  # tap (the same as its term . t)
    return _Recorded(resid={i: rec.resid[i][0].detach().to(CPU, dtype) for i in range(L + 1)},
                     mid={i: m[0].detach().to(CPU, dtype) for i, m in rec.mid.items()}, calls=dict(rec.calls), z=z,
                     big=big, t_final=grads[0][0].to(CPU, dtype), per=per)


def _unit_sums(spec: ModelSpec, i: int, product: Tensor) -> Tensor:
    """Layer i's unit scores [pos unit] from its tap's input times its gradient [pos channels]: each unit's channels
    summed (a layer with a mixer beside attention: the heads' channels, then the beside block's units')."""
    t_len = product.shape[0]
    heads = product[:, :spec.n_heads * spec.unit_width(i)].reshape(t_len, spec.n_heads, -1).sum(-1)
    if not spec.n_beside:
        return heads
    return torch.cat([heads, product[:, spec.n_heads * spec.unit_width(i):].reshape(t_len, spec.n_beside, -1).sum(-1)],
                     -1)


def build_graph(session, grads: list[Tensor], direction: Tensor, value: float, n_units: int | None,
                positions: bool) -> dict:
    """The graph's fields, inside the DPA run's session: the kept units, their g_v (one block each) and writes,
    every edge among tokens, units and the target, the rests, gaps and in-flows."""
    model, req, spec = session.model, session.request, session.spec
    dtype = session.scores.dtype
    t_len = req.n_tokens
    mods = layer_modules(model, spec)
    r = _recorded(session, grads, dtype)
    units = _select(r.per, n_units, positions, spec)
    with torch.no_grad():
        emb = spec.embeddings(model, req.input_ids)[0].detach().to(CPU, dtype)
    g, inblock, reads, values = _pullbacks(session, mods, units, r.resid, r.mid, r.calls, r.big, dtype)
    cache: dict = {}
    writes = torch.stack([values[k] if values[k] is not None else  # an expert's write: its term of the block
                          _write(mods[u.layer], spec, u, r.z[(u.layer, u.block)], dtype, cache)
                          for k, u in enumerate(units)]) if units else torch.zeros(0, t_len, spec.d_model, dtype=dtype)
    writes = writes * spec.residual_multiplier  # what joins the residual stream (Granite scales each block's output)
    # the target as a destination: t^(L) at the final residual, its in-block bias the final norm's beta . u
    beta = getattr(spec.final_norm(model), "bias", None)
    g = torch.cat([g, r.t_final[None]])
    bias_in_block = 0.0 if beta is None else float(beta.to(CPU, dtype) @ direction.to(CPU, dtype))
    inblock = torch.cat([inblock, torch.tensor([bias_in_block], dtype=dtype)])
    flow = _in_flows(model, spec, mods, units, r, g, writes, emb, positions)
    unit_scores = torch.stack([_unit_score(r.per, u) for u in units]) if units else torch.zeros(0, dtype=dtype)
    dest_scores = torch.cat([unit_scores, torch.tensor([value], dtype=dtype)])
    total = flow["by_position"].sum(1)
    rest = total - flow["tokens"].sum(1) - flow["positions"] - flow["bias_writes"] - flow["units"].sum(0)
    in_gap = dest_scores - total - inblock
    bias_in = flow["positions"] + flow["bias_writes"] + inblock

    tokens = [Node("token", f"tok{i}", None, i, i) for i in range(t_len)]
    nodes = tokens + units + [Node("target", "target", None, None, int(req.positions[0]))]
    dest_index = list(range(t_len, t_len + len(units) + 1))
    edges = torch.zeros(len(nodes), len(nodes), dtype=dtype)
    edges[:t_len, dest_index] = flow["tokens"].T
    edges[t_len:t_len + len(units), dest_index] = flow["units"]
    all_scores = torch.cat([session.scores.tokens[0].to(CPU, dtype), dest_scores])
    out_rest = all_scores - edges.sum(1)
    out_rest[-1] = 0.0
    in_pos = torch.zeros(len(nodes), t_len, dtype=dtype)
    in_pos[dest_index] = flow["by_position"]
    zero = torch.zeros(t_len, dtype=dtype)
    fields = dict(in_positions=in_pos, writes=writes, embeddings=emb,
                  reads={t_len + k: x for k, x in enumerate(reads)}, direction=direction.detach().to(CPU, dtype))
    return assemble(None, nodes, edges, all_scores, rest, torch.cat([zero, in_gap]),
                     torch.cat([zero, bias_in]), out_rest, **fields)


def _in_flows(model, spec: ModelSpec, mods, units: list[Node], r: _Recorded, g: Tensor, writes: Tensor,
              emb: Tensor, positions: bool) -> dict[str, Tensor]:
    """Each destination's (the units', then the target's) in-flow, from its g_v [dest pos d_model] and the
    residual stream its block reads: by position [dest pos], from each token [dest pos], from the learned
    positions and the blocks' biases below it [dest], and from each kept unit below it [unit dest]."""
    dtype = g.dtype
    reads_at = [read_slot(spec, u) for u in units] + [2 * spec.n_layers]
    xin = torch.stack([r.resid[u.layer] if u.block == 0 or spec.parallel else r.mid[u.layer] for u in units]
                      + [r.resid[spec.n_layers]])
    learned = r.resid[0] - emb if spec.positions(model) is not None else None  # GPT-2's position embeddings
    gsum = g.sum(1)  # [dest d_model]
    bias_writes = torch.stack([sum((b @ gsum[k] for s, b in _bias_writes(mods, spec, dtype).items() if s < at),
                                   torch.zeros((), dtype=dtype)) for k, at in enumerate(reads_at)])
    below = torch.tensor([[2 * u.layer + u.block < at for at in reads_at] for u in units],
                         dtype=torch.bool).reshape(len(units), -1)
    if positions:  # each unit writes at its own position only: E[u, v] = out_u[p_u] . g_v[p_u]
        at = torch.tensor([u.position for u in units], dtype=torch.long)
        own = writes[torch.arange(len(units)), at]  # [unit d_model]
        unit_edges = torch.einsum("ud,vud->uv", own, g[:, at]) * below
    else:
        unit_edges = torch.einsum("upd,vpd->uv", writes, g) * below
    return {"by_position": (g * xin).sum(2), "tokens": (g * emb).sum(-1),
            "positions": (g * learned).sum((1, 2)) if learned is not None else torch.zeros(len(g), dtype=dtype),
            "bias_writes": bias_writes, "units": unit_edges}


def _select(per: dict[int, Tensor], n_units: int | None, positions: bool, spec: ModelSpec) -> list[Node]:
    """The units with the largest |score| (all with ``n_units=None``), in graph order: layer, block, position."""
    flat = {b: (per[b] if positions else per[b].sum(1, keepdim=True)) for b in (0, 1)}  # [layer pos|1 unit]
    sizes = [flat[0].numel(), flat[1].numel()]
    heads, mlps = _taps(spec)  # the units that exist: not a row of a block the layer lacks (Nemotron-H's), nor the
    # columns past a dense layer's neurons in a row as wide as the experts' (a mixed layout)
    counts = [[spec.row_width * (i in heads) for i in range(spec.n_layers)],
              [spec.mlp_units(i)[1] * (i in mlps) for i in range(spec.n_layers)]]
    exists = [(torch.arange(flat[b].shape[-1])[None, :] < torch.tensor(counts[b])[:, None])[:, None, :]
              .expand_as(flat[b]).flatten() for b in (0, 1)]
    real = int(sum(e.sum() for e in exists))
    if n_units is None and real > MAX_UNITS:
        raise InputError(f"nodes=None keeps all {real} units of this model and prompt, and the edge matrix "
                         f"would not fit; keep fewer (nodes=64) or use positions=False")
    both = torch.cat([flat[0].flatten(), flat[1].flatten()]).abs().masked_fill(~torch.cat(exists), -1.0)
    k = real if n_units is None else min(n_units, real)
    picked = _top(both, k)
    out = []
    for j in picked:
        b = 0 if j < sizes[0] else 1
        layer, pos, index = torch.unravel_index(torch.tensor(j - (0 if b == 0 else sizes[0])), flat[b].shape)
        kind = "head" if b == 0 else spec.mlp_units(int(layer))[0]
        p = int(pos) if positions else None
        letter = LETTER[kind] if b or spec.kind(int(layer)) == "attention" else UNIT_LETTERS[spec.kind(int(layer))]
        shown = int(index)
        if b == 0 and spec.beside_unit(shown) is not None:  # a unit of the mixer beside attention (Falcon-H1's L0.S1)
            letter, shown = UNIT_LETTERS[spec.beside_kind], spec.beside_unit(shown)
        label = f"L{int(layer)}.{letter}{shown}" + (f"@{p}" if positions else "")
        out.append(Node(kind, label, int(layer), int(index), p))
    return sorted(out, key=lambda u: (u.layer, u.block, -1 if u.position is None else u.position, u.index))


def _top(x: Tensor, k: int, chunk: int = 1 << 16) -> list[int]:
    """Indices of the k largest entries of a 1-D ``x``: the k largest of each chunk first, then of those (one
    topk over tens of millions of scores is slow on a CPU)."""
    if k >= x.numel() or x.numel() <= 4 * chunk:
        return torch.topk(x, k).indices.tolist()
    pad = (-x.numel()) % chunk
    blocks = torch.cat([x, x.new_full((pad,), -1.0)]).view(-1, chunk)
    vals, idx = torch.topk(blocks, min(k, chunk), dim=1)
    idx = idx + torch.arange(blocks.shape[0])[:, None] * chunk
    best = torch.topk(vals.flatten(), k).indices
    return idx.flatten()[best].tolist()


def _unit_score(per: dict[int, Tensor], u: Node) -> Tensor:
    s = per[u.block][u.layer][:, u.index]
    return s.sum() if u.position is None else s[u.position]


def read_slot(spec: ModelSpec, u: Node) -> int:
    """Where unit u's block reads the residual stream, in write slots: 2 * layer (+1 after the layer's
    attention, unless the layer runs attention and MLP in parallel)."""
    return 2 * u.layer + (1 if u.block == 1 and not spec.parallel else 0)


def _columns(spec: ModelSpec, u: Node) -> slice:
    """The unit's columns of its tap: a head's slice of the o_proj input, a neuron's column of the down input;
    an expert's tap is the block's output (all of it, the expert's term alone: ``Session.only``)."""
    if u.kind == "expert":
        return slice(0, spec.d_model)
    j = spec.beside_unit(u.index) if u.block == 0 else None
    if j is not None:  # the beside block's unit: after the attention heads' channels
        start = spec.n_heads * spec.unit_width(u.layer) + j * spec.beside_width
        return slice(start, start + spec.beside_width)
    w = spec.unit_width(u.layer) if u.block == 0 else 1
    return slice(u.index * w, (u.index + 1) * w)


def unit_tap(mods, spec: ModelSpec, u: Node) -> tuple[nn.Module, slice]:
    """The module whose input holds unit u's channels, and those channels (path patching hooks it): attention's
    o_proj (a head), the beside block's out_proj (its unit), the down projection (a neuron)."""
    j = spec.beside_unit(u.index) if u.block == 0 else None
    if j is not None:
        return mods.beside.heads, slice(j * spec.beside_width, (j + 1) * spec.beside_width)
    return _out_module(mods, u.block), _columns(spec, u)


def _post_gain(mods, spec: ModelSpec, block: int, pre: Tensor) -> Tensor | None:
    """The frozen post-norm after a block's output projection, as the diagonal it multiplies by [pos d_model]
    (None without one): its gain times 1/rms of its input at the forward pass."""
    norm = mods.post_norms[block]
    if norm is None:
        return None
    if spec.parts.norm_kind == "layer":
        raise UnsupportedModelError(f"{spec.family}: a LayerNorm after a block is not supported in circuit graphs")
    gain = GAIN[spec.parts.norm_kind](norm.weight.detach().to(pre.device, pre.dtype))
    return gain * rms_scale(pre, norm_eps(norm)).to(pre.dtype)


def _out_module(mods, block: int) -> nn.Module:
    return mods.heads if block == 0 else mods.neurons


def _out_weight(mods, block: int, dtype) -> Tensor:
    """What a block's tap input is multiplied by to join the residual stream [d_model width], before any post-norm:
    its output projection's weight times the scale the layer puts on the block's output (``LayerModules.scale``);
    with a mixer beside attention, the two projections side by side, each with its own scale."""
    if block == 1:
        return weight_rows(mods.neurons).detach().to(CPU, dtype) * mods.scale("mlp_out")
    w = weight_rows(mods.heads).detach().to(CPU, dtype) * mods.scale("attention_out")
    if mods.beside is None:
        return w
    return torch.cat([w, weight_rows(mods.beside.heads).detach().to(CPU, dtype) * mods.scale("beside_out")], 1)


def _write(mods, spec: ModelSpec, u: Node, z: Tensor, dtype, cache: dict) -> Tensor:
    """out_u [pos d_model]: the unit's slice of its block's o_proj / down input through the projection (no bias)
    and the frozen post-norm, at its position (or every position). ``cache`` keeps each block's output weight and
    post-norm diagonal, by (layer, block, what), for its other units."""
    key = (u.layer, u.block)
    if key + ("weight",) not in cache:
        cache[key + ("weight",)] = _out_weight(mods, u.block, dtype)
    w = cache[key + ("weight",)]  # [d_model width]
    cols = _columns(spec, u)
    rows = slice(None) if u.position is None else slice(u.position, u.position + 1)
    out = torch.zeros(z.shape[0], w.shape[0], dtype=dtype)
    out[rows] = z[rows, cols] @ w[:, cols].T
    if mods.post_norms[u.block] is not None:
        if key + ("gain",) not in cache:
            bias = getattr(_out_module(mods, u.block), "bias", None)
            pre = z @ w.T + (0 if bias is None else bias.detach().to(CPU, dtype))
            cache[key + ("gain",)] = _post_gain(mods, spec, u.block, pre)
        out[rows] = out[rows] * cache[key + ("gain",)][rows]
    return out


def _bias_writes(mods, spec: ModelSpec, dtype) -> dict[int, Tensor]:
    """What each block writes that no unit owns, by write slot: its output projection's bias."""
    out = {}
    for i, m in enumerate(mods):
        for b in (0, 1):
            bias = getattr(_out_module(m, b), "bias", None)
            if bias is not None:
                if m.post_norms[b] is not None:
                    raise UnsupportedModelError(f"{spec.family}: a biased projection before a post-norm is not "
                                                "supported in circuit graphs")
                out[2 * i + b] = (bias.detach().to(CPU, dtype) * spec.residual_multiplier
                                  * m.scale("attention_out" if b == 0 else "mlp_out"))
    return out


ROWS = 16  # units per batch when running a block again (memory: ROWS x pos x the block's activations)


def _pullbacks(session, mods, units: list[Node], resid, mid, calls, big, dtype):
    """g_v for every unit [unit pos d_model], its block's own biases' share [unit], G_v at its tap, and an
    expert's write (its term of the block's output, seen on the way; None for heads and neurons)."""
    spec = session.spec
    t_len = resid[0].shape[0]
    g = torch.zeros(len(units), t_len, spec.d_model, dtype=dtype)
    inblock = torch.zeros(len(units), dtype=dtype)
    reads: list[Tensor] = []
    for u in units:
        cols = _columns(spec, u)
        G = torch.zeros(t_len, cols.stop - cols.start, dtype=dtype)
        rows = slice(None) if u.position is None else slice(u.position, u.position + 1)
        G[rows] = big[(u.layer, u.block)][rows, cols]
        reads.append(G)
    values: list[Tensor | None] = [None] * len(units)
    groups: dict[tuple[int, int], list[int]] = {}
    for k, u in enumerate(units):
        groups.setdefault((u.layer, u.block), []).append(k)
    for (layer, block), members in groups.items():
        for start in range(0, len(members), ROWS):
            chunk = members[start:start + ROWS]
            gk, bk, vk = pullback(session, mods[layer], layer, block, [units[k] for k in chunk],
                                   [reads[k] for k in chunk], resid, mid, calls, dtype)
            g[chunk] = gk
            inblock[chunk] = bk
            for r, k in enumerate(chunk):
                values[k] = None if vk is None else vk[r]
    return g, inblock, reads, values


def pullback(session, m, layer: int, block: int, units: list[Node], reads: list[Tensor], resid, mid, calls,
              dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """Run one block again on its recorded input, one batch row per unit, in the session's linearised model;
    backward from each unit's G_v at its tap. A neuron's (an expert's) block is run at its position only (the
    MLP is position-wise); a sparse block keeps one expert's term per row (``Session.only``). Returns g_v
    [unit pos d_model], the block's biases' share of S_v [unit], and for experts their terms [unit pos d_model]."""
    spec, rec = session.spec, session.recording
    t_len = next(iter(resid.values())).shape[0]
    source = resid[layer] if block == 0 or spec.parallel else mid[layer]
    one = block == 1 and all(u.position is not None for u in units)
    experts = block == 1 and spec.has_experts(layer)
    width = (spec.n_heads * spec.unit_width(layer) + spec.n_beside * spec.beside_width if block == 0
             else spec.d_model if experts else spec.neuron_width(layer))
    if one:  # each row: the unit's own position
        x = torch.stack([source[u.position:u.position + 1] for u in units])
    else:
        x = source[None].expand(len(units), -1, -1)
    param_dtype = spec.embed(session.model).weight.dtype
    x = x.to(next(m.layer.parameters()).device, param_dtype).clone().requires_grad_(True)  # where the block runs
    G = torch.zeros(len(units), x.shape[1], width, dtype=dtype)
    for r, (u, read) in enumerate(zip(units, reads)):
        cols = _columns(spec, u)
        G[r, :, cols] = read[u.position:u.position + 1] if one else read
    sink = session.scores.parts.setdefault(("bias", None), [])
    mark = len(sink)
    norm = m.block_inputs[block] if m.block_inputs else None
    h = norm(x) if norm is not None else x
    if block == 0:
        args, kwargs = calls[layer]
        scale = m.scale("attention_in")  # (Falcon-H1's attention reads its input scaled)
        m.attention(h if scale == 1 else h * scale, *args, **kwargs)
        tap = rec.head_inputs[layer]
        if m.beside is not None:  # the block beside attention reads the same input: its units after the heads
            args, kwargs = calls[("beside", layer)]
            m.beside.attention(h, *args, **kwargs)
            tap = torch.cat([tap, rec.head_inputs[("beside", layer)]], -1)
    elif experts:
        slots = torch.tensor([u.index for u in units], device=x.device).repeat_interleave(x.shape[1])
        session.only = (slots, len(units))
        try:
            tap = m.mlp_write(h)
        finally:
            session.only = None
    else:
        m.mlp(h)
        tap = rec.neuron_inputs[layer]
    # with the anchor too: the taps of constants (GPT-OSS's expert biases) lie on no path to x, yet take their share
    grad, _ = torch.autograd.grad(tap, [x, session.anchor], G.to(tap.device, tap.dtype), allow_unused=True)
    value = tap.detach().to(CPU, dtype) if experts else None
    shares = sink[mark:]
    del sink[mark:]
    bias = torch.zeros(len(units), dtype=dtype)
    for s in shares:
        bias = bias + s.to(CPU, dtype).reshape(len(units))
    grad = grad.detach().to(CPU, dtype)
    if one:
        out = torch.zeros(len(units), t_len, spec.d_model, dtype=dtype)
        written = None if value is None else torch.zeros_like(out)
        for r, u in enumerate(units):
            out[r, u.position] = grad[r, 0]
            if written is not None:
                written[r, u.position] = value[r, 0]
        return out, bias, written
    return grad, bias, value
