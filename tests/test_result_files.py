"""Saved results read back from outside (``Attribution.from_json`` / ``from_dict``), from a hostile review: a path is
a file whatever its name, a file that is not UTF-8 JSON is refused saying what it is, a key twice in one object is
refused, and every field is checked by name (type, depth, finiteness) instead of failing later or being read wrong.
No model: a small result built by hand."""

from __future__ import annotations

import bz2
import gzip
import json
import math
from pathlib import Path

import pytest
import torch

import dpa
from dpa import Attribution, InputError, InputTypeError, TargetInfo


def result() -> Attribution:
    return Attribution(
        tokens=["The", " city"], token_ids=[5, 9], token_scores=torch.tensor([0.25, 1.5], dtype=torch.float64),
        head_scores=torch.arange(6, dtype=torch.float64).reshape(2, 3), neuron_scores=torch.ones(2, 4,
                                                                                                dtype=torch.float64),
        target_logit=2.0, target=TargetInfo(kind="token", position=1, token=" of", token_id=3, probability=0.5,
                                            logprob=-0.693),
        top_predictions=[(" of", 0.5), (" is", 0.25)], special=[False, False])


def saved(**change) -> dict:
    return {**json.loads(result().to_json()), **change}


# --- from_json: a path or JSON text -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["{draft}.json", "[draft].json", " {x}"])
def test_a_path_object_is_always_a_file_whatever_its_name(tmp_path, monkeypatch, name):
    """A file whose name starts with { or [ was parsed as JSON text (not valid JSON) instead of read."""
    monkeypatch.chdir(tmp_path)
    path = Path(name)  # relative: its text starts with the brace
    result().to_json(path)
    assert Attribution.from_json(path).tokens == ["The", " city"]


def test_a_str_is_json_text_when_it_starts_with_a_brace_else_a_path(tmp_path, monkeypatch):
    assert Attribution.from_json("\n  " + result().to_json()).tokens == ["The", " city"]
    monkeypatch.chdir(tmp_path)
    result().to_json(tmp_path / "[draft].json")
    assert Attribution.from_json("[draft].json").tokens == ["The", " city"]  # a file, read as one
    with pytest.raises(InputTypeError, match="got list"):  # names no file: JSON text of a list, not a result
        Attribution.from_json("[1, 2]")
    with pytest.raises(InputError, match=r"no result file 'r\.json'"):
        Attribution.from_json("r.json")


ENCODED = {
    "gzip": (lambda t: gzip.compress(t.encode()), "is gzip-compressed; decompress it first"),
    "bzip2": (lambda t: bz2.compress(t.encode()), "is bzip2-compressed"),
    "utf-16": (lambda t: t.encode("utf-16"), r"is not UTF-8 \(UTF-16 byte-order mark\)"),
    "utf-16-be": (lambda t: b"\xfe\xff" + t.encode("utf-16-be"), r"is not UTF-8 \(UTF-16 byte-order mark\)"),
    "utf-32": (lambda t: t.encode("utf-32"), r"is not UTF-8 \(UTF-32 byte-order mark\)"),
    "utf-16-no-bom": (lambda t: t.encode("utf-16-le"), "holds NUL bytes: UTF-16 or UTF-32 text without"),
    "latin-1": (lambda t: t.replace("The", "Th\xe9").encode("latin-1"), r"is not UTF-8 text \(invalid"),
    "empty": (lambda t: b"", "is empty"),
    "blank": (lambda t: b" \n\n", r"is empty \(blank space only\)"),
}


@pytest.mark.parametrize("encoding", ENCODED)
def test_a_result_file_that_is_not_utf8_json_says_what_it_is(tmp_path, encoding):
    """These gave a raw UnicodeDecodeError (or 'not valid JSON at line 1, column 1' for an empty file)."""
    encode, message = ENCODED[encoding]
    path = tmp_path / "r.json"
    path.write_bytes(encode(result().to_json()))
    with pytest.raises(InputError, match=message) as info:
        Attribution.from_json(path)
    assert str(path) in str(info.value)


def test_json_text_with_a_byte_order_mark_is_text():
    """Text read with open().read() from a file saved with a BOM was taken as a path: 'File name too long'."""
    assert Attribution.from_json("\ufeff" + result().to_json()).tokens == ["The", " city"]
    assert Attribution.from_json("\ufeff \n" + result().to_json()).tokens == ["The", " city"]


def test_a_nul_in_a_path_is_a_dpa_error(tmp_path):
    with pytest.raises(InputError, match="cannot hold a NUL character"):  # was a raw ValueError
        Attribution.from_json("results/a\0.json")
    with pytest.raises(InputError, match="cannot hold a NUL character"):
        Attribution.from_json(tmp_path / "a\0.json")


def test_a_str_naming_a_file_that_starts_with_a_brace_says_to_pass_a_path(tmp_path, monkeypatch):
    """'{x}.json' naming a file was parsed as JSON text: 'not valid JSON' with no word of the file."""
    monkeypatch.chdir(tmp_path)
    result().to_json(tmp_path / "{x}.json")
    with pytest.raises(InputError, match=r"not valid JSON .*; a file of that name exists: pass "
                                         r"pathlib\.Path\('\{x\}\.json'\) to read it"):
        Attribution.from_json("{x}.json")
    with pytest.raises(InputError, match="not valid JSON") as info:  # no such file: nothing said of one
        Attribution.from_json("{y}.json")
    assert "file of that name" not in str(info.value)


def test_a_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(b"\xef\xbb\xbf" + result().to_json().encode())
    assert Attribution.from_json(path).tokens == ["The", " city"]


@pytest.mark.parametrize("text, key", [
    ('{"tokens": ["a"], "tokens": ["b"]}', "tokens"),
    ('{"target": {"position": 0, "kind": "token", "position": 1}}', "position"),
])
def test_a_key_twice_in_one_object_is_refused(text, key):
    """json.loads keeps the last value: a result edited by hand, or joined from two, read as one of them."""
    with pytest.raises(InputError, match=f"the JSON text has the key '{key}' twice"):
        Attribution.from_json(text)


def test_a_key_twice_in_a_result_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(result().to_json()[:-1] + ', "target_logit": 9.0}')
    with pytest.raises(InputError, match="'target_logit' twice") as info:
        Attribution.from_json(path)
    assert str(path) in str(info.value)


def test_json_the_parser_cannot_read_is_a_dpa_error():
    with pytest.raises(InputError, match="nested too deeply"):  # was a raw RecursionError
        Attribution.from_json("{\"tokens\": " + "[" * 100_000)
    with pytest.raises(InputError, match="cannot be read as JSON"):  # an integer of over 4300 digits: ValueError
        Attribution.from_json('{"target_logit": ' + "1" * 5000 + "}")


# --- from_dict: every field, by name -------------------------------------------------------------------------------

BAD_FIELDS = [
    ({"token_scores": None}, InputTypeError, "token_scores must be a list of numbers, got None"),
    ({"head_scores": None}, InputTypeError, "head_scores must be a list of lists of numbers"),
    ({"token_scores": "0.25, 1.5"}, InputTypeError, "token_scores must be a list"),
    ({"token_scores": ["0.25", 1.5]}, InputTypeError, r"token_scores\[0\] must be a number or null, got '0.25'"),
    ({"token_scores": [True, 1.5]}, InputTypeError, r"token_scores\[0\] must be a number or null, got True"),
    ({"token_scores": [[0.25], [1.5]]}, InputTypeError, r"token_scores\[0\] must be a number or null"),
    ({"head_scores": [0.0, 1.0]}, InputTypeError, r"head_scores\[0\] must be a list of numbers, got 0.0"),
    ({"head_scores": [[[0.0]] * 3] * 2}, InputTypeError, r"head_scores\[0\]\[0\] must be a number"),
    ({"neuron_scores": [[1.0] * 4, [1.0] * 3]}, InputError, "neuron_scores is ragged"),
    ({"neuron_scores": [[1.0] * 4, [1e400, "x", 1.0, 1.0]]}, InputTypeError, r"neuron_scores\[1\]\[1\]"),
    ({"token_scores": [10 ** 400, 1.0]}, InputError, r"token_scores\[0\] is out of the range of a float"),
    ({"edge_scores": [[1.0]]}, InputTypeError, r"edge_scores\[0\]\[0\] must be a list of lists of numbers"),
    ({"target_logit": None}, InputTypeError, "target_logit must be a number, got None"),
    ({"target_logit": "2.0"}, InputTypeError, "target_logit must be a number"),
    ({"target_logit": float("nan")}, InputError, "target_logit must be a finite number"),
    ({"completeness_gap": float("inf")}, InputError, "completeness_gap must be a finite number"),
    ({"bias_share": True}, InputTypeError, "bias_share must be a number"),
    ({"tokens": None}, InputTypeError, "tokens must be a list"),
    ({"tokens": ["The", 7]}, InputTypeError, r"tokens\[1\] must be a string"),
    ({"token_ids": [5, 9.0]}, InputTypeError, r"token_ids\[1\] must be an int"),
    ({"token_ids": [5, -1]}, InputError, r"token_ids\[1\] must be at least 0"),
    ({"special": [0, 1]}, InputTypeError, r"special\[0\] must be True or False"),
    ({"target": None}, InputTypeError, "target must be an object"),
    ({"target": {"kind": "token"}}, InputError, "missing target.position"),
    ({"target": {"kind": "token", "position": "1"}}, InputTypeError, "target.position must be an int"),
    ({"target": {"kind": "logit", "position": 1}}, InputError, "target.kind must be one of"),
    ({"target": {"kind": "token", "position": 1, "probability": 1.5}}, InputError, "target.probability must be in"),
    ({"target": {"kind": "token", "position": 1, "colour": 1}}, InputError, r"unknown field\(s\) target.colour"),
    ({"weights": None}, InputTypeError, "weights must be an object"),
    ({"weights": {"query": "0.25"}}, InputTypeError, "path weight query must be a number"),
    ({"weights": {"mu": 1}}, InputError, r"unknown field\(s\) weights.mu"),
    ({"top_predictions": [[" of"]]}, InputTypeError, r"top_predictions\[0\] must be a \[token, probability\] pair"),
    ({"top_predictions": [[" of", "0.5"]]}, InputTypeError, r"top_predictions\[0\]\[1\] must be a number"),
    ({"method": None}, InputTypeError, "method must be a string"),
    ({"neuron_target": "input"}, InputError, "neuron_target must be one of"),
    ({"n_kv_heads": 0}, InputError, "n_kv_heads must be at least 1"),
    ({"d_expert": "4"}, InputTypeError, "d_expert must be an int"),
    ({"score_dtype": "int64"}, InputError, "score_dtype 'int64' is not one of 'float16', 'bfloat16', 'float32', "),
    ({"score_dtype": 32}, InputError, "score_dtype 32 is not one of"),
    ({"score_dtype": "float8_e4m3fn"}, InputError, "score_dtype 'float8_e4m3fn' is not one of"),  # read, rounded
    ({"score_dtype": "float8_e8m0fnu"}, InputError, "score_dtype 'float8_e8m0fnu' is not one of"),  # signs lost
    ({"score_dtype": "float4_e2m1fn_x2"}, InputError, "score_dtype 'float4_e2m1fn_x2'"),  # a raw RuntimeError
    ({"score_dtype": "float32", "token_scores": [1e39, 1.0]}, InputError,  # was read as inf
     r"token_scores\[0\] is out of the range of float32 \(score_dtype\): 1e\+39"),
    ({"score_dtype": "float16", "head_scores": [[0.0, 1.0, 2.0], [3.0, 7e4, 5.0]]}, InputError,
     r"head_scores\[1\]\[1\] is out of the range of float16"),
    ({"score_dtype": "float32", "token_scores": torch.tensor([1.0, -1e39], dtype=torch.float64)}, InputError,
     r"token_scores\[1\] is out of the range of float32"),
    ({"token_scores": torch.empty(2, device="meta")}, InputError, "token_scores is a tensor on the meta device"),
    ({"colour": "red"}, InputError, r"unknown field\(s\) colour"),
]


@pytest.mark.parametrize("change, error, message", BAD_FIELDS, ids=lambda x: None)
def test_every_field_is_checked_by_name(change, error, message):
    """token_scores=None was a raw AttributeError; strings, bools and lists of the wrong depth among scores were
    read (or failed in torch with no field named); a NaN target logit was accepted."""
    with pytest.raises(error, match=message) as info:
        Attribution.from_dict(saved(**change))
    assert str(info.value).startswith("not an Attribution dict: ")


def test_a_bad_field_in_a_file_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(saved(token_scores=None)))
    with pytest.raises(InputTypeError, match=f"'{path}': not an Attribution dict: token_scores") as info:
        Attribution.from_json(path)
    assert "AttributeError" not in repr(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_an_integer_tensor_is_refused_where_scores_go(dtype):
    """An int64 tensor passed for scores rounded to whole numbers (torch.tensor cast it, silently)."""
    with pytest.raises(InputTypeError, match="head_scores must hold floating-point scores, got a tensor of "):
        Attribution.from_dict(saved(head_scores=torch.zeros(2, 3, dtype=dtype)))


def test_float_tensors_and_the_values_to_dict_writes_are_read():
    back = Attribution.from_dict(result().to_dict())  # tuples and tensors-as-lists, no JSON in between
    assert torch.equal(back.head_scores, result().head_scores) and back.top_predictions == result().top_predictions
    back = Attribution.from_dict(saved(token_scores=torch.tensor([1.0, 2.0], dtype=torch.float32)))
    assert back.token_scores.dtype == torch.float64 and back.token_scores.tolist() == [1.0, 2.0]  # as score_dtype
    back = Attribution.from_dict(saved(token_scores=[None, 2], head_scores=[[1, 2, 3]] * 2))  # JSON.stringify(1.0)
    assert math.isnan(back.token_scores[0]) and back.head_scores.dtype == torch.float64
    assert Attribution.from_dict(saved(neuron_scores=None)).neuron_scores is None  # saved with top_neurons


def test_a_bad_input_is_never_a_raw_python_exception():
    """Every field replaced by values of every JSON type: a dpa error or a result, nothing else."""
    values = [None, True, 0, -1, 1.5, "x", [], [None], ["x"], [[1.0]], {}, {"a": 1}]
    for key in saved():
        for value in values:
            try:
                Attribution.from_dict(saved(**{key: value}))
            except dpa.DPAError:
                pass
