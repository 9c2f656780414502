"""Attributing a generation: one forward over the prompt and the generated tokens, one linearised backward per
generated token through it. Each row is the one-position call at its step; the rows add up to the whole
continuation attributed as one target of several tokens."""

from __future__ import annotations

import pytest
import torch

import dpa
from dpa.errors import InputError
from dpa.generation import attribute_generation
from tests.conftest import ALL_FAMILIES, tiny_model
from tests.test_multi_token import TOK

PROMPT = "the cat sa"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_each_row_is_the_one_position_call(family):
    model = tiny_model(family)
    gen = attribute_generation(model, TOK, PROMPT, max_new_tokens=4, stop_at_eos=False)
    n = gen.prompt_length
    assert gen.generated_by == "greedy" and len(gen.steps) == 4 and gen.scores.shape == (4, n + 3)
    for j, step in enumerate(gen.steps):
        prefix = gen.token_ids[:n + j]
        with torch.no_grad():  # greedy: the model's own argmax after the prefix
            assert int(model(torch.tensor([prefix])).logits[0, -1].argmax()) == gen.token_ids[n + j]
        one = dpa.attribute(model, TOK, prefix, target=gen.token_ids[n + j])
        assert step.target_logit == pytest.approx(one.target_logit, abs=1e-12)
        assert step.target.probability == pytest.approx(one.target.probability, abs=1e-12)
        assert step.tokens == one.tokens and step.target.position == n + j - 1
        torch.testing.assert_close(gen.scores[j, :n + j], one.token_scores, rtol=0, atol=1e-12)
        assert not gen.scores[j, n + j:].any()  # nothing after the step's position
        torch.testing.assert_close(step.head_scores, one.head_scores, rtol=0, atol=1e-12)
        torch.testing.assert_close(step.neuron_scores, one.neuron_scores, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_rows_add_up_to_the_whole_continuation(family):
    """A given continuation: the rows' sum is the continuation attributed as one target (multi_token="sum")."""
    model = tiny_model(family)
    for kind in ("logit", "logprob"):
        gen = attribute_generation(model, TOK, PROMPT, continuation="t on", kind=kind)
        whole = dpa.attribute(model, TOK, PROMPT, target="t on", multi_token="sum", kind=kind)
        assert gen.generated_by == "given" and gen.generated == list("t on")
        torch.testing.assert_close(gen.scores.sum(0), whole.token_scores, rtol=0, atol=1e-12)
        torch.testing.assert_close(sum(s.head_scores for s in gen.steps), whole.head_scores, rtol=0, atol=1e-12)
        assert gen.values == pytest.approx([t.value for t in whole.target.terms], abs=1e-12)


def test_lean_equals_full():
    model = tiny_model("qwen2")
    lean = attribute_generation(model, TOK, PROMPT, max_new_tokens=3, memory="lean")
    full = attribute_generation(model, TOK, PROMPT, max_new_tokens=3, memory="full")
    torch.testing.assert_close(lean.scores, full.scores, rtol=0, atol=1e-12)
    for a, b in zip(lean.steps, full.steps):
        torch.testing.assert_close(a.neuron_scores, b.neuron_scores, rtol=0, atol=1e-12)


def test_stops_after_the_end_of_sequence_token():
    model = tiny_model("llama")
    first = attribute_generation(model, TOK, PROMPT, max_new_tokens=3, stop_at_eos=False).token_ids[-3]
    model.generation_config.eos_token_id = first  # the first generated token ends the sequence
    try:
        gen = attribute_generation(model, TOK, PROMPT, max_new_tokens=3)
    finally:
        model.generation_config.eos_token_id = None
    assert gen.token_ids[gen.prompt_length:] == [first]


class TestRefused:
    @pytest.mark.parametrize("kwargs, match", [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"continuation": ""}, "empty string"),
        ({"continuation": []}, "non-empty list"),
        ({"continuation": [10 ** 6]}, "vocabulary"),
        ({"kind": "prob"}, "kind"),
    ])
    def test_bad_arguments(self, kwargs, match):
        with pytest.raises(InputError, match=match):
            attribute_generation(tiny_model("llama"), TOK, PROMPT, **kwargs)

    def test_past_the_context(self):
        model = tiny_model("llama")
        limit = model.config.max_position_embeddings
        with pytest.raises(InputError, match="do not fit the model's context"):
            attribute_generation(model, TOK, "a" * (limit - 2), max_new_tokens=3)
        with pytest.raises(InputError, match="teacher forcing"):
            attribute_generation(model, TOK, "a" * (limit - 2), continuation="bcd")

    def test_one_prompt(self):
        model = tiny_model("llama")
        with pytest.raises(InputError, match="a generation follows one prompt; got a batch of 2"):
            attribute_generation(model, TOK, [PROMPT, PROMPT])
        ids = TOK(PROMPT)["input_ids"]  # a batch of one (a tokenizer's return_tensors output) is that prompt
        one = attribute_generation(model, TOK, torch.tensor([ids]), max_new_tokens=2)
        assert one.token_ids == attribute_generation(model, TOK, ids, max_new_tokens=2).token_ids

    @pytest.mark.parametrize("continuation, match", [
        ([True, 5], "must be integers, got True"),
        (torch.tensor([[5, 6], [7, 8]]), "1-D integer token ids"),
        ([5.0], "must be integers, got 5.0"),
        (torch.tensor([1.5]), "1-D integer token ids"),
    ])
    def test_bad_continuations(self, continuation, match):
        with pytest.raises(InputError, match=match):
            attribute_generation(tiny_model("llama"), TOK, PROMPT, continuation)

    def test_max_new_tokens_with_a_continuation(self):
        with pytest.raises(InputError, match="max_new_tokens is for generating"):
            attribute_generation(tiny_model("llama"), TOK, PROMPT, "ab", max_new_tokens=2)


def test_continuation_ids_of_any_integer_type_are_saved_as_ints():
    import numpy as np

    gen = attribute_generation(tiny_model("llama"), TOK, PROMPT, [torch.tensor(5), np.int64(6), 7])
    assert gen.token_ids[-3:] == [5, 6, 7] and all(type(i) is int for i in gen.token_ids)
    assert dpa.Generation.from_json(gen.to_json()).token_ids == gen.token_ids


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["tokens"].__setitem__(1, "HACKED"), "the steps are not the generation's"),
    (lambda d: d["steps"][1]["target"].update(kind="logprob"), "share one kind of target"),
    (lambda d: d.update(generated_by="sampled"), "generated_by must be 'greedy' or 'given'"),
    (lambda d: d.update(prompt_length=0), "prompt_length must be at least 1"),
])
def test_a_saved_generation_that_does_not_fit_is_refused(edit, match):
    data = attribute_generation(tiny_model("llama"), TOK, PROMPT, max_new_tokens=3, stop_at_eos=False).to_dict()
    edit(data)
    with pytest.raises(InputError, match=match):
        dpa.Generation.from_dict(data)


def test_saved_and_read_back(tmp_path):
    model = tiny_model("llama")
    gen = attribute_generation(model, TOK, PROMPT, max_new_tokens=3, stop_at_eos=False)
    gen.to_json(str(tmp_path / "g.json"), precision="full")
    back = dpa.Generation.from_json(tmp_path / "g.json")
    assert back.token_ids == gen.token_ids and back.prompt_length == gen.prompt_length
    torch.testing.assert_close(back.scores, gen.scores, rtol=0, atol=0)
    assert [s.target for s in back.steps] == [s.target for s in gen.steps]
    data = gen.to_dict()
    data["token_ids"][-1] += 1  # the last step's target is no longer the last generated token
    with pytest.raises(InputError, match="the steps are not the generation's"):
        dpa.Generation.from_dict(data)
    with pytest.raises(InputError, match="no generation file .*nothing.json"):
        dpa.Generation.from_json(tmp_path / "nothing.json")
