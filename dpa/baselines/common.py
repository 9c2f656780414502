"""What every baseline shares: the prompt and target resolved once, the target metric, the result.

Each method takes the same arguments as ``dpa.attribute`` (prompt, target, contrast, position)
and returns a ``dpa.Attribution`` with ``method`` set to its name. The quantity a method explains
is the target *logit* at the target position, or the logit difference with a contrast token
(the same linear target DPA attributes by default).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from ..adapters import ModelSpec, spec_for
from ..result import Attribution, TargetInfo
from ..targets import TargetError, token_id

Prompt = str | Sequence[int] | Tensor


@dataclass
class Problem:
    """One prompt with its target resolved: everything a baseline needs besides the model.

    ``clean_logits`` is filled by whichever forward pass on the clean prompt comes first (the
    method's own where it has one, so that no method pays for an extra pass).
    """

    input_ids: Tensor  # [1 pos] on the model's device
    position: int  # target position (0-based)
    target_id: int
    contrast_id: int | None
    spec: ModelSpec
    tokens: list[str]
    special: list[bool]
    clean_logits: Tensor | None = None  # [vocab] float32 (or float64) at the target position

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def logits(self, model: nn.Module) -> Tensor:
        """The clean logits at the target position (one forward pass if no method has run one)."""
        if self.clean_logits is None:
            with torch.no_grad():
                hidden = model.model(input_ids=self.input_ids, use_cache=False).last_hidden_state
                self.clean_logits = final_logits(model, hidden, self.position)[0]
        return self.clean_logits

    def metric(self, logits: Tensor) -> Tensor:
        """Target logit (minus the contrast logit) from logits [batch vocab] -> [batch]."""
        value = logits[:, self.target_id]
        if self.contrast_id is not None:
            value = value - logits[:, self.contrast_id]
        return value

    def seed(self, seed: int) -> int:
        """A per-prompt seed: the same prompt and seed always give the same random scores."""
        ids = self.input_ids.flatten().tolist()
        return (seed * 1_000_003 + zlib.crc32(str(ids).encode())) % (2 ** 31)


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a string (tokenised as the tokenizer does, BOS included when it adds
    one), a list of ids or a LongTensor of ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer; pass token ids instead")
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Tensor):
        if prompt.is_floating_point():
            raise ValueError(f"a tensor prompt must hold token ids, got {prompt.dtype}")
        return prompt.flatten().tolist()
    ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    return ids


def final_logits(model: nn.Module, hidden: Tensor, position: int | Tensor) -> Tensor:
    """Logits at one position from the base model's last hidden state [batch pos d_model], in float32
    or better."""
    logits = model.lm_head(hidden[:, position])
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def prepare(model: nn.Module, tokenizer, prompt: Prompt, target=None, contrast=None,
            position: int | None = None) -> Problem:
    """Resolve prompt, target and contrast (a forward pass only when the target is the prediction)."""
    spec = spec_for(model)
    ids = encode(tokenizer, prompt)
    if len(ids) > spec.max_positions:
        raise ValueError(f"the prompt has {len(ids)} tokens, more than the model's context of {spec.max_positions}")
    n = len(ids)
    pos = n - 1 if position is None else (position + n if position < 0 else position)
    if not 0 <= pos < n:
        raise ValueError(f"target position {position} is outside the prompt of {n} tokens")
    special_ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    resolve = lambda t, what: None if t is None else token_id(  # noqa: E731
        tokenizer, int(t) if isinstance(t, Tensor) else t, spec.vocab_size, what=what)
    problem = Problem(input_ids=torch.tensor([ids], device=model.lm_head.weight.device), position=pos, target_id=-1,
                      contrast_id=resolve(contrast, "contrast"), spec=spec, tokens=_decode(tokenizer, ids),
                      special=[i in special_ids for i in ids])
    problem.target_id = int(problem.logits(model).argmax()) if target is None else resolve(target, "target")
    if problem.contrast_id is not None and problem.contrast_id == problem.target_id:
        raise TargetError("contrast and target are the same token")
    return problem


def _decode(tokenizer, ids: list[int]) -> list[str]:
    return [str(i) for i in ids] if tokenizer is None else [tokenizer.decode([i]) for i in ids]


def embeddings(model: nn.Module, problem: Problem) -> Tensor:
    """Token embeddings [1 pos d_model] (the input ablation zeroes these)."""
    return model.model.embed_tokens(problem.input_ids)


def result(model: nn.Module, tokenizer, problem: Problem, method: str, *, token_scores: Tensor | None = None,
           edge_scores: Tensor | None = None, neuron_position_scores: Tensor | None = None,
           head_scores: Tensor | None = None, neuron_scores: Tensor | None = None) -> Attribution:
    """An ``Attribution`` for a baseline. Missing scores are zeros of the right shape; head and
    neuron scores default to the sums of the edge and position-level scores."""
    spec = problem.spec
    t = problem.n_tokens
    as_cpu = lambda x: None if x is None else x.detach().float().cpu()  # noqa: E731
    edge_scores, neuron_position_scores = as_cpu(edge_scores), as_cpu(neuron_position_scores)
    if head_scores is None:
        head_scores = edge_scores.sum((-1, -2)) if edge_scores is not None else torch.zeros(spec.n_layers, spec.n_heads)
    if neuron_scores is None:
        neuron_scores = (neuron_position_scores.sum(1) if neuron_position_scores is not None
                         else torch.zeros(spec.n_layers, spec.d_mlp))
    token_scores = torch.zeros(t) if token_scores is None else as_cpu(token_scores)
    clean = problem.logits(model)
    probs = clean.softmax(-1)
    logit = float(problem.metric(clean[None])[0])
    top = probs.topk(5)
    name = lambda i: None if i is None else _decode(tokenizer, [i])[0]  # noqa: E731
    info = TargetInfo(kind="token" if problem.contrast_id is None else "contrast", position=problem.position,
                      token=name(problem.target_id), token_id=problem.target_id,
                      contrast=name(problem.contrast_id), contrast_id=problem.contrast_id,
                      probability=float(probs[problem.target_id]),
                      logprob=float(probs[problem.target_id].clamp_min(1e-45).log()))
    return Attribution(
        tokens=problem.tokens, token_ids=problem.input_ids[0].tolist(), token_scores=token_scores,
        head_scores=as_cpu(head_scores), neuron_scores=as_cpu(neuron_scores), target_logit=logit, target=info,
        completeness_gap=float(token_scores.sum()) - logit, n_kv_heads=spec.n_kv_heads, special=problem.special,
        top_predictions=[(name(int(i)), float(p)) for p, i in zip(top.values, top.indices)], method=method,
        model_name=getattr(model.config, "_name_or_path", "") or spec.family,
        edge_scores=edge_scores, neuron_position_scores=neuron_position_scores,
    )


def causal(t: int, device=None) -> Tensor:
    """Boolean [query key]: True where key <= query."""
    i = torch.arange(t, device=device)
    return i[None, :] <= i[:, None]
