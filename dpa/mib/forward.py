"""The model run reader by reader: MIB's patched forward, and the pass its edge scores are read from.

MIB's graph has a reader per head and per q/k/v input, so a layer's attention runs on copies of the batch stacked
together. In MIB's evaluation (the model's own projections) each copy's q, k and v projections compute only the
columns of the heads that run there, each from that head's own input, and o_proj's input is read, not run: one
copy for multi-head attention, at most as many as heads share a key/value head for GQA. Where the projections carry
dpa's rules (the pass the gradients are read from) or q/k norms read every head at once (OLMo 2), a copy is a
distinct triple of inputs run whole: its query input goes to the attention module, its key and value inputs to
the key and value projections (hooks swap their inputs). Either way each head's output is its slice of o_proj's
input in its own copy, through its columns of o_proj. Readers that exclude the same writers read one input.
Everything
else is the model's own modules, called in order: the block input norms, the attention module (its rotary,
masks, soft-caps, sinks and kernel, with the arguments it was called with in a plain forward), the post-norms,
the MLP or sparse block, the final norm and the unembedding. Inside ``dpa.instrument`` these are the modules
with dpa's rules on them (the linearised model), or untouched (the model's own backward).

``run`` computes, layer by layer, each writer's output (``Graph``'s writers) and each reader's input:

    reader input = residual of this run + sum over excluded writers u below it of (other_u - out_u)

with ``other`` the writers' outputs in another run (the counterfactual). With nothing excluded every reader sees
the residual and the run is the model's forward; with everything excluded every reader sees the other run's
residual. A head's output is its o_proj term times the post-norm's frozen scale (Gemma, OLMo 2), so that the
heads' outputs and the projection's bias add up to the block's output.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..families import LayerModules, layer_modules, norm_eps, own_forward, weight_rows
from ..state_checks import check_not_compiled
from ..instrument import Session, unembed
from ..registry import MIXER_RULES
from ..rules.norm import GAIN, rms_scale
from ..scan_rules import RULES
from ..ssd import READERS, input_scales, readers_value
from .graph import Graph


@dataclass
class Pass:
    """One run: the metric per prompt [batch]; the writers' outputs [writer batch pos d_model] (``keep``); the
    readers' inputs (``leaves``): per layer the attention readers [3 head batch pos d_model] and the MLP's
    [batch pos d_model], then the logits' [batch pos d_model]."""

    metric: Tensor
    writes: Tensor | None = None
    reads: list[Tensor] = field(default_factory=list)


def calls(session: Session) -> dict[int, tuple[tuple, dict]]:
    """Each layer's attention arguments besides its input (rotary, masks), from a plain forward of the session's
    request (``record={"calls"}``): the runs below call the attention modules with them."""
    with torch.no_grad():
        session.forward()
    return dict(session.recording.calls)


def run(session: Session, graph: Graph, layers: list[LayerModules], args: dict, metric: Callable[[Tensor], Tensor],
        ids: Tensor, *, embeds: Tensor | None = None, excluded: Tensor | None = None, other: Tensor | None = None,
        keep: bool = False, leaves: bool = False) -> Pass:
    """Run the model on ``ids`` [batch pos] (or on the input embeddings ``embeds``), reader by reader (see the
    module docstring). ``args``: ``calls(session)``; ``metric(logits [batch vocab]) -> [batch]`` at the request's
    positions; ``excluded`` [writer reader] bool with ``other`` [writer batch pos d_model]: the edges whose
    readers see the other run's writer. ``leaves``: the readers' inputs are kept for gradients."""
    spec, model, request = session.spec, session.model, session.request
    b = ids.shape[0]
    x = embeds if embeds is not None else _embed(session, ids)
    if leaves and not x.requires_grad:
        x = x.detach().requires_grad_(True)
    writes: list[Tensor] = [x.detach()]
    out = Pass(metric=torch.empty(0))
    patch = _Patcher(graph, excluded, other, writes)
    for i, m in enumerate(layers):
        ins, which = patch.inputs(x, graph.attention_readers(i), graph.below(i, 0), distinct=not leaves)
        ins = ins.clone() if leaves else ins  # [3H b t d] leaves for the readers' gradients
        if m.beside is not None:  # attention and a block beside it (Falcon-H1's): both mixers' units, in one row
            heads, block = _side_by_side(m, spec, args, i, ins, which, b)
        elif m.attention is not None:
            heads, block = _attention(m, spec, args[i], ins, which, b)
        else:  # a layer without a token mixer (Nemotron-H's MLP layers): its head nodes write nothing
            block = torch.zeros_like(x)
            heads = block[None].expand(spec.n_heads, *block.shape)
        heads, block = heads * spec.residual_multiplier, block * spec.residual_multiplier  # what joins the stream
        writes.extend(heads.detach().unbind(0))
        mid = x + block
        source = x if spec.parallel else mid
        into = patch.inputs(source, slice(graph.mlp_reader(i), graph.mlp_reader(i) + 1), graph.below(i, 1))[0][0]
        into = into.clone() if leaves else into
        mlp = _mlp(m, into) * spec.residual_multiplier if m.mlp is not None else torch.zeros_like(into)  # (Mamba-2)
        writes.append(mlp.detach())
        x = mid + mlp
        if leaves:
            out.reads += [ins, into]
    final = patch.inputs(x, slice(graph.logits, graph.logits + 1), graph.n_writers)[0][0]
    final = final.clone() if leaves else final
    if leaves:
        out.reads.append(final)
    hidden = spec.final_norm(model)(final)
    rows = torch.arange(b, device=hidden.device)
    logits = unembed(model, request, hidden[rows, request.positions])
    out.metric = metric(logits.to(torch.promote_types(logits.dtype, torch.float32)))
    if keep:
        out.writes = torch.stack(writes)
    return out


def _embed(session: Session, ids: Tensor) -> Tensor:
    """The input writer: the token embeddings, plus the learned positions where the model has them (GPT-2)."""
    spec, model = session.spec, session.model
    x = spec.embeddings(model, ids)
    positions = spec.positions(model)
    if positions is not None:
        x = x + positions(session.request.position_ids.expand(ids.shape[0], -1))
    return x


class _Patcher:
    """Readers' inputs: the residual plus, for each excluded edge, the other run's writer minus this run's.

    The differences D_w are kept in one tensor as the writers come, with their running sum; a reader whose
    writers are mostly excluded gets the sum minus its kept writers' differences, so each reader costs what the
    smaller of its kept and excluded sets costs, as one matrix product over the writers below it.

    Only positions from the first where the two runs' inputs differ are kept: before it every writer's output is
    the same in both runs (the models are causal), so D_w is zero there and adds nothing."""

    def __init__(self, graph: Graph, excluded: Tensor | None, other: Tensor | None, writes: list[Tensor]):
        self.writes, self.other = writes, other
        self.excluded = None
        if excluded is not None and bool(excluded.any()):
            if other is None:
                raise ValueError("excluded edges need the other run's writes")
            self.excluded = excluded
            self.diffs: Tensor | None = None  # [writer batch pos d_model] from position ``start``, as writers come
            self.sums: Tensor | None = None  # sums[k]: the sum of the first k + 1 differences
            self.filled = 0
            self.start = 0

    def _update(self) -> None:
        n = len(self.writes)
        if self.diffs is None:
            same = (self.other[0].to(self.writes[0].dtype) == self.writes[0]).flatten(2).all(-1).all(0)  # [pos]
            self.start = int(same.long().cumprod(0).sum())  # the first position where the inputs differ
            shape = (self.other.shape[0], *self.writes[0][:, self.start:].shape)
            self.diffs = torch.empty(shape, dtype=self.writes[0].dtype, device=self.writes[0].device)
            self.sums = torch.empty_like(self.diffs)
        s = self.start
        for w in range(self.filled, n):
            torch.sub(self.other[w, :, s:].to(self.diffs.dtype), self.writes[w][:, s:], out=self.diffs[w])
            if w == 0:
                self.sums[0].copy_(self.diffs[0])
            else:
                torch.add(self.sums[w - 1], self.diffs[w], out=self.sums[w])
        self.filled = n

    def inputs(self, resid: Tensor, readers: slice, below: int, distinct: bool = True) -> tuple[Tensor, Tensor]:
        """The inputs of ``readers`` (whose writers are the first ``below``): ``distinct`` ones [input batch pos
        d_model] and which of them each reader reads [reader] (readers that exclude the same writers read one
        input); else one per reader."""
        n = readers.stop - readers.start
        one = torch.zeros(n, dtype=torch.long)
        if self.excluded is None or not bool(self.excluded[:below, readers].any()):
            if distinct:
                return resid.unsqueeze(0), one
            return resid.unsqueeze(0).expand(n, *resid.shape), torch.arange(n)
        cut = self.excluded[:below, readers]  # [writer reader]: every writer below feeds these readers
        which = torch.arange(n)
        if distinct:
            cut, which = torch.unique(cut.T, dim=0, return_inverse=True)
            cut = cut.T
        self._update()
        x, s = resid.unsqueeze(0), self.start
        if 2 * int(cut.sum()) <= cut.numel():
            late = x[:, :, s:] + self._sum(cut, below)
        else:
            late = x[:, :, s:] + (self.sums[below - 1].unsqueeze(0) - self._sum(~cut, below))
        if s == 0:
            return late, which
        return torch.cat([x[:, :, :s].expand(late.shape[0], -1, -1, -1), late], dim=2), which

    def _sum(self, pick: Tensor, below: int) -> Tensor:
        """[reader batch pos d_model]: for each reader, the sum of the differences of the writers ``pick`` marks."""
        rows = pick.any(1).nonzero().flatten()
        if rows.numel() == 0:
            return torch.zeros((), dtype=self.diffs.dtype, device=self.diffs.device)
        lo, hi = int(rows[0]), int(rows[-1]) + 1  # a contiguous block of writers: a view, no copy
        d = self.diffs[lo:hi]
        weights = pick[lo:hi].to(d.dtype).to(d.device)
        return (weights.T @ d.reshape(hi - lo, -1)).view(pick.shape[1], *d.shape[1:])


def _rows(value, copies: int, batch: int):
    """An attention argument for ``copies`` stacked copies of the batch: tensors with a batch dimension repeated."""
    if isinstance(value, Tensor):
        if value.dim() and value.shape[0] == batch and batch > 1:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, copies, batch) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, copies, batch) for k, v in value.items()}
    return value


def _norm(m: LayerModules, block: int) -> Callable[[Tensor], Tensor]:
    return m.block_inputs[block] if m.block_inputs else (lambda x: x)


def _side_by_side(m: LayerModules, spec, args: dict, i: int, ins: Tensor, which: Tensor,
                  b: int) -> tuple[Tensor, Tensor]:
    """Layer ``i``'s attention and the block beside it (``Family.beside``) on their readers' inputs: the layer's row
    of units is the heads, then the block's units, and ``which`` [3 row] their q, k and v readers' inputs in that
    order. Each block's outputs carry the scale the layer puts on them (``LayerModules.scale``); attention reads its
    input scaled. Returns every unit's output [row b t d] and the two blocks' sum [b t d]."""
    n, row = spec.n_heads, spec.row_width
    q, k, v = which.view(3, row)
    heads, block = _attention(m, spec, args[i], ins, torch.cat([q[:n], k[:n], v[:n]]), b, m.scale("attention_in"))
    units = replace(spec, n_heads=spec.n_beside, n_kv_heads=spec.n_beside, d_head=spec.beside_width)
    scan, total = _attention(m.beside, units, args[("beside", i)], ins, torch.cat([q[n:], k[n:], v[n:]]), b)
    a, s = m.scale("attention_out"), m.scale("beside_out")
    return torch.cat([heads * a, scan * s]), block * a + total * s


def _attention(m: LayerModules, spec, call: tuple[tuple, dict], ins: Tensor, which: Tensor,
               b: int, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Layer ``m``'s attention with a separate input per head and per q/k/v: ``ins`` [input b t d] and
    ``which`` [3H], the input each reader reads (q of every head, then k, then v). The module runs on copies of
    the batch stacked (``_copies``). Returns each head's output [H b t d] and the block's output [b t d] (its
    post-norm's). ``scale``: what the layer multiplies the block's normalised input by (Falcon-H1's attention)."""
    n_heads, width = spec.n_heads, weight_rows(m.heads).shape[1] // spec.n_heads  # a scan unit's width is its own
    t, d = ins.shape[-2:]
    normed = _norm(m, 0)(ins)
    normed = normed if scale == 1 else normed * scale
    triples = [tuple(tr) for tr in which.view(3, n_heads).T.tolist()]  # per head: its q, k and v input
    own = (spec.parts.head_norms_over == "head"  # OLMo 2's q/k norms read every head's columns at once
           and MIXER_RULES.get(m.kind) != "scan"  # a Mamba-2 block's units share its B, C and norm: run whole
           and not any("forward" in module.__dict__ for module in (*(m.branches[n] for n in BRANCHES), m.heads)))
    # heads sharing a key/value head read one k/v input; a mixer's units (LFM2's channel groups) share nothing
    copy_of = _copies(triples, n_heads // spec.n_kv_heads if m.kind == "attention" else 1, own)
    c = max(copy_of) + 1
    args, kwargs = call
    seen: dict[str, Tensor] = {}
    if own:
        query = normed[triples[0][0]]
        query = query if c == 1 else query.repeat(c, 1, 1)  # its shape is read; its projections are _sliced
        with _sliced(m, spec, normed, triples, copy_of, b, seen):
            m.attention(query, *_rows(args, c, b), **_rows(kwargs, c, b))
    else:
        first = {k: triples[copy_of.index(k)] for k in range(c)}
        inputs = {name: normed[torch.tensor([first[k][j] for k in range(c)], device=ins.device)].reshape(c * b, t, d)
                  for j, name in enumerate(BRANCHES)}
        with _swapped_inputs(m, inputs, spec), _hook(m.heads, pre=lambda _m, a: seen.__setitem__("z", a[0])):
            m.attention(inputs["query"], *_rows(args, c, b), **_rows(kwargs, c, b))
    z = seen["z"].view(c, b, t, n_heads, width)
    z = torch.stack([z[copy_of[h], :, :, h] for h in range(n_heads)])  # [H b t width]: each head from its copy
    w_o = weight_rows(m.heads).view(d, n_heads, width).to(z.dtype)
    terms = torch.einsum("hbte,dhe->hbtd", z, w_o)
    bias = getattr(m.heads, "bias", None)
    total = terms.sum(0) if bias is None else terms.sum(0) + bias
    post = m.post_norms[0]
    if post is None:
        return terms, total
    block = post(total)
    return terms * _frozen_scale(post, spec, total.detach()), block


BRANCHES = ("query", "key", "value")


def _copies(triples: list[tuple], per_kv: int, own: bool) -> list[int]:
    """The copy of the batch each head runs in. Modules with dpa's rules on them, or q/k norms over the whole
    projection, run whole, so heads share a copy only when they read the same three inputs. The model's own projections are sliced (``_sliced``): a head's
    query columns can come from any input, and in each group of heads sharing a key/value head the k-th distinct
    (key, value) input pair runs in copy k, so MHA runs one copy and GQA at most one per head of a group."""
    if not own:
        distinct = list(dict.fromkeys(triples))
        return [distinct.index(tr) for tr in triples]
    ranks: dict[int, list[tuple]] = {}
    out = []
    for h, (_, k, v) in enumerate(triples):
        seen = ranks.setdefault(h // per_kv, [])
        if (k, v) not in seen:
            seen.append((k, v))
        out.append(seen.index((k, v)))
    return out


@contextmanager
def _sliced(m: LayerModules, spec, normed: Tensor, triples: list[tuple], copy_of: list[int], b: int, seen: dict):
    """While the attention module runs on ``max(copy_of) + 1`` copies of the batch: its q, k and v projections (the
    model's own, no rules on them) compute in each copy only the columns of the heads that run there, each from
    its own input (``normed`` [input b t d]); the other columns are zeros, which nothing reads. o_proj is not run:
    ``seen["z"]`` gets its input, all that is read of it."""
    per_kv = spec.n_heads // spec.n_kv_heads if m.kind == "attention" else 1
    width, device = spec.d_head, normed.device
    c = max(copy_of) + 1
    units = {name: {} for name in BRANCHES}  # name -> (copy, input) -> the heads (q) or key/value heads it computes
    for h, tr in enumerate(triples):
        for j, name in enumerate(BRANCHES):
            unit = h if name == "query" else h // per_kv
            got = units[name].setdefault((copy_of[h], tr[j]), [])
            if unit not in got:
                got.append(unit)

    def columns(name: str, heads: list[int]) -> Tensor:
        idx = (torch.tensor(heads, device=device)[:, None] * width + torch.arange(width, device=device)).flatten()
        cols = m.columns.get(name)
        if cols is None:
            return idx
        if name == "query" and "output_gate" in m.columns:  # the heads' output gates, read with their queries
            return torch.cat([cols.to(device)[idx], m.columns["output_gate"].to(device)[idx]])
        return idx + (cols.start or 0) if isinstance(cols, slice) else cols.to(device)[idx]

    def forward_of(module: nn.Module, names: list[str]) -> Callable:
        weight, bias = weight_rows(module), getattr(module, "bias", None)
        pieces = [(k, i, columns(name, heads)) for name in names for (k, i), heads in units[name].items()]

        def forward(*_a, **_k):
            out = normed.new_zeros(c, *normed.shape[1:-1], weight.shape[0])
            for k, i, idx in pieces:
                out[k, ..., idx] = nn.functional.linear(normed[i], weight[idx], None if bias is None else bias[idx])
            return out.view(c * b, *out.shape[2:])
        return forward

    def skipped(x, *_a, **_k):
        seen["z"] = x
        return x.new_zeros(*x.shape[:-1], weight_rows(m.heads).shape[0])

    groups: dict[nn.Module, list[str]] = {}
    for name in BRANCHES:
        groups.setdefault(m.branches[name], []).append(name)
    patched = [(module, forward_of(module, names)) for module, names in groups.items()] + [(m.heads, skipped)]
    try:
        for module, forward in patched:
            module.__dict__["forward"] = forward
        yield
    finally:
        for module, _ in patched:
            module.__dict__.pop("forward", None)


def _frozen_scale(norm: nn.Module, spec, pre: Tensor) -> Tensor:
    """A post-norm as the diagonal it multiplies by at this run [b t d]: its gain times 1/rms of its input."""
    if spec.parts.norm_kind == "layer":
        raise UnsupportedModelError(f"{spec.family}: a LayerNorm after a block is not supported in MIB's graph")
    gain = GAIN[spec.parts.norm_kind](norm.weight.detach().to(pre.dtype))
    return gain * rms_scale(pre, norm_eps(norm)).to(pre.dtype)


def _mlp(m: LayerModules, into: Tensor) -> Tensor:
    y = m.mlp_write(_norm(m, 1)(into))
    return y if m.post_norms[1] is None else m.post_norms[1](y)


@contextmanager
def _swapped_inputs(m: LayerModules, normed: dict[str, Tensor], spec):
    """While the attention module runs on the query input, its key and value projections read their own inputs:
    a projection of its own gets its input swapped; a fused one is run again on each input, and each branch's
    columns are taken from its own run. A Mamba block, whose B and C are read from x after its convolution, cannot
    be fed apart so: its output is its copy's, fed per reader (``ssd.readers_value``)."""
    groups: dict[nn.Module, list[str]] = {}
    for name in ("query", "key", "value"):
        groups.setdefault(m.branches[name], []).append(name)
    handles = []
    scan = MIXER_RULES.get(m.kind) == "scan"  # dpa's copy of the block reads them too
    token = READERS.set({**READERS.get(), m.attention: dict(normed)}) if scan else None
    rule = RULES[spec.parts.mixer(m.kind).scan] if scan else None
    if rule is not None and not rule.apart:
        groups = {}  # (no column of in_proj is one reader's alone)
        where = f"layers[{getattr(m.attention, 'layer_idx', '?')}].{spec.parts.mixer(m.kind).module}"
        handles.append(m.attention.register_forward_hook(readers_value(m.attention, rule, where), with_kwargs=True))
    try:
        for module, names in groups.items():
            if names == ["query"]:
                continue
            if len(names) == 1:
                x = normed[names[0]]
                handles.append(module.register_forward_pre_hook(lambda _m, a, x=x: (x, *a[1:])))
                continue
            masks = {}
            width = weight_rows(module).shape[0]
            for name in names:
                col = torch.zeros(width, dtype=normed["query"].dtype, device=normed["query"].device)
                cols = m.columns[name]
                col[cols if isinstance(cols, slice) else cols.to(col.device)] = 1
                masks[name] = col

            into = input_scales(m.attention)[0] if scan and rule is RULES["ssd"] else 1.0  # (Falcon-H1's block
            # scales its input before in_proj: so are the other readers')

            def fused(module, _a, out, names=names, masks=masks, into=into):
                total = 0
                for name in names:
                    part = out if name == "query" else module.forward(normed[name] if into == 1 else normed[name] * into)
                    total = total + part * masks[name].to(part.dtype)
                return total
            handles.append(module.register_forward_hook(fused))
        yield
    finally:
        for h in handles:
            h.remove()
        if token is not None:
            READERS.reset(token)


@contextmanager
def _hook(module: nn.Module, pre: Callable):
    handle = module.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        handle.remove()


def check_graph_run(model: nn.Module, spec) -> None:
    """MIB's graph is run module by module (``forward.run``): the norms, the attention module (its output read at
    o_proj's input, o_proj from its weights), the MLP, never the decoder stack's, the layers' or the attention's own
    forward as a whole. A class that replaces one of these forwards (a subclass with a forward of its own) may
    compute something those parts do not: refused by name rather than measured as another model."""
    graph = Graph.of(spec)
    cells = graph.n_writers * graph.n_readers
    if cells > MAX_CELLS:  # (a Mamba model: a unit per channel, 1536 a layer on Mamba-130m)
        raise UnsupportedModelError(
            f"MIB's graph of this model has {graph.n_writers:,} writers and {graph.n_readers:,} readers "
            f"({spec.n_heads:,} units a layer): its edge scores alone would take {cells * 8 / 2**30:.0f} GiB in "
            f"float64, beyond the {MAX_CELLS * 8 / 2**30:.0f} GiB dpa builds; dpa.attribute and dpa.circuit (its "
            "top units and their edges) run on it")
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    if len(devices) > 1:  # the writers' outputs are kept side by side and summed per reader, on one device
        raise UnsupportedModelError(
            f"MIB's graph runs on a model on one device; this one is split across {', '.join(devices)} (a device "
            "map): load it on one device (dpa.attribute and dpa.circuit take a split model)")
    modules = [("the decoder stack", spec.base(model))]
    for i, m in enumerate(layer_modules(model, spec)):
        modules += [(f"layers[{i}]", m.layer)] + ([(f"layers[{i}]'s attention", m.attention)] if m.attention else [])
    for name, module in modules:
        check_not_compiled(name, module)
        forward = type(module).forward
        if own_forward(module):
            raise UnsupportedModelError(
                f"{name} is a {type(module).__name__} whose forward is its own ({forward.__qualname__}, not "
                "transformers'): MIB's graph runs the model part by part (norms, attention heads read at o_proj's "
                "input, MLPs), not that forward, so what it changes would be missed; use the model's own class")


MAX_CELLS = 2 ** 29  # writer x reader cells of the largest MIB graph dpa builds (4 GiB of float64 scores; Llama 3
# 8B's has 3.3 million)


@dataclass
class Batch:
    """A batch of pairs on the instrumented model: its rows, the session, each layer's modules and attention
    arguments, the clean and counterfactual ids [batch pos] and the metric."""

    rows: list[int]
    session: Session
    layers: list[LayerModules]
    args: dict
    clean: Tensor
    counter: Tensor
    metric: Callable[[Tensor], Tensor]

    def run(self, graph: Graph, ids: Tensor, **kw) -> Pass:
        return run(self.session, graph, self.layers, self.args, self.metric, ids, **kw)


@contextmanager
def batch_of(model: nn.Module, pairs, rows: list[int], *, weights=None, grad: bool = False):
    """The pairs ``rows`` as one batch on the model inside ``dpa.instrument`` (linearised with ``weights``, or the
    model's own backward with None): the one request step checks and encodes both prompts of each pair."""
    from .. import request as requests
    from ..instrument import instrument

    check_graph_run(model, requests.check_model(model))
    req = requests.build(model, None, [list(pairs.clean[i]) for i in rows], weights=weights, batch=True)
    cf = requests.build(model, None, [list(pairs.counter[i]) for i in rows], batch=True)
    with instrument(model, req, weights=weights, record={"calls"}, grad=grad) as session:
        yield Batch(list(rows), session, layer_modules(model, req.spec), calls(session), req.input_ids,
                    cf.input_ids, pairs.metric_of(rows))


def batches(model: nn.Module, pairs, batch_size: int, *, weights=None, grad: bool = False,
            rows: list[int] | None = None):
    """The pairs (or ``rows`` of them) in batches of ``batch_size`` (``batch_of``)."""
    order = list(range(len(pairs))) if rows is None else list(rows)
    for start in range(0, len(order), batch_size):
        with batch_of(model, pairs, order[start:start + batch_size], weights=weights, grad=grad) as batch:
            yield batch
