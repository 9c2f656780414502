"""The attribution result: tokens, scores, and helpers (JSON for the widget and the book)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .weights import PathWeights


class Component(NamedTuple):
    kind: str  # "head" or "neuron"
    layer: int
    index: int
    score: float


@dataclass(frozen=True)
class TargetInfo:
    """What was attributed, at which position, and what the model predicted there."""

    kind: str  # token | contrast | logprob | vector
    position: int
    token: str | None = None
    token_id: int | None = None
    contrast: str | None = None
    contrast_id: int | None = None
    probability: float | None = None  # p(token) at the position
    logprob: float | None = None


@dataclass
class Attribution:
    """Scores for one prompt. Index conventions: ``[layer, head]``, ``[layer, d_mlp]``, ``[pos]``.

    ``target_logit`` is the value of the attributed linear target at the forward pass:
    the logit (token), the logit difference (contrast), ``logit_y - E_p[logit]`` (logprob)
    or ``u . norm(x)`` (vector). ``completeness_gap = sum(token_scores) - target_logit``;
    on bias-free models it is zero for conservative weights (value path only, gate + up = 1).
    ``bias_share`` is the part no token owns (Qwen2's value biases).
    """

    tokens: list[str]
    token_ids: list[int]
    token_scores: Tensor  # [pos]
    head_scores: Tensor  # [layer, head]
    neuron_scores: Tensor  # [layer, d_mlp]
    target_logit: float
    target: TargetInfo
    weights: PathWeights = field(default_factory=PathWeights)
    completeness_gap: float = 0.0
    bias_share: float = 0.0
    n_kv_heads: int | None = None
    special: list[bool] | None = None  # special tokens (BOS, template) per position
    top_predictions: list[tuple[str, float]] = field(default_factory=list)
    method: str = "dpa"
    model_name: str = ""
    neuron_target: str = "output"  # "output" (the paper) or "mid" (reference code)
    edge_scores: Tensor | None = None  # [layer, head, query, key]
    neuron_position_scores: Tensor | None = None  # [layer, pos, d_mlp]
    effective_targets: Tensor | None = None  # [layer + 1, pos, d_model]; 0 = embeddings

    @property
    def n_layers(self) -> int:
        return self.head_scores.shape[0]

    def top_components(self, k: int = 10, kinds: tuple[str, ...] = ("head", "neuron")) -> dict[str, list[Component]]:
        """The k most positive and k most negative heads and neurons, ranked jointly."""
        parts = []
        if "head" in kinds:
            parts.append(("head", self.head_scores))
        if "neuron" in kinds:
            parts.append(("neuron", self.neuron_scores))
        items: list[Component] = []
        for kind, scores in parts:
            flat = scores.detach().double().flatten()
            width = scores.shape[1]
            take = min(k, flat.numel())
            for idx in torch.cat([flat.topk(take).indices, (-flat).topk(take).indices]).tolist():
                items.append(Component(kind, idx // width, idx % width, float(flat[idx])))
        pos = sorted({c for c in items if c.score > 0}, key=lambda c: -c.score)[:k]
        neg = sorted({c for c in items if c.score < 0}, key=lambda c: c.score)[:k]
        return {"positive": pos, "negative": neg}

    def to_dict(self, *, top_neurons: int | None = None) -> dict[str, Any]:
        """JSON-ready dict. ``top_neurons`` keeps only that many neurons per layer by |score|."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value.detach().float().cpu().tolist()
            elif isinstance(value, (TargetInfo, PathWeights)):
                value = asdict(value)
            out[f.name] = value
        if top_neurons is not None:
            scores = self.neuron_scores.detach().float()
            k = min(top_neurons, scores.shape[1])
            idx = scores.abs().topk(k, dim=1).indices
            out["neuron_scores"] = None
            out["top_neurons"] = {"index": idx.tolist(), "score": scores.gather(1, idx).tolist(),
                                  "d_mlp": scores.shape[1]}
            out["neuron_position_scores"] = None
        return out

    def to_json(self, path: str | None = None, **kwargs) -> str:
        text = json.dumps(self.to_dict(**kwargs))
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attribution:
        data = dict(data)
        data.pop("top_neurons", None)
        for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores",
                     "effective_targets"):
            if data.get(name) is not None:
                data[name] = torch.tensor(data[name])
        data["target"] = TargetInfo(**data["target"])
        data["weights"] = PathWeights(**data["weights"])
        data["top_predictions"] = [tuple(p) for p in data.get("top_predictions", [])]
        return cls(**data)
