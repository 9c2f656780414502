"""Targets (token, contrast, log-prob, vector) and the errors for bad input."""

import json
import math

import pytest
import torch

import dpa
from dpa.targets import token_id

from .conftest import random_ids, tiny_model
from .reference import reference_forward


class FakeTokenizer:
    """Splits on characters: 'a' is one token, 'ab' two."""

    all_special_ids = [0]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 31 for c in text]  # printable ASCII -> 1..95

    def decode(self, ids):
        return "".join(chr(i - 1 + 32) for i in ids)

    def __call__(self, text):
        return {"input_ids": [0] + self.encode(text)}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 2)


class TestTargets:
    def test_contrast_is_difference(self, model):
        ids = random_ids(8)
        a = dpa.attribute(model, None, ids, target=5)
        b = dpa.attribute(model, None, ids, target=9)
        c = dpa.attribute(model, None, ids, target=5, contrast=9)
        torch.testing.assert_close(c.token_scores, a.token_scores - b.token_scores)
        assert c.target.kind == "contrast" and c.target_logit == pytest.approx(a.target_logit - b.target_logit)

    def test_logprob_target_is_gradient_with_p_fixed(self, model):
        ids = random_ids(8)
        res = dpa.attribute(model, None, ids, target=5, kind="logprob", effective_targets=True)
        emb = model.model.embed_tokens(ids[None]).detach().requires_grad_(True)
        logits = reference_forward(model, emb, mu=(0.25, 0.25, 0.5, 0.5, 0.5))[0, -1] @ model.lm_head.weight.T
        p = logits.softmax(-1).detach()
        (logits[5] - (p * logits).sum()).backward()  # d log p(y) with p held fixed
        torch.testing.assert_close(res.effective_targets[0], emb.grad[0])
        assert res.target.logprob == pytest.approx(float(logits.detach().log_softmax(-1)[5]))

    def test_vector_target(self, model):
        ids = random_ids(8)
        vec = model.lm_head.weight[5].clone()
        torch.testing.assert_close(dpa.attribute(model, None, ids, target=vec).token_scores,
                                   dpa.attribute(model, None, ids, target=5).token_scores)

    def test_default_target_is_prediction(self, model):
        ids = random_ids(8)
        res = dpa.attribute(model, None, ids)
        assert res.target.token_id == int(model(ids[None]).logits[0, -1].argmax())
        assert res.target.probability == pytest.approx(res.top_predictions[0][1])

    def test_string_prompt_and_special_tokens(self, model):
        res = dpa.attribute(model, FakeTokenizer(), "abc", target="d")
        assert len(res.tokens) == 4 and res.special == [True, False, False, False]

    def test_json_round_trip(self, model):
        res = dpa.attribute(model, None, random_ids(6), target=3, edges=True)
        back = dpa.Attribution.from_dict(__import__("json").loads(res.to_json()))
        for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):  # float64 stays float64, exactly
            assert torch.equal(getattr(back, name), getattr(res, name)), name
        assert back.target == res.target and back.weights == res.weights

    def test_json_is_strict_and_keeps_non_finite_values(self, model):
        res = dpa.attribute(model, None, random_ids(6), target=3)
        res.head_scores[0, 0] = float("nan")
        res.neuron_scores[1, 2] = float("-inf")
        text = res.to_json()
        assert "NaN" not in text and "Infinity" not in text  # strict JSON (JSON.parse accepts it)
        back = dpa.Attribution.from_json(text)
        assert back.head_scores[0, 0].isnan() and back.neuron_scores[1, 2].isnan()  # null: not a number
        assert torch.equal(back.token_scores, res.token_scores)

    def test_truncated_neurons_refuse_top_neurons_clearly(self, model, tmp_path):
        res = dpa.attribute(model, None, random_ids(6), target=3)
        path = tmp_path / "r.json"
        res.to_json(str(path), top_neurons=3)
        back = dpa.Attribution.from_json(str(path))
        assert back.top_components(3, kinds=("head",))["positive"] == res.top_components(3, kinds=("head",))["positive"]
        with pytest.raises(dpa.InputError, match="top_neurons=3"):
            back.top_components(4)

    @pytest.mark.parametrize("k", [1, 3, 8])
    def test_top_neurons_keep_the_top_components_exact(self, model, k):
        """A result saved with top_neurons=k ranks heads and neurons together exactly as the full one, up to k:
        the k most positive (negative) neurons overall are among each layer's k most positive (negative)."""
        res = dpa.attribute(model, None, random_ids(6), target=3)
        back = dpa.Attribution.from_json(res.to_json(top_neurons=k))
        assert back.neuron_scores is None and back.neuron_top.k == k
        for j in range(k + 1):
            assert back.top_components(j) == res.top_components(j), j
        assert back.neuron_top.total == pytest.approx(res.neuron_scores.sum(1).tolist(), rel=1e-12, abs=1e-12)
        again = dpa.Attribution.from_json(back.to_json())
        assert again.neuron_top == back.neuron_top, "a result read back writes its neurons again"

    def test_top_neurons_read_with_checks(self, model):
        res = dpa.attribute(model, None, random_ids(6), target=3)
        good = res.to_dict(top_neurons=2)
        layers = len(good["top_neurons"]["index"])

        def bad(**change):
            data = json.loads(json.dumps(good))
            data["top_neurons"].update(change)
            return data

        first = good["top_neurons"]["index"][0]
        cases = [(bad(index=good["top_neurons"]["index"][:-1]), f"top_neurons.index must be {layers} lists"),
                 (bad(index=[[10**6] + r[1:] if r else r for r in good["top_neurons"]["index"]]), "out of"),
                 (bad(index=[[first[0]] * len(first)] + good["top_neurons"]["index"][1:]) if len(first) > 1 else None,
                  "given twice"),
                 (bad(k=0), "top_neurons.k"), (bad(total=[1.0]), "top_neurons.total"), (bad(extra=1), "top_neurons.extra"),
                 (bad(k=1), "more than k = 1"),
                 ({**good, "neuron_scores": res.neuron_scores.tolist()}, "not both")]
        for data, message in cases:
            if data is None:
                continue
            with pytest.raises(dpa.InputError, match=message):
                dpa.Attribution.from_dict(data)
        old = {**good, "top_neurons": {"index": [[0]] * layers, "score": [[0.1]] * layers, "d_mlp": 8}}
        with pytest.raises(dpa.InputError, match="older format .* delete the top_neurons field"):
            dpa.Attribution.from_dict(old)
        for wrong in ("top", [1, 2]):
            with pytest.raises(dpa.InputTypeError, match="top_neurons must be an object"):
                dpa.Attribution.from_dict({**good, "top_neurons": wrong})
        assert dpa.Attribution.from_dict({**good, "top_neurons": None}).neuron_top is None
        few = json.loads(json.dumps(good))  # k = 2 said, but a layer keeps fewer of both signs: its total must be theirs
        few["top_neurons"]["index"][0], few["top_neurons"]["score"][0] = [], []
        with pytest.raises(dpa.InputError, match="does not fit the kept scores' sum"):
            dpa.Attribution.from_dict(few)
        inflated = json.loads(json.dumps(good))
        inflated["top_neurons"]["k"] = 100  # claims more were kept than there are
        with pytest.raises(dpa.InputError, match="does not fit"):
            dpa.Attribution.from_dict(inflated)

    def test_top_neurons_of_odd_scores(self, model):
        """NaN has no rank and JSON writes an infinity as null: saving the top refuses both by name; a smaller k
        is taken from the top a result was read with; a k beyond d_mlp keeps every neuron once."""
        res = dpa.attribute(model, None, random_ids(6), target=3)
        for bad in (float("nan"), float("inf")):
            odd = dpa.Attribution.from_dict(res.to_dict())
            odd.neuron_scores[0, 0] = bad
            with pytest.raises(dpa.InputError, match="NaN or an infinity"):
                odd.to_json(top_neurons=4)
        back = dpa.Attribution.from_dict(json.loads(res.to_json(top_neurons=4)))
        smaller = dpa.Attribution.from_json(back.to_json(top_neurons=2)).neuron_top
        assert smaller.k == 2 and smaller.index == back.neuron_top.smaller(2).index
        assert dpa.Attribution.from_json(res.to_json(top_neurons=10**6)).neuron_top.k == res.neuron_scores.shape[1]

    def test_top_components(self, model):
        res = dpa.attribute(model, None, random_ids(6), target=3)
        top = res.top_components(4)
        scores = torch.cat([res.head_scores.flatten(), res.neuron_scores.flatten()])
        assert top["positive"][0].score == pytest.approx(float(scores.max()))
        assert top["negative"][0].score == pytest.approx(float(scores.min()))
        assert [c.score for c in top["positive"]] == sorted((c.score for c in top["positive"]), reverse=True)


class TestBadInput:
    def test_empty_prompt(self, model):
        with pytest.raises(dpa.InputError, match="empty"):
            dpa.attribute(model, FakeTokenizer(), "   ", target=1)
        with pytest.raises(dpa.InputError, match="empty"):
            dpa.attribute(model, None, torch.tensor([], dtype=torch.long), target=1)

    def test_too_long(self, model):
        with pytest.raises(dpa.InputError, match="65 tokens, more than the model's context of 64"):
            dpa.attribute(model, None, random_ids(65), target=1)

    def test_multi_token_target_says_how_it_splits(self, model):
        with pytest.raises(dpa.TargetError, match=r"splits into 2 tokens \['a', 'b'\]"):
            dpa.attribute(model, FakeTokenizer(), "xyz", target="ab")
        res = dpa.attribute(model, FakeTokenizer(), "xyz", target="ab", multi_token="first")
        assert res.target.token == "a"

    def test_bad_ids(self, model):
        with pytest.raises(dpa.TargetError, match="outside the vocabulary"):
            token_id(None, 1000, 96)
        with pytest.raises(dpa.TargetError, match="same token"):
            dpa.attribute(model, None, random_ids(5), target=3, contrast=3)

    def test_bad_position(self, model):
        with pytest.raises(dpa.InputError, match="position 9"):
            dpa.attribute(model, None, random_ids(5), target=3, position=9)

    def test_bad_weights(self):
        with pytest.raises(ValueError, match="finite"):
            dpa.PathWeights(query=float("nan"))
        with pytest.raises(ValueError, match="five"):
            dpa.PathWeights.parse("1,2")


class TestPathWeights:
    @pytest.mark.parametrize("family", ["control_content", "attention", "query_key", "mlp"])
    @pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
    def test_families_are_constrained(self, family, p):
        assert dpa.PathWeights.preset(family, p).constrained

    def test_table(self):
        assert dpa.PathWeights.query_key(1.0).as_tuple() == (0.5, 0.0, 0.5, 0.5, 0.5)
        assert dpa.PathWeights.control_content(1.0).conservative
        assert dpa.PathWeights() == dpa.PathWeights.control_content(0.5)
