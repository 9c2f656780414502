"""``attribute``: one forward and one backward pass through the linearised model (book: modified-backward).

    request   = the one request step (request.py)
    forward   = the model's own modules and attention kernel, taps in place (instrument.py)
    backward  = autograd through the linearised copy: frozen norms, s * sigmoid(s), mu-scaled branches

Token scores are embedding . gradient, head scores each head's slice of the o_proj input . its
gradient, neuron scores the down_proj input . its gradient: the taps write them during the backward.
Edge scores need alpha itself and come from the explicit path (explicit.py).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from . import request as requests
from .checks import check_bool, check_choice
from .errors import InputError, NonFiniteError, TargetWarning, UnsupportedModelError
from .explicit import edge_scores
from .families import ModelSpec, layer_modules, weight_rows
from .instrument import instrument
from .linearise import Scores
from .request import Prompt, Request
from .result import Attribution, TargetInfo, TargetTerm
from .targets import continuation_hint, spelling_hint, target_direction
from .weights import PathWeights


def attribute(model: nn.Module, tokenizer, prompt: Prompt | list[Prompt], target=None, *, contrast=None,
              kind: Literal["logit", "logprob"] = "logit", position: int | list[int] | None = None,
              weights: PathWeights | None = None, edges: bool = False, neuron_positions: bool = False,
              effective_targets: bool = False, neuron_target: Literal["output", "mid"] = "output",
              multi_token: Literal["error", "first", "sum"] = "error", memory: Literal["auto", "full", "lean"] = "auto",
              padding_side: Literal["right", "left"] = "right",
              probabilities: bool = True) -> Attribution | list[Attribution]:
    """Dual Path Attribution of ``target`` at the end of ``prompt``: token, head and neuron scores from one forward
    and one linearised backward pass (the book: *DPA is a modified backward pass*).

    model: a transformers causal LM of a supported family (``dpa.load_model`` gives the default one).
    tokenizer: its tokenizer; None when the prompt and the target are token ids.
    prompt: a string, a list/LongTensor/numpy array of token ids, a tokenizer's output (``BatchEncoding``: each row
        cut to its attention mask), or a list of those (a batch: one ``Attribution`` per prompt).
    target: a token string or id (default: the model's own prediction), or a float tensor of shape exactly
        [d_model] (a direction on the final normalised residual, on any device: moved to the model's; a batch takes
        a list of them, one per prompt).
    contrast: a foil token: the target's logit minus the foil's is attributed (IOI's logit difference).
    kind: "logit" (default) or "logprob" (log p(target), with p held fixed).
    position: the target position (default: the last token; negative counts from the end).
    weights: the path weights mu (``dpa.PathWeights``; default the paper's: query = key = 0.25, value = 0.5,
        gate = up = 0.5). ``PathWeights.control_content(1.0)`` keeps content paths only, where the token scores
        add up to the target logit.
    edges: also score every attention edge, ``edge_scores`` [layer, head, query, key] (the heads' scores per key).
    neuron_positions: also score every neuron at every position, ``neuron_position_scores`` [layer, pos, d_mlp].
    effective_targets: also return the effective target at every layer and position, ``effective_targets``
        [layer + 1, pos, d_model] (0: the embeddings), the vectors every score is a dot product with.
    neuron_target: "output" (default, the paper: neurons scored against their layer's output target) or "mid"
        (the reference code: against the target in the middle of the layer).
    multi_token: what a target string of several tokens does: "error" (default), "first" (its first token) or
        "sum" (the whole of it under teacher forcing: its tokens are appended to the prompt but the last, and the
        attributed quantity is the sum of each token's logit -- with ``kind="logprob"``, of each token's logit minus
        the expected logit at its position, p held fixed -- read at the position before it, in one forward and one
        backward pass; ``target.terms`` has each token's share and probability, ``target.logprob`` the true log p of
        the whole, and the token scores cover the appended tokens too). Read after the whole prompt (``position`` the
        last token). A contrast of one token is subtracted at the first position; a contrast of several tokens is
        read the same way in a sequence of its own (the prompt and its tokens, a second row of the same forward and
        backward pass) and its sum subtracted: its forced tokens follow the target's in ``tokens`` and its terms
        follow the target's in ``target.terms`` (``contrast=True``); edges, position-level neurons and effective
        targets take a contrast of one token.
    memory: "full" keeps the whole graph of the forward pass, "lean" recomputes one decoder layer at a time in the
        backward, "auto" (default) picks lean when the full graph would not fit in half the free memory. Both give
        the same scores.
    padding_side: checked but not needed: dpa pads a batch on the right itself, and the scores never depend on
        padding.
    probabilities: also compute the next-token distribution at the target position (``target.probability``,
        ``top_predictions``): one product with the whole unembedding per prompt, a few percent of the call on a
        small model and a short prompt; always computed when the target is the prediction or a log-probability.

    Returns an ``Attribution`` (a list of them for a batch). Raises a ``dpa.DPAError`` naming the argument for
    every input it cannot attribute; the model is left exactly as it was, even when a call fails.
    """
    check_choice("neuron_target", neuron_target, ("output", "mid"))
    check_choice("memory", memory, ("auto", "full", "lean"))
    edges, neuron_positions = check_bool("edges", edges), check_bool("neuron_positions", neuron_positions)
    effective_targets = check_bool("effective_targets", effective_targets)
    probabilities = check_bool("probabilities", probabilities)
    req = requests.build(model, tokenizer, prompt, target, contrast=contrast, kind=kind, position=position,
                         weights=weights, padding_side=padding_side, multi_token=multi_token,
                         multi_options=requests.MULTI_TOKEN)
    spec = req.spec
    if req.contrast_rows and (edges or neuron_positions or effective_targets or neuron_target == "mid"):
        raise InputError("a contrast of several tokens is read in a sequence of its own (the prompt and its tokens), "
                         "so its position-level scores have no place beside the target's: edges, neuron_positions, "
                         "effective_targets and neuron_target='mid' take a contrast of one token")
    if neuron_target == "mid" and spec.n_experts:
        raise UnsupportedModelError(f"neuron_target='mid' reads each neuron's down projection; {spec.family}'s "
                                    "neurons are inside its experts: use neuron_target='output'")
    if neuron_target == "mid" and spec.parallel:
        raise UnsupportedModelError(f"neuron_target='mid' needs the residual stream between attention and the MLP; "
                                    f"{spec.family} runs them in parallel (use_parallel_residual), so there is none: "
                                    "use neuron_target='output'")
    dtype = torch.float64 if spec.embed(model).weight.dtype == torch.float64 else torch.float32
    lean = plan_memory(model, spec, req.batch, req.n_tokens, memory)
    probabilities = probabilities or kind == "logprob" or any(t.kind != "vector" and t.token_id is None
                                                                for t in req.targets)
    run = _run(model, req, dtype, lean=lean, edges=edges, neuron_positions=neuron_positions or neuron_target == "mid",
               effective_targets=effective_targets, neuron_target=neuron_target, probabilities=probabilities)
    results = [_result(model, req, run, b, neuron_target, neuron_positions) for b in range(req.n_prompts)]
    for b, row in enumerate(req.contrast_rows):  # a contrast of several tokens: its own row, merged in
        if row is not None:
            results[b] = with_contrast(results[b], _result(model, req, run, row, neuron_target, False), req, b)
    for res in results:
        if res.target.hint:
            warnings.warn(res.target.hint, TargetWarning, stacklevel=2)
    return results if req.batched else results[0]


@dataclass
class Run:
    """What one instrumented forward + backward produced, batched [batch ...]."""

    scores: Scores
    values: Tensor  # [batch] the attributed quantity at the forward pass
    probs: Tensor | None  # [batch vocab] next-token probabilities at the target positions
    edges: Tensor | None  # [batch layer head query key]
    effective_targets: Tensor | None  # [batch layer+1 pos d_model]
    capped: Tensor | None = None  # [batch] the value after the final soft-cap (Gemma 2), where there is one
    graph: object = None  # what a ``Graph`` extension built inside the session (circuit.py)
    term_rows: list[int] | None = None  # each term's row (Request.terms); probs are per term then: [term vocab]
    term_values: Tensor | None = None  # [term] each term's share of values (a target token's logit or logprob)
    per_term: list[Scores] | None = None  # each term's own scores (each_term=True: one backward per term)
    term_capped: Tensor | None = None  # [term] each term's value after the final soft-cap, where there is one


def _run(model: nn.Module, req: Request, dtype: torch.dtype, *, lean: bool, edges: bool, neuron_positions: bool,
         effective_targets: bool, neuron_target: str, probabilities: bool = True, graph=None,
         each_term: bool = False) -> Run:
    """The instrumented forward and the linearised backward. ``graph`` (circuit.py) extends the run: it names
    what to record (``graph.record``) and which recorded tensors' gradients it needs (``graph.tensors``), and
    ``graph.build(session, grads, directions, values)`` runs inside the session after the scores are settled."""
    spec = req.spec
    record = set() if graph is None else set(graph.record)
    if edges:
        record |= {"branches", "head_inputs", "rope"}
    if neuron_target == "mid":
        record |= {"mid", "neuron_inputs"}
    if effective_targets:
        record |= {"resid"}
    scores = Scores.empty(spec, req.batch, req.n_tokens, dtype, req.device, neuron_positions)
    with instrument(model, req, weights=req.weights, scores=scores, record=record, lean=lean) as session:
        hidden = session.forward()  # [batch pos d_model], the model's own values
        unembed = spec.unembed(model).weight
        # [batch d_model], on the unembedding's device (a device map may put the last layers and the head elsewhere)
        # every term (a target token: several under teacher forcing for a target of several tokens), flat
        rows, at = req.terms()
        first = [rows.index(b) for b in range(req.batch)]  # each row's first term: its target position
        final = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(at, device=hidden.device)]
        final = final.to(unembed.device)  # [term d_model], on the unembedding's device (a device map may split)
        if not finite(final.detach()):
            raise NonFiniteError(_locate_non_finite(session))
        probs = None
        if probabilities:
            with torch.no_grad():
                logits = (final.detach().to(unembed.dtype) @ unembed.T).to(dtype)  # [term vocab]
            if not finite(logits):
                raise NonFiniteError("non-finite logits (NaN or inf): the unembedding overflows on this input")
            req.resolve(logits[first])
            probs = softcap(logits, spec.final_softcap).softmax(-1)  # the model's own distribution, in `dtype`
        capped = spec.final_softcap is not None
        terms = [req.targets[b].term(j - first[b]) for j, b in enumerate(rows)]
        u = torch.stack([target_direction(t, unembed.detach().to(dtype), None if probs is None else probs[j],
                                          (logits[j], spec.final_softcap) if capped and probs is not None else None)
                         for j, t in enumerate(terms)])
        term_values = (final.to(dtype) * u).sum(-1)  # [term]
        values = term_values.new_zeros(req.batch).index_add(0, torch.tensor(rows, device=u.device), term_values)
        term_capped = _after_cap(terms, final.detach().to(dtype), unembed.detach().to(dtype), term_values.detach(),
                                 spec.final_softcap) if capped else None
        after_cap = None if term_capped is None else term_capped.new_zeros(req.batch).index_add(
            0, torch.tensor(rows, device=term_capped.device), term_capped)
        rec = session.recording
        extra: list[Tensor] = []
        if effective_targets:
            extra += [rec.resid[i] for i in range(spec.n_layers + 1)]
        if neuron_target == "mid":
            extra += [rec.mid[i] for i in range(spec.n_layers)]
        if edges:
            extra += [rec.head_inputs[i] for i in range(spec.n_layers)]
        own = [] if graph is None else graph.tensors(rec, spec)
        per_term = None
        if each_term:  # one backward per term, the graph kept between them: each term's own scores
            if extra or own:
                raise ValueError("each_term gives token, head and neuron scores only")
            per_term = []
            for j in range(len(terms)):
                session.backward(term_values[j], again=j < len(terms) - 1)
                per_term.append(scores.take())
            scores = sum_scores(per_term)
        grads = [] if each_term else session.backward(values.sum(), extra + own)
        own, grads = grads[len(extra):], grads[:len(extra)]
        targets = None
        if effective_targets:
            targets = torch.stack([g.to(req.device, dtype) for g in grads[:spec.n_layers + 1]], dim=1)
            grads = grads[spec.n_layers + 1:]
        if neuron_target == "mid":  # against t_mid instead of the taps' t^(l): replaces their parts
            for i, mods in enumerate(layer_modules(model, spec)):
                lam = grads[i].to(dtype) @ weight_rows(mods.neurons).detach().to(dtype)  # t_mid W_D  [batch pos d_mlp]
                scores.parts[("neuron_positions", i)] = [rec.neuron_inputs[i].detach().to(dtype) * lam]
            grads = grads[spec.n_layers:]
        if not each_term:
            scores.settle()
        edge = edge_scores(spec, model, req, rec, grads, dtype) if edges else None
        built = None if graph is None else graph.build(session, own, u.detach(), values.detach())
    names = ("tokens", "heads", "neurons", "bias")  # "the token scores", ...
    bad = [n for s in [scores, *(per_term or [])] for n in names if not finite(getattr(s, n))]
    if bad:
        raise NonFiniteError(f"the {bad[0].removesuffix('s')} scores are not finite (NaN or inf): the path weights "
                             f"{req.weights.as_tuple()} or the target overflow in {dtype}")
    return Run(scores=scores, values=values.detach(), probs=probs, edges=edge, effective_targets=targets,
               capped=after_cap, graph=built, term_rows=rows, term_values=term_values.detach(), per_term=per_term,
               term_capped=term_capped)


def with_contrast(target: Attribution, foil: Attribution, req: Request, b: int) -> Attribution:
    """The attribution of a target minus a contrast of several tokens, from the target's result and the contrast's
    (its own sequence: the prompt and its tokens but the last, its direction negated): the prompt's token scores
    and every component score add up; the tokens are the prompt, the target's forced tokens, then the contrast's
    (each continuation reads only the prompt and its own tokens); ``target.terms`` lists the target's terms, then
    the contrast's (``contrast=True``, their values negative)."""
    n = target.target.position + 1  # the prompt's tokens
    k = len(target.tokens) - n  # the target's forced tokens
    add = lambda a, b: None if a is None else a + b  # noqa: E731
    glue = lambda a, b: None if a is None else torch.cat([a[:n] + b[:n], a[n:], b[n:]])  # noqa: E731
    t, c = target.target, foil.target
    mine = t.terms or [TargetTerm(position=n - 1, token=t.token, token_id=t.token_id, value=target.target_logit,
                                  probability=t.probability)]
    spec, ids = req.targets[b], list(req.targets[req.contrast_rows[b]].tokens)
    theirs = [TargetTerm(position=n - 1 if i == 0 else n + k + i - 1, token=req.decode([tok])[0], token_id=tok,
                         value=term.value, probability=term.probability, contrast=True)
              for i, (tok, term) in enumerate(zip(ids, c.terms))]
    info = dataclasses.replace(t, kind="contrast", contrast=spec.contrast_text, contrast_id=ids[0],
                               terms=[*mine, *theirs], hint=None,
                               capped_logit=None if t.capped_logit is None else t.capped_logit + c.capped_logit)
    value = target.target_logit + foil.target_logit
    tokens = glue(target.token_scores, foil.token_scores)
    positions = glue(target.position_scores, foil.position_scores)
    bias = target.bias_share + foil.bias_share
    return dataclasses.replace(
        target, tokens=target.tokens + foil.tokens[n:], token_ids=target.token_ids + foil.token_ids[n:],
        special=None if target.special is None else target.special + foil.special[n:], token_scores=tokens,
        head_scores=target.head_scores + foil.head_scores, neuron_scores=target.neuron_scores + foil.neuron_scores,
        expert_scores=add(target.expert_scores, foil.expert_scores), position_scores=positions, target_logit=value,
        target=info, bias_share=bias,
        completeness_gap=float(tokens.sum()) + bias - value + (0.0 if positions is None else float(positions.sum())))


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


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap), the final soft-capping of Gemma 2 (identity without a cap)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


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
    return (f"non-finite activations (NaN or inf) in the output of {where}; the model's weights or dtype "
            "overflow on this input (try float32)")


def plan_memory(model: nn.Module, spec: ModelSpec, batch: int, pos: int, memory: str,
                budget: int | None = None) -> bool:
    """True for lean mode: ``auto`` takes it when the full graph would exceed half the free memory."""
    if memory != "auto":
        return memory == "lean"
    return graph_bytes(model, spec, batch, pos) > (budget if budget is not None else _free_memory(model, spec)) // 2


def graph_bytes(model: nn.Module, spec: ModelSpec, batch: int, pos: int) -> int:
    """What the full graph keeps per forward pass, from the family's shapes (an upper estimate: 1.2x the measured
    peak on SmolLM2 and on Gemma 3 at 4096 tokens, benchmarks/results/long_context_cpu.json). Per token and layer:
    the query, key and value projections and their rotated copies, keys and values repeated to every head, the
    heads' output and o_proj's; each norm's input and output (and the q/k norms'); the MLP's gate, activation, up
    and their product, and down's output. Plus the [head pos pos] maps where attention is not fused (eager)."""
    size = spec.embed(model).weight.element_size()
    q, kv, d = spec.n_heads * spec.d_head, spec.n_kv_heads * spec.d_head, spec.d_model
    attention = 2 * (q + 2 * kv) + 2 * q + q + d + (q + kv if spec.qk_norm else 0)
    norms = 2 * d * len(spec.parts.norms)
    mlp = (4 * spec.d_mlp if spec.parts.gated else 2 * spec.d_mlp) + d
    per_layer = batch * pos * (attention + norms + mlp) * size
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        per_layer += 2 * batch * spec.n_heads * pos * pos * size
    return spec.n_layers * per_layer


def _free_memory(model: nn.Module, spec: ModelSpec) -> int:
    device = spec.device(model)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def _result(model: nn.Module, req: Request, run: Run, b: int, neuron_target: str,
            neuron_positions: bool) -> Attribution:
    real = req.real(b)
    ids = req.token_ids(b)
    t = req.targets[b]
    mine = [j for j, r in enumerate(run.term_rows) if r == b]  # this row's terms (several: a target of several tokens)
    probs = None if run.probs is None else run.probs[mine[0]]
    top = None if probs is None else probs.topk(min(5, probs.numel()))
    name = lambda i: None if i is None else req.decode([i])[0]  # noqa: E731
    known = probs is not None and t.token_id is not None
    hints = [] if probs is None else [spelling_hint(req.tokenizer, text, i, probs, what) for text, i, what in
                                      ((None if t.tokens else t.text, t.token_id, "target"), (t.contrast_text, t.contrast_id, "contrast"))]
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
    info = TargetInfo(
        kind=t.kind, position=req.position(b),
        token=name(t.token_id) if terms is None else t.text, token_id=t.token_id,  # several tokens: as written
        contrast=name(t.contrast_id), contrast_id=t.contrast_id,
        probability=None if logprob is None else (float(probs[t.token_id]) if terms is None else math.exp(logprob)),
        logprob=logprob, hint=" ".join(h for h in hints if h) or None,
        capped_logit=None if run.capped is None or t.kind == "vector" else float(run.capped[b]),
        terms=terms,
    )
    s = run.scores
    token_scores = s.tokens[b].cpu()[real]
    positions = None if s.position_scores is None else s.position_scores[b].cpu()[real]
    value = float(run.values[b])
    keep = slice(int(real[0]), int(real[0]) + len(real))
    pick = lambda x, *index: None if x is None else x[(b, *index)].cpu()  # noqa: E731
    return Attribution(
        tokens=req.decode(ids), token_ids=ids, token_scores=token_scores,
        head_scores=s.heads[b].cpu(), neuron_scores=s.neurons[b].cpu(),
        target_logit=value, target=info, weights=req.weights,
        completeness_gap=(float(token_scores.sum()) + float(s.bias[b]) - value
                          + (0.0 if positions is None else float(positions.sum()))),
        bias_share=float(s.bias[b]), position_scores=positions, expert_scores=pick(s.experts),
        expert_position_scores=pick(s.expert_positions, slice(None), keep) if neuron_positions else None,
        d_expert=req.spec.d_expert or None,
        n_kv_heads=req.spec.n_kv_heads, special=req.special(ids),
        top_predictions=[] if top is None else [(name(int(i)), float(p)) for p, i in zip(top.values, top.indices)],
        model_name=getattr(model.config, "_name_or_path", "") or req.spec.family, neuron_target=neuron_target,
        edge_scores=pick(run.edges, slice(None), slice(None), keep, keep),
        neuron_position_scores=pick(s.neuron_positions, slice(None), keep) if neuron_positions else None,
        effective_targets=pick(run.effective_targets, slice(None), keep),
    )
