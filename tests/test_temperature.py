"""GIM's softmax rule (book: circuit-discovery) as one more rule of the linearised model: the attention softmax's
backward at temperature T, grad_x = s_T * (grad_s - sum(grad_s s_T)), no 1/T; T = 1 is DPA's.

The rule runs on the model's own kernel (``linearise.tempered_attention``); the reference is dpa's explicit
attention with the formula as an autograd Function (``rules.attention.TemperedSoftmax``), itself checked against
autograd of the formula written out."""

from __future__ import annotations

import copy

import pytest
import torch

import dpa
from dpa import request as requests
from dpa.instrument import instrument
from dpa.linearise import Scores
from dpa.rules.attention import TemperedSoftmax
from dpa.weights import PathWeights
from tests.conftest import ALL_FAMILIES, MHA_ONLY, tiny_model

LAYOUT = [(f, kv) for f in ALL_FAMILIES for kv in ((4,) if f in MHA_ONLY else (4, 1))]
IDS = [11, 42, 7, 93, 5, 60, 23]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 3.0])
def test_tempered_softmax_backward_is_the_formula(temperature):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    masked = lambda: x.masked_fill(torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)[:5], float("-inf"))  # noqa: E731
    x_masked = masked()
    up = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad(TemperedSoftmax.apply(x_masked, temperature), x, up)
    s_t = torch.softmax(x_masked.detach() / temperature, -1)
    want = s_t * (up - (up * s_t).sum(-1, keepdim=True))  # section 9, no 1/T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    assert torch.equal(TemperedSoftmax.apply(x_masked, temperature), torch.softmax(x_masked, -1))
    if temperature == 1:  # the exact Jacobian
        (exact,) = torch.autograd.grad(torch.softmax(masked(), -1), x, up)
        torch.testing.assert_close(got, exact, rtol=0, atol=1e-14)


def _explicit(model, weights):
    """Token and head scores through dpa's explicit attention (the reference): the pre-cap logit difference."""
    req = requests.build(model, None, IDS, target=5, contrast=7, weights=weights)
    scores = Scores.empty(req.spec, 1, len(IDS), torch.float64, "cpu", False)
    with instrument(model, req, weights=weights, scores=scores, explicit=True) as session:
        logits = req.spec.unembed(model)(session.forward()[:, -1])
        session.backward((logits[:, 5] - logits[:, 7]).sum())
    scores.settle()
    return scores.tokens[0], scores.heads[0]


@pytest.mark.parametrize("family,kv", LAYOUT, ids=lambda p: str(p))
def test_temperature_on_the_models_own_kernel_equals_the_formula(family, kv):
    model = tiny_model(family, kv)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    w = PathWeights().with_temperature(2.0)
    tokens, heads = _explicit(model, w)
    default = dpa.attribute(model, None, IDS, target=5, contrast=7)
    for m, tol in ((model, 1e-10), (eager, 1e-6)):  # HF's eager softmax rounds to float32 (Gemma 2's: not here)
        configs = [x.__dict__["config"] for x in m.modules() if "config" in x.__dict__]
        a = dpa.attribute(m, None, IDS, target=5, contrast=7, weights=w)
        scale = float(tokens.abs().max())
        torch.testing.assert_close(a.token_scores, tokens, rtol=0, atol=tol * scale)
        torch.testing.assert_close(a.head_scores, heads, rtol=0, atol=tol * scale)
        assert [x.__dict__["config"] for x in m.modules() if "config" in x.__dict__] == configs  # put back
    if family != "gpt2" or kv != 4:  # the rule changes the scores (GPT-2's tiny attention is nearly uniform)
        assert float((default.token_scores - a.token_scores).abs().max()) > 1e-4
    one = dpa.attribute(model, None, IDS, target=5, contrast=7, weights=PathWeights(temperature=1.0))
    assert torch.equal(one.token_scores, default.token_scores)


def test_the_config_is_put_back_even_when_the_call_fails():
    model = tiny_model("llama", 2)
    before = [m.__dict__["config"] for m in model.modules() if "config" in m.__dict__]
    with pytest.raises(dpa.errors.TargetError):
        dpa.attribute(model, None, IDS, target=500, weights=PathWeights(temperature=2.0))
    with pytest.raises(KeyboardInterrupt):
        req = requests.build(model, None, IDS, target=5, weights=PathWeights(temperature=2.0))
        with instrument(model, req, weights=req.weights):
            assert model.model.layers[0].self_attn.config is not model.config
            raise KeyboardInterrupt
    assert [m.__dict__["config"] for m in model.modules() if "config" in m.__dict__] == before
    assert model.model.layers[0].self_attn.config._attn_implementation in ("sdpa", "eager")


def test_weights_keep_the_temperature_apart():
    assert PathWeights().to_dict() == {"query": 0.25, "key": 0.25, "value": 0.5, "gate": 0.5, "up": 0.5}
    w = PathWeights().with_temperature(2)
    assert w.to_dict()["temperature"] == 2.0 and PathWeights(**w.to_dict()) == w
    for bad in (0, -1, float("nan")):
        with pytest.raises(dpa.errors.InputError):
            PathWeights(temperature=bad)
