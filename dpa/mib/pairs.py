"""Clean/counterfactual prompt pairs and the task metric (MIB's): what circuits are discovered and evaluated on.

A pair is a clean prompt, its counterfactual (the same number of tokens), the clean answer's token ids and the
counterfactual answer's. The metric on logits at the last token is MIB's: the logit difference of the clean
answer over the counterfactual's (``logit_diff``), or the probability difference (``prob_diff``: the summed
probability of the clean answers minus that of the counterfactual's, greater-than's years).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..errors import InputError, InputTypeError

MetricKind = Literal["logit_diff", "prob_diff"]


@dataclass(frozen=True)
class Pairs:
    """``clean[i]`` and ``counter[i]``: token ids of equal length; ``answers[i]`` / ``wrong[i]``: the clean and
    counterfactual answers' token ids (one each for ``logit_diff``; one or more for ``prob_diff``).

    Checked once, when made, and immutable after (every row a tuple): a pair cannot change between the check and
    the runs that read it, or between a run's saved identity and its resumption."""

    clean: tuple[tuple[int, ...], ...]
    counter: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]
    wrong: tuple[tuple[int, ...], ...]
    metric: MetricKind = "logit_diff"
    names: tuple[str, ...] | None = None  # where each pair came from ("line 3"), for messages

    def __post_init__(self):
        if self.metric not in ("logit_diff", "prob_diff"):
            raise InputError(f"metric must be 'logit_diff' or 'prob_diff', got {self.metric!r}")
        for what in ("clean", "counter", "answers", "wrong") + (("names",) if self.names is not None else ()):
            rows = getattr(self, what)
            if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
                raise InputTypeError(f"{what} must be a list with one entry per pair, got {type(rows).__name__}")
            object.__setattr__(self, what, tuple(rows))  # a generator is read once, here
        n = len(self.clean)
        if not n:
            raise InputError("no prompt pairs given")
        for what in ("counter", "answers", "wrong") + (("names",) if self.names is not None else ()):
            if len(getattr(self, what)) != n:
                raise InputError(f"{len(getattr(self, what))} {what} for {n} clean prompts")
        if self.names is not None:
            object.__setattr__(self, "names", tuple(str(x) for x in self.names))
        for what in ("clean", "counter", "answers", "wrong"):  # token ids, as ints: never read as something else
            object.__setattr__(self, what, tuple(_ids(row, self._where(i), what)
                                                 for i, row in enumerate(getattr(self, what))))
        for i in range(n):
            where = self._where(i)
            if not self.clean[i]:
                raise InputError(f"{where}: the clean prompt is empty")
            if len(self.clean[i]) != len(self.counter[i]):
                raise InputError(f"{where}: the clean prompt has {len(self.clean[i])} tokens and the counterfactual "
                                 f"{len(self.counter[i])}; MIB patches position by position, so they must be as long")
            if self.clean[i] == self.counter[i]:
                raise InputError(f"{where}: the clean and counterfactual prompts are the same tokens: patching "
                                 "changes nothing, so the pair measures nothing")
            if not self.answers[i] or not self.wrong[i]:
                raise InputError(f"{where}: an answer is missing")
            if self.metric == "logit_diff" and (len(self.answers[i]) != 1 or len(self.wrong[i]) != 1):
                raise InputError(f"{where}: the logit difference takes one answer token each")
            both = sorted(set(self.answers[i]) & set(self.wrong[i]))
            if both:
                raise InputError(f"{where}: token {both[0]} is both an answer and a counterfactual answer: the metric "
                                 "cannot tell them apart")

    def _where(self, i: int) -> str:
        return self.names[i] if self.names else f"pair {i}"

    def check(self, sizes) -> None:
        """The pairs against a model's sizes (a ``ModelSpec``, or ``dpa.request.sizes_of(config)``): every token id
        in its vocabulary, every prompt within its context; a pair that is not is refused by its name."""
        for i in range(len(self)):
            if len(self.clean[i]) > sizes.max_positions:
                raise InputError(f"{self._where(i)}: the prompts are {len(self.clean[i])} tokens, more than the "
                                 f"model's context of {sizes.max_positions}")
            _in_vocab(self, i, sizes.vocab_size)

    def __len__(self) -> int:
        return len(self.clean)

    def subset(self, rows: list[int]) -> Pairs:
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Pairs(pick(self.clean), pick(self.counter), pick(self.answers), pick(self.wrong), self.metric,
                     pick(self.names) if self.names else None)

    def metric_of(self, rows: list[int]):
        """The metric of these pairs: logits [len(rows) vocab] -> [len(rows)]."""
        answers, wrong = [self.answers[i] for i in rows], [self.wrong[i] for i in rows]

        def check(logits: Tensor) -> None:  # the model's vocabulary is the logits' width: an id past it is refused
            for i in rows:
                _in_vocab(self, i, logits.shape[-1], prompts=False)
        if self.metric == "logit_diff":
            good = torch.tensor([a[0] for a in answers])
            bad = torch.tensor([w[0] for w in wrong])

            def logit_diff(logits: Tensor) -> Tensor:
                check(logits)
                r = torch.arange(logits.shape[0], device=logits.device)
                return logits[r, good.to(logits.device)] - logits[r, bad.to(logits.device)]
            return logit_diff
        good_mask = _mask(answers)
        bad_mask = _mask(wrong)

        def prob_diff(logits: Tensor) -> Tensor:
            check(logits)
            p = torch.softmax(logits, -1)
            v = p.shape[-1]
            return (p * _pad(good_mask, v, p)).sum(-1) - (p * _pad(bad_mask, v, p)).sum(-1)
        return prob_diff


def _ids(row, where: str, what: str) -> tuple[int, ...]:
    """A row of token ids as ints (an int, numpy or 0-d integer tensor each); anything else is refused by name."""
    name = {"clean": "the clean prompt", "counter": "the counterfactual prompt", "answers": "the answers",
            "wrong": "the counterfactual answers"}[what]
    if isinstance(row, (str, bytes, dict)) or not hasattr(row, "__iter__"):
        raise InputTypeError(f"{where}: {name} must be a list of token ids, got {type(row).__name__}")
    out = []
    for x in row:
        try:
            if isinstance(x, bool) or (isinstance(x, Tensor) and x.dtype == torch.bool):
                raise TypeError
            out.append(operator.index(x))
        except TypeError:
            raise InputTypeError(f"{where}: {name} must be token ids (ints), got {x!r}") from None
        if out[-1] < 0:
            raise InputError(f"{where}: {name} hold the token id {out[-1]}; ids are 0 or more")
    return tuple(out)


def _in_vocab(pairs: Pairs, i: int, vocab_size: int, prompts: bool = True) -> None:
    rows = [("answer", pairs.answers[i]), ("counterfactual answer", pairs.wrong[i])]
    if prompts:
        rows = [("clean prompt", pairs.clean[i]), ("counterfactual prompt", pairs.counter[i])] + rows
    for what, ids in rows:
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise InputError(f"{pairs._where(i)}: the {what} holds the token id {outside[0]}, outside the model's "
                             f"vocabulary (size {vocab_size})")


def _mask(ids: list[list[int]]) -> Tensor:
    width = max(max(a) for a in ids) + 1
    out = torch.zeros(len(ids), width)
    for r, a in enumerate(ids):
        out[r, a] = 1
    return out


def _pad(mask: Tensor, v: int, like: Tensor) -> Tensor:
    out = torch.zeros(mask.shape[0], v, dtype=like.dtype, device=like.device)
    out[:, :mask.shape[1]] = mask.to(like.dtype)
    return out
