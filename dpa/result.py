"""The attribution result: tokens, scores, and helpers (JSON for the widget and the book)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from .checks import check_bool, check_choice, check_float, check_int, show
from .errors import InputError, InputTypeError
from .files import check_run_config, model_identity, run_folder, write_text  # noqa: F401  (their old home)
from .files import load_json, read_json
from .weights import PathWeights


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


class JsonRecord:
    """``to_json`` and ``from_json`` from a class's ``to_dict`` and ``from_dict`` (a result, a generation)."""

    _json_what = "result"  # what messages call a file of it

    def to_json(self, path: str | None = None, **kwargs) -> str:
        """As JSON (strict: no bare NaN; ``kwargs`` go to ``to_dict``); written to ``path`` atomically when given."""
        text = json.dumps(self.to_dict(**kwargs), allow_nan=False)
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike):
        """What ``to_json`` wrote: JSON text, or the path of a file holding it (UTF-8; what else it is, e.g.
        gzip-compressed or UTF-16, is refused by name: ``files.read_text``). A path object (``pathlib.Path``, any
        ``os.PathLike``) is always a file; a ``str`` is JSON text when it starts with ``{`` (after blank space),
        or with ``[`` and names no file (a list: refused as not a result), else the path of a file; so a file
        whose name starts with ``{`` is given as a ``Path`` (a ``str`` that is not valid JSON and names a file says
        so). A byte-order mark (U+FEFF) first in a ``str`` is dropped (text read from a file saved with one). A key
        twice in one object is refused."""
        data, path = json_source(source, cls._json_what)
        try:
            return cls.from_dict(data)
        except InputError as err:
            if path is None:
                raise
            raise type(err)(f"{path!r}: {err}") from None


@dataclass
class Attribution(JsonRecord):
    """Scores for one prompt. Index conventions: ``[layer, head]``, ``[layer, d_mlp]``, ``[pos]``.

    ``target_logit`` is the value of the attributed linear target at the forward pass:
    the logit (token), the logit difference (contrast), ``logit_y - E_p[logit]`` (logprob)
    or ``u . norm(x)`` (vector). ``completeness_gap = sum(token_scores) + position_share + bias_share -
    target_logit``, what no input accounts for: zero for conservative weights (value path only, gate + up = 1).
    ``bias_share`` is the part no token owns (projection and LayerNorm biases: Qwen2, GPT-2, GPT-NeoX);
    ``position_scores`` the learned position embeddings' part per position (GPT-2), apart from the tokens':
    On a model with a final soft-cap (Gemma 2) ``target_logit`` is the pre-cap logit (linear in the
    residual) and ``target.capped_logit`` the model's own.
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
    position_scores: Tensor | None = None  # [pos] learned position embeddings' share (GPT-2); None without them
    expert_scores: Tensor | None = None  # [layer, expert] mixture of experts: routed experts, then a shared one
    expert_position_scores: Tensor | None = None  # [layer, pos, expert] (with neuron_positions=True)
    d_expert: int | None = None  # neurons per routed expert: neuron n of a layer is neuron n % d_expert of expert
    # n // d_expert (the shared expert's after the routed experts'); None for a dense model
    neuron_top: NeuronTop | None = None  # a result read from a file saved with top_neurons=k: the neurons kept
    # (neuron_scores is then None)

    def __repr__(self) -> str:
        """A few lines: what was attributed and the top tokens and components (``summary()``: the full report)."""
        from .report import attribution_repr

        return attribution_repr(self)

    def _repr_html_(self) -> str:
        from .report import attribution_html

        return attribution_html(self)

    def summary(self, top: int = 10) -> str:
        """The report ``dpa attribute`` prints (plain text): the model and target, the tokens' scores, completeness,
        the ``top`` most positive and negative components."""
        from .report import terminal_report

        return terminal_report(self, color=False, top=top)

    def plot_tokens(self, ax=None):
        """A bar per token (matplotlib ``Figure``; drawn into ``ax`` when given)."""
        from .figures import plot_tokens

        return plot_tokens(self, ax)

    def plot_heads(self, ax=None):
        """The head scores as a [layer, head] heatmap (matplotlib ``Figure``)."""
        from .figures import plot_heads

        return plot_heads(self, ax)

    def plot_components(self, k: int = 10, ax=None):
        """The ``k`` most positive and negative heads and neurons as bars (matplotlib ``Figure``)."""
        from .figures import plot_components

        return plot_components(self, k, ax)

    @property
    def position_share(self) -> float:
        """The learned position embeddings' part of the target (0 for models with rotary positions)."""
        return 0.0 if self.position_scores is None else float(self.position_scores.sum())

    @property
    def caveats(self) -> list[str]:
        """What dpa cannot vouch for in these scores (also in ``to_dict`` and the reports); [] when none."""
        w, out = self.weights, []
        if self.method != "dpa":
            return out
        if not w.constrained:
            out.append(f"path weights off the paper's constraints (q+k+v = {w.query + w.key + w.value:g}, "
                       f"gate+up = {w.gate + w.up:g}; the paper has 1 and 1): the scores scale the target's "
                       "paths unevenly and are not the paper's DPA")
        if not w.conservative:
            out.append("control paths on (query, key or gate weight > 0, or value != 1): the token scores need "
                       f"not sum to the target (completeness gap {self.completeness_gap:+.3g})")
        return out

    @property
    def n_layers(self) -> int:
        return self.head_scores.shape[0]

    def top_components(self, k: int = 10, kinds: tuple[str, ...] | None = None) -> dict[str, list[Component]]:
        """The k most positive and k most negative heads, neurons (and experts, on a mixture-of-experts model),
        ranked jointly. ``kinds``: which of "head", "neuron", "expert" (default: all the result has)."""
        k = check_int("k", k, low=0)
        if kinds is None:
            kinds = ("head", "neuron") + (("expert",) if self.expert_scores is not None else ())
        if isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset)):
            raise InputTypeError(f"kinds must be a tuple of 'head', 'neuron' and/or 'expert', got {kinds!r}")
        unknown = [x for x in kinds if x not in ("head", "neuron", "expert")]
        if unknown:
            raise InputError(f"kinds must hold 'head', 'neuron' and/or 'expert', got {unknown[0]!r}")
        if "expert" in kinds and self.expert_scores is None:
            raise InputError("this result has no expert scores (the model has no mixture of experts)")
        if "neuron" in kinds and self.neuron_scores is None:
            if self.neuron_top is None:
                raise InputError("this result has no neuron scores: use kinds=('head',)")
            if k > self.neuron_top.k:
                raise InputError(f"this result keeps the {self.neuron_top.k} most positive and most negative neurons "
                                 f"of each layer (saved with top_neurons={self.neuron_top.k}), so the top {k} neurons "
                                 f"overall are not known: ask for k <= {self.neuron_top.k}, use kinds=('head',), or "
                                 "save every neuron (top_neurons=None; dpa attribute --json-neurons all)")
        parts = []
        if "head" in kinds:
            parts.append(("head", self.head_scores))
        if "neuron" in kinds and self.neuron_scores is not None:
            parts.append(("neuron", self.neuron_scores))
        if "expert" in kinds:
            parts.append(("expert", self.expert_scores))
        items: list[Component] = []
        if "neuron" in kinds and self.neuron_scores is None:
            items.extend(self.neuron_top.components())
        for kind, scores in parts:
            flat = scores.detach().double().flatten()
            width = scores.shape[1]
            take = min(k, flat.numel())
            for idx in torch.cat([flat.topk(take).indices, (-flat).topk(take).indices]).tolist():
                items.append(Component(kind, idx // width, idx % width, float(flat[idx])))
        pos = sorted({c for c in items if c.score > 0}, key=lambda c: -c.score)[:k]
        neg = sorted({c for c in items if c.score < 0}, key=lambda c: c.score)[:k]
        return {"positive": pos, "negative": neg}

    def to_dict(self, *, top_neurons: int | None = None,
                precision: Literal["full", "float32"] = "full") -> dict[str, Any]:
        """JSON-ready dict. ``top_neurons=k`` keeps, instead of every neuron, the k most positive and the k most
        negative of each layer and each layer's total (``"top_neurons"``: the neuron scores of a 30-layer model
        are most of its size; ``NeuronTop``); the neuron-by-position scores are then left out. Scores keep
        their precision (``score_dtype``), or with ``precision="float32"`` are rounded to float32 and written
        in the fewest digits that read back as the same float32 (about half the text of float64). NaN and
        infinities are written as null."""
        check_choice("precision", precision, ("full", "float32"))
        short = precision == "float32"
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "neuron_top":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = _encode(_as_list(value, short))
            elif isinstance(value, PathWeights):
                value = value.to_dict()
            elif isinstance(value, TargetInfo):
                value = asdict(value)
            out[f.name] = value
        out["score_dtype"] = "float32" if short else str(self.token_scores.dtype).removeprefix("torch.")
        out["caveats"] = self.caveats
        if top_neurons is not None:
            top_neurons = check_int("top_neurons", top_neurons, low=1)
        top = self.neuron_top if self.neuron_top is None or top_neurons is None else self.neuron_top.smaller(top_neurons)
        if top_neurons is not None and self.neuron_scores is not None:
            top = NeuronTop.of(self.neuron_scores, top_neurons)
            out["neuron_scores"] = None
            out["neuron_position_scores"] = None
        if top is not None:
            row = lambda values: _encode(_as_list(torch.tensor(values, dtype=torch.float64), short))  # noqa: E731
            out["top_neurons"] = {"k": top.k, "d_mlp": top.d_mlp, "index": top.index,
                                  "score": [row(r) for r in top.score], "total": row(top.total)}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attribution:
        """The result ``to_dict`` wrote (a result saved with ``top_neurons`` has ``neuron_scores=None``). Every
        field is checked once, by name (``InputTypeError``: a wrong type, ``InputError``: a wrong value): a score
        field is a floating-point tensor or lists nested to its number of dimensions of numbers (null: NaN, as
        ``to_dict`` writes NaN and infinities), read as ``score_dtype`` (default float32); an integer tensor, a
        string or a bool among numbers, a non-finite target logit or probability are refused, as are a number too
        large for ``score_dtype`` (1e39 in float32: it would read as infinity) and a tensor with no values (on the
        meta device); ``score_dtype`` is float16, bfloat16, float32 or float64. Then the fields must fit together
        (one token score a token, ...)."""
        if not isinstance(data, dict):
            raise InputTypeError(f"an Attribution is read from a dict (as to_dict writes), got {type(data).__name__}")
        if "neuron_top" in data:
            raise InputError("not an Attribution dict: unknown field(s) neuron_top (a saved result has top_neurons)")
        top = data.get("top_neurons")
        data = {k: v for k, v in data.items() if k not in ("top_neurons", "caveats")}  # caveats: from the weights
        try:
            name = data.pop("score_dtype", "float32")
            dtype = getattr(torch, name, None) if isinstance(name, str) else None
            if dtype not in SCORE_DTYPES:  # float8/float4: signs and infinities lost, or no conversion at all
                raise InputError(f"score_dtype {name!r} is not one of {', '.join(map(repr, SCORE_DTYPES_NAMES))}")
            scores = {field: (lambda f, v, d=dims: _scores(f, v, d, dtype)) for field, dims in SCORES.items()}
            result = _record("", data, cls, {**FIELDS, **scores})
            if top is not None:
                result.neuron_top = _neuron_top(top, result)
            problem = result._shape_problem()
            if problem:
                raise InputError(problem)
        except InputError as err:
            raise type(err)(f"not an Attribution dict: {err}") from None
        return result

    def _shape_problem(self) -> str | None:
        """What does not fit together in a result read from outside (None when everything fits), once each field
        is of its type (``from_dict``'s readers)."""
        n = len(self.tokens)
        if n < 1:
            return "tokens must be a non-empty list of strings"
        if len(self.token_ids) != n:
            return f"token_ids must be {n} ints, one per token"
        if self.special is not None and len(self.special) != n:
            return f"special has {len(self.special)} entries for {n} tokens"
        if tuple(self.token_scores.shape) != (n,):
            return f"token_scores has shape {tuple(self.token_scores.shape)} for {n} tokens"
        layers, heads = self.head_scores.shape
        d_mlp = None
        if self.neuron_scores is not None:
            if self.neuron_scores.shape[0] != layers:
                return f"neuron_scores must be [{layers} layers, d_mlp], got {tuple(self.neuron_scores.shape)}"
            d_mlp = self.neuron_scores.shape[1]
        expect = {"edge_scores": (layers, heads, n, n), "neuron_position_scores": (layers, n, d_mlp),
                  "effective_targets": (layers + 1, n, None), "position_scores": (n,),
                  "expert_scores": (layers, None),
                  "expert_position_scores": (layers, n, None if self.expert_scores is None else self.expert_scores.shape[1])}
        for name, shape in expect.items():
            t = getattr(self, name)
            if t is not None and any(w is not None and w != g for w, g in zip(shape, t.shape)):
                return f"{name} has shape {tuple(t.shape)}, expected {tuple('?' if w is None else w for w in shape)}"
        if self.d_expert is not None and (self.expert_scores is None or d_mlp is None or self.d_expert > d_mlp):
            return f"d_expert {self.d_expert!r} does not fit the expert and neuron scores"
        if self.target.position >= n:
            return f"target.position {self.target.position!r} is outside the {n} tokens"
        terms = self.target.terms
        if terms is not None:  # several tokens: each read after the last, its own token the next input
            p = self.target.position
            mine = [t for t in terms if not t.contrast]
            theirs = [t for t in terms if t.contrast]
            k = len(mine) - 1  # the target's forced tokens; the contrast's follow them
            want = list(range(p, p + len(mine))) + ([p] + list(range(p + k + 1, p + k + len(theirs))))[:len(theirs)]
            forced = [t.token_id for t in mine[:-1]] + [t.token_id for t in theirs[:-1]]
            if len(terms) < 2 or terms[:len(mine)] != mine or [t.position for t in terms] != want \
                    or p + 1 + len(forced) != n or mine[0].token_id != self.target.token_id \
                    or forced != self.token_ids[p + 1:] or (theirs and self.target.kind != "contrast"):
                return (f"target.terms do not fit the tokens: a target of several tokens has one term a token, the "
                        f"first at target.position ({p}), each next one a position later, and every term but the "
                        "last is the next input token (teacher forcing), up to the end of the tokens (a contrast "
                        "of several tokens: its terms after the target's, its tokens after the target's)")
            total = sum(t.value for t in terms)
            if not math.isclose(total, self.target_logit, rel_tol=1e-4, abs_tol=1e-4):
                return f"target.terms add up to {total!r}, not to target_logit {self.target_logit!r}"
        return None


def json_source(source: str | os.PathLike, what: str) -> tuple[Any, str | None]:
    """(the parsed JSON, the file's path or None) of what ``from_json`` takes: JSON text, or the path of a file (see
    ``Attribution.from_json``); ``what`` names it in messages ("result", "generation")."""
    if not isinstance(source, (str, os.PathLike)):
        raise InputTypeError(f"from_json takes JSON text or a file path, got {type(source).__name__}")
    if isinstance(source, str):
        source = source.removeprefix("\ufeff")
        if not source.strip():
            raise InputError(f"from_json got an empty string: give JSON text or the path of a {what} file")
    text = source.lstrip() if isinstance(source, str) else ""
    if text.startswith("{") or (text.startswith("[") and not os.path.lexists(source)):
        try:
            return load_json(source, "the JSON text"), None
        except InputError as err:
            if text.startswith("{") and os.path.lexists(source):  # lexists: False for a name too long
                raise type(err)(f"{err}; a file of that name exists: pass pathlib.Path({source!r}) to read "
                                f"it") from None
            raise
    if "\0" in os.fsdecode(source):  # os.stat's raw ValueError
        raise InputError(f"no {what} file {os.fsdecode(source)!r}: a path cannot hold a NUL character")
    return read_json(source, f"{what} file"), os.fsdecode(source)


# --- reading a saved result: one reader a field, each naming the field in its messages ------------------------

# The score fields and their number of dimensions ([layer, head], [pos], ...); only the first two are required.
SCORES = {"token_scores": 1, "head_scores": 2, "neuron_scores": 2, "edge_scores": 4, "neuron_position_scores": 3,
          "effective_targets": 3, "position_scores": 1, "expert_scores": 2, "expert_position_scores": 3}
REQUIRED_SCORES = ("token_scores", "head_scores")
SCORE_DTYPES_NAMES = ("float16", "bfloat16", "float32", "float64")
SCORE_DTYPES = tuple(getattr(torch, n) for n in SCORE_DTYPES_NAMES)


def _record(name: str, value: Any, cls: type, readers: dict[str, Any] | None) -> Any:
    """The dataclass ``cls`` from the dict ``value`` (the field ``name`` of a saved result; "" for the result
    itself): unknown and missing fields refused by name, each field read by its reader (None: by ``cls``)."""
    where = f"{name}." if name else ""
    if not isinstance(value, dict):
        raise InputTypeError(f"{name} must be an object (a dict), got {show(value)}")
    known = [f.name for f in fields(cls)]
    unknown = [str(k) for k in value if k not in known]
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(where + k for k in unknown)}")
    missing = [where + f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
               and f.name not in value]
    if missing:
        raise InputError(f"missing {', '.join(missing)}")
    return cls(**{k: v if readers is None else readers[k](where + k, v) for k, v in value.items()})


def _optional(read):
    return lambda name, value: None if value is None else read(name, value)


def _list_of(read):
    def read_list(name: str, value: Any) -> list:
        if not isinstance(value, (list, tuple)):
            raise InputTypeError(f"{name} must be a list, got {show(value)}")
        return [read(f"{name}[{i}]", v) for i, v in enumerate(value)]
    return read_list


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InputTypeError(f"{name} must be a string, got {show(value)}")
    return value


def _index(name: str, value: Any) -> int:
    return check_int(name, value, low=0)


def _count(name: str, value: Any) -> int:
    return check_int(name, value, low=1)


def _probability(name: str, value: Any) -> float:
    return check_float(name, value, low=0, high=1)


def _prediction(name: str, value: Any) -> tuple[str, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise InputTypeError(f"{name} must be a [token, probability] pair, got {show(value)}")
    return _text(f"{name}[0]", value[0]), _probability(f"{name}[1]", value[1])


TERM_FIELDS = {
    "position": _index, "token": _optional(_text), "token_id": _index, "value": check_float,
    "probability": _optional(_probability), "contrast": check_bool,
}
TARGET_FIELDS = {
    "kind": lambda name, value: check_choice(name, value, ("token", "contrast", "logprob", "vector")),
    "position": _index, "token": _optional(_text), "token_id": _optional(_index), "contrast": _optional(_text),
    "contrast_id": _optional(_index), "probability": _optional(_probability),
    "logprob": _optional(lambda name, value: check_float(name, value, high=0)), "hint": _optional(_text),
    "capped_logit": _optional(check_float),
    "terms": _optional(_list_of(lambda name, value: _record(name, value, TargetTerm, TERM_FIELDS))),
}
FIELDS = {  # every field of Attribution but the scores (SCORES), whose reader depends on score_dtype
    "tokens": _list_of(_text), "token_ids": _list_of(_index), "target_logit": check_float,
    "target": lambda name, value: _record(name, value, TargetInfo, TARGET_FIELDS),
    "weights": lambda name, value: _record(name, value, PathWeights, None),  # PathWeights checks its numbers
    "completeness_gap": check_float, "bias_share": check_float, "n_kv_heads": _optional(_count),
    "special": _optional(_list_of(check_bool)), "top_predictions": _list_of(_prediction), "method": _text,
    "model_name": _text, "neuron_target": lambda name, value: check_choice(name, value, ("output", "mid")),
    "d_expert": _optional(_count),
}


def _neuron_top(value: dict, result: Attribution) -> NeuronTop:
    """The ``top_neurons`` of a saved result, checked: one row per layer of the result, indices in range and
    once each, as many scores as indices, finite numbers, no more than k of each sign; none next to
    neuron_scores."""
    if not isinstance(value, dict):
        raise InputTypeError(f"top_neurons must be an object (a dict), got {show(value)}")
    if result.neuron_scores is not None:
        raise InputError("a result has neuron_scores or top_neurons, not both")
    if "k" not in value and set(value) <= {"index", "score", "d_mlp"}:
        raise InputError("top_neurons is in an older format (each layer's neurons by |score|, without k), from which "
                         "the top neurons cannot be ranked: write the result again with this version of dpa, or "
                         "delete the top_neurons field to read the rest")
    unknown = sorted(set(value) - {"k", "d_mlp", "index", "score", "total"})
    if unknown:
        raise InputError(f"unknown field(s) {', '.join('top_neurons.' + u for u in unknown)}")
    k = check_int("top_neurons.k", value.get("k"), low=1)
    d_mlp = check_int("top_neurons.d_mlp", value.get("d_mlp"), low=1)
    layers = result.head_scores.shape[0]
    rows = {}
    for name in ("index", "score"):
        rows[name] = value.get(name)
        if not isinstance(rows[name], list) or len(rows[name]) != layers or not all(isinstance(r, list) for r in rows[name]):
            raise InputError(f"top_neurons.{name} must be {layers} lists, one per layer")
    index = [[_index(f"top_neurons.index[{layer}]", i) for i in row] for layer, row in enumerate(rows["index"])]
    score = [[_number(f"top_neurons.score[{layer}]", v) for v in row] for layer, row in enumerate(rows["score"])]
    total = value.get("total")
    if not isinstance(total, list) or len(total) != layers:
        raise InputError(f"top_neurons.total must be {layers} numbers, one per layer")
    total = [_number(f"top_neurons.total[{layer}]", v) for layer, v in enumerate(total)]
    for layer, (idx, sc) in enumerate(zip(index, score)):
        if len(idx) != len(sc):
            raise InputError(f"top_neurons layer {layer}: {len(idx)} indices and {len(sc)} scores")
        if any(i >= d_mlp for i in idx) or len(set(idx)) != len(idx):
            raise InputError(f"top_neurons layer {layer}: an index is out of [0, {d_mlp}) or given twice")
        pos, neg = sum(v > 0 for v in sc), sum(v < 0 for v in sc)
        if pos > k or neg > k:
            raise InputError(f"top_neurons layer {layer}: more than k = {k} neurons of one sign")
        if any(math.isnan(v) for v in sc):
            raise InputError(f"top_neurons layer {layer}: a kept score is NaN (null), which has no rank")
        # fewer than k of a sign kept: the layer has no other neuron of that sign, which its total must show
        kept, t = sum(sc), total[layer]
        tol = 1e-4 * (sum(abs(v) for v in sc) + abs(t)) + 1e-6
        if math.isfinite(t) and math.isfinite(kept) and (
                (pos < k and neg < k and abs(t - kept) > tol) or (pos < k and t > kept + tol)
                or (neg < k and t < kept - tol)):
            raise InputError(f"top_neurons layer {layer}: keeps {pos} positive and {neg} negative neurons (k = {k}), "
                             f"so the layer's other neurons are of the other sign or zero, but its total {t:+.6g} "
                             f"does not fit the kept scores' sum {kept:+.6g}")
    return NeuronTop(k, d_mlp, index, score, total)


def _number(name: str, value: Any) -> float:
    """A saved score: a number, or null (NaN: to_dict writes NaN and infinities as null); a float that is not
    finite (a dict built in Python) is kept as it is."""
    if value is None:
        return math.nan
    if isinstance(value, float) and not math.isfinite(value):
        return value
    return check_float(name, value)


def _scores(name: str, value: Any, dims: int, dtype: torch.dtype) -> Tensor | None:
    """A score field as a tensor of ``dtype``: a floating-point tensor of ``dims`` dimensions, or lists nested
    ``dims`` deep of numbers (None: NaN); None where the field is optional."""
    if value is None and name not in REQUIRED_SCORES:
        return None
    if isinstance(value, Tensor):
        if not value.is_floating_point():  # an integer tensor would pass for scores rounded to whole numbers
            raise InputTypeError(f"{name} must hold floating-point scores, got a tensor of "
                                 f"{str(value.dtype).removeprefix('torch.')}")
        if value.is_meta:  # no values to read (a raw NotImplementedError on copying)
            raise InputError(f"{name} is a tensor on the meta device: it holds no values")
        source = value.detach()
        t = source.to("cpu", dtype)
    else:
        source = numbers = _numbers(name, value, dims)
        try:
            t = torch.tensor(numbers, dtype=dtype)
        except ValueError:  # lists of one depth not all of one length
            raise InputError(f"{name} is ragged: its lists are not all of one length") from None
    if t.dim() != dims:
        raise InputError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.isinf().any():  # rare: only then the check that no finite number became an infinity in dtype
        was = source.cpu() if isinstance(source, Tensor) else torch.tensor(source, dtype=torch.float64)
        overflow = (t.isinf() & was.isfinite()).nonzero()
        if len(overflow):
            at = "".join(f"[{i}]" for i in overflow[0].tolist())
            raise InputError(f"{name}{at} is out of the range of {str(dtype).removeprefix('torch.')} (score_dtype): "
                             f"{was[tuple(overflow[0].tolist())].item()!r}")
    return t


def _numbers(name: str, value: Any, dims: int) -> list:
    """``value`` checked to be lists nested ``dims`` deep of numbers or None (NaN): each as a float."""
    if not isinstance(value, (list, tuple)):
        raise InputTypeError(f"{name} must be a list{' of lists' * (dims - 1)} of numbers, got {show(value)}")
    if dims > 1:
        return [_numbers(f"{name}[{i}]", v, dims - 1) for i, v in enumerate(value)]
    return [v if type(v) is float else _number(f"{name}[{i}]", v) for i, v in enumerate(value)]  # float: at once


def _number(name: str, value: Any) -> float:
    if value is None:  # to_dict writes NaN and infinities as null
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputTypeError(f"{name} must be a number or null, got {show(value)}")
    try:
        return float(value)
    except OverflowError:
        raise InputError(f"{name} is out of the range of a float: {show(value)}") from None


def _as_list(t: Tensor, float32: bool) -> list:
    """A tensor as nested lists of Python numbers; ``float32``: each float rounded to float32 and then to the
    shortest decimal that reads back as that float32 (numpy's shortest repr), so JSON stays short."""
    t = t.detach().cpu()
    if not (float32 and t.is_floating_point()):
        return t.tolist()
    import numpy as np

    a = t.to(torch.float32).numpy()
    return a.astype(str).astype(np.float64).tolist()


def _encode(x):
    """Nested lists of floats with NaN and infinities as None (strict JSON has no NaN)."""
    if isinstance(x, list):
        return [_encode(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x

