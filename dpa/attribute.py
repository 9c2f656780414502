"""``attribute``: one forward and one backward pass through the linearised model (book: modified-backward).

    request   = the one request step (request.py)
    run       = the instrumented forward and the linearised backward, with the read-outs asked for (backward.py)
    results   = one ``Attribution`` per prompt (``backward.attribution``)

Token scores are embedding . gradient, head scores each head's slice of the o_proj input . its
gradient, neuron scores the down_proj input . its gradient: the taps write them during the backward.
Edges, effective targets and mid-layer neuron targets are read-outs of the same pass (backward.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import torch
from torch import nn

from . import request as requests
from .backward import EffectiveTargets, Edges, MidNeurons, attribution, run
from .checks import check_bool, check_choice, check_removed
from .errors import InputError, TargetWarning, UnsupportedModelError
from .families import ModelSpec
from .request import Prompt, Request
from .result import Attribution, TargetTerm
from .weights import PathWeights


def attribute(model: nn.Module, tokenizer, prompt: Prompt | list[Prompt], target=None, *, contrast=None,
              kind: Literal["logit", "logprob"] = "logit", position: int | list[int] | None = None,
              weights: PathWeights | None = None, edges: bool = False, neuron_positions: bool = False,
              effective_targets: bool = False, neuron_target: Literal["output", "mid"] = "output",
              multi_token: Literal["error", "first", "sum"] = "error", memory: Literal["auto", "full", "lean"] = "auto",
              probabilities: bool = True, **removed) -> Attribution | list[Attribution]:
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
    probabilities: also compute the next-token distribution at the target position (``target.probability``,
        ``top_predictions``): one product with the whole unembedding per prompt, a few percent of the call on a
        small model and a short prompt; always computed when the target is the prediction or a log-probability.
    **removed: an argument dpa no longer takes (``padding_side``: dpa pads a batch itself) is refused by name.

    Returns an ``Attribution`` (a list of them for a batch). Raises a ``dpa.DPAError`` naming the argument for
    every input it cannot attribute; the model is left exactly as it was, even when a call fails.
    """
    check_removed("attribute", removed)
    check_choice("neuron_target", neuron_target, ("output", "mid"))
    check_choice("memory", memory, ("auto", "full", "lean"))
    edges, neuron_positions = check_bool("edges", edges), check_bool("neuron_positions", neuron_positions)
    effective_targets = check_bool("effective_targets", effective_targets)
    probabilities = check_bool("probabilities", probabilities)
    req = requests.build(model, tokenizer, prompt, target, contrast=contrast, kind=kind, position=position,
                         weights=weights, multi_token=multi_token,
                         multi_options=requests.MULTI_TOKEN)
    spec = req.spec
    _check_readouts(req, edges or neuron_positions or effective_targets, neuron_target)
    lean = plan_memory(model, spec, req.batch, req.n_tokens, memory)
    probabilities = probabilities or kind == "logprob" or any(t.kind != "vector" and t.token_id is None
                                                                for t in req.targets)
    readouts = {name: readout for name, readout, wanted in (
        ("edges", Edges(), edges), ("effective_targets", EffectiveTargets(), effective_targets),
        ("mid", MidNeurons(), neuron_target == "mid")) if wanted}
    out = run(model, req, readouts, lean=lean, positions=neuron_positions or neuron_target == "mid",
              probabilities=probabilities)
    results = [attribution(model, req, out, b, neuron_target, neuron_positions) for b in range(req.n_prompts)]
    for b, row in enumerate(req.contrast_rows):  # a contrast of several tokens: its own row, merged in
        if row is not None:
            results[b] = with_contrast(results[b], attribution(model, req, out, row, neuron_target), req, b)
    for res in results:
        if res.target.hint:
            warnings.warn(res.target.hint, TargetWarning, stacklevel=2)
    return results if req.batched else results[0]


def _check_readouts(req: Request, position_level: bool, neuron_target: str) -> None:
    """Refuse the read-outs a request cannot have: position-level ones beside a contrast of several tokens (read in
    a sequence of its own), and mid-layer neuron targets where there is no middle of the layer."""
    spec = req.spec
    if req.contrast_rows and (position_level or neuron_target == "mid"):
        raise InputError("a contrast of several tokens is read in a sequence of its own (the prompt and its tokens), "
                         "so its position-level scores have no place beside the target's: edges, neuron_positions, "
                         "effective_targets and neuron_target='mid' take a contrast of one token")
    if neuron_target == "mid" and not spec.d_mlp:
        raise UnsupportedModelError(f"neuron_target='mid' scores MLP neurons in the middle of their layer; "
                                    f"{spec.family}'s layers have no MLP")
    if neuron_target == "mid" and spec.n_experts:
        raise UnsupportedModelError(f"neuron_target='mid' reads each neuron's down projection; {spec.family}'s "
                                    "neurons are inside its experts: use neuron_target='output'")
    if neuron_target == "mid" and spec.parallel:
        raise UnsupportedModelError(f"neuron_target='mid' needs the residual stream between attention and the MLP; "
                                    f"{spec.family} runs them in parallel (use_parallel_residual), so there is none: "
                                    "use neuron_target='output'")


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


def plan_memory(model: nn.Module, spec: ModelSpec, batch: int, pos: int, memory: str,
                budget: int | None = None) -> bool:
    """True for lean mode: ``auto`` takes it when the full graph would exceed half the free memory."""
    if memory != "auto":
        return memory == "lean"
    return graph_bytes(model, spec, batch, pos) > (budget if budget is not None else free_memory(model, spec)) // 2


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


def free_memory(model: nn.Module, spec: ModelSpec) -> int:
    device = spec.device(model)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
