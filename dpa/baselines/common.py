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
from ..backward import Run, attribution
from ..instrument import clean_logits, logits_at
from ..request import Prompt, Request
from ..linearise import Scores
from ..result import Attribution
from ..weights import PathWeights

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
    """An ``Attribution`` for a baseline, built by DPA's one result builder (``backward.attribution``) from the
    method's scores, the model's own next-token distribution and the target metric. Missing scores are zeros of
    the right shape; head and neuron scores default to the sums of the edge and position-level scores. A baseline
    explains the model's own logit (difference): under a final soft-cap (Gemma 2) that is the logit after the cap,
    so ``target_logit`` and ``capped_logit`` are the same value (DPA attributes the logit before the cap)."""
    spec = req.spec
    t = req.n_tokens
    as_cpu = lambda x: None if x is None else x.detach().float().cpu()  # noqa: E731
    edge_scores, neuron_position_scores = as_cpu(edge_scores), as_cpu(neuron_position_scores)
    if head_scores is None:
        head_scores = (edge_scores.sum((-1, -2)) if edge_scores is not None
                       else torch.zeros(spec.n_layers, spec.row_width))
    if neuron_scores is None:
        neuron_scores = (neuron_position_scores.sum(1) if neuron_position_scores is not None
                         else torch.zeros(spec.n_layers, spec.d_mlp))
    if spec.n_beside:  # a method that scores the attention heads alone (Falcon-H1's rows also hold the SSM heads):
        head_scores, edge_scores = (_unscored(x, spec) for x in (head_scores, edge_scores))  # those are NaN, unscored
    if req.clean_logits is None:
        req.clean_logits = clean_logits(model, req)
    clean = req.clean_logits[0]
    value = torch.tensor([float(req.metric(clean[None])[0])], dtype=torch.float64)
    positions = neuron_position_scores is not None
    scores = Scores.empty(spec, 1, t, torch.float32, "cpu", positions)
    scores.tokens = (torch.zeros(t) if token_scores is None else as_cpu(token_scores))[None]
    scores.heads, scores.neurons = as_cpu(head_scores)[None], as_cpu(neuron_scores)[None]
    scores.bias = torch.zeros(1)
    scores.neuron_positions = neuron_position_scores[None] if positions else None
    run = Run(scores=scores, values=value, probs=clean.float().softmax(-1)[None], term_rows=[0], term_values=value,
              out={} if edge_scores is None else {"edges": edge_scores[None]},
              capped=value if spec.final_softcap is not None else None)  # the model's own logits are after its cap
    return attribution(model, req, run, 0, neuron_positions=positions, method=method, weights=PathWeights())


def _unscored(scores: Tensor | None, spec) -> Tensor | None:
    """Head or edge scores [layer head ...] of the attention heads alone, widened to a layer's row with the units
    beside them (``ModelSpec.n_beside``) as NaN: a score the method did not compute (the reports and top components
    skip them, files keep them as null)."""
    if scores is None or scores.shape[1] != spec.n_heads:
        return scores
    pad = scores.new_full((scores.shape[0], spec.n_beside, *scores.shape[2:]), float("nan"))
    return torch.cat([scores, pad], dim=1)


def causal(t: int, device=None) -> Tensor:
    """Boolean [query key]: True where key <= query."""
    i = torch.arange(t, device=device)
    return i[None, :] <= i[:, None]


def metric_at(model: nn.Module, req: Request, hidden: Tensor) -> Tensor:
    """The attributed logit (difference) of every row of a last hidden state [rows pos d_model]."""
    return req.metric(logits_at(model, req, hidden, int(req.positions[0])))
