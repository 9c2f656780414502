"""What every baseline shares: the request (``dpa.request``), the target metric, the result.

Each method takes the same arguments as ``dpa.attribute`` (prompt, target, contrast, position) for one
prompt and returns a ``dpa.Attribution`` with ``method`` set to its name. The quantity a method
explains is the target *logit* at the target position, or the logit difference with a contrast token
(the same linear target DPA attributes by default). Every forward pass runs inside
``dpa.instrument.instrument``: under the model's lock, with the model restored afterwards.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor, nn

from .. import request as requests
from ..instrument import clean_logits, logits_at
from ..request import Prompt, Request
from ..result import Attribution, TargetInfo

__all__ = ["Prompt", "Request", "causal", "logits_at", "prepare", "result", "seed_for"]


def prepare(model: nn.Module, tokenizer, prompt: Prompt, target=None, contrast=None,
            position: int | None = None) -> Request:
    """The checked one-prompt request, its target resolved (a forward pass only when the target is
    the model's own prediction)."""
    req = requests.build(model, tokenizer, prompt, target, contrast=contrast, position=position, batch=False,
                         multi_options=("error",))  # one target token: no baseline sums several
    if req.targets[0].kind == "vector":
        raise requests.TargetError("the baselines attribute a token (or a token contrast), not a vector target")
    if req.targets[0].token_id is None:
        req.resolve(clean_logits(model, req))
    return req


def seed_for(req: Request, seed: int) -> int:
    """A per-prompt seed: the same prompt and seed always give the same random scores."""
    return (seed * 1_000_003 + zlib.crc32(str(req.token_ids(0)).encode())) % (2 ** 31)


def result(model: nn.Module, req: Request, method: str, *, token_scores: Tensor | None = None,
           edge_scores: Tensor | None = None, neuron_position_scores: Tensor | None = None,
           head_scores: Tensor | None = None, neuron_scores: Tensor | None = None) -> Attribution:
    """An ``Attribution`` for a baseline. Missing scores are zeros of the right shape; head and
    neuron scores default to the sums of the edge and position-level scores."""
    spec = req.spec
    t = req.n_tokens
    as_cpu = lambda x: None if x is None else x.detach().float().cpu()  # noqa: E731
    edge_scores, neuron_position_scores = as_cpu(edge_scores), as_cpu(neuron_position_scores)
    if head_scores is None:
        head_scores = edge_scores.sum((-1, -2)) if edge_scores is not None else torch.zeros(spec.n_layers, spec.n_heads)
    if neuron_scores is None:
        neuron_scores = (neuron_position_scores.sum(1) if neuron_position_scores is not None
                         else torch.zeros(spec.n_layers, spec.d_mlp))
    token_scores = torch.zeros(t) if token_scores is None else as_cpu(token_scores)
    if req.clean_logits is None:
        req.clean_logits = clean_logits(model, req)
    clean = req.clean_logits[0]
    probs = clean.float().softmax(-1)
    logit = float(req.metric(clean[None])[0])
    top = probs.topk(5)
    target = req.targets[0]
    name = lambda i: None if i is None else req.decode([i])[0]  # noqa: E731
    ids = req.token_ids(0)
    info = TargetInfo(kind=target.kind, position=req.position(0), token=name(target.token_id),
                      token_id=target.token_id, contrast=name(target.contrast_id), contrast_id=target.contrast_id,
                      probability=float(probs[target.token_id]),
                      logprob=float(probs[target.token_id].clamp_min(1e-45).log()))
    return Attribution(
        tokens=req.decode(ids), token_ids=ids, token_scores=token_scores,
        head_scores=as_cpu(head_scores), neuron_scores=as_cpu(neuron_scores), target_logit=logit, target=info,
        completeness_gap=float(token_scores.sum()) - logit, n_kv_heads=spec.n_kv_heads, special=req.special(ids),
        top_predictions=[(name(int(i)), float(p)) for p, i in zip(top.values, top.indices)], method=method,
        model_name=getattr(model.config, "_name_or_path", "") or spec.family,
        edge_scores=edge_scores, neuron_position_scores=neuron_position_scores,
    )


def causal(t: int, device=None) -> Tensor:
    """Boolean [query key]: True where key <= query."""
    i = torch.arange(t, device=device)
    return i[None, :] <= i[:, None]


def metric_at(model: nn.Module, req: Request, hidden: Tensor) -> Tensor:
    """The attributed logit (difference) of every row of a last hidden state [rows pos d_model]."""
    return req.metric(logits_at(model, req, hidden, int(req.positions[0])))
