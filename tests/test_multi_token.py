"""A target of several tokens (``multi_token="sum"``): the sum of its tokens' logits (or log-probabilities), each at
its own position under teacher forcing, in one forward and one backward pass. DPA is linear in its target, so
the attribution of the sum is the sum of the one-token attributions, term by term."""

from __future__ import annotations

import pytest
import torch

import dpa
from dpa.errors import InputError, TargetError
from tests.conftest import ALL_FAMILIES, MOE_FAMILIES, tiny_model

class PieceTokenizer:
    """Characters as tokens (``'ab'`` is two), ids 1..95: a string target of several tokens."""

    all_special_ids = [0]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 31 for c in text]

    def decode(self, ids):
        return "".join(chr(i + 31) for i in ids)

    def __call__(self, text):
        return {"input_ids": [0] + self.encode(text)}


TOK = PieceTokenizer()
PROMPT, TARGET = "the cat sa", "t on"


def conservative(family: str) -> dpa.PathWeights:
    """Value path only, up path only (and the experts' path): the token scores add up to the target."""
    if family in MOE_FAMILIES:
        return dpa.PathWeights(0, 0, 1, 0, 1, router=0, expert=1)
    return dpa.PathWeights.control_content(1.0)


def hf_logits(model, text: str) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOK(text)["input_ids"]])).logits[0]


@pytest.mark.filterwarnings("ignore::dpa.TargetWarning")  # the pieces are random tokens to these models
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_sum_is_complete_and_each_term_is_its_own_call(family):
    model = tiny_model(family)
    weights = conservative(family)
    res = dpa.attribute(model, TOK, PROMPT, target=TARGET, multi_token="sum", weights=weights)
    # teacher forcing: the prompt and every target token but the last are the input
    assert res.tokens[1:] == list(PROMPT + TARGET[:-1])
    logits = hf_logits(model, PROMPT + TARGET[:-1])
    n = len(PROMPT)  # the BOS is position 0: the first target token is read at position n
    want = [float(logits[n + k, TOK.encode(c)[0]]) for k, c in enumerate(TARGET)]
    cap = dpa.spec_for(model).final_softcap
    if cap is not None:  # Gemma 2: the attributed logit is the one before the final soft-cap, HF's after it
        assert res.target.capped_logit == pytest.approx(sum(want), abs=1e-10)
        want = [cap * float(torch.atanh(torch.tensor(w / cap, dtype=torch.float64))) for w in want]
    assert [t.value for t in res.target.terms] == pytest.approx(want, abs=1e-10)  # the forward oracle, per term
    assert res.target_logit == pytest.approx(sum(want), abs=1e-10)
    assert [t.position for t in res.target.terms] == list(range(n, n + len(TARGET)))
    assert res.target.token == TARGET and res.target.position == n
    if not dpa.spec_for(model).qkv_bias:  # a bias's share is no token's: completeness_gap counts it
        assert res.bias_share == 0
    assert abs(res.completeness_gap) < 1e-10
    tokens, heads, neurons = torch.zeros_like(res.token_scores), 0, 0
    for k, piece in enumerate(TARGET):  # each term is the one-token call on its own prefix
        one = dpa.attribute(model, TOK, PROMPT + TARGET[:k], target=piece, weights=weights)
        assert one.target_logit == pytest.approx(res.target.terms[k].value, abs=1e-12)
        tokens[:len(one.token_scores)] += one.token_scores
        heads, neurons = heads + one.head_scores, neurons + one.neuron_scores
    torch.testing.assert_close(res.token_scores, tokens, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.head_scores, heads, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.neuron_scores, neurons, rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore::dpa.TargetWarning")
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
def test_logprob_terms_and_the_default_weights(family):
    """Each term of a log-probability target holds its own position's p fixed; the default weights too are a sum."""
    model = tiny_model(family)
    res = dpa.attribute(model, TOK, PROMPT, target=TARGET, multi_token="sum", kind="logprob")
    logp = hf_logits(model, PROMPT + TARGET[:-1]).double().log_softmax(-1)
    n = len(PROMPT)
    p = [float(logp[n + k, TOK.encode(c)[0]]) for k, c in enumerate(TARGET)]
    assert res.target.logprob == pytest.approx(sum(p), abs=1e-9)  # the whole continuation's
    assert [t.probability for t in res.target.terms] == pytest.approx([float(torch.tensor(x).exp()) for x in p])
    heads = 0
    for k, piece in enumerate(TARGET):
        one = dpa.attribute(model, TOK, PROMPT + TARGET[:k], target=piece, kind="logprob")
        assert one.target_logit == pytest.approx(res.target.terms[k].value, abs=1e-12)
        heads = heads + one.head_scores
    torch.testing.assert_close(res.head_scores, heads, rtol=0, atol=1e-12)


def test_contrast_is_subtracted_at_the_first_position():
    model = tiny_model("llama")
    res = dpa.attribute(model, TOK, PROMPT, target=TARGET, contrast="x", multi_token="sum")
    plain = dpa.attribute(model, TOK, PROMPT, target=TARGET, multi_token="sum")
    foil = dpa.attribute(model, TOK, PROMPT, target="x")
    assert res.target_logit == pytest.approx(plain.target_logit - foil.target_logit, abs=1e-12)
    torch.testing.assert_close(res.head_scores, plain.head_scores - foil.head_scores, rtol=0, atol=1e-12)
    assert res.target.kind == "contrast" and res.target.contrast == "x"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "qwen2_moe"])
@pytest.mark.parametrize("target", [TARGET, "t"])
def test_a_contrast_of_several_tokens_is_subtracted_whole(family, target):
    """The target's sum minus the contrast's, each under its own teacher forcing (the contrast in a row of its own):
    the prompt's token scores and every component score are the difference of the two calls; the tokens are the
    prompt, the target's forced tokens, then the contrast's."""
    model = tiny_model(family)
    both = dpa.attribute(model, TOK, [PROMPT, "the m"], target=[target, "a"], contrast=["xyz", None],
                         multi_token="sum")
    res = both[0]
    mine = dpa.attribute(model, TOK, PROMPT, target=target, multi_token="sum")
    theirs = dpa.attribute(model, TOK, PROMPT, target="xyz", multi_token="sum")
    n = len(PROMPT) + 1
    assert res.tokens == mine.tokens + theirs.tokens[n:]
    assert res.target_logit == pytest.approx(mine.target_logit - theirs.target_logit, abs=1e-12)
    want = torch.cat([mine.token_scores[:n] - theirs.token_scores[:n], mine.token_scores[n:], -theirs.token_scores[n:]])
    torch.testing.assert_close(res.token_scores, want, rtol=0, atol=1e-12)
    for name in ("head_scores", "neuron_scores", "expert_scores"):
        a, b, got = (getattr(r, name) for r in (mine, theirs, res))
        if got is not None:
            torch.testing.assert_close(got, a - b, rtol=0, atol=1e-12)
    assert res.completeness_gap == pytest.approx(mine.completeness_gap - theirs.completeness_gap, abs=1e-10)
    contrast = [t for t in res.target.terms if t.contrast]
    assert [t.token for t in contrast] == list("xyz") and res.target.kind == "contrast"
    assert [t.value for t in contrast] == pytest.approx([-t.value for t in theirs.target.terms], abs=1e-12)
    assert dpa.Attribution.from_json(res.to_json(precision="full")).target == res.target
    alone = dpa.attribute(model, TOK, "the m", target="a")  # the other prompt of the batch is untouched
    torch.testing.assert_close(both[1].token_scores, alone.token_scores, rtol=0, atol=1e-12)
    assert "minus those of 'xyz', 3 tokens" in repr(res)


def test_a_batch_mixes_lengths_and_one_token_targets():
    model = tiny_model("qwen2")
    both = dpa.attribute(model, TOK, [PROMPT, "the m"], target=[TARGET, "a"], multi_token="sum")
    alone = [dpa.attribute(model, TOK, PROMPT, target=TARGET, multi_token="sum"),
             dpa.attribute(model, TOK, "the m", target="a")]
    for got, want in zip(both, alone):
        assert got.tokens == want.tokens and got.target_logit == pytest.approx(want.target_logit, abs=1e-12)
        torch.testing.assert_close(got.token_scores, want.token_scores, rtol=0, atol=1e-12)
    assert both[1].target.terms is None and len(both[0].target.terms) == len(TARGET)


def test_saved_and_read_back():
    model = tiny_model("llama")
    res = dpa.attribute(model, TOK, PROMPT, target=TARGET, multi_token="sum")
    back = dpa.Attribution.from_json(res.to_json())
    assert back.target == res.target and back.target.terms[1].token == TARGET[1]


class TestRefused:
    def test_the_default_names_the_option(self):
        model = tiny_model("llama")
        with pytest.raises(TargetError, match=r"multi_token='sum'.*--multi-token sum"):
            dpa.attribute(model, TOK, PROMPT, target=TARGET)

    def test_a_position_before_the_end(self):
        with pytest.raises(InputError, match="after the whole prompt"):
            dpa.attribute(tiny_model("llama"), TOK, PROMPT, target=TARGET, multi_token="sum", position=-2)

    def test_past_the_context(self):
        model = tiny_model("llama")
        limit = model.config.max_position_embeddings
        dpa.attribute(model, TOK, "a" * (limit - 1), target="b")  # BOS + limit - 1: the whole context
        with pytest.raises(InputError, match="teacher forcing"):  # two more tokens do not fit
            dpa.attribute(model, TOK, "a" * (limit - 1), target="bcd", multi_token="sum")

    def test_position_level_scores_with_a_contrast_of_several_tokens(self):
        for option in ({"edges": True}, {"neuron_positions": True}, {"effective_targets": True}):
            with pytest.raises(InputError, match="a contrast of several tokens is read in a sequence of its own"):
                dpa.attribute(tiny_model("llama"), TOK, PROMPT, target=TARGET, contrast="xy", multi_token="sum",
                              **option)

    def test_where_sums_are_not_attributed(self):
        model = tiny_model("llama")
        with pytest.raises(InputError, match="multi_token must be 'error' or 'first' here"):
            dpa.circuit(model, TOK, PROMPT, target=TARGET, multi_token="sum")
        with pytest.raises(TargetError, match="not a single token") as err:
            dpa.circuit(model, TOK, PROMPT, target=TARGET)
        assert "'sum'" not in str(err.value)  # the option is named only where it is accepted

    def test_a_list_of_ids_is_one_target_per_prompt(self):
        with pytest.raises(InputError, match="a target of several tokens is a string, with multi_token='sum'"):
            dpa.attribute(tiny_model("llama"), TOK, PROMPT, target=[5, 6], multi_token="sum")

    def test_the_report_names_what_logprob_attributes(self):
        res = dpa.attribute(tiny_model("llama"), TOK, PROMPT, target=TARGET, multi_token="sum", kind="logprob")
        assert "sum of the logit - expected logit (p held fixed) of 't on', 4 tokens" in repr(res)

    def test_the_baselines_attribute_one_token(self):
        """No baseline sums several target tokens: the error offers nothing the baseline does not take."""
        from dpa import baselines

        model = tiny_model("llama")
        for method in (baselines.gradient, baselines.occlusion, baselines.atp):
            with pytest.raises(TargetError, match="not a single token") as err:
                method(model, TOK, PROMPT, TARGET)
            assert "multi_token" not in str(err.value)
        # DPA in the baselines' calling convention takes it, as dpa.attribute does
        got = baselines.dpa_input(model, TOK, PROMPT, TARGET, multi_token="sum")
        assert got.target.terms == dpa.attribute(model, TOK, PROMPT, TARGET, multi_token="sum").target.terms


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["target"]["terms"].pop(), "do not fit the tokens"),
    (lambda d: d["target"]["terms"][1].update(position=3), "do not fit the tokens"),
    (lambda d: d["token_ids"].__setitem__(-1, 1), "do not fit the tokens"),
    (lambda d: d["target"]["terms"][0].update(value=d["target"]["terms"][0]["value"] + 1), "add up to"),
])
def test_a_saved_result_whose_terms_do_not_fit_is_refused(edit, match):
    data = dpa.attribute(tiny_model("llama"), TOK, PROMPT, target=TARGET, multi_token="sum").to_dict()
    edit(data)
    with pytest.raises(InputError, match=match):
        dpa.Attribution.from_dict(data)


def test_a_target_of_several_tokens_without_its_space_is_hinted():
    """'New York' after a prompt ending in a word: its first token 'New' is unlikely where ' New' is likely. The
    single-token hint did not look at targets of several tokens, so the sum was attributed without a word."""
    from dpa.targets import continuation_hint

    class Words:
        vocab = {"New": 1, "York": 2, " New": 3, " York": 4}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab[w if i == 0 and not text.startswith(" ") else " " + w]
                    for i, w in enumerate(text.split())]
    probs = torch.zeros(5, dtype=torch.float64)
    probs[1], probs[3] = 1e-5, 0.2
    hint = continuation_hint(Words(), "New York", 1, probs)
    assert "did you mean ' New York'?" in hint and "with a leading space" in hint
    assert continuation_hint(Words(), " New York", 3, probs) is None  # the likely spelling: nothing to say
    probs[3] = 0.04
    assert continuation_hint(Words(), "New York", 1, probs) is None  # under 5 %: no hint
