"""The default model (SmolLM2-135M-Instruct, float32 on CPU): completeness and sanity of real attributions."""

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
        batch = dpa.attribute(model, tok, prompts, target=" Paris", padding_side="left")
        for p, b in zip(prompts, batch):
            single = dpa.attribute(model, tok, p, target=" Paris")
            torch.testing.assert_close(b.token_scores, single.token_scores, rtol=1e-4, atol=1e-4)
