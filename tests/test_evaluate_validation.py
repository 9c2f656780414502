"""Adverse inputs to the evaluation package's Python API (``dpa.evaluate``): each one raises exactly the
``dpa`` error named (also the matching built-in) with the argument named in its message; never a raw
exception from torch, never a silently wrong number.

Kinds: token ids of the ablation helpers that used to be truncated; attributions of another sample given
to the curves; the ablation helpers' other arguments; ``Settings`` and the runner's arguments; AUCs and
the small helpers (component units and scores, IOI generation, the first token of a word).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dpa import PathWeights
from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS
from dpa.errors import DPAError, InputError, InputTypeError, NonFiniteError, TargetError
from dpa.evaluate import ablation, auc, auc_summary, generate_ioi
from dpa.evaluate.curves import ComponentUnits, component_curves, component_scores, component_units, input_curves
from dpa.evaluate.prompts import Sample, first_token
from dpa.evaluate.runner import Settings, evaluate, sweep
from tests.conftest import tiny_model
from tests.test_evaluate import word_tokenizer

IDS = [3, 17, 25, 40, 8, 61]
T, TARGET = len(IDS), 12
SAMPLE = Sample("s", IDS, [False] + [True] * (T - 1), TARGET, None)
GRID = [0.2, 0.5, 1.0]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", kv_heads=2)


@pytest.fixture(scope="module")
def attributions(llama):
    """Input and component attributions of SAMPLE, and of other prompts, positions and targets."""
    inp, comp = INPUT_METHODS["random"], COMPONENT_METHODS["random"]
    return {
        "input": inp(llama, None, IDS, TARGET, seed=1),
        "input-other-tokens": inp(llama, None, [3, 17, 25, 41, 8, 61], TARGET, seed=1),
        "input-shorter": inp(llama, None, IDS[:5], TARGET, seed=1),
        "input-longer": inp(llama, None, IDS + [9], TARGET, seed=1),
        "input-other-position": inp(llama, None, IDS, TARGET, position=3, seed=1),
        "input-other-target": inp(llama, None, IDS, TARGET + 1, seed=1),
        "component": comp(llama, None, IDS, TARGET, seed=1),
        "component-other-tokens": comp(llama, None, [3, 17, 25, 41, 8, 61], TARGET, seed=1),
        "component-other-position": comp(llama, None, IDS, TARGET, position=2, seed=1),
        "component-other-target": comp(llama, None, IDS, 0, seed=1),
    }


def refused(call, error: type[DPAError], names: str) -> DPAError:
    """``call()`` raises exactly ``error`` (a DPAError, so also its built-in), naming ``names``."""
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, DPAError)
    assert names in str(info.value), str(info.value)
    return info.value


# --- 1. token ids that used to be truncated silently --------------------------------------------------

TRUNCATED_IDS = {
    "floats": [i + 0.7 for i in IDS],
    "integral-floats": [float(i) for i in IDS],
    "bools": [True] * T,
    "one-float": IDS[:-1] + [61.5],
    "float-tensor": torch.tensor(IDS, dtype=torch.float64) + 0.7,
    "bool-tensor": torch.ones(T, dtype=torch.bool),
    "float-numpy": np.array(IDS, dtype=np.float32),
    "float-tensor-1-by-pos": (torch.tensor(IDS, dtype=torch.float32) + 0.2)[None],
}
TRUNCATING_CALLS = {
    "input_ablation_prob": lambda m, ids: ablation.input_ablation_prob(m, ids, [1], -1, 3),
    "input_ablation_probs": lambda m, ids: ablation.input_ablation_probs(m, ids, torch.ones(1, T), -1, 3),
    "component_ablation_prob": lambda m, ids: ablation.component_ablation_prob(m, ids, [], [], -1, 3),
}


@pytest.mark.parametrize("call", TRUNCATING_CALLS)
@pytest.mark.parametrize("case", TRUNCATED_IDS)
def test_float_and_bool_token_ids_are_refused(llama, case, call):
    refused(lambda: TRUNCATING_CALLS[call](llama, TRUNCATED_IDS[case]), InputError, "input_ids")


@pytest.mark.parametrize("form", ["int32-tensor", "1-by-pos-tensor", "numpy-int", "tuple", "list-of-one"])
def test_integer_token_ids_in_any_form_give_the_list_result(llama, form):
    ids = {"int32-tensor": torch.tensor(IDS, dtype=torch.int32), "1-by-pos-tensor": torch.tensor([IDS]),
           "numpy-int": np.array(IDS), "tuple": tuple(IDS), "list-of-one": [IDS]}[form]
    assert ablation.input_ablation_prob(llama, ids, [1], -1, 3) == ablation.input_ablation_prob(llama, IDS, [1], -1, 3)


# --- 2. curves of an attribution that is not of the sample ---------------------------------------------

INPUT_MISMATCH = {
    "other-tokens": ("input-other-tokens", "another prompt"),
    "shorter-prompt": ("input-shorter", "another prompt"),
    "longer-prompt": ("input-longer", "another prompt"),
    "other-position": ("input-other-position", "target position"),
    "other-target": ("input-other-target", "target token"),
}


@pytest.mark.parametrize("case", INPUT_MISMATCH)
def test_input_curves_refuse_an_attribution_of_another_sample(llama, attributions, case):
    key, says = INPUT_MISMATCH[case]
    err = refused(lambda: input_curves(llama, SAMPLE, attributions[key], GRID), InputError, "attribution")
    assert says in str(err)


COMPONENT_MISMATCH = {
    "other-tokens": ("component-other-tokens", "another prompt"),
    "other-position": ("component-other-position", "target position"),
    "other-target": ("component-other-target", "target token"),
}


@pytest.mark.parametrize("case", COMPONENT_MISMATCH)
def test_component_curves_refuse_an_attribution_of_another_sample(llama, attributions, case):
    key, says = COMPONENT_MISMATCH[case]
    units = component_units(SAMPLE, 3, 4, 48, "coarse")
    err = refused(lambda: component_curves(llama, SAMPLE, attributions[key], units, GRID), InputError, "attribution")
    assert says in str(err)


BAD_FRACTIONS = {
    "above-one": ([0.5, 1.5], InputError, "fractions[1]"),
    "negative": ([-0.1, 0.5], InputError, "fractions[0]"),
    "zero": ([0.0, 0.5], InputError, "fractions[0]"),
    "nan": ([0.5, math.nan], InputError, "fractions[1]"),
    "empty": ([], InputError, "fractions"),
    "string": ("0.5", InputTypeError, "fractions"),
    "a-number": (0.5, InputTypeError, "fractions"),
    "strings-inside": (["0.5"], InputTypeError, "fractions[0]"),
}


@pytest.mark.parametrize("unit", ["input", "component"])
@pytest.mark.parametrize("case", BAD_FRACTIONS)
def test_curves_refuse_fractions_outside_zero_one(llama, attributions, case, unit):
    fractions, error, names = BAD_FRACTIONS[case]
    if unit == "input":
        call = lambda: input_curves(llama, SAMPLE, attributions["input"], fractions)  # noqa: E731
    else:
        units = component_units(SAMPLE, 3, 4, 48, "coarse")
        call = lambda: component_curves(llama, SAMPLE, attributions["component"], units, fractions)  # noqa: E731
    refused(call, error, names)


def test_component_curves_refuse_units_of_another_sample_or_model(llama, attributions):
    other = Sample("o", IDS + [9], [False] + [True] * T, TARGET, None)
    refused(lambda: component_curves(llama, SAMPLE, attributions["component"], component_units(other, 3, 4, 48),
                                     GRID), InputError, "units")
    refused(lambda: component_curves(llama, SAMPLE, attributions["component"], component_units(SAMPLE, 2, 4, 48),
                                     GRID), InputError, "units")


def test_matching_attributions_still_give_curves(llama, attributions):
    assert input_curves(llama, SAMPLE, attributions["input"], GRID).n_units == T - 1
    units = component_units(SAMPLE, 3, 4, 48, "coarse")
    assert component_curves(llama, SAMPLE, attributions["component"], units, GRID).n_units == 3 * 4 + 3 * 48


# --- 3. the ablation helpers' other arguments ----------------------------------------------------------

ABLATION_BAD = {
    "string-prompt": (lambda m: ablation.input_ablation_prob(m, "w3 w17", [1], -1, 3), InputTypeError, "input_ids"),
    "none-prompt": (lambda m: ablation.input_ablation_prob(m, None, [1], -1, 3), InputTypeError, "input_ids"),
    "int-prompt": (lambda m: ablation.input_ablation_probs(m, 5, torch.ones(1, 1), -1, 3), InputTypeError,
                   "input_ids"),
    "empty-prompt": (lambda m: ablation.input_ablation_prob(m, [], [], -1, 3), InputError, "input_ids"),
    "two-prompts-tensor": (lambda m: ablation.input_ablation_probs(m, torch.tensor([IDS, IDS]), torch.ones(1, T),
                                                                   -1, 3), InputError, "one prompt"),
    "keep-no-rows": (lambda m: ablation.input_ablation_probs(m, IDS, torch.ones(0, T), -1, 3), InputError, "keep"),
    "keep-half": (lambda m: ablation.input_ablation_probs(m, IDS, torch.full((1, T), 0.5), -1, 3), InputError,
                  "keep"),
    "keep-list": (lambda m: ablation.input_ablation_probs(m, IDS, [[1] * T], -1, 3), InputTypeError, "keep"),
    "attn-keep-no-rows": (lambda m: ablation.component_ablation_probs(m, IDS, torch.ones(0, 3, 4, T, T), None, -1, 3),
                          InputError, "attn_keep"),
    "neuron-keep-no-rows": (lambda m: ablation.component_ablation_probs(m, IDS, None, torch.ones(0, 3, T, 48), -1,
                                                                        3), InputError, "neuron_keep"),
    "attn-keep-two": (lambda m: ablation.component_ablation_probs(m, IDS, torch.full((1, 3, 4, 1, 1), 2.0), None, -1,
                                                                  3), InputError, "attn_keep"),
    "target-none": (lambda m: ablation.input_ablation_prob(m, IDS, [1], -1, None), InputTypeError, "target_id"),
    "target-none-probs": (lambda m: ablation.input_ablation_probs(m, IDS, torch.ones(1, T), -1, None),
                          InputTypeError, "target_id"),
    "target-none-component": (lambda m: ablation.component_ablation_prob(m, IDS, [], [], -1, None), InputTypeError,
                              "target_id"),
    "target-vector": (lambda m: ablation.input_ablation_prob(m, IDS, [1], -1, torch.tensor([1, 2])), TargetError,
                      "target"),
    "target-float-vector": (lambda m: ablation.input_ablation_prob(m, IDS, [1], -1, torch.ones(32)),
                            InputTypeError, "target_id"),
    "target-out-of-vocab": (lambda m: ablation.input_ablation_prob(m, IDS, [1], -1, 96), TargetError, "target"),
    "zero-positions-none": (lambda m: ablation.input_ablation_prob(m, IDS, None, -1, 3), InputTypeError,
                            "zero_positions"),
    "zero-positions-int": (lambda m: ablation.input_ablation_prob(m, IDS, 2, -1, 3), InputTypeError,
                           "zero_positions"),
    "zero-positions-0d-tensor": (lambda m: ablation.input_ablation_prob(m, IDS, torch.tensor(2), -1, 3),
                                 InputTypeError, "zero_positions"),
    "zero-positions-string": (lambda m: ablation.input_ablation_prob(m, IDS, "12", -1, 3), InputTypeError,
                              "zero_positions"),
    "zero-position-out-of-range": (lambda m: ablation.input_ablation_prob(m, IDS, [T], -1, 3), InputError,
                                   "zero_positions"),
    "zero-position-negative-out-of-range": (lambda m: ablation.input_ablation_prob(m, IDS, [-T - 1], -1, 3),
                                            InputError, "zero_positions"),
    "target-position-out-of-range": (lambda m: ablation.input_ablation_prob(m, IDS, [1], T, 3), InputError,
                                     "position"),
    "target-position-negative-out-of-range": (lambda m: ablation.component_ablation_prob(m, IDS, [], [], -T - 1, 3),
                                              InputError, "position"),
    "edges-none": (lambda m: ablation.component_ablation_prob(m, IDS, None, [], -1, 3), InputTypeError, "edges"),
    "edges-int": (lambda m: ablation.component_ablation_prob(m, IDS, 4, [], -1, 3), InputTypeError, "edges"),
    "neurons-none": (lambda m: ablation.component_ablation_prob(m, IDS, [], None, -1, 3), InputTypeError,
                     "neurons"),
    "edge-query-out-of-range": (lambda m: ablation.component_ablation_prob(m, IDS, [(0, 0, T, 0)], [], -1, 3),
                                InputError, "edge"),
    "neuron-position-out-of-range": (lambda m: ablation.component_ablation_prob(m, IDS, [], [(0, T, 0)], -1, 3),
                                     InputError, "neuron"),
}


@pytest.mark.parametrize("case", ABLATION_BAD)
def test_ablation_helpers_refuse(llama, case):
    call, error, names = ABLATION_BAD[case]
    refused(lambda: call(llama), error, names)


def test_unit_lists_in_other_iterable_forms_are_accepted(llama):
    base = ablation.input_ablation_prob(llama, IDS, [1, 2], -1, 3)
    assert ablation.input_ablation_prob(llama, IDS, torch.tensor([1, 2]), -1, 3) == base
    assert ablation.input_ablation_prob(llama, IDS, (p for p in (1, 2)), -1, 3) == base
    edge = ablation.component_ablation_prob(llama, IDS, [(0, 1, 4, 2)], [(1, 3, 5)], -1, 3)
    assert ablation.component_ablation_prob(llama, IDS, torch.tensor([[0, 1, 4, 2]]), {(1, 3, 5)}, -1, 3) == edge


# --- 4. Settings and the runner's arguments ------------------------------------------------------------

SETTINGS_BAD = {
    "unit": ({"unit": "heads"}, InputError, "unit"),
    "unit-none": ({"unit": None}, InputError, "unit"),
    "dataset": ({"dataset": "mnist"}, InputError, "dataset"),
    "component-units": ({"component_units": "heads"}, InputError, "component_units"),
    "limit-float": ({"limit": 1.5}, InputTypeError, "limit"),
    "limit-string": ({"limit": "1"}, InputTypeError, "limit"),
    "limit-negative": ({"limit": -1}, InputError, "limit"),
    "limit-zero": ({"limit": 0}, InputError, "limit"),
    "limit-bool": ({"limit": True}, InputTypeError, "limit"),
    "n-generated-float": ({"n_generated": 2.5}, InputTypeError, "n_generated"),
    "n-generated-zero": ({"n_generated": 0}, InputError, "n_generated"),
    "weights-tuple": ({"weights": (0, 0, 1, 0, 1)}, InputTypeError, "weights"),
    "weights-string": ({"weights": "0,0,1,0,1"}, InputTypeError, "weights"),
    "methods-dict": ({"methods": {"x": 5}}, InputTypeError, "methods"),
    "methods-string": ({"methods": "gradient"}, InputTypeError, "methods"),
    "methods-ints": ({"methods": (1, 2)}, InputTypeError, "methods"),
    "methods-empty-name": ({"methods": ("dpa", "")}, InputTypeError, "methods"),
    "max-tokens-zero": ({"max_tokens": 0}, InputError, "max_tokens"),
    "max-tokens-float": ({"max_tokens": 400.0}, InputTypeError, "max_tokens"),
    "min-probability-two": ({"min_probability": 2}, InputError, "min_probability"),
    "min-probability-one": ({"min_probability": 1}, InputError, "min_probability"),
    "min-probability-negative": ({"min_probability": -0.1}, InputError, "min_probability"),
    "min-probability-nan": ({"min_probability": math.nan}, InputError, "min_probability"),
    "min-probability-string": ({"min_probability": "0.1"}, InputTypeError, "min_probability"),
    "steps-string": ({"steps": "20"}, InputTypeError, "steps"),
    "steps-float": ({"steps": 2.5}, InputTypeError, "steps"),
    "steps-zero": ({"steps": 0}, InputError, "steps"),
    "batch-size-zero": ({"batch_size": 0}, InputError, "batch_size"),
    "batch-size-float": ({"batch_size": 8.0}, InputTypeError, "batch_size"),
    "seed-float": ({"seed": 1.5}, InputTypeError, "seed"),
    "seed-string": ({"seed": "0"}, InputTypeError, "seed"),
    "contrast-int": ({"contrast": 1}, InputTypeError, "contrast"),
    "filter": ({"filter": "strict"}, InputError, "filter"),
    "data-dir-int": ({"data_dir": 3}, InputTypeError, "data_dir"),
}


@pytest.mark.parametrize("case", SETTINGS_BAD)
def test_settings_refuse(case):
    fields, error, names = SETTINGS_BAD[case]
    refused(lambda: Settings(**{"dataset": "known_1000", "unit": "input", **fields}), error, names)
    good = Settings(dataset="known_1000", unit="input")
    refused(lambda: replace(good, **fields), error, names)  # replace() checks the same way


def test_settings_canonical_forms():
    s = Settings(dataset="ioi", unit="component", methods=["dpa", "gradient"], limit=np.int64(3),
                 weights=PathWeights(0, 0, 1, 0, 1), min_probability=0, data_dir=__import__("pathlib").Path("/tmp"))
    assert s.methods == ("dpa", "gradient") and type(s.limit) is int and s.limit == 3
    assert type(s.min_probability) is float and s.data_dir == "/tmp"


RUNNER_BAD = {
    "methods-not-callable": (lambda m, s, o: evaluate(m, None, s, o, methods={"x": 5}), InputTypeError, "methods"),
    "methods-list": (lambda m, s, o: evaluate(m, None, s, o, methods=["dpa"]), InputTypeError, "methods"),
    "methods-empty": (lambda m, s, o: evaluate(m, None, s, o, methods={}), InputError, "methods"),
    "settings-dict": (lambda m, s, o: evaluate(m, None, {"dataset": "ioi"}, o), InputTypeError, "settings"),
    "progress-string": (lambda m, s, o: evaluate(m, None, s, o, progress="no"), InputTypeError, "progress"),
    "out-int": (lambda m, s, o: evaluate(m, None, s, 5), InputTypeError, "out"),
    "unknown-method": (lambda m, s, o: evaluate(m, None, replace(s, methods=("dpaa",)), o), InputError, "dpaa"),
    "sweep-families-string": (lambda m, s, o: sweep(m, None, s, o, families="attention", ps=[0.5]),
                              InputTypeError, "families"),
    "sweep-unknown-family": (lambda m, s, o: sweep(m, None, s, o, families=["colour"], ps=[0.5]), InputError,
                             "families"),
    "sweep-p-above-one": (lambda m, s, o: sweep(m, None, s, o, families=["attention"], ps=[1.5]), InputError,
                          "ps[0]"),
}


@pytest.mark.parametrize("case", RUNNER_BAD)
def test_runner_refuses_before_writing(llama, tmp_path, case):
    call, error, names = RUNNER_BAD[case]
    settings = Settings(dataset="ioi_templates", unit="input", methods=("random",), n_generated=2)
    refused(lambda: call(llama, settings, tmp_path / "out"), error, names)
    assert not (tmp_path / "out").exists()


# --- 5. AUCs and the small helpers ---------------------------------------------------------------------

F3 = [0.1, 0.5, 1.0]
HELPERS_BAD = {
    "auc-nan-value": (lambda: auc(F3, [1, math.nan, 3], curve="recovery", unit="input"), NonFiniteError,
                      "values[1]"),
    "auc-inf-value": (lambda: auc(F3, [1, 2, math.inf], curve="disruption", unit="input", mode="paper"),
                      NonFiniteError, "values[2]"),
    "auc-nan-fraction": (lambda: auc([0.1, math.nan, 1.0], [1, 2, 3], curve="recovery", unit="input"),
                         NonFiniteError, "fractions[1]"),
    "auc-tensor-nan": (lambda: auc(F3, torch.tensor([1.0, 2.0, math.nan]), curve="recovery", unit="input"),
                       NonFiniteError, "values[2]"),
    "auc-length": (lambda: auc(F3, [1, 2], curve="recovery", unit="input"), InputError, "fractions"),
    "auc-empty": (lambda: auc([], [], curve="recovery", unit="input"), InputError, "fractions"),
    "auc-fraction-above-one": (lambda: auc([0.5, 2.0], [1, 2], curve="recovery", unit="input"), InputError,
                               "fractions[1]"),
    "auc-curve": (lambda: auc(F3, [1, 2, 3], curve="sideways", unit="input"), InputError, "curve"),
    "auc-unit": (lambda: auc(F3, [1, 2, 3], curve="recovery", unit="heads"), InputError, "unit"),
    "auc-mode": (lambda: auc(F3, [1, 2, 3], curve="recovery", unit="input", mode="other"), InputError, "mode"),
    "auc-values-string": (lambda: auc(F3, "123", curve="recovery", unit="input"), InputTypeError, "values"),
    "auc-value-string": (lambda: auc(F3, [1, "2", 3], curve="recovery", unit="input"), InputTypeError,
                         "values[1]"),
    "auc-values-none": (lambda: auc(F3, None, curve="recovery", unit="input"), InputTypeError, "values"),
    "summary-nan-disruption": (lambda: auc_summary(F3, [1, math.nan, 3], [1, 2, 3], unit="input"),
                               NonFiniteError, "disruption"),
    "summary-nan-recovery": (lambda: auc_summary(F3, [1, 2, 3], [1, 2, math.nan], unit="input"),
                             NonFiniteError, "recovery"),
    "summary-nan-paper": (lambda: auc_summary(F3, [1, 2, 3], [1, 2, 3], unit="input",
                                              paper=([1, 2, 3], [math.nan] * 3)), NonFiniteError, "paper[1]"),
    "summary-paper-one-curve": (lambda: auc_summary(F3, [1, 2, 3], [1, 2, 3], unit="input", paper=[1, 2, 3]),
                                InputTypeError, "paper"),
    "summary-unit": (lambda: auc_summary(F3, [1, 2, 3], [1, 2, 3], unit="tokens"), InputError, "unit"),
    "summary-length": (lambda: auc_summary(F3, [1, 2], [1, 2, 3], unit="input"), InputError, "disruption"),
    "units-granularity": (lambda: component_units(SAMPLE, 3, 4, 48, "heads"), InputError, "granularity"),
    "units-protocol": (lambda: component_units(SAMPLE, 3, 4, 48, protocol="reference"), InputError, "protocol"),
    "units-layers-zero": (lambda: component_units(SAMPLE, 0, 4, 48), InputError, "n_layers"),
    "units-heads-float": (lambda: component_units(SAMPLE, 3, 4.0, 48), InputTypeError, "n_heads"),
    "units-sample-list": (lambda: component_units(IDS, 3, 4, 48), InputTypeError, "sample"),
    "units-context-length": (lambda: component_units(Sample("c", IDS, [True] * 3, TARGET, None), 3, 4, 48),
                             InputError, "context"),
    "units-one-kind-other-kind": (lambda: component_units(SAMPLE, 3, 4, 48, "neurons", protocol="paper",
                                                          method="attn_only"), InputError, "granularity"),
    "units-method-int": (lambda: component_units(SAMPLE, 3, 4, 48, method=3), InputTypeError, "method"),
    "ioi-negative": (lambda: generate_ioi(-1), InputError, "n"),
    "ioi-float": (lambda: generate_ioi(2.5), InputTypeError, "n"),
    "ioi-seed-string": (lambda: generate_ioi(2, seed="x"), InputTypeError, "seed"),
    "first-token-empty": (lambda: first_token(word_tokenizer(), ""), InputError, "word"),
    "first-token-blank": (lambda: first_token(word_tokenizer(), "  "), InputError, "word"),
    "first-token-none": (lambda: first_token(word_tokenizer(), None), InputTypeError, "word"),
}


@pytest.mark.parametrize("case", HELPERS_BAD)
def test_auc_and_helpers_refuse(case):
    call, error, names = HELPERS_BAD[case]
    refused(call, error, names)


def test_nonfinite_auc_is_also_a_floating_point_error():
    with pytest.raises(FloatingPointError):
        auc(F3, [1, math.nan, 3], curve="recovery", unit="input")


SCORES_BAD = {
    "units-not-units": (lambda a: component_scores(a["component"], "fine"), InputTypeError, "units"),
    "attribution-not-attribution": (lambda a: component_scores(None, component_units(SAMPLE, 3, 4, 48)),
                                    InputTypeError, "attribution"),
    "input-attribution-has-no-edges": (lambda a: component_scores(a["input"], component_units(SAMPLE, 3, 4, 48)),
                                       InputError, "attribution"),
    "units-of-a-longer-prompt": (lambda a: component_scores(a["component"], component_units(
        Sample("o", IDS + [9], [True] * (T + 1), TARGET, None), 3, 4, 48)), InputError, "attribution"),
    "index-out-of-range": (lambda a: component_scores(a["component"], ComponentUnits(
        (3, 4, 1, 1), (3, 1, 48), torch.tensor([12]), torch.tensor([0]))), InputError, "attn_index"),
    "index-float": (lambda a: component_scores(a["component"], ComponentUnits(
        (3, 4, 1, 1), (3, 1, 48), torch.tensor([1.0]), torch.tensor([0]))), InputTypeError, "attn_index"),
}


@pytest.mark.parametrize("case", SCORES_BAD)
def test_component_scores_refuse(attributions, case):
    call, error, names = SCORES_BAD[case]
    refused(lambda: call(attributions), error, names)
