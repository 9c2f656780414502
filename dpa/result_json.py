"""A result as JSON: where ``from_json`` reads it from (text or a file), one reader per field, each naming the field
in its messages (a saved result is input like any other), and how scores are written (short floats, NaN as null)."""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .checks import check_bool, check_choice, check_float, check_int, show
from .errors import InputError, InputTypeError
from .files import load_json, read_json
from .records import NeuronTop, TargetInfo, TargetTerm
from .weights import PathWeights

if TYPE_CHECKING:
    from .result import Attribution


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


def read_record(name: str, value: Any, cls: type, readers: dict[str, Any] | None) -> Any:
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


def _beside(name: str, value: Any) -> tuple[str, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise InputTypeError(f"{name} must be a [unit kind, first column] pair, got {show(value)}")
    return _text(f"{name}[0]", value[0]), _count(f"{name}[1]", value[1])


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
    "terms": _optional(_list_of(lambda name, value: read_record(name, value, TargetTerm, TERM_FIELDS))),
}
FIELDS = {  # every field of Attribution but the scores (SCORES), whose reader depends on score_dtype
    "tokens": _list_of(_text), "token_ids": _list_of(_index), "target_logit": check_float,
    "target": lambda name, value: read_record(name, value, TargetInfo, TARGET_FIELDS),
    "weights": lambda name, value: read_record(name, value, PathWeights, None),  # PathWeights checks its numbers
    "completeness_gap": check_float, "bias_share": check_float, "n_kv_heads": _optional(_count),
    "special": _optional(_list_of(check_bool)), "top_predictions": _list_of(_prediction), "method": _text,
    "model_name": _text, "neuron_target": lambda name, value: check_choice(name, value, ("output", "mid")),
    "d_expert": _optional(_count), "layer_kinds": _optional(_list_of(_text)),
    "dense_layers": _optional(_list_of(_index)), "d_dense": _optional(_count), "n_experts": _optional(_count),
    "beside": _optional(_beside),
}


def read_neuron_top(value: dict, result: Attribution) -> NeuronTop:
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


def read_scores(name: str, value: Any, dims: int, dtype: torch.dtype) -> Tensor | None:
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


def as_lists(t: Tensor, float32: bool) -> list:
    """A tensor as nested lists of Python numbers; ``float32``: each float rounded to float32 and then to the
    shortest decimal that reads back as that float32 (numpy's shortest repr), so JSON stays short."""
    t = t.detach().cpu()
    if not (float32 and t.is_floating_point()):
        return t.tolist()
    import numpy as np

    a = t.to(torch.float32).numpy()
    return a.astype(str).astype(np.float64).tolist()


def encode_json(x):
    """Nested lists of floats with NaN and infinities as None (strict JSON has no NaN)."""
    if isinstance(x, list):
        return [encode_json(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x
