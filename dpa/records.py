"""The small records of a result: a component and its score, the target (and each term of a target of several
tokens), and the top neurons a result saved with ``top_neurons=k`` keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from .errors import InputError


class Component(NamedTuple):
    kind: str  # "head" or "neuron"
    layer: int
    index: int
    score: float


@dataclass(frozen=True)
class TargetTerm:
    """One token of a target of several tokens (``multi_token="sum"``), read at its own position under teacher
    forcing: its logit (or log-probability, ``kind="logprob"``) is its share of ``Attribution.target_logit``."""

    position: int  # where it is predicted: the token before it
    token: str | None
    token_id: int
    value: float  # its share of target_logit: its logit (minus the contrast's, for the first term with a contrast);
    # for kind="logprob" its logit minus the expected logit at its position, p held fixed (what that kind attributes:
    # log p linearised; the true log p is in probability)
    probability: float | None = None  # p(token) at its position
    contrast: bool = False  # a token of a contrast of several tokens (its value counts negatively)


@dataclass(frozen=True)
class TargetInfo:
    """What was attributed, at which position, and what the model predicted there. A target of several tokens
    has ``terms`` (one per token); ``token`` is then the whole target, ``position`` and ``token_id`` its first
    token's, ``probability`` and ``logprob`` those of the whole continuation (the product of its tokens')."""

    kind: str  # token | contrast | logprob | vector
    position: int
    token: str | None = None
    token_id: int | None = None
    contrast: str | None = None
    contrast_id: int | None = None
    probability: float | None = None  # p(token) at the position
    logprob: float | None = None
    hint: str | None = None  # a likelier spelling of the target or contrast string, when there is one
    capped_logit: float | None = None  # the target after the model's final soft-cap (Gemma 2); None without one
    terms: list[TargetTerm] | None = None  # a target of several tokens: each token's share, in order


@dataclass
class NeuronTop:
    """The neurons a result saved with ``top_neurons=k`` keeps (``Attribution.neuron_top``): per layer the k
    most positive and the k most negative (fewer where a layer has fewer), and each layer's total over all its
    neurons. The k most positive (negative) neurons overall are among them, so ``top_components`` up to k is
    exact; beyond k it is refused."""
    k: int
    d_mlp: int
    index: list[list[int]]  # per layer: the kept neurons' indices
    score: list[list[float]]  # per layer: their scores
    total: list[float]  # per layer: the sum over every neuron of the layer (the MLP's share)

    @classmethod
    def of(cls, scores: Tensor, k: int) -> NeuronTop:
        """The top of the ``[layer, d_mlp]`` scores (k at most d_mlp); refused when a score is not finite."""
        s = scores.detach().double().cpu()
        if not bool(s.isfinite().all()):
            raise InputError("neuron_scores hold NaN or an infinity, which a saved top cannot rank (JSON writes both "
                             "as null): save every neuron (top_neurons=None)")
        k = min(k, s.shape[1])
        index, score = [], []
        for row in s:
            take = min(k, row.numel())
            pos = [i for i in row.topk(take).indices.tolist() if row[i] > 0]
            neg = [i for i in (-row).topk(take).indices.tolist() if row[i] < 0]
            index.append(pos + neg)
            score.append([float(row[i]) for i in pos + neg])
        return cls(k, s.shape[1], index, score, s.sum(1).tolist())

    def smaller(self, k: int) -> NeuronTop:
        """The same top for a smaller k (each layer's k most positive and most negative of those kept)."""
        if k >= self.k:
            return self
        index, score = [], []
        for idx, sc in zip(self.index, self.score):
            pos = sorted((v, i) for i, v in zip(idx, sc) if v > 0)[::-1][:k]
            neg = sorted((v, i) for i, v in zip(idx, sc) if v < 0)[:k]
            index.append([i for _, i in pos + neg])
            score.append([v for v, _ in pos + neg])
        return NeuronTop(k, self.d_mlp, index, score, self.total)

    def components(self) -> list[Component]:
        return [Component("neuron", layer, i, v) for layer, (idx, sc) in enumerate(zip(self.index, self.score))
                for i, v in zip(idx, sc)]
