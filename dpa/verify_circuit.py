"""Path patching on the real model: the causal check of one edge of a circuit graph (book: circuits-as-graphs).

For an edge u -> v: run the model with out_u removed from the residual stream *as v's block reads it* (a
pre-hook on the module that reads the residual stream for that block: its input norm, or the block itself), and
nothing else changed. Two measures:

* ``direct``: the change of S_v = z_v . G_v, v's tap input z_v against G_v held at its DPA value: the edge's own
  quantity, so that in the linearised model it equals E(u -> v) exactly (tests/test_circuit.py);
* ``target``: the change of the attributed value (u . final residual, the target direction held) when v's write
  alone is replaced by its patched one and everything downstream recomputes.

For an edge into the target both are the change of the value with out_u removed from the final norm's input.

An edge is DPA's *share* of an effect: each path of v's block counts with its weight mu (query 0.25, key 0.25,
value 0.5 by default), while patching measures the whole effect. ``first_order`` is what the linearised model
predicts for the patch itself, every path of v's block at weight 1 (out_u . g_v with all mu = 1): the number to
compare ``direct`` with, and ``edge / first_order`` is the share the path weights give the edge.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import request as requests
from .circuit_graph import unit_tap
from .errors import InputError
from .families import layer_modules
from .instrument import instrument


def _reader(mods, block: int) -> nn.Module:
    """The module through which a block reads the residual stream: its input norm, or the block (OLMo 2)."""
    if mods.block_inputs:
        return mods.block_inputs[block]
    return mods.attention if block == 0 else mods.mlp


def _first(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _replace_first(args: tuple, kwargs: dict, value: Tensor) -> tuple[tuple, dict]:
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _upstream(circ, src, dst) -> bool:
    from .circuit_graph import read_slot

    return 2 * src.layer + src.block < read_slot(circ._spec, dst)


class _ExpertTerm:
    """Hooks on a sparse block of the real model that keep one expert's term of its output, w_e(x) E_e(x)
    [1 pos d_model], in ``seen["z"]`` (a routed expert: the experts module again with the other routing weights
    zeroed; the shared expert: its gate's sigmoid times its output), and with ``replace`` swap that term at
    ``rows`` of the block's output for the given one (v's write replaced, nothing else)."""

    def __init__(self, mods, spec, slot: int, rows: slice, seen: dict, replace: Tensor | None):
        self.mods, self.spec, self.slot, self.rows, self.seen, self.replace = mods, spec, slot, rows, seen, replace

    def hooks(self) -> list:
        m = self.mods
        if self.slot < self.spec.n_experts:
            out = [m.experts.register_forward_hook(self._routed)]
        else:
            out = [m.shared.register_forward_hook(self._shared)]
            out += [m.shared_gate.register_forward_hook(self._gate)] if m.shared_gate is not None else []
        # the term is replaced in the output that holds it: the block's, or a shared expert's beside it (Granite's,
        # run after the block), which the layer adds to the block's
        beside = m.shared_beside and self.slot >= self.spec.n_experts
        return out + [(m.shared if beside else m.mlp).register_forward_hook(self._block)]

    def _routed(self, module, args, _out):
        hidden, index, weights = args
        keep = (index == self.slot).to(weights.dtype)
        z = type(module).forward(module, hidden, index, weights * keep).detach()
        latent = self.mods.latent_out  # (experts in a latent space: their term is what the projection out makes it)
        self.seen["z"] = (z if latent is None else latent(z))[None]

    def _shared(self, _module, _args, out):
        self.seen["shared"] = out.detach()
        if self.mods.shared_gate is None:  # ungated, beside the block (Granite's)
            self.seen["z"] = out.detach().reshape(1, -1, self.spec.d_model)

    def _gate(self, _module, _args, out):
        self.seen["z"] = (torch.sigmoid(out.detach()) * self.seen["shared"]).reshape(1, -1, self.spec.d_model)

    def _block(self, _module, _args, out):
        if self.replace is None:
            return None
        y = out[0] if isinstance(out, tuple) else out
        y = y.clone()
        delta = (self.replace - self.seen["z"]).to(y.dtype).reshape(1, -1, y.shape[-1])
        y[:, self.rows] = y[:, self.rows] + delta[:, self.rows]
        return (y, *out[1:]) if isinstance(out, tuple) else y


def _score(z: Tensor, cols: slice, G: Tensor) -> float:
    """S_v = z_v . G_v: v's tap input (its columns) against its DPA gradient, G held."""
    return float((z[0, :, cols].to(G.dtype).cpu() * G).sum())


def _forward_with(model: nn.Module, req, pre_hooks: list, term: _ExpertTerm | None = None) -> Tensor:
    """One forward of the model (no grad) with forward pre-hooks ``[(module, hook)]`` and, into an expert, the
    hooks that read (or replace) its term; every hook is removed again, even when the forward fails."""
    with instrument(model, req, grad=False) as session:
        handles = []
        try:
            for module, hook in pre_hooks:
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            if term is not None:
                handles += term.hooks()
            return session.forward()
        finally:
            for h in handles:
                h.remove()


def _same_model(circ, model: nn.Module) -> None:
    """The model must be the one the circuit was computed on, its weights unchanged (``ModelIdentity``): the
    circuit's writes, gradients and edges are that model's, and on another they would be silently wrong."""
    if circ._model is None:
        raise InputError("this circuit does not record the model it was computed on (built by hand?): compute it "
                         "with dpa.circuit to verify it")
    circ._model.check(model)


def path_patch(circ, model: nn.Module, tokenizer, edge) -> dict[str, Any]:
    if not isinstance(edge, (tuple, list)) or len(edge) != 2:
        raise InputError(f"edge must be (source, destination), got {edge!r}")
    s, d = circ.index(edge[0]), circ.index(edge[1])
    src, dst = circ.nodes[s], circ.nodes[d]
    if src.kind not in ("token", "head", "neuron", "expert"):
        raise InputError(f"the source of a verified edge is a token or a unit, not {src.kind} ({src.label})")
    if dst.kind not in ("head", "neuron", "expert", "target"):
        raise InputError(f"the destination of a verified edge is a unit or the target, not {dst.kind} ({dst.label})")
    if src.kind != "token" and dst.kind != "target" and not _upstream(circ, src, dst):
        raise InputError(f"{src.label} is not upstream of {dst.label}: {dst.label}'s block does not read its write")
    if circ._writes is None:
        raise InputError("this circuit was loaded without its tensors (from JSON): compute it again to verify edges")
    req = requests.build(model, tokenizer, circ.token_ids, None, batch=False)
    _same_model(circ, model)
    spec = req.spec
    if spec.d_model != circ._writes.shape[-1] or req.n_tokens != len(circ.token_ids):
        raise InputError("this circuit was computed on another model (its sizes differ)")
    mods = layer_modules(model, spec)
    if src.kind == "token":
        write = torch.zeros_like(circ._embeddings)
        write[src.position] = circ._embeddings[src.position]
    else:
        write = circ._writes[s - len(circ.tokens)]  # [pos d_model]
    u = circ._direction
    pos = circ.target.position
    if dst.kind == "target":
        reader, tap, cols = spec.final_norm(model), None, None
    elif dst.kind == "expert":  # its "tap" is its term of the sparse block (_ExpertTerm), all of d_model
        reader, tap, cols = _reader(mods[dst.layer], 1), None, slice(None)
    else:
        m = mods[dst.layer]
        reader, (tap, cols) = _reader(m, dst.block), unit_tap(m, spec, dst)
    G = circ._reads.get(d)

    def run(remove: bool, replace: Tensor | None = None) -> tuple[float, Tensor | None]:
        """One forward: the value, and v's tap input; ``remove`` patches v's read, ``replace`` v's tap slice."""
        seen: dict[str, Tensor] = {}
        rows = slice(None) if dst.position is None else slice(dst.position, dst.position + 1)

        def patch(_m, args, kwargs):
            x = _first(args, kwargs)
            return _replace_first(args, kwargs, x - write.to(x.device, x.dtype)[None])

        def keep(_m, args, kwargs):
            z = _first(args, kwargs)
            seen["z"] = z.detach()
            if replace is not None:
                z = z.clone()
                z[0, rows, cols] = replace.to(z.dtype)[0, rows, cols]
                return _replace_first(args, kwargs, z)
            return None
        hooks = ([(reader, patch)] if remove else []) + ([(tap, keep)] if tap is not None else [])
        term = _ExpertTerm(mods[dst.layer], spec, dst.index, rows, seen, replace) if dst.kind == "expert" else None
        hidden = _forward_with(model, req, hooks, term)
        value = float(hidden[0, pos].to(u.dtype) @ u.to(hidden.device))
        return value, seen.get("z")

    clean, z_clean = run(False)
    patched, z_patched = run(True)
    if dst.kind == "target":
        direct = through = clean - patched
    else:
        direct = _score(z_clean, cols, G) - _score(z_patched, cols, G)
        through = clean - run(False, replace=z_patched)[0]
    e = float(circ.edges[s, d])
    first = e if dst.kind == "target" else _first_order(circ, model, req, mods, dst, G, write)
    return {"source": src.label, "destination": dst.label, "edge": e, "first_order": first, "direct": direct,
            "target": through, "ratio": direct / first if first != 0 else float("nan")}


def _first_order(circ, model: nn.Module, req, mods, dst, G: Tensor, write: Tensor) -> float:
    """out_u . g_v with every path of v's block at weight 1: v's block run again on its input (one forward of
    the model records it) in the linearised model with all mu = 1, as ``dpa.circuit`` does for its edges."""
    from .circuit_graph import pullback
    from .linearise import Scores
    from .weights import PathWeights

    spec = req.spec
    dtype = write.dtype
    scores = Scores.empty(spec, 1, req.n_tokens, dtype, req.device, False)
    record = {"resid", "mid", "calls", "head_inputs", "neuron_inputs"}
    with instrument(model, req, weights=PathWeights(*(1,) * (7 if spec.n_experts else 5)), scores=scores, record=record) as session:
        session.forward()
        rec = session.recording
        layer = dst.layer
        resid = {layer: rec.resid[layer][0].detach().to(dtype)}
        mid = {i: m[0].detach().to(dtype) for i, m in rec.mid.items() if i == layer}  # (none without an MLP)
        g, _, _ = pullback(session, mods[layer], layer, dst.block, [dst], [G], resid, mid, dict(rec.calls), dtype)
    return float((g[0] * write.to(dtype)).sum())


def patch_read(circ, model: nn.Module, tokenizer, node, position: int, corrupt) -> dict[str, Any]:
    """Path patching from a position: v's block reads the residual stream at ``position`` from a run on
    ``corrupt`` (a prompt of the same length: the clean one with one token swapped, say), everything else from
    the clean run; returns S_v clean and patched (z_v . G_v, G_v held), their difference, and DPA's in-flow of v
    from that position (``Circuit.in_positions``) beside it."""
    v = circ.nodes[circ.index(node)]
    d = circ.index(node)
    if v.kind not in ("head", "neuron", "expert"):
        raise InputError(f"patch_read takes a head, a neuron or an expert, not {v.kind} ({v.label})")
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < len(circ.tokens):
        raise InputError(f"position must be an int in [0, {len(circ.tokens)}), got {position!r}")
    if circ._writes is None:
        raise InputError("this circuit was loaded without its tensors (from JSON): compute it again to patch reads")
    clean_req = requests.build(model, tokenizer, circ.token_ids, None, batch=False)
    _same_model(circ, model)
    bad_req = requests.build(model, tokenizer, corrupt, None, batch=False)
    if bad_req.n_tokens != clean_req.n_tokens:
        raise InputError(f"the corrupt prompt has {bad_req.n_tokens} tokens, the circuit's {clean_req.n_tokens}: "
                         "path patching needs the same positions")
    mods = layer_modules(model, clean_req.spec)[v.layer]
    reader = _reader(mods, v.block)
    tap, cols = (None, slice(None)) if v.kind == "expert" else unit_tap(mods, clean_req.spec, v)
    G = circ._reads[d]
    rows = slice(None) if v.position is None else slice(v.position, v.position + 1)

    def run(req, replace: Tensor | None) -> tuple[Tensor, Tensor]:
        seen: dict[str, Tensor] = {}

        def read(_m, args, kwargs):
            x = _first(args, kwargs)
            seen["x"] = x.detach()
            if replace is None:
                return None
            x = x.clone()
            x[0, position] = replace.to(x.dtype)
            return _replace_first(args, kwargs, x)

        def keep(_m, args, kwargs):
            seen["z"] = _first(args, kwargs).detach()
        hooks = [(reader, read)] + ([(tap, keep)] if tap is not None else [])
        term = None if tap is not None else _ExpertTerm(mods, clean_req.spec, v.index, rows, seen, None)
        _forward_with(model, req, hooks, term)
        return seen["x"], seen["z"]

    x_bad, _ = run(bad_req, None)
    _, z_clean = run(clean_req, None)
    _, z_patched = run(clean_req, x_bad[0, position])
    clean, patched = _score(z_clean, cols, G), _score(z_patched, cols, G)
    return {"node": v.label, "position": position, "token": circ.tokens[position], "clean": clean,
            "patched": patched, "change": clean - patched, "in_flow": float(circ.in_positions[d, position])}
