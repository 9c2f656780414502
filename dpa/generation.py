"""``attribute_generation``: every generated token attributed to every token before it (book: whole-answers).

A generation is a target of several tokens (``multi_token="sum"``) whose terms are kept apart: the model's own
greedy continuation (or one given) is appended to the prompt, one instrumented forward pass runs over the whole,
and one linearised backward per generated token runs through that same graph (kept between them). Row j of the
[generated x source] matrix is step j's token scores: exactly the one-position ``dpa.attribute`` call on the
prompt and the first j generated tokens with the j-th generated token as the target (causal attention: later
tokens get zero), with that step's head and neuron scores beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from . import prompts
from . import request as requests
from .attribute import plan_memory
from .backward import Run, attribution, run
from .checks import check_bool, check_choice, check_int
from .errors import InputError
from .instrument import clean_logits
from .request import Prompt
from .result import Attribution, JsonRecord
from .targets import TargetSpec
from .weights import PathWeights


@dataclass
class Generation(JsonRecord):
    """What ``attribute_generation`` returns: the tokens (prompt, then generated), the matrix of token scores
    [generated x source] and each step's whole ``Attribution`` (its tokens are the prefix it read)."""

    tokens: list[str]  # the prompt's tokens, then the generated ones
    token_ids: list[int]
    prompt_length: int  # the first generated token is tokens[prompt_length]
    scores: Tensor  # [generated, source]: row j = step j's token scores; sources from position n - 1 + j on are 0
    steps: list[Attribution]  # step j: the target tokens[prompt_length + j] after the prompt and j generated tokens
    generated_by: str  # "greedy" (the model's own argmax, one token at a time) or "given"
    text: tuple[str, str] = ("", "")  # (prompt, generation) as the tokenizer decodes them

    _json_what = "generation"  # what from_json's messages call a file of it (JsonRecord)

    @property
    def generated(self) -> list[str]:
        return self.tokens[self.prompt_length:]

    @property
    def values(self) -> list[float]:
        """Each step's attributed value (the generated token's logit, or what ``kind="logprob"`` attributes)."""
        return [s.target_logit for s in self.steps]

    def to_dict(self, **kwargs) -> dict:
        """JSON-ready: the tokens, the prompt length, how it was generated and each step's ``Attribution.to_dict``
        (``kwargs``: its ``precision`` and ``top_neurons``); the matrix is the steps' token scores."""
        return {"format": "dpa.Generation/1", "tokens": list(self.tokens), "token_ids": list(self.token_ids),
                "prompt_length": self.prompt_length, "generated_by": self.generated_by, "text": list(self.text),
                "steps": [s.to_dict(**kwargs) for s in self.steps]}

    @classmethod
    def from_dict(cls, data: dict) -> Generation:
        """What ``to_dict`` wrote, checked: each step read by ``Attribution.from_dict``, and the steps must be the
        prefixes of the tokens, one a generated token."""
        if not isinstance(data, dict) or data.get("format") != "dpa.Generation/1":
            raise InputError("not a dpa generation (to_dict writes format 'dpa.Generation/1')")
        unknown = sorted(set(data) - {"format", "tokens", "token_ids", "prompt_length", "generated_by", "text",
                                      "steps"})
        if unknown:
            raise InputError(f"unknown field(s) {', '.join(unknown)}")
        ids, n = data.get("token_ids"), data.get("prompt_length")
        steps = data.get("steps")
        if not isinstance(steps, list) or not steps or not isinstance(ids, list) or not isinstance(n, int):
            raise InputError("a generation needs token_ids, prompt_length and a non-empty list of steps")
        if n < 1:
            raise InputError(f"prompt_length must be at least 1, got {n}")
        if data.get("generated_by") not in ("greedy", "given"):
            raise InputError(f"generated_by must be 'greedy' or 'given', got {data.get('generated_by')!r}")
        steps = [Attribution.from_dict(s) for s in steps]
        tokens, text = data.get("tokens"), data.get("text")
        if not isinstance(tokens, list) or len(tokens) != len(ids) or not all(isinstance(t, str) for t in tokens):
            raise InputError("tokens must be one string per token id")
        if not isinstance(text, list) or len(text) != 2 or not all(isinstance(t, str) for t in text):
            raise InputError("text must be [prompt, generation], two strings")
        first = steps[0]
        if len(ids) != n + len(steps) or any(
                s.token_ids != ids[:n + j] or s.tokens != tokens[:n + j] or s.target.token_id != ids[n + j]
                or s.target.position != n + j - 1 or s.target.terms is not None for j, s in enumerate(steps)):
            raise InputError("the steps are not the generation's: step j reads the prompt and j generated tokens "
                             "(its tokens and ids those of the generation) and attributes the next one, one token")
        if any(s.target.kind != first.target.kind or s.target.kind not in ("token", "logprob") or s.weights !=
               first.weights or s.model_name != first.model_name or s.method != first.method for s in steps):
            raise InputError("the steps of a generation share one kind of target (token or logprob), one set of path "
                             "weights, one model and one method")
        matrix = torch.zeros(len(steps), len(ids) - 1, dtype=first.token_scores.dtype)
        for j, s in enumerate(steps):
            matrix[j, :len(s.token_scores)] = s.token_scores
        return cls(tokens=tokens, token_ids=ids, prompt_length=n, scores=matrix, steps=steps,
                   generated_by=data["generated_by"], text=tuple(text))

    def __repr__(self) -> str:
        text = self.text[1]
        return (f"<dpa.Generation of {len(self.steps)} tokens ({self.generated_by}) after {self.prompt_length} "
                f"prompt tokens: {text!r}; scores [{self.scores.shape[0]} x {self.scores.shape[1]}], steps[j] holds "
                "step j's heads and neurons>")


def attribute_generation(model: nn.Module, tokenizer, prompt: Prompt, continuation: str | list[int] | None = None, *,
                         max_new_tokens: int | None = None, stop_at_eos: bool = True,
                         kind: Literal["logit", "logprob"] = "logit", weights: PathWeights | None = None,
                         memory: Literal["auto", "full", "lean"] = "auto") -> Generation:
    """Generate greedily after ``prompt`` (or take ``continuation``) and attribute every generated token to every
    token before it, prompt and generated, with each step's head and neuron scores.

    prompt: a string or token ids (a tensor of one row and a tokenizer's output of one prompt too).
    continuation: the tokens to attribute instead of generating: a string (tokenised on its own, no special
        tokens) or token ids (a list or a 1-D tensor). max_new_tokens: how many tokens to generate (default 20;
        greedy: the model's argmax, one at a time; refused with a continuation). stop_at_eos: stop after the
        model's end-of-sequence token (it is attributed too). kind, weights, memory: as in ``dpa.attribute``.

    One forward pass over the prompt and the generation, then one linearised backward per generated token
    through that graph. Returns a ``Generation``: ``scores`` [generated x source], ``steps`` (one ``Attribution``
    each, equal to ``dpa.attribute`` on its prefix).
    """
    check_choice("kind", kind, ("logit", "logprob"))
    check_choice("memory", memory, ("auto", "full", "lean"))
    stop_at_eos = check_bool("stop_at_eos", stop_at_eos)
    spec = requests.check_model(model)
    ids = requests.encode(tokenizer, spec, _one_prompt(tokenizer, prompt), batch=False).rows[0]
    if continuation is not None and max_new_tokens is not None:
        raise InputError("max_new_tokens is for generating: a continuation given is attributed whole (cut it "
                         "instead)")
    if continuation is None:
        max_new_tokens = check_int("max_new_tokens", 20 if max_new_tokens is None else max_new_tokens, low=1)
        if len(ids) + max_new_tokens - 1 > spec.max_positions:
            raise InputError(f"the prompt has {len(ids)} tokens: {max_new_tokens} more do not fit the model's context "
                             f"of {spec.max_positions} (the last generated token is a target, not an input)")
        new, how = _greedy(model, tokenizer, ids, max_new_tokens, stop_at_eos), "greedy"
    else:
        new, how = _continuation(tokenizer, continuation), "given"
    req = requests.build(model, tokenizer, ids, kind=kind, weights=weights, batch=False, continuation=new)
    lean = plan_memory(model, spec, 1, req.n_tokens, memory)
    done = run(model, req, lean=lean, each_term=True)
    n = len(ids)
    steps = [attribution(model, *_step(req, done, j, n), 0) for j in range(len(new))]
    t = len(ids) + len(new) - 1  # the sources: the prompt and every generated token but the last
    matrix = torch.zeros(len(new), t, dtype=steps[0].token_scores.dtype)
    for j, s in enumerate(steps):
        matrix[j, :len(s.token_scores)] = s.token_scores
    all_ids = ids + new
    text = (ids, new) if tokenizer is None else (tokenizer.decode(ids), tokenizer.decode(new))
    return Generation(tokens=req.decode(all_ids), token_ids=all_ids, prompt_length=n, scores=matrix, steps=steps,
                      generated_by=how, text=tuple(map(str, text)))


def _step(req: requests.Request, run: Run, j: int, n: int) -> tuple[requests.Request, Run]:
    """Step j as a one-position request and run of its own: the prefix it reads, its target and scores."""
    t = req.targets[0]
    cut = n + j  # the prompt and the first j generated tokens
    step_req = dataclasses.replace(
        req, input_ids=req.input_ids[:, :cut], mask=req.mask[:, :cut],
        positions=torch.tensor([cut - 1], device=req.device),
        targets=[TargetSpec(t.kind if t.kind == "logprob" else "token", token_id=t.term(j).token_id)],
        clean_logits=None)
    one = slice(j, j + 1)
    return step_req, Run(scores=run.per_term[j], values=run.term_values[one], probs=run.probs[one],
                         capped=None if run.term_capped is None else run.term_capped[one],
                         term_rows=[0], term_values=run.term_values[one])


def _greedy(model: nn.Module, tokenizer, ids: list[int], max_new_tokens: int, stop_at_eos: bool) -> list[int]:
    """The model's argmax, one token at a time (no sampling, no penalties: the generation config is not read)."""
    eos = _eos_ids(model, tokenizer) if stop_at_eos else set()
    out: list[int] = []
    for _ in range(max_new_tokens):
        req = requests.build(model, tokenizer, ids + out, batch=False)
        out.append(int(clean_logits(model, req)[0].argmax()))
        if out[-1] in eos:
            break
    return out


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    found = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        found |= set(value) if isinstance(value, (list, tuple)) else ({value} if isinstance(value, int) else set())
    return found


def _one_prompt(tokenizer, prompt):
    """A batch of one prompt (a tokenizer's output with return_tensors, a [1, pos] tensor) as that prompt."""
    canonical = prompts.canonical(tokenizer, prompt)
    if prompts.is_batch(canonical):
        rows = list(canonical.unbind(0)) if isinstance(canonical, Tensor) else list(canonical)
        if len(rows) != 1:
            raise InputError(f"a generation follows one prompt; got a batch of {len(rows)} (attribute each alone)")
        return rows[0]
    return canonical


def _continuation(tokenizer, continuation) -> list[int]:
    """The given continuation as a list of int ids: a string (tokenised alone), a list of ids, a 1-D tensor or
    array of integers."""
    if isinstance(continuation, str):
        if tokenizer is None:
            raise InputError("a continuation string needs the tokenizer; pass token ids instead")
        if not continuation:
            raise InputError("the continuation is an empty string")
        return list(tokenizer.encode(continuation, add_special_tokens=False))
    continuation = prompts.numpy_tensor(continuation, "continuation")
    if isinstance(continuation, Tensor):
        if continuation.dim() != 1 or continuation.is_floating_point() or continuation.is_complex() \
                or continuation.dtype == torch.bool:
            raise InputError(f"a continuation tensor must be 1-D integer token ids (one continuation), got "
                             f"{continuation.dtype} of shape {tuple(continuation.shape)}")
        continuation = continuation.tolist()
    if not isinstance(continuation, (list, tuple)) or not continuation:
        raise InputError(f"the continuation must be a string or a non-empty list of token ids, got "
                         f"{type(continuation).__name__}")
    out = []
    for x in continuation:
        x = prompts.numpy_tensor(x, "continuation")
        if isinstance(x, Tensor) and x.numel() == 1 and not x.is_floating_point() and x.dtype != torch.bool:
            x = int(x)
        if not prompts.is_id(x):
            raise InputError(f"the continuation's token ids must be integers, got {x!r} ({type(x).__name__})")
        out.append(int(x))
    return out
