"""The attribution result: tokens, scores, and helpers (JSON for the widget and the book). Its small records are
``records.py``; how it is read from and written to JSON, ``result_json.py``."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
from torch import Tensor

from .checks import check_choice, check_int
from .errors import InputError, InputTypeError
from .registry import MIXER_KINDS, MLP_LAYER
from .files import check_run_config, model_identity, run_folder, write_text  # noqa: F401  (their old home)
from .records import Component, NeuronTop, TargetInfo, TargetTerm  # noqa: F401  (importable from here)
from .result_json import (FIELDS, SCORE_DTYPES, SCORE_DTYPES_NAMES, SCORES, as_lists, encode_json, json_source,
                          read_neuron_top, read_record, read_scores)
from .weights import PathWeights


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
    n_experts: int | None = None  # routed experts per sparse layer: the expert scores' slots, but the last where it
    # is the shared expert's (one more slot); None for a dense model (or a file written before it was recorded)
    d_expert: int | None = None  # neurons per routed expert: neuron n of a layer is neuron n % d_expert of expert
    # n // d_expert (the shared expert's after the routed experts'); None for a dense model
    dense_layers: list[int] | None = None  # where a mixture of experts has a dense MLP on some layers (Jamba's, Qwen's
    # mlp_only_layers): those layers, whose neurons are their dense MLP's, the first columns of their row (the rest
    # zeros), and whose expert scores are zeros; None: every layer's MLP is the sparse block
    d_dense: int | None = None  # with dense_layers: the dense MLPs' neurons, the first columns of those rows
    layer_kinds: list[str] | None = None  # per layer, what its head_scores row scores: "head" (attention heads) or a
    # mixer's unit kind (LFM2's "conv": channel groups of a convolution layer), or "mlp" where the layer's one block is
    # an MLP (Nemotron-H's: a row of zeros, no units); None: every layer attention
    beside: tuple[str, int] | None = None  # (kind, first column): on every layer, the columns of head_scores from the
    # first on are the units of a token mixer beside attention (Falcon-H1's Mamba-2 block: "scan", its SSM heads after
    # the attention heads); None: one kind of unit per row
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
        if not self.conserves:
            paths = ("query, key, gate or router weight > 0, or value or expert != 1" if w.moe else
                     "query, key or gate weight > 0, or value != 1")
            out.append(f"control paths on ({paths}): the token scores need not sum to the target (completeness gap "
                       f"{self.completeness_gap:+.3g})")
        return out

    @property
    def conserves(self) -> bool:
        """Whether the weights conserve the target on this model: the value path alone with gate + up = 1
        (``PathWeights.conservative``: attention's softmax is not multilinear in its queries and keys); on a hybrid
        with no attention layer (its mixers multilinear in their factors, book: Beyond attention) any q + k + v = 1
        with gate + up = 1."""
        w = self.weights
        mixers_only = self.layer_kinds is not None and "head" not in self.layer_kinds and not w.moe
        return w.conservative or (mixers_only and w.constrained)

    @property
    def n_layers(self) -> int:
        return self.head_scores.shape[0]

    def neurons_that_exist(self) -> Tensor:
        """[layer d_mlp] bool: the columns of each layer's row of ``neuron_scores`` that are neurons: all of them,
        but a dense layer's first ``d_dense`` in a mixed layout (``dense_layers``; the model's own record of the same
        fact is ``ModelSpec.neurons_that_exist``)."""
        layers, d_mlp = self.neuron_scores.shape
        width = torch.full((layers,), d_mlp, dtype=torch.long)
        if self.dense_layers:
            width[self.dense_layers] = self.d_dense
        return torch.arange(d_mlp)[None, :] < width[:, None]

    @property
    def unit_kinds(self) -> tuple[str, ...]:
        """The kinds of unit ``head_scores`` holds, in layer order: ("head",), or on a hybrid also its mixers'
        ("head", "conv")."""
        kinds = [*(self.layer_kinds or ["head"]), *([self.beside[0]] if self.beside else [])]
        return tuple(k for k in dict.fromkeys(kinds) if k != MLP_LAYER)  # (an MLP layer's row holds no unit:
        # Nemotron-H's)

    def unit_columns(self, kind: str) -> tuple[Tensor, int]:
        """[layer width] bool: which entries of ``head_scores`` are units of ``kind`` (a hybrid's rows of that kind;
        beside attention, a column range), and the column its unit 0 sits in (a unit's index is its column minus
        it)."""
        layers, width = self.head_scores.shape
        columns, first = torch.arange(width), self.beside[1] if self.beside else width
        if self.beside and kind == self.beside[0]:
            return (columns >= first)[None, :].expand(layers, -1), first
        rows = torch.tensor([r == kind for r in (self.layer_kinds or ["head"] * layers)])
        return rows[:, None] & (columns < first)[None, :], 0

    def unit_at(self, layer: int, column: int) -> tuple[str, int]:
        """(kind, index among that kind's units of the layer) of ``head_scores[layer, column]``: ("head", 2), a
        hybrid's ("conv", 3) on a convolution row, ("scan", 1) at column 5 beside four attention heads (Falcon-H1's);
        the inverse of ``unit_columns``."""
        if self.beside is not None and column >= self.beside[1]:
            return self.beside[0], column - self.beside[1]
        return (self.layer_kinds[layer] if self.layer_kinds is not None else "head"), column

    def top_components(self, k: int = 10, kinds: tuple[str, ...] | None = None) -> dict[str, list[Component]]:
        """The k most positive and k most negative heads, neurons (and experts, on a mixture-of-experts model),
        ranked jointly. ``kinds``: which of "head", "neuron", "expert" (default: all the result has)."""
        k = check_int("k", k, low=0)
        units = self.unit_kinds
        if kinds is None:
            kinds = (*units, "neuron") + (("expert",) if self.expert_scores is not None else ())
        known = (*dict.fromkeys(("head", *units)), "neuron", "expert")
        if isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset)):
            raise InputTypeError(f"kinds must be a tuple of {', '.join(map(repr, known))}, got {kinds!r}")
        unknown = [x for x in kinds if x not in known]
        if unknown:
            raise InputError(f"kinds must hold {', '.join(map(repr, known))}, got {unknown[0]!r}")
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
        for unit in units:  # the head_scores entries of each kind (attention heads, a hybrid's convolution units,
            if unit in kinds:  # the SSM heads beside attention)
                keep, first = self.unit_columns(unit)
                parts.append((unit, torch.where(keep, self.head_scores, torch.nan)[:, first:]))
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
            valid = ~flat.isnan()  # rows of another kind are NaN here (never picked)
            take = min(k, int(valid.sum()))
            high, low = flat.masked_fill(~valid, -math.inf), (-flat).masked_fill(~valid, -math.inf)
            for idx in torch.cat([high.topk(take).indices, low.topk(take).indices]).tolist():
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
                value = encode_json(as_lists(value, short))
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
        if top_neurons is not None and self.neuron_scores is not None and self.neuron_scores.shape[1]:  # (none to
            # keep a top of where the layers have no MLP, Mamba-2's: the empty rows are written as they are)
            top = NeuronTop.of(self.neuron_scores, top_neurons)
            out["neuron_scores"] = None
            out["neuron_position_scores"] = None
        if top is not None:
            row = lambda values: encode_json(as_lists(torch.tensor(values, dtype=torch.float64), short))  # noqa: E731
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
            scores = {field: (lambda f, v, d=dims: read_scores(f, v, d, dtype)) for field, dims in SCORES.items()}
            result = read_record("", data, cls, {**FIELDS, **scores})
            if top is not None:
                result.neuron_top = read_neuron_top(top, result)
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
            if self.neuron_scores.shape[0] != layers:  # which of the two is wrong is not known: both named
                return (f"head_scores has {layers} layers and neuron_scores {self.neuron_scores.shape[0]} (shapes "
                        f"{tuple(self.head_scores.shape)} and {tuple(self.neuron_scores.shape)}): they must agree")
            d_mlp = self.neuron_scores.shape[1]
        expect = {"edge_scores": (layers, heads, n, n), "neuron_position_scores": (layers, n, d_mlp),
                  "effective_targets": (layers + 1, n, None), "position_scores": (n,),
                  "expert_scores": (layers, None),
                  "expert_position_scores": (layers, n, None if self.expert_scores is None else self.expert_scores.shape[1])}
        for name, shape in expect.items():
            t = getattr(self, name)
            if t is not None and any(w is not None and w != g for w, g in zip(shape, t.shape)):
                return f"{name} has shape {tuple(t.shape)}, expected {tuple('?' if w is None else w for w in shape)}"
        if self.beside is not None and not (
                isinstance(self.beside, (tuple, list)) and len(self.beside) == 2 and self.beside[0] in MIXER_KINDS
                and isinstance(self.beside[1], int) and 0 < self.beside[1] < heads and self.layer_kinds is None):
            return (f"beside must be (a mixer's unit kind, the first of its columns, between 1 and {heads - 1}) on a "
                    f"model whose every layer is attention; got {self.beside!r}")
        if self.layer_kinds is not None:
            known = ("head", *MIXER_KINDS, MLP_LAYER)
            if len(self.layer_kinds) != layers or not set(self.layer_kinds) <= set(known):
                return (f"layer_kinds must be {layers} entries, one per layer, each one of {', '.join(known)}; got "
                        f"{self.layer_kinds!r}")
        slots = None if self.expert_scores is None else self.expert_scores.shape[1]
        if self.n_experts is not None and slots is not None and slots - self.n_experts not in (0, 1):
            return f"n_experts {self.n_experts} does not fit the {slots} expert slots (the routed ones, a shared one)"
        if self.d_expert is not None and d_mlp is not None and self.d_expert > d_mlp:  # (a file kept with
            return f"d_expert {self.d_expert!r} does not fit the {d_mlp} neurons per layer"  # top_neurons: none)
        if self.dense_layers is not None or self.d_dense is not None:
            return dense_problem(self, layers, d_mlp)
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


def dense_problem(res: Attribution, layers: int, d_mlp: int | None) -> str | None:
    """What does not fit in a result's dense layers (``Attribution.dense_layers``, ``d_dense``): they must be
    layers of a mixture of experts, once each, with the dense MLPs' width, and no score where they have no unit (an
    expert's, a neuron's past that width)."""
    dense, width = res.dense_layers, res.d_dense
    if (dense is None or width is None or res.d_expert is None or len(set(dense)) != len(dense)
            or not all(0 <= i < layers for i in dense) or (d_mlp is not None and width > d_mlp)):
        return (f"dense_layers must name layers (0 to {layers - 1}, once each) of a mixture of experts (d_expert), "
                f"with d_dense, their neurons (at most {d_mlp} a layer); got dense_layers {dense!r}, "
                f"d_dense {width!r}, d_expert {res.d_expert!r}")
    for name, cols in (("expert_scores", slice(None)), ("expert_position_scores", slice(None)),
                       ("neuron_scores", slice(width, None)), ("neuron_position_scores", slice(width, None))):
        t = getattr(res, name)
        if t is not None and dense and bool(t[dense][..., cols].any()):
            return (f"{name} scores units that dense_layers {dense} (d_dense {width}) says do not exist: an expert on "
                    "a dense layer, or a neuron past its dense MLP's width")
    return None
