import torch
from torch.func import vjp
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dpa.rules.norm import apply_norm, rms_scale

from dpa.rules.hand import pull_back_norm

torch.manual_seed(0)


class TestFrozenRMSNorm:
    def test_scale_matches_hf_norm(self):
        x = torch.randn(2, 5, 16, dtype=torch.float32)
        norm = LlamaRMSNorm(16, eps=1e-5)
        norm.weight.data = torch.randn(16)
        torch.testing.assert_close(apply_norm(x, norm.weight, rms_scale(x, 1e-5)), norm(x))

    def test_pull_back_is_the_transpose(self):
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        gamma = torch.randn(16, dtype=torch.float64)
        scale = rms_scale(x, 1e-6)
        t = torch.randn_like(x)
        _, pull = vjp(lambda y: apply_norm(y, gamma, scale), x)
        torch.testing.assert_close(pull_back_norm(t, gamma, scale), pull(t)[0])

    def test_frozen_pull_back_differs_from_true_gradient(self):
        x = torch.randn(3, 16, dtype=torch.float64)
        gamma = torch.randn(16, dtype=torch.float64)
        t = torch.randn_like(x)
        _, pull = vjp(lambda y: gamma * y * rms_scale(y, 1e-6), x)
        assert (pull_back_norm(t, gamma, rms_scale(x, 1e-6)) - pull(t)[0]).abs().max() > 1e-3

    def test_frozen_norm_is_linear_and_exact_at_x(self):
        x = torch.randn(4, 16, dtype=torch.float64)
        gamma = torch.randn(16, dtype=torch.float64)
        scale = rms_scale(x, 1e-6)
        t = torch.randn_like(x)
        # t . norm(x) == pull_back(t) . x : the norm output is a linear function of x at frozen scale
        torch.testing.assert_close((t * apply_norm(x, gamma, scale)).sum(), (pull_back_norm(t, gamma, scale) * x).sum())
