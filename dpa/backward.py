"""``run``: the one door to DPA's backward (book: modified-backward).

    forward   = the model's own modules and attention kernel, taps in place (instrument.py)
    value     = the target direction u dotted with the final normalised residual at each target position
    backward  = one autograd backward through the linearised copy: frozen norms, s * sigmoid(s), mu-scaled branches

The taps write token, head, neuron (and expert) scores during the backward (``Scores``). Everything else a caller
wants from the same pass is a *read-out*: it declares what the forward must record (``record``), whose gradients
the backward must return (``tensors``), and what it makes of them (``adjust`` before the scores settle, ``read``
after, inside the session). ``dpa.attribute``, ``dpa.circuit`` and ``dpa.generate`` are assemblies over ``run``;
a new read-out is a class here (or beside its caller), not a new flag through the pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .errors import InputError, InputTypeError, NonFiniteError, non_finite_cause
from .explicit import edge_scores
from .families import ModelSpec, layer_modules, weight_rows
from .instrument import RECORDABLE, instrument
from .linearise import Scores
from .request import Request
from .result import Attribution, TargetInfo, TargetTerm
from .rules.softcap import softcap
from .targets import continuation_hint, spelling_hint, target_direction
from .weights import PathWeights


@dataclass
class Context:
    """What a read-out may use inside the session, once the backward has run: the session (its recording, its
    model), the request, the scores the taps wrote (settled only in ``read``; None where the session has no taps),
    the target directions [term d_model] (None for a value of another kind) and values [batch], and the dtype of
    the scores."""

    model: nn.Module
    req: Request
    session: Any
    scores: Scores | None
    directions: Tensor | None
    values: Tensor
    dtype: torch.dtype

    @property
    def spec(self) -> ModelSpec:
        return self.req.spec


class Readout:
    """What one read-out records and reads. The default reads nothing. ``run`` checks what a read-out declares
    (``record``: a set of ``instrument.RECORDABLE`` keys; ``tensors``: recorded tensors of the forward's graph) and
    refuses anything else by name."""

    record: frozenset = frozenset()  # recording keys the forward must fill (instrument's ``record``)

    def tensors(self, rec, spec: ModelSpec) -> list[Tensor]:
        """The recorded tensors whose gradients this read-out needs, in the order ``adjust``/``read`` get them."""
        return []

    def adjust(self, ctx: Context, grads: list[Tensor]) -> None:
        """Before the scores settle: may replace the taps' parts (``ctx.scores.parts``)."""

    def read(self, ctx: Context, grads: list[Tensor]) -> Any:
        """After the scores settled, inside the session: this read-out's result (``Run.out[name]``)."""
        return None


class EffectiveTargets(Readout):
    """The effective target at every layer boundary, [batch layer+1 pos d_model] (0: the embeddings): the gradient
    at each layer's input residual and the final norm's."""

    record = frozenset({"resid"})

    def tensors(self, rec, spec):
        return [rec.resid[i] for i in range(spec.n_layers + 1)]

    def read(self, ctx, grads):
        return torch.stack([g.to(ctx.req.device, ctx.dtype) for g in grads], dim=1)


class MidNeurons(Readout):
    """Neurons scored against the target in the middle of their layer, t_mid W_D (the reference code), in place of
    their layer's output target: replaces the taps' neuron parts."""

    record = frozenset({"mid", "neuron_inputs"})

    def tensors(self, rec, spec):
        return [rec.mid[i] for i in spec.neuron_layers]  # (Nemotron-H: its MLP layers')

    def adjust(self, ctx, grads):
        rec = ctx.session.recording
        mods = layer_modules(ctx.model, ctx.spec)
        for i, grad in zip(ctx.spec.neuron_layers, grads):
            lam = grad.to(ctx.dtype) @ weight_rows(mods[i].neurons).detach().to(ctx.dtype)  # [batch pos d_mlp]
            lam = lam * ctx.spec.residual_multiplier  # the MLP's output joins the stream scaled (Granite)
            ctx.scores.parts[("neuron_positions", i)] = [rec.neuron_inputs[i].detach().to(ctx.dtype) * lam]


class Edges(Readout):
    """Every attention edge's score alpha_{h,ij} (lambda_{h,i} . v_{h,j}), [batch layer head query key]
    (explicit.py)."""

    record = frozenset({"branches", "head_inputs", "rope"})

    def tensors(self, rec, spec):
        return [rec.head_inputs[i] for i in spec.mixing_layers] + (  # (Nemotron-H's MLP layers: no units, no edges)
            [rec.head_inputs[("beside", i)] for i in range(spec.n_layers)] if spec.n_beside else [])  # (Falcon-H1)

    def read(self, ctx, grads):
        lam = dict(zip(ctx.spec.mixing_layers, grads))
        if ctx.spec.n_beside:  # the mixer beside attention's: the target on its output projection's input
            lam.update(zip((("beside", i) for i in range(ctx.spec.n_layers)), grads[len(ctx.spec.mixing_layers):]))
        return edge_scores(ctx.spec, ctx.model, ctx.req, ctx.session.recording, lam, ctx.dtype)


@dataclass
class Run:
    """What one instrumented forward + backward produced, batched [batch ...], and each read-out's result (``out``)."""

    scores: Scores
    values: Tensor  # [batch] the attributed quantity at the forward pass
    probs: Tensor | None  # [term vocab] next-token probabilities at the target positions
    capped: Tensor | None = None  # [batch] the value after the final soft-cap (Gemma 2), where there is one
    term_rows: list[int] | None = None  # each term's row (Request.terms)
    term_values: Tensor | None = None  # [term] each term's share of values (a target token's logit or logprob)
    per_term: list[Scores] | None = None  # each term's own scores (each_term=True: one backward per term)
    term_capped: Tensor | None = None  # [term] each term's value after the final soft-cap, where there is one
    out: dict = field(default_factory=dict)  # {read-out name: its result}


def run(model: nn.Module, req: Request, readouts: dict[str, Readout] | None = None, *, lean: bool = False,
        positions: bool = False, probabilities: bool = True, each_term: bool = False) -> Run:
    """One instrumented forward and one linearised backward for ``req`` (``dpa.request.build``), with the
    ``readouts`` asked for ({name: Readout}; their results in ``Run.out``). ``lean`` recomputes one layer at a time
    in the backward; ``positions`` keeps neuron scores per position; ``probabilities`` computes the next-token
    distribution at each target position; ``each_term`` runs one backward per target term (a target of several
    tokens; token, head and neuron scores only) and keeps each term's scores."""
    readouts = check_readouts(readouts)
    if each_term and readouts:
        raise ValueError("each_term gives token, head and neuron scores only")
    spec = req.spec
    dtype = torch.float64 if spec.embed(model).weight.dtype == torch.float64 else torch.float32
    record = set().union(*(r.record for r in readouts.values()))
    scores = Scores.empty(spec, req.batch, req.n_tokens, dtype, req.device, positions)
    with instrument(model, req, weights=req.weights, scores=scores, record=record, lean=lean) as session:
        try:
            hidden = session.forward()  # [batch pos d_model], the model's own values
        except NonFiniteError as err:  # met inside a block (a scan block's input): name the parameter where one is
            cause = None if "parameter" in str(err) else non_finite_cause(model)
            if cause is None:
                raise
            raise NonFiniteError(f"{err}; {cause}") from None
        final, probs, logits, rows = _final(session, req, hidden, dtype, probabilities)
        terms, u, term_values, values, term_capped, after_cap = _values(model, req, final, probs, logits, rows, dtype)
        per_term, out = None, {}
        if each_term:  # one backward per term, the graph kept between them: each term's own scores
            per_term = []
            for j in range(len(terms)):
                session.backward(term_values[j], again=j < len(terms) - 1)
                per_term.append(scores.take())
            scores = sum_scores(per_term)
        else:
            out = read_out(Context(model, req, session, scores, u.detach(), values.detach(), dtype), values.sum(),
                           readouts)
    names = ("tokens", "heads", "neurons", "bias")  # "the token scores", ...
    bad = [n for s in [scores, *(per_term or [])] for n in names if not finite(getattr(s, n))]
    if bad:
        raise NonFiniteError(f"the {bad[0].removesuffix('s')} scores are not finite (NaN or inf): " + non_finite_cause(
            model, f"the path weights {req.weights.as_tuple()} or the target overflow in {dtype}"))
    return Run(scores=scores, values=values.detach(), probs=probs, capped=after_cap, term_rows=rows,
               term_values=term_values.detach(), per_term=per_term, term_capped=term_capped, out=out)


def check_readouts(readouts) -> dict[str, Readout]:
    """``{name: Readout}``, each asking to record only what a session can record; anything else refused by name."""
    if readouts is None:
        return {}
    if not isinstance(readouts, Mapping):
        raise InputTypeError(f"readouts must be a dict of name -> dpa.backward.Readout, got {type(readouts).__name__}")
    for name, r in readouts.items():
        if not isinstance(r, Readout):
            raise InputTypeError(f"read-out {name!r} is a {type(r).__name__}, not a dpa.backward.Readout")
        record = r.record
        if not isinstance(record, (set, frozenset)) or not all(isinstance(k, str) for k in record):
            raise InputTypeError(f"read-out {name!r}: record must be a set of recording keys "
                                 f"(frozenset({{'resid'}})), got {record!r}")
        unknown = sorted(record - RECORDABLE)
        if unknown:
            raise InputError(f"read-out {name!r} asks to record {', '.join(map(repr, unknown))}; a session records "
                             f"{', '.join(sorted(RECORDABLE))}")
    return dict(readouts)


def _tensors(name: str, r: Readout, ctx: Context) -> list[Tensor]:
    """The tensors read-out ``name`` wants the gradients of, checked: each recorded, each in the backward's graph."""
    try:
        tensors = list(r.tensors(ctx.session.recording, ctx.spec))
    except KeyError as err:
        raise InputError(f"read-out {name!r}: its tensors() read {err} of a recording it did not ask for; add the "
                         f"recording's key to its record (it asks for {sorted(r.record) or 'nothing'})") from None
    for t in tensors:
        if not isinstance(t, Tensor) or not t.requires_grad:
            got = "a tensor outside the graph" if isinstance(t, Tensor) else type(t).__name__
            raise InputError(f"read-out {name!r}: tensors() must give tensors of the forward's graph (recorded "
                             f"ones), got {got}")
    return tensors


def read_out(ctx: Context, value: Tensor, readouts: dict[str, Readout]) -> dict:
    """One backward from the scalar ``value`` through the session's model (``ctx.session``), each read-out given the
    gradients of the tensors it declares (``tensors``), then ``adjust``, the taps' scores settled (where the session
    has them), ``read``: {name: result}. ``run`` calls it for the target's value; a caller with a forward and value
    of its own calls it in its own session (MIB's graph, run reader by reader: ``mib.methods``)."""
    wanted = {name: _tensors(name, r, ctx) for name, r in readouts.items()}
    flat = ctx.session.backward(value, [t for ts in wanted.values() for t in ts])
    grads, k = {}, 0
    for name, ts in wanted.items():
        grads[name], k = flat[k:k + len(ts)], k + len(ts)
    for name, r in readouts.items():
        r.adjust(ctx, grads[name])
    if ctx.scores is not None:
        ctx.scores.settle()
    return {name: r.read(ctx, grads[name]) for name, r in readouts.items()}


def _final(session, req: Request, hidden: Tensor, dtype, probabilities: bool):
    """The final normalised residual at every target term's position [term d_model] (on the unembedding's device: a
    device map may put the last layers and the head elsewhere), the model's next-token distribution there (and
    its logits) when asked for or needed, and each term's row."""
    spec, model = req.spec, session.model
    unembed = spec.unembed(model).weight
    rows, at = req.terms()  # every term (a target token: several under teacher forcing), flat
    first = [rows.index(b) for b in range(req.batch)]  # each row's first term: its target position
    final = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(at, device=hidden.device)]
    final = final.to(unembed.device)
    if not finite(final.detach()):
        raise NonFiniteError(_locate_non_finite(session))
    probs = logits = None
    if probabilities:
        with torch.no_grad():
            logits = spec.logits((final.detach().to(unembed.dtype) @ unembed.T).to(dtype))  # [term vocab]
        if not finite(logits):
            raise NonFiniteError("non-finite logits (NaN or inf): the unembedding overflows on this input")
        req.resolve(logits[first])
        probs = softcap(logits, spec.final_softcap).softmax(-1)  # the model's own distribution, in `dtype`
    return final, probs, logits, rows


def _values(model: nn.Module, req: Request, final: Tensor, probs, logits, rows: list[int], dtype):
    """Each term's target, direction u [term d_model] and value; the values per row [batch]; and, under a final
    soft-cap, each term's and each row's value after the cap."""
    spec = req.spec
    unembed = spec.unembed(model).weight.detach().to(dtype)
    first = [rows.index(b) for b in range(req.batch)]
    capped = spec.final_softcap is not None
    terms = [req.targets[b].term(j - first[b]) for j, b in enumerate(rows)]
    u = torch.stack([target_direction(t, unembed, None if probs is None else probs[j],
                                      (logits[j], spec.final_softcap) if capped and probs is not None else None)
                     for j, t in enumerate(terms)])
    if spec.logits_scaling != 1 or spec.logits_multiplier != 1:  # the model scales its logits (Granite, Falcon-H1):
        u = torch.stack([v if t.kind == "vector" else spec.logits(v) for v, t in zip(u, terms)])  # every direction
        # read from the unembedding
    term_values = (final.to(dtype) * u).sum(-1)  # [term]
    index = torch.tensor(rows, device=u.device)
    values = term_values.new_zeros(req.batch).index_add(0, index, term_values)
    if not capped:
        return terms, u, term_values, values, None, None
    scaled = spec.logits(unembed)  # (no copy unless the model scales its logits)
    term_capped = _after_cap(terms, final.detach().to(dtype), scaled, term_values.detach(), spec.final_softcap)
    after_cap = term_capped.new_zeros(req.batch).index_add(0, index.to(term_capped.device), term_capped)
    return terms, u, term_values, values, term_capped, after_cap


def attribution(model: nn.Module, req: Request, run: Run, b: int, neuron_target: str = "output",
                neuron_positions: bool = False, method: str = "dpa", weights: PathWeights | None = None
                ) -> Attribution:
    """Row ``b`` of a run as an ``Attribution``: its tokens, scores, target and read-outs (edges, effective targets),
    cut to the row's real tokens. The one result builder: DPA's runs and the baselines' (``baselines.common``, whose
    ``Run`` holds the scores a method computed, the model's own probabilities and the metric) come out here.
    ``weights``: the path weights to report (default: the request's)."""
    real = req.real(b)
    ids = req.token_ids(b)
    info = _target_info(req, run, b)
    s = run.scores
    token_scores = s.tokens[b].cpu()[real]
    positions = None if s.position_scores is None else s.position_scores[b].cpu()[real]
    value = float(run.values[b])
    keep = slice(int(real[0]), int(real[0]) + len(real))
    pick = lambda x, *index: None if x is None else x[(b, *index)].cpu()  # noqa: E731
    probs = None if run.probs is None else run.probs[run.term_rows.index(b)]
    top = None if probs is None else probs.topk(min(5, probs.numel()))
    return Attribution(
        tokens=req.decode(ids), token_ids=ids, token_scores=token_scores,
        head_scores=s.heads[b].cpu(), neuron_scores=s.neurons[b].cpu(),
        target_logit=value, target=info, weights=req.weights if weights is None else weights, method=method,
        completeness_gap=(float(token_scores.sum()) + float(s.bias[b]) - value
                          + (0.0 if positions is None else float(positions.sum()))),
        bias_share=float(s.bias[b]), position_scores=positions, expert_scores=pick(s.experts),
        expert_position_scores=pick(s.expert_positions, slice(None), keep) if neuron_positions else None,
        n_experts=req.spec.n_experts or None, d_expert=req.spec.d_expert or None, dense_layers=req.spec.dense_layers,
        d_dense=req.spec.d_dense if req.spec.dense_layers else None, layer_kinds=req.spec.unit_kinds,
        beside=(req.spec.beside_kind, req.spec.n_heads) if req.spec.n_beside else None,
        n_kv_heads=req.spec.n_kv_heads, special=req.special(ids),
        top_predictions=[] if top is None else [(req.decode([int(i)])[0], float(p))
                                                for p, i in zip(top.values, top.indices)],
        model_name=getattr(model.config, "_name_or_path", "") or req.spec.family, neuron_target=neuron_target,
        edge_scores=pick(run.out.get("edges"), slice(None), slice(None), keep, keep),
        neuron_position_scores=pick(s.neuron_positions, slice(None), keep) if neuron_positions else None,
        effective_targets=pick(run.out.get("effective_targets"), slice(None), keep),
    )


def _target_info(req: Request, run: Run, b: int) -> TargetInfo:
    """Row ``b``'s target: its token(s), probability and log-probability, each term of a target of several tokens,
    the value after a final cap, and the spelling hints."""
    t = req.targets[b]
    mine = [j for j, r in enumerate(run.term_rows) if r == b]  # this row's terms (several: a target of several tokens)
    probs = None if run.probs is None else run.probs[mine[0]]
    name = lambda i: None if i is None else req.decode([i])[0]  # noqa: E731
    known = probs is not None and t.token_id is not None
    hints = [] if probs is None else [spelling_hint(req.tokenizer, text, i, probs, what) for text, i, what in
                                      ((None if t.tokens else t.text, t.token_id, "target"),
                                       (t.contrast_text, t.contrast_id, "contrast"))]
    if t.tokens and probs is not None:  # several tokens: judged on the first, at the first position
        hints.append(continuation_hint(req.tokenizer, t.text, t.tokens[0], probs))
    terms = None
    if t.tokens:  # each token at its own position; the continuation's probability is their product
        p = [float(run.probs[j][i]) if run.probs is not None else None for j, i in zip(mine, t.tokens)]
        terms = [TargetTerm(position=req.position(b) + k, token=name(i), token_id=i,
                            value=float(run.term_values[j]), probability=p[k])
                 for k, (j, i) in enumerate(zip(mine, t.tokens))]
    logprob = (None if not known else float(probs[t.token_id].clamp_min(1e-45).log()) if terms is None else
               sum(math.log(max(q, 1e-45)) for q in p))
    return TargetInfo(
        kind=t.kind, position=req.position(b),
        token=name(t.token_id) if terms is None else t.text, token_id=t.token_id,  # several tokens: as written
        contrast=name(t.contrast_id), contrast_id=t.contrast_id,
        probability=None if logprob is None else (float(probs[t.token_id]) if terms is None else math.exp(logprob)),
        logprob=logprob, hint=" ".join(h for h in hints if h) or None,
        capped_logit=None if run.capped is None or t.kind == "vector" else float(run.capped[b]),
        terms=terms,
    )


def sum_scores(parts: list[Scores]) -> Scores:
    """One ``Scores`` holding the sums of several settled ones (the terms of one target)."""
    first = parts[0]
    total = Scores(first.spec, first.shape, first.dtype, first.device, first.positions)
    for name in ("tokens", "heads", "neurons", "neuron_positions", "bias", "position_scores", "experts",
                 "expert_positions"):
        values = [getattr(p, name) for p in parts]
        setattr(total, name, None if values[0] is None else torch.stack(values).sum(0))
    return total


def _after_cap(terms: list, final: Tensor, unembed: Tensor, values: Tensor, cap: float) -> Tensor:
    """Each term's attributed value after the final soft-cap [term]: cap(z_y), cap(z_y) - cap(z_y') for a
    contrast, the value itself for a log-probability (whose direction already has the cap linearised), NaN for
    a vector."""
    out = []
    for j, t in enumerate(terms):
        if t.kind == "logprob":
            out.append(values[j])
        elif t.kind == "vector":
            out.append(values.new_tensor(float("nan")))
        else:
            z = softcap(final[j] @ unembed[t.token_id], cap)
            z = z - softcap(final[j] @ unembed[t.contrast_id], cap) if t.kind == "contrast" else z
            out.append(-z if t.negate else z)
    return torch.stack(out)


def finite(t: Tensor) -> bool:
    """No NaN or inf in ``t``: one reduction first (a non-finite entry makes the sum so), the elementwise
    check only when the sum overflows or is not finite."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _locate_non_finite(session) -> str:
    """Name the first layer whose output is not finite (one more forward pass, only on failure)."""
    model, req, spec = session.model, session.request, session.spec
    found: list[str] = []
    real = req.mask[..., None]

    def check(name):
        def hook(_m, _a, out):
            out = out[0] if isinstance(out, tuple) else out
            if not found and not torch.isfinite(out.masked_fill(~real, 0)).all():
                found.append(name)
        return hook

    handles = [spec.embed(model).register_forward_hook(check("the embeddings"))]
    handles += [layer.register_forward_hook(check(f"layer {i}")) for i, layer in enumerate(spec.layers(model))]
    try:
        with torch.no_grad():
            session.forward()
    finally:
        for h in handles:
            h.remove()
    where = found[0] if found else "the final norm or the unembedding"
    return f"non-finite activations (NaN or inf) in the output of {where}; " + non_finite_cause(
        model, "the model's weights or dtype overflow on this input (try float32)")
