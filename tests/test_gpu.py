"""CUDA checks (skipped without a GPU): a bf16 model with float32 targets agrees with float32 on CPU."""

import pytest
import torch

import dpa

from .conftest import random_ids, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tiny_model_cuda_float64_matches_cpu():
    model = tiny_model("qwen3", 2)
    ids = random_ids(12)
    cpu = dpa.attribute(model, None, ids, target=5, edges=True)
    gpu = dpa.attribute(model.cuda(), None, ids, target=5, edges=True)
    torch.testing.assert_close(gpu.token_scores, cpu.token_scores)
    torch.testing.assert_close(gpu.edge_scores, cpu.edge_scores)


def test_bf16_model_float32_targets():
    model = tiny_model("llama", 2).float()
    ids = random_ids(12)
    ref = dpa.attribute(model, None, ids, target=5)
    res = dpa.attribute(model.cuda().to(torch.bfloat16), None, ids, target=5)
    assert res.token_scores.dtype == torch.float32
    assert torch.corrcoef(torch.stack([res.token_scores, ref.token_scores]))[0, 1] > 0.98
    assert res.target_logit == pytest.approx(ref.target_logit, rel=0.05, abs=0.05)


@pytest.mark.slow
def test_default_model_bf16_on_cuda():
    model, tok = dpa.load_model(device="cuda", dtype=torch.bfloat16)
    res = dpa.attribute(model, tok, "The capital of France is", target=" Paris",
                        weights=dpa.PathWeights.control_content(1.0))
    assert res.target.probability > 0.5
    assert abs(res.completeness_gap) < 0.05 * abs(res.target_logit)
