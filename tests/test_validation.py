"""Adverse inputs, tried as a new user would: each either gives the canonical form's result or raises a
``dpa.DPAError`` (also the matching built-in) whose message names the argument. Never a raw exception
from deep inside torch or transformers, never a silently wrong number.

The catalogue is data: one ``Bad`` per input that must be refused, one ``Same`` per input form that
must give the same result as its canonical form. Kinds: prompts, targets, positions and options, path
weights, the baselines' own arguments, results, ablation helpers, the model's state.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import dpa
from dpa import baselines
from dpa.errors import (DPAError, InputError, InputTypeError, ModelStateError, NonFiniteError, TargetError,
                        UnsupportedModelError)
from dpa.evaluate import ablation

from .test_cli import PROMPT, save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-validation"))
    model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float64)
    return model, tok


@dataclass
class Bad:
    """``call(model, tok)`` must raise ``error`` (a DPAError subclass) with ``names`` in its message."""

    id: str
    call: Callable[[Any, Any], Any]
    error: type[DPAError]
    names: str
    builtin: type[Exception] | None = None  # the built-in it must also be (default: the error's own)


@dataclass
class Same:
    """``call(model, tok)`` must give the same scores as ``canonical(model, tok)``."""

    id: str
    call: Callable[[Any, Any], Any]
    canonical: Callable[[Any, Any], Any]


def ids(tok, text: str = PROMPT) -> list[int]:
    return tok(text)["input_ids"]


A = dpa.attribute  # the shortest way to write the catalogue


def attr(**kw):
    """attribute(PROMPT) with these options; a callable option value is made at call time."""
    return lambda m, t: A(m, t, PROMPT, **{"target": "paris", **{k: v() if callable(v) and not isinstance(
        v, torch.Tensor) else v for k, v in kw.items()}})


# --- prompts -------------------------------------------------------------------------------------

PROMPTS_BAD = [
    Bad("prompt-none", lambda m, t: A(m, t, None, target=3), InputError, "prompt"),
    Bad("prompt-int", lambda m, t: A(m, t, 5, target=3), InputError, "prompt"),
    Bad("prompt-float", lambda m, t: A(m, t, 2.5, target=3), InputError, "prompt"),
    Bad("prompt-bytes", lambda m, t: A(m, t, b"the capital", target=3), InputError, "prompt"),
    Bad("prompt-empty-string", lambda m, t: A(m, t, "", target=3), InputError, "prompt"),
    Bad("prompt-blank-string", lambda m, t: A(m, t, "   \n", target=3), InputError, "prompt"),
    Bad("prompt-empty-list", lambda m, t: A(m, t, [], target=3), InputError, "prompt"),
    Bad("prompt-empty-tensor", lambda m, t: A(m, t, torch.tensor([], dtype=torch.long), target=3), InputError,
        "prompt"),
    Bad("prompt-float-tensor", lambda m, t: A(m, t, torch.tensor([1.0, 2.0]), target=3), InputError, "prompt"),
    Bad("prompt-bool-tensor", lambda m, t: A(m, t, torch.tensor([True, False]), target=3), InputError, "prompt"),
    Bad("prompt-complex-tensor", lambda m, t: A(m, t, torch.tensor([1 + 1j]), target=3), InputError, "prompt"),
    Bad("prompt-3d-tensor", lambda m, t: A(m, t, torch.ones(1, 2, 3, dtype=torch.long), target=3), InputError,
        "prompt"),
    Bad("prompt-0d-tensor", lambda m, t: A(m, t, torch.tensor(3), target=3), InputError, "prompt"),
    Bad("prompt-floats-list", lambda m, t: A(m, t, [1.0, 2.0], target=3), InputError, "prompt"),
    Bad("prompt-mixed-list", lambda m, t: A(m, t, [1, "a"], target=3), InputError, "prompt"),
    Bad("prompt-bool-list", lambda m, t: A(m, t, [True, False], target=3), InputError, "prompt"),
    Bad("prompt-negative-id", lambda m, t: A(m, t, [1, -4, 5], target=3), InputError, "token id -4"),
    Bad("prompt-id-too-big", lambda m, t: A(m, t, [1, 128, 5], target=3), InputError, "token id 128"),
    Bad("prompt-id-huge", lambda m, t: A(m, t, [1, 2**40], target=3), InputError, "token id"),
    Bad("prompt-too-long", lambda m, t: A(m, t, [2] * 65, target=3), InputError, "context"),
    Bad("prompt-string-no-tokenizer", lambda m, t: A(m, None, PROMPT, target=3), InputError, "tokenizer"),
    Bad("prompt-batch-with-empty", lambda m, t: A(m, t, [PROMPT, ""], target=3), InputError, "prompt 1"),
    Bad("prompt-batch-with-none", lambda m, t: A(m, t, [PROMPT, None], target=3), InputError, "prompt 1"),
    Bad("prompt-dict", lambda m, t: A(m, t, {"text": PROMPT}, target=3), InputError, "prompt"),
    Bad("prompt-set", lambda m, t: A(m, t, {1, 2, 3}, target=3), InputError, "prompt"),
    Bad("prompt-numpy-float", lambda m, t: A(m, t, np.array([1.0, 2.0]), target=3), InputError, "prompt"),
    Bad("prompt-numpy-2d-float", lambda m, t: A(m, t, np.ones((2, 3)), target=3), InputError, "prompt"),
    Bad("prompt-ragged-nested", lambda m, t: A(m, t, [[1, 2], [3, [4]]], target=3), InputError, "prompt 1"),
    Bad("prompt-batchencoding-no-ids", lambda m, t: A(m, t, t(PROMPT).data | {"input_ids": []}, target=3),
        InputError, "prompt"),
    # found by the second new-user pass
    Bad("prompt-mask-hole", lambda m, t: A(m, t, {"input_ids": ids(t), "attention_mask": [1, 1, 0, 1, 1, 1]},
                                           target=3), InputError, "attention_mask"),
    Bad("prompt-dict-ids-string", lambda m, t: A(m, t, {"input_ids": PROMPT}, target=3), InputError, "input_ids"),
    Bad("prompt-dict-ids-none", lambda m, t: A(m, t, {"input_ids": None}, target=3), InputError, "input_ids"),
    Bad("prompt-dict-mask-string", lambda m, t: A(m, t, {"input_ids": ids(t), "attention_mask": "abc"},
                                                  target=3), InputError, "attention_mask"),
    # found by the issue-30 hostile pass: keys that change the model's forward, which dpa would ignore
    Bad("prompt-dict-position-ids", lambda m, t: A(m, t, {"input_ids": ids(t), "position_ids": list(range(2, 8))},
                                                   target=3), InputError, "'position_ids'"),
    Bad("prompt-dict-past-key-values", lambda m, t: A(m, t, {"input_ids": ids(t), "past_key_values": None},
                                                      target=3), InputError, "'past_key_values'"),
    Bad("prompt-dict-token-types", lambda m, t: A(m, t, {"input_ids": ids(t), "token_type_ids": [0, 0, 1, 1, 0, 0]},
                                                  target=3), InputError, "'token_type_ids'"),
    Bad("prompt-lone-surrogate", lambda m, t: A(m, t, "the \ud800 capital", target=3), InputError,
        "not valid Unicode"),
    Bad("baseline-dpa-mid-batch", lambda m, t: baselines.dpa_mid(m, t, [PROMPT, PROMPT], 3), InputError, "batch"),
    Bad("baseline-dpa-input-batch", lambda m, t: baselines.dpa_input(m, t, [PROMPT, PROMPT], 3), InputError,
        "batch"),
    Bad("weights-parse-six-fields", lambda m, t: dpa.PathWeights.parse("0.25,,0.25,0.5,0.5,0.5"), InputError,
        "five"),
    Bad("weights-parse-underscore", lambda m, t: dpa.PathWeights.parse("0_5,0,1,.5,.5"), InputError,
        "five numbers"),
    Bad("weights-family-string-p", lambda m, t: dpa.PathWeights.attention("0.5"), InputTypeError, "p"),
    Bad("weights-family-none-p", lambda m, t: dpa.PathWeights.query_key(None), InputTypeError, "p"),
    Bad("weights-family-p-above-1", lambda m, t: dpa.PathWeights.control_content(1.5), InputError, "p"),
    Bad("weights-family-p-below-0", lambda m, t: dpa.PathWeights.mlp(-3), InputError, "p"),
]

PROMPTS_SAME = [
    Same("prompt-ids-list", lambda m, t: A(m, t, ids(t), target=3), lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-ids-tuple", lambda m, t: A(m, t, tuple(ids(t)), target=3), lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-1d-tensor", lambda m, t: A(m, t, torch.tensor(ids(t)), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-int32-tensor", lambda m, t: A(m, t, torch.tensor(ids(t), dtype=torch.int32), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-uint8-tensor", lambda m, t: A(m, t, torch.tensor(ids(t), dtype=torch.uint8), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-list-of-0d", lambda m, t: A(m, t, list(torch.tensor(ids(t))), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-numpy-ints", lambda m, t: A(m, t, [np.int64(i) for i in ids(t)], target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-numpy-array", lambda m, t: A(m, t, np.array(ids(t)), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-numpy-int32-array", lambda m, t: A(m, t, np.array(ids(t), dtype=np.int32), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-2d-tensor-one-row", lambda m, t: A(m, t, torch.tensor([ids(t)]), target=3)[0],
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-batchencoding", lambda m, t: A(m, t, t(PROMPT), target=3),
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-batchencoding-pt", lambda m, t: A(m, t, t(PROMPT, return_tensors="pt"), target=3)[0],
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-tuple-of-strings", lambda m, t: A(m, t, (PROMPT, "the city"), target=3)[0],
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("prompt-nested-lists", lambda m, t: A(m, t, [ids(t), ids(t, "the city")], target=3)[1],
         lambda m, t: A(m, t, "the city", target=3)),
    Same("prompt-batch-short-row", lambda m, t: A(m, t, [PROMPT, "the city"], target=3)[1],
         lambda m, t: A(m, t, "the city", target=3)),
    Same("prompt-batch-of-numpy-rows", lambda m, t: A(m, t, [np.array(ids(t)), np.array(ids(t))], target=3)[1],
         lambda m, t: A(m, t, PROMPT, target=3)),
    Same("target-numpy-0d", lambda m, t: A(m, t, PROMPT, target=np.array(3)), lambda m, t: A(m, t, PROMPT, target=3)),
    Same("target-numpy-vector", lambda m, t: A(m, t, PROMPT, target=np.ones(64)),
         lambda m, t: A(m, t, PROMPT, target=torch.ones(64, dtype=torch.float64))),
]


def _padded(t, side: str):
    """A padded batch straight from the tokenizer (pad = the unknown token), with its attention mask."""
    t.pad_token = "[UNK]"
    t.padding_side = side
    return t([PROMPT, "the city"], padding=True, return_tensors="pt")


PADDING_SAME = [
    Same(f"batchencoding-padded-{side}", lambda m, t, side=side: A(m, t, _padded(t, side), target=3)[1],
         lambda m, t: A(m, t, "the city", target=3)) for side in ("left", "right")
]
PADDING_BAD = [
    Bad("2d-tensor-padded-no-mask", lambda m, t: A(m, t, _padded(t, "left")["input_ids"], target=3),
        InputError, "attention_mask"),
]


# --- targets -------------------------------------------------------------------------------------

TARGETS_BAD = [
    Bad("target-0d-float-tensor", attr(target=torch.tensor(7.0)), TargetError, "target"),
    Bad("target-float", attr(target=7.0), TargetError, "target"),
    Bad("target-nan-vector", attr(target=torch.full((64,), math.nan, dtype=torch.float64)), TargetError, "target"),
    Bad("target-inf-vector", attr(target=torch.full((64,), math.inf, dtype=torch.float64)), TargetError, "target"),
    Bad("target-short-vector", attr(target=torch.ones(5, dtype=torch.float64)), TargetError, "d_model"),
    Bad("target-2d-vector", attr(target=torch.ones(2, 64, dtype=torch.float64)), TargetError, "target"),
    Bad("target-complex-vector", attr(target=torch.ones(64, dtype=torch.complex128)), TargetError, "target"),
    Bad("target-multi-id-tensor", attr(target=torch.tensor([3, 4])), TargetError, "target"),
    Bad("target-negative-id", attr(target=-1), TargetError, "target"),
    Bad("target-id-too-big", attr(target=128), TargetError, "target"),
    Bad("target-bool", attr(target=True), TargetError, "target"),
    Bad("target-multi-token-string", attr(target="paris london"), TargetError, "target"),
    Bad("target-empty-string", attr(target=""), TargetError, "target"),
    Bad("target-list-wrong-length", lambda m, t: A(m, t, [PROMPT, PROMPT], target=[3, 4, 5]), InputError, "target"),
    Bad("target-dict", attr(target={"token": 3}), TargetError, "target"),
    Bad("contrast-0d-float", attr(contrast=torch.tensor(3.0)), TargetError, "contrast"),
    Bad("contrast-float", attr(contrast=3.0), TargetError, "contrast"),
    Bad("contrast-same-as-target", attr(target=3, contrast=3), TargetError, "contrast"),
    Bad("contrast-with-vector", attr(target=torch.ones(64, dtype=torch.float64), contrast=3), TargetError,
        "contrast"),
    Bad("contrast-with-logprob", attr(contrast=4, kind="logprob"), TargetError, "contrast"),
    Bad("contrast-negative", attr(contrast=-2), TargetError, "contrast"),
    Bad("contrast-list-wrong-length", lambda m, t: A(m, t, [PROMPT, PROMPT], target=3, contrast=[4]), InputError,
        "contrast"),
    Bad("vector-with-logprob", attr(target=torch.ones(64, dtype=torch.float64), kind="logprob"), TargetError,
        "logprob"),
    Bad("kind-unknown", attr(kind="prob"), InputError, "kind"),
    Bad("kind-none", attr(kind=None), InputError, "kind"),
    Bad("multi-token-unknown", attr(multi_token="last"), InputError, "multi_token"),
]

TARGETS_SAME = [
    Same("target-0d-long-tensor", attr(target=torch.tensor(3)), attr(target=3)),
    Same("target-1-element-tensor", attr(target=torch.tensor([3])), attr(target=3)),
    Same("target-numpy-int", attr(target=np.int64(3)), attr(target=3)),
    Same("target-int32-tensor", attr(target=torch.tensor(3, dtype=torch.int32)), attr(target=3)),
    Same("target-string-vs-id", attr(target="paris"), lambda m, t: A(m, t, PROMPT, target=t.convert_tokens_to_ids(
        "paris"))),
    Same("contrast-numpy-int", attr(target=3, contrast=np.int32(4)), attr(target=3, contrast=4)),
    Same("target-float32-vector", attr(target=torch.ones(64, dtype=torch.float32)),
         attr(target=torch.ones(64, dtype=torch.float64))),
]


# --- positions and options ------------------------------------------------------------------------

OPTIONS_BAD = [
    Bad("position-float", attr(position=2.0), InputError, "position"),
    Bad("position-string", attr(position="2"), InputError, "position"),
    Bad("position-bool", attr(position=True), InputError, "position"),
    Bad("position-too-big", attr(position=50), InputError, "position"),
    Bad("position-too-negative", attr(position=-50), InputError, "position"),
    Bad("position-list-wrong-length", lambda m, t: A(m, t, [PROMPT, PROMPT], target=3, position=[1]), InputError,
        "position"),
    Bad("position-tensor-2", attr(position=torch.tensor([1, 2])), InputError, "position"),
    Bad("padding-side-removed", attr(padding_side="left"), InputTypeError, "no longer takes padding_side"),
    Bad("unknown-keyword", attr(padding="left"), InputTypeError, "unexpected keyword argument 'padding'"),
    Bad("memory-unknown", attr(memory="small"), InputError, "memory"),
    Bad("neuron-target-unknown", attr(neuron_target="input"), InputError, "neuron_target"),
    Bad("probabilities-string", attr(probabilities="yes"), InputError, "probabilities"),
    Bad("edges-string", attr(edges="yes"), InputError, "edges"),
    Bad("edges-none", attr(edges=None), InputError, "edges"),
    Bad("neuron-positions-int", attr(neuron_positions=2), InputError, "neuron_positions"),
    Bad("effective-targets-string", attr(effective_targets="no"), InputError, "effective_targets"),
    Bad("weights-tuple", attr(weights=(0.25, 0.25, 0.5, 0.5, 0.5)), InputError, "weights"),
    Bad("weights-dict", attr(weights={"query": 1}), InputError, "weights"),
    Bad("model-none", lambda m, t: A(None, t, PROMPT, target=3), InputError, "model"),
    Bad("model-string", lambda m, t: A("SmolLM2", t, PROMPT, target=3), InputError, "model"),
    Bad("model-tokenizer-swapped", lambda m, t: A(t, m, PROMPT, target=3), InputError, "model"),
    Bad("tokenizer-string", lambda m, t: A(m, "gpt2", PROMPT, target=3), InputError, "tokenizer"),
    Bad("tokenizer-is-model", lambda m, t: A(m, m, PROMPT, target=3), InputError, "tokenizer"),
    Bad("plain-module", lambda m, t: A(torch.nn.Linear(2, 2), t, PROMPT, target=3), UnsupportedModelError,
        "Linear"),
]

OPTIONS_SAME = [
    Same("position-negative", attr(position=-1), attr()),
    Same("position-numpy", attr(position=np.int64(-1)), attr()),
    Same("position-0d-tensor", attr(position=torch.tensor(-1)), attr()),
    Same("memory-lean", attr(memory="lean"), attr(memory="full")),
]


# --- path weights ----------------------------------------------------------------------------------

WEIGHTS_BAD = [
    Bad("weights-nan", lambda m, t: dpa.PathWeights(query=math.nan), InputError, "query", ValueError),
    Bad("weights-inf", lambda m, t: dpa.PathWeights(up=math.inf), InputError, "up", ValueError),
    Bad("weights-string", lambda m, t: dpa.PathWeights(gate="0.5"), InputError, "gate", ValueError),
    Bad("weights-none", lambda m, t: dpa.PathWeights(value=None), InputError, "value", ValueError),
    Bad("weights-bool", lambda m, t: dpa.PathWeights(value=True), InputError, "value", ValueError),
    Bad("weights-complex", lambda m, t: dpa.PathWeights(value=1j), InputError, "value", ValueError),
    Bad("weights-tensor-2", lambda m, t: dpa.PathWeights(value=torch.ones(2)), InputError, "value", ValueError),
    Bad("weights-huge", attr(weights=lambda: dpa.PathWeights(1e300, 1e300, 1e300, 1e300, 1e300)), NonFiniteError,
        "path weights"),
    Bad("weights-1e200", attr(weights=lambda: dpa.PathWeights(1e200, 0.25, 0.5, 0.5, 0.5)), NonFiniteError,
        "path weights"),
    Bad("weights-neg-huge", attr(weights=lambda: dpa.PathWeights(-1e308, 0.25, 0.5, 0.5, 0.5)), NonFiniteError,
        "path weights"),
    Bad("parse-letters", lambda m, t: dpa.PathWeights.parse("a,b,c,d,e"), InputError, "a,b,c,d,e", ValueError),
    Bad("parse-four", lambda m, t: dpa.PathWeights.parse("1,2,3,4"), InputError, "five", ValueError),
    Bad("parse-nan", lambda m, t: dpa.PathWeights.parse("nan,0,1,0.5,0.5"), InputError, "five numbers", ValueError),
    Bad("parse-not-string", lambda m, t: dpa.PathWeights.parse(0.5), InputError, "0.5", TypeError),
    Bad("preset-p-string", lambda m, t: dpa.PathWeights.preset("attention", "0.5"), InputError, "p", TypeError),
    Bad("preset-p-out-of-range", lambda m, t: dpa.PathWeights.preset("attention", 1.5), InputError, "p", ValueError),
    Bad("preset-p-nan", lambda m, t: dpa.PathWeights.preset("attention", math.nan), InputError, "p", ValueError),
    Bad("preset-family-unknown", lambda m, t: dpa.PathWeights.preset("value", 0.5), InputError, "family",
        ValueError),
]

WEIGHTS_SAME = [
    Same("weights-ints", attr(weights=lambda: dpa.PathWeights(0, 0, 1, 0, 1)),
         attr(weights=lambda: dpa.PathWeights(0., 0., 1., 0., 1.))),
    Same("weights-numpy", attr(weights=lambda: dpa.PathWeights(*map(np.float32, (0.25, 0.25, 0.5, 0.5, 0.5)))), attr()),
    Same("weights-0d-tensor", attr(weights=lambda: dpa.PathWeights(*map(torch.tensor, (0.25, 0.25, 0.5, 0.5, 0.5)))),
         attr()),
    Same("weights-parse-spaces", attr(weights=lambda: dpa.PathWeights.parse(" 0.25, 0.25 ,0.5,0.5,0.5 ")), attr()),
]


# --- the baselines' own arguments -------------------------------------------------------------------

B = baselines

BASELINES_BAD = [
    Bad("ig-steps-float", lambda m, t: B.integrated_gradients(m, t, PROMPT, 3, steps=2.5), InputError, "steps"),
    Bad("ig-steps-zero", lambda m, t: B.integrated_gradients(m, t, PROMPT, 3, steps=0), InputError, "steps"),
    Bad("ig-batch-size-zero", lambda m, t: B.integrated_gradients(m, t, PROMPT, 3, batch_size=0), InputError,
        "batch_size"),
    Bad("depass-temperature-zero", lambda m, t: B.depass(m, t, PROMPT, 3, temperature=0), InputError,
        "temperature"),
    Bad("depass-temperature-negative", lambda m, t: B.depass(m, t, PROMPT, 3, temperature=-0.1), InputError,
        "temperature"),
    Bad("depass-temperature-nan", lambda m, t: B.depass(m, t, PROMPT, 3, temperature=math.nan), InputError,
        "temperature"),
    Bad("depass-rule", lambda m, t: B.depass(m, t, PROMPT, 3, neuron_rule="gate"), InputError, "neuron_rule"),
    Bad("patching-batch-size-zero", lambda m, t: B.activation_patching(m, t, PROMPT, 3, batch_size=0), InputError,
        "batch_size"),
    Bad("occlusion-batch-size-float", lambda m, t: B.occlusion(m, t, PROMPT, 3, batch_size=1.5), InputError,
        "batch_size"),
    Bad("random-seed-string", lambda m, t: B.random_input(m, t, PROMPT, 3, seed="a"), InputError, "seed"),
    Bad("baseline-batch", lambda m, t: B.gradient(m, t, [PROMPT, PROMPT], 3), InputError, "one prompt"),
    Bad("baseline-vector-target", lambda m, t: B.gradient(m, t, PROMPT, torch.ones(64, dtype=torch.float64)),
        TargetError, "vector"),
    Bad("baseline-0d-float-target", lambda m, t: B.gradient(m, t, PROMPT, torch.tensor(7.0)), TargetError,
        "target"),
    Bad("baseline-bytes-prompt", lambda m, t: B.atp(m, t, b"abc", 3), InputError, "prompt"),
    Bad("baseline-2d-prompt", lambda m, t: B.ifr(m, t, torch.tensor([ids(t), ids(t)]), 3), InputError,
        "one prompt"),
    Bad("baseline-position-float", lambda m, t: B.atp(m, t, PROMPT, 3, position=1.0), InputError, "position"),
    Bad("patching-units-unknown", lambda m, t: B.activation_patching(m, t, PROMPT, 3, units="edges"), InputError,
        "units"),
    Bad("patching-max-units-zero", lambda m, t: B.activation_patching(m, t, PROMPT, 3, max_units=0), InputError,
        "max_units"),
    Bad("depass-skip-first-string", lambda m, t: B.depass(m, t, PROMPT, 3, skip_first="no"), InputError,
        "skip_first", TypeError),
]

BASELINES_SAME = [
    Same("baseline-int32-prompt", lambda m, t: B.gradient(m, t, torch.tensor(ids(t), dtype=torch.int32), 3),
         lambda m, t: B.gradient(m, t, PROMPT, 3)),
    Same("baseline-numpy-prompt", lambda m, t: B.atp(m, t, np.array(ids(t)), 3), lambda m, t: B.atp(m, t, PROMPT, 3)),
]


# --- results ---------------------------------------------------------------------------------------

RESULTS_BAD = [
    Bad("top-components-kind", lambda m, t: A(m, t, PROMPT, target=3).top_components(kinds=("heads",)), InputError,
        "kinds"),
    Bad("top-components-k-negative", lambda m, t: A(m, t, PROMPT, target=3).top_components(k=-1), InputError, "k"),
    Bad("top-components-k-float", lambda m, t: A(m, t, PROMPT, target=3).top_components(k=2.5), InputError, "k",
        TypeError),
    Bad("top-components-kinds-string", lambda m, t: A(m, t, PROMPT, target=3).top_components(kinds="head"),
        InputError, "kinds"),
    Bad("to-dict-top-neurons-negative", lambda m, t: A(m, t, PROMPT, target=3).to_dict(top_neurons=-2), InputError,
        "top_neurons"),
    Bad("from-dict-not-dict", lambda m, t: dpa.Attribution.from_dict([1, 2]), InputError, "dict", TypeError),
    Bad("from-dict-missing", lambda m, t: dpa.Attribution.from_dict({"tokens": ["a"]}), InputError, "token_scores"),
    Bad("from-json-garbage", lambda m, t: dpa.Attribution.from_json("{not json"), InputError, "JSON"),
]


# --- ablation helpers ------------------------------------------------------------------------------

ABLATION_BAD = [
    Bad("ablation-target-negative", lambda m, t: ablation.input_ablation_prob(m, ids(t), [1], -1, -1), TargetError,
        "target"),
    Bad("ablation-target-too-big", lambda m, t: ablation.input_ablation_prob(m, ids(t), [1], -1, 500), TargetError,
        "target"),
    Bad("ablation-zero-position-too-big", lambda m, t: ablation.input_ablation_prob(m, ids(t), [40], -1, 3),
        InputError, "position"),
    Bad("ablation-zero-position-float", lambda m, t: ablation.input_ablation_prob(m, ids(t), [1.5], -1, 3),
        InputError, "position"),
    Bad("ablation-target-position-too-big", lambda m, t: ablation.input_ablation_prob(m, ids(t), [1], 40, 3),
        InputError, "position"),
    Bad("ablation-two-prompts", lambda m, t: ablation.input_ablation_probs(m, [ids(t), ids(t)], torch.ones(1, 6), -1,
                                                                          3), InputError, "one prompt"),
    Bad("ablation-keep-wrong-width", lambda m, t: ablation.input_ablation_probs(m, ids(t), torch.ones(2, 3), -1, 3),
        InputError, "keep"),
    Bad("ablation-edge-layer-out-of-range", lambda m, t: ablation.component_ablation_prob(
        m, ids(t), [(5, 0, 1, 0)], [], -1, 3), InputError, "edge"),
    Bad("ablation-edge-head-out-of-range", lambda m, t: ablation.component_ablation_prob(
        m, ids(t), [(0, 4, 1, 0)], [], -1, 3), InputError, "edge"),
    Bad("ablation-edge-three-numbers", lambda m, t: ablation.component_ablation_prob(
        m, ids(t), [(0, 0, 1)], [], -1, 3), InputError, "edge"),
    Bad("ablation-neuron-out-of-range", lambda m, t: ablation.component_ablation_prob(
        m, ids(t), [], [(0, 1, 999)], -1, 3), InputError, "neuron"),
    Bad("ablation-neuron-float", lambda m, t: ablation.component_ablation_prob(
        m, ids(t), [], [(0, 1.0, 2)], -1, 3), InputError, "neuron"),
    Bad("ablation-attn-keep-shape", lambda m, t: ablation.component_ablation_probs(
        m, ids(t), torch.ones(1, 2, 4, 3, 3), None, -1, 3), InputError, "attn_keep"),
    Bad("ablation-neuron-keep-shape", lambda m, t: ablation.component_ablation_probs(
        m, ids(t), None, torch.ones(1, 2, 6), -1, 3), InputError, "neuron_keep"),
    Bad("ablation-rows-disagree", lambda m, t: ablation.component_ablation_probs(
        m, ids(t), torch.ones(2, 2, 4, 6, 6), torch.ones(3, 2, 6, 128), -1, 3), InputError, "rows"),
    Bad("ablation-keep-nan", lambda m, t: ablation.input_ablation_probs(m, ids(t), torch.full((1, 6), math.nan), -1,
                                                                       3), InputError, "keep"),
    Bad("ablation-batch-size-zero", lambda m, t: ablation.input_ablation_probs(m, ids(t), torch.ones(1, 6), -1, 3,
                                                                              batch_size=0), InputError, "batch_size"),
]


# --- loading -----------------------------------------------------------------------------------------

def _load(**kw):
    return lambda m, t: dpa.load_model(m.config._name_or_path, **kw)


LOAD_BAD = [
    Bad("load-dtype-string", _load(dtype="float32"), InputTypeError, "dtype", TypeError),
    Bad("load-dtype-int64", _load(dtype=torch.int64), InputTypeError, "dtype"),
    Bad("load-dtype-numpy", _load(dtype=np.float32), InputTypeError, "dtype"),
    Bad("load-dtype-float8", _load(dtype=torch.float8_e4m3fn), InputTypeError, "dtype"),
    Bad("load-device-gpu", _load(device="gpu"), InputError, "device"),
    Bad("load-device-cuda-99", _load(device="cuda:99"), InputError, "cuda"),  # no CUDA, or no 100th device
    Bad("load-device-int-string", _load(device="tpu"), InputError, "device"),
    Bad("load-name-int", lambda m, t: dpa.load_model(5), InputTypeError, "name"),
    Bad("load-no-such-folder", lambda m, t: dpa.load_model("/nonexistent/model"), DPAError, "/nonexistent/model"),
]


CATALOGUE_BAD = (LOAD_BAD + PROMPTS_BAD + PADDING_BAD + TARGETS_BAD + OPTIONS_BAD + WEIGHTS_BAD + BASELINES_BAD
                 + RESULTS_BAD + ABLATION_BAD)
CATALOGUE_SAME = PROMPTS_SAME + PADDING_SAME + TARGETS_SAME + OPTIONS_SAME + WEIGHTS_SAME + BASELINES_SAME


@pytest.mark.parametrize("case", CATALOGUE_BAD, ids=lambda c: c.id)
def test_refused_with_a_clear_error(tiny, case: Bad):
    model, tok = tiny
    with pytest.raises(DPAError) as info:
        case.call(model, tok)
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__}: {err}"
    if case.builtin is not None:
        assert isinstance(err, case.builtin), f"{type(err).__name__} is not a {case.builtin.__name__}"
    assert case.names.lower() in str(err).lower(), str(err)


def _scores(res) -> list[torch.Tensor]:
    if isinstance(res, list):
        return [s for r in res for s in _scores(r)]
    return [torch.as_tensor(x) for x in (res.token_scores, res.head_scores, res.neuron_scores)] + [
        torch.tensor(res.target_logit)]


@pytest.mark.parametrize("case", CATALOGUE_SAME, ids=lambda c: c.id)
def test_every_form_gives_the_canonical_result(tiny, case: Same):
    model, tok = tiny
    got, want = _scores(case.call(model, tok)), _scores(case.canonical(model, tok))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# --- the model's state ------------------------------------------------------------------------------

def _hook_forward(m):
    return m.model.layers[0].mlp.register_forward_hook(lambda mod, a, out: out * 2)


def _hook_pre(m):
    return m.model.norm.register_forward_pre_hook(lambda mod, a: (a[0] + 1,))


def _hook_backward(m):
    return m.model.layers[1].self_attn.o_proj.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0,))


def _hook_global(m):
    return torch.nn.modules.module.register_module_forward_hook(lambda mod, a, out: None)


def _patch_forward(m):
    mod = m.model.layers[1].mlp
    mod.forward = lambda x: type(mod).forward(mod, x) * 0

    class Handle:
        def remove(self):
            del mod.forward
    return Handle()


FOREIGN = {"forward-hook": (_hook_forward, "model.layers.0.mlp"), "pre-hook": (_hook_pre, "model.norm"),
           "backward-hook": (_hook_backward, "model.layers.1.self_attn.o_proj"),
           "global-hook": (_hook_global, "global"), "patched-forward": (_patch_forward, "model.layers.1.mlp.forward")}
ENTRY_POINTS = {
    "attribute": lambda m, t: A(m, t, PROMPT, target=3),
    "edges": lambda m, t: A(m, t, PROMPT, target=3, edges=True),
    "atp": lambda m, t: B.atp(m, t, PROMPT, 3),
    "ifr": lambda m, t: B.ifr(m, t, PROMPT, 3),
    "ablation": lambda m, t: ablation.input_ablation_prob(m, ids(t), [1], -1, 3),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("foreign", FOREIGN)
def test_foreign_hooks_are_refused_by_name(tiny, foreign, entry):
    """A hook or patched forward from outside dpa could change activations or gradients behind its back."""
    model, tok = tiny
    install, where = FOREIGN[foreign]
    handle = install(model)
    try:
        with pytest.raises(ModelStateError, match=where.replace(".", r"\.")):
            ENTRY_POINTS[entry](model, tok)
    finally:
        handle.remove()
    ENTRY_POINTS[entry](model, tok)  # and nothing was left behind


def test_transformers_output_capture_hooks_are_allowed(tiny):
    model, tok = tiny
    expected = A(model, tok, PROMPT, target=3)
    model(torch.tensor([ids(tok)]), output_hidden_states=True)  # transformers leaves recording hooks behind
    assert any(layer._forward_hooks for layer in model.model.layers)
    torch.testing.assert_close(A(model, tok, PROMPT, target=3).token_scores, expected.token_scores)


@pytest.mark.parametrize("setting", ["train", "dropout", "checkpointing"])
def test_model_settings_give_the_right_answer(tmp_path, setting):
    """Train mode, active dropout and gradient checkpointing: dpa runs the model in eval mode and
    restores every setting afterwards; the scores equal those of the model in eval mode."""
    folder = save_tiny_model(tmp_path / "m", attention_dropout=0.5 if setting == "dropout" else 0.0)
    model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float64)
    expected = A(model, tok, PROMPT, target=3)
    model.train()
    if setting == "checkpointing":
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    got = [A(model, tok, PROMPT, target=3) for _ in range(2)]
    assert model.training and all(m.training for m in model.modules())
    for res in got:
        torch.testing.assert_close(res.token_scores, expected.token_scores, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.neuron_scores, expected.neuron_scores, rtol=1e-12, atol=1e-12)


def test_meta_device_is_refused(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    with pytest.raises(ModelStateError, match="meta"):
        A(model, None, [1, 2, 3], target=3)


def test_non_finite_weights_are_named(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float64)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match="layer 1"):
        A(model, tok, PROMPT, target=3)


N_MODEL_STATE = len(FOREIGN) * len(ENTRY_POINTS) + 1 + 3 + 1 + 1


def test_catalogue_size():
    """The issue asks for at least 150 adverse cases in all."""
    assert len(CATALOGUE_BAD) + len(CATALOGUE_SAME) + N_MODEL_STATE + N_FILES + len(CLI_BAD) + len(EVAL_BAD) >= 150


# --- files ------------------------------------------------------------------------------------------

from dpa.evaluate import datasets  # noqa: E402
from dpa.evaluate.runner import Store  # noqa: E402

DATA_FILES = {
    "not-json": (b"[{not json", "not valid JSON"),
    "truncated": (b'[{"prompt": "a", "attribute": "b"', "not valid JSON"),
    "latin-1": ('[{"prompt": "caf\xe9", "attribute": "b"}]'.encode("latin-1"), "not UTF-8"),
    "an-object": (b'{"prompt": "a"}', "JSON list"),
    "records-are-lists": (b'[["a", "b"]]', "record 0"),
    "records-are-strings": (b'["a", "b"]', "record 0"),
    "empty-file": (b"", "not valid JSON"),
}


@pytest.mark.parametrize("content", DATA_FILES)
def test_malformed_data_files_name_the_path(tmp_path, content):
    data, message = DATA_FILES[content]
    (tmp_path / "known_1000.json").write_bytes(data)
    with pytest.raises(datasets.DataError, match=message) as info:
        datasets.load_records("known_1000", tmp_path)
    assert "known_1000.json" in str(info.value) and isinstance(info.value, DPAError)


def test_a_byte_order_mark_is_read(tmp_path):
    (tmp_path / "known_1000.json").write_bytes(b'\xef\xbb\xbf[{"prompt": "a", "attribute": "b"}]')
    assert datasets.load_records("known_1000", tmp_path) == [{"prompt": "a", "attribute": "b"}]


def test_corrupt_lines_on_resume_are_run_again(tmp_path):
    good = {"index": 1, "method": "dpa", "x": 1}
    (tmp_path / "samples.jsonl").write_text("\n".join(
        ['{"index": 0, "meth', json.dumps(good), "[1, 2]", '"a string"', '{"index": "2", "method": "dpa"}',
         "null"]) + "\n")
    assert Store(tmp_path).samples == {(1, "dpa"): good}


def test_results_out_that_is_a_file_is_refused(tmp_path, tiny):
    from dpa.evaluate.runner import Settings, evaluate

    model, tok = tiny
    data = tmp_path / "data"  # a one-record data file, so that the check does not depend on ../shared/data
    data.mkdir()
    (data / "known_1000.json").write_text(json.dumps([{"known_id": 0, "prompt": PROMPT, "attribute": "paris"}]))
    (tmp_path / "out").write_text("keep me")
    with pytest.raises(datasets.DataError, match="is a file"):
        evaluate(model, tok, Settings(dataset="known_1000", unit="input", limit=1, data_dir=str(data)),
                 tmp_path / "out")
    assert (tmp_path / "out").read_text() == "keep me"


def test_to_json_into_a_folder_or_nowhere(tmp_path, tiny):
    model, tok = tiny
    res = A(model, tok, PROMPT, target=3)
    with pytest.raises(InputError, match="directory"):
        res.to_json(str(tmp_path))
    with pytest.raises(InputError, match="cannot write"):
        res.to_json(str(tmp_path / "no-such-folder" / "r.json"))
    with pytest.raises(InputError, match="cannot write"):
        res.to_json(str(tmp_path / ("x" * 300 + ".json")))  # a name longer than the file system allows


def test_a_failed_write_keeps_the_old_file(tmp_path, tiny, monkeypatch):
    """Writes go to a temporary file and are renamed into place: a full disk leaves the old file whole."""
    model, tok = tiny
    path = tmp_path / "r.json"
    path.write_text("old result")

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(InputError, match="No space left"):
        A(model, tok, PROMPT, target=3).to_json(str(path))
    assert path.read_text() == "old result" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_written_files_get_the_usual_mode(tmp_path, tiny):
    """The atomic write's temporary file is private; the result must not be: the umask's mode for a new
    file, the old file's mode for one it replaces."""
    model, tok = tiny
    res = A(model, tok, PROMPT, target=3)
    old = os.umask(0o022)
    try:
        res.to_json(str(tmp_path / "new.json"))
    finally:
        os.umask(old)
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o644
    (tmp_path / "old.json").write_text("x")
    os.chmod(tmp_path / "old.json", 0o640)
    res.to_json(str(tmp_path / "old.json"))
    assert (tmp_path / "old.json").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("flag", ["--json", "--html"])
def test_cli_output_to_a_folder_is_one_message(tmp_path, capsys, flag):
    from dpa.cli import main

    folder = save_tiny_model(tmp_path / "m")
    with pytest.raises(SystemExit) as info:
        main(["attribute", PROMPT, "--model", str(folder), flag, str(tmp_path)])
    assert info.value.code == 2 and "is a folder" in capsys.readouterr().err


N_FILES = len(DATA_FILES) + 1 + 1 + 1 + 3 + 1 + 2 + 1 + 1


def test_results_say_what_dpa_cannot_vouch_for(tiny):
    """Weights off the paper's constraints and control paths are said in the result, its JSON and the report."""
    from dpa.report import terminal_report

    model, tok = tiny
    assert A(model, tok, PROMPT, target=3, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5)).caveats == []
    default = A(model, tok, PROMPT, target=3)
    assert len(default.caveats) == 1 and "completeness gap" in default.caveats[0]
    off = A(model, tok, PROMPT, target=3, weights=dpa.PathWeights(0.5, 0.5, 0.5, 1, 1))
    assert "off the paper's constraints" in off.caveats[0]
    assert json.loads(off.to_json())["caveats"] == off.caveats
    assert "off the paper's constraints" in terminal_report(off, color=False)
    assert dpa.Attribution.from_json(off.to_json()).caveats == off.caveats


def test_missing_data_writes_nothing(tmp_path, tiny):
    from dpa.evaluate.runner import Settings, evaluate

    model, tok = tiny
    empty = tmp_path / "data"
    empty.mkdir()
    with pytest.raises(datasets.DataError, match="known_1000.json"):
        evaluate(model, tok, Settings(dataset="known_1000", unit="input", limit=1, data_dir=str(empty)),
                 tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- the command line: one message on stderr, exit 2, never a traceback ----------------------------

M = "MODEL"  # replaced by the tiny model's folder
CLI_BAD = {
    "empty-prompt": (["   ", "--model", M], "prompt"),
    "multi-token-target": ([PROMPT, "--model", M, "--target", "paris london"], "single token"),
    "unknown-target-word": ([PROMPT, "--model", M, "--target", "zebra"], "target"),
    "position-out-of-range": ([PROMPT, "--model", M, "--position", "99"], "position"),
    "position-not-int": ([PROMPT, "--model", M, "--position", "two"], "--position"),
    "weights-four": ([PROMPT, "--model", M, "--weights", "1,2,3,4"], "five"),
    "weights-letters": ([PROMPT, "--model", M, "--weights", "a,b,c,d,e"], "five numbers"),
    "weights-nan": ([PROMPT, "--model", M, "--weights", "nan,0,1,0.5,0.5"], "five numbers"),
    "p-without-preset": ([PROMPT, "--model", M, "--p", "0.3"], "--preset"),
    "top-zero": ([PROMPT, "--model", M, "--top", "0"], "--top"),
    "device-gpu": ([PROMPT, "--model", M, "--device", "gpu"], "device"),
    "device-cuda-99": ([PROMPT, "--model", M, "--device", "cuda:99"], "cuda"),  # no CUDA, or no 100th device
    "no-such-model": ([PROMPT, "--model", "/nonexistent/model"], "/nonexistent/model"),
    "logprob-with-contrast": ([PROMPT, "--model", M, "--logprob", "--contrast", "london"], "contrast"),
    "contrast-is-target": ([PROMPT, "--model", M, "--target", "paris", "--contrast", "paris"], "contrast"),
    "json-in-missing-folder": ([PROMPT, "--model", M, "--json", "/nonexistent/dir/r.json"], "no folder"),
}


@pytest.mark.parametrize("case", CLI_BAD)
def test_cli_refuses_with_one_line(tmp_path, capsys, case):
    from dpa.cli import main

    args, names = CLI_BAD[case]
    folder = str(save_tiny_model(tmp_path / "m"))
    try:
        code = main(["attribute", "--color", "never", *(folder if a == M else a for a in args)])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and names.lower() in err.lower(), err


# --- evaluate / sweep flags: one line on stderr, exit 2, nothing written -----------------------------

D, O = "DATA", "OUT"  # replaced by a one-record data folder and a fresh output path
EVAL_BAD = {
    "limit-zero": (["evaluate", "--limit", "0"], "--limit"),
    "limit-negative": (["evaluate", "--limit", "-2"], "--limit"),
    "limit-word": (["evaluate", "--limit", "ten"], "--limit"),
    "steps-zero": (["evaluate", "--steps", "0"], "--steps"),
    "steps-float": (["evaluate", "--steps", "2.5"], "--steps"),
    "batch-size-zero": (["evaluate", "--batch-size", "0"], "--batch-size"),
    "threads-zero": (["evaluate", "--threads", "0"], "--threads"),
    "n-generated-zero": (["evaluate", "--n-generated", "0"], "--n-generated"),
    "seed-word": (["evaluate", "--seed", "x"], "--seed"),
    "unknown-method": (["evaluate", "--methods", "dpa,magic"], "magic"),
    "empty-methods": (["evaluate", "--methods", ","], "--methods"),
    "weights-three": (["evaluate", "--weights", "1,2,3"], "five"),
    "weights-inf": (["evaluate", "--weights", "inf,0,1,0.5,0.5"], "five numbers"),
    "p-out-of-range": (["evaluate", "--preset", "attention", "--p", "2"], "p"),
    "p-without-preset": (["evaluate", "--p", "0.3"], "--preset"),
    "dataset-unknown": (["evaluate", "--dataset", "mnist"], "--dataset"),
    "unit-unknown": (["evaluate", "--unit", "heads"], "--unit"),
    "dtype-unknown": (["evaluate", "--dtype", "int8"], "--dtype"),
    "data-dir-missing": (["evaluate", "--data-dir", "/nonexistent/data"], "/nonexistent/data"),
    "out-is-a-file": (["evaluate", "--out", "FILE"], "is a file"),
    "device-gpu": (["evaluate", "--device", "gpu"], "device"),
    "no-such-model": (["evaluate", "--model", "/nonexistent/model"], "/nonexistent/model"),
    "shard-removed": (["evaluate", "--shard", "0/2"], "unrecognized arguments: --shard"),  # torchrun instead
    "sweep-shard-removed": (["sweep", "--shard", "1/2"], "unrecognized arguments: --shard"),
    "sweep-unknown-family": (["sweep", "--families", "attention,magic"], "magic"),
    "sweep-p-out-of-range": (["sweep", "--ps", "0.5,1.5"], "1.5"),
    "sweep-p-word": (["sweep", "--ps", "0.5,x"], "--ps"),
    "sweep-empty-ps": (["sweep", "--ps", ","], "--ps"),
    "sweep-limit-zero": (["sweep", "--limit", "0"], "--limit"),
    "sweep-empty-families": (["sweep", "--families", ","], "--families"),
    "sweep-batch-size-zero": (["sweep", "--batch-size", "0"], "--batch-size"),
}


@pytest.mark.parametrize("case", EVAL_BAD)
def test_evaluate_and_sweep_refuse_with_one_line(tmp_path, capsys, case):
    from dpa.cli import main

    command, *flags = EVAL_BAD[case][0]
    names = EVAL_BAD[case][1]
    data = tmp_path / "data"
    data.mkdir()
    (data / "known_1000.json").write_text(json.dumps([{"known_id": 0, "prompt": PROMPT, "attribute": "paris"}]))
    (tmp_path / "FILE").write_text("keep me")
    defaults = {"--dataset": "known_1000", "--unit": "input", "--model": M, "--data-dir": D, "--out": O}
    for flag, value in defaults.items():
        if flag not in flags:
            flags += [flag, value]
    folder = str(save_tiny_model(tmp_path / "m"))
    swap = {M: folder, D: str(data), O: str(tmp_path / "out"), "FILE": str(tmp_path / "FILE")}
    try:
        code = main([command, "--quiet", "--no-figures", *(swap.get(a, a) for a in flags)])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and names.lower() in err.lower(), err
    assert not (tmp_path / "out").exists() and (tmp_path / "FILE").read_text() == "keep me"



# --- results read back from outside ------------------------------------------------------------------

def _saved(tiny, **change):
    model, tok = tiny
    data = json.loads(A(model, tok, PROMPT, target=3).to_json())
    for key, value in change.items():
        if "." in key:
            outer, inner = key.split(".")
            data[outer] = {**data[outer], inner: value}
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("change, message", [
    ({"target.position": 99}, "target.position 99"),
    ({"head_scores": [1.0, 2.0]}, "head_scores"),
    ({"token_scores": [1.0, 2.0]}, "token_scores"),
    ({"token_ids": [1, 2]}, "token_ids"),
    ({"tokens": []}, "tokens"),
    ({"neuron_scores": [[1.0]]}, "neuron_scores"),
    ({"edge_scores": [[[[1.0]]]]}, "edge_scores"),
])
def test_a_result_that_does_not_fit_together_is_refused_on_reading(tiny, change, message):
    with pytest.raises(InputError, match=message):
        dpa.Attribution.from_dict(_saved(tiny, **change))


@pytest.mark.parametrize("source, error, message", [
    ("", InputError, "empty"), ("[1, 2]", InputTypeError, "got list"), ("   ", InputError, "empty"),
])
def test_from_json_messages(source, error, message):
    with pytest.raises(error, match=message):
        dpa.Attribution.from_json(source)


def test_from_json_takes_a_path(tiny, tmp_path):
    model, tok = tiny
    res = A(model, tok, PROMPT, target=3)
    res.to_json(tmp_path / "r.json")
    assert torch.equal(dpa.Attribution.from_json(tmp_path / "r.json").token_scores, res.token_scores)


def test_reports_of_a_result_saved_with_top_neurons(tiny):
    from dpa import report

    model, tok = tiny
    res = A(model, tok, PROMPT, target=3)
    back = dpa.Attribution.from_json(res.to_json(top_neurons=5))
    assert report.terminal_report(back, color=False, top=5) == report.terminal_report(res, color=False, top=5).replace(
        "neurons per layer)", "neurons per layer; the top 5 neurons of each sign saved)")
    text = report.terminal_report(back, color=False, top=6)  # more than were saved: heads alone, and it says why
    assert "only the top 5 neurons of each sign per layer were saved" in text and "neuron L" not in text
    from dpa_widgets.page import html_report

    assert "the top 5 neurons of each sign saved" in html_report(back)
    assert dpa.Attribution.from_json(back.to_json()).neuron_top == back.neuron_top, "the neurons it has, written again"
    assert dpa.Attribution.from_json(back.to_json(top_neurons=3)).neuron_top.k == 3, "or fewer of them"
    bare = back.to_dict()
    del bare["top_neurons"]
    assert "neuron scores not saved" in report.terminal_report(dpa.Attribution.from_dict(bare), color=False)


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    from dpa.models import ModelLoadError

    folder = save_tiny_model(tmp_path / "m")
    for f in folder.iterdir():
        if "token" in f.name:
            f.unlink()
    with pytest.raises(ModelLoadError, match="holds no tokenizer"):
        dpa.load_model(str(folder), device="cpu")


def test_a_truncated_checkpoint_is_one_load_error(tmp_path):
    from dpa.models import ModelLoadError

    folder = save_tiny_model(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot load model"):
        dpa.load_model(str(folder), device="cpu")
