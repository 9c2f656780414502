import pytest
import torch
from torch.func import vjp
from torch.nn import functional as F

from dpa.rules.hand import glu_forward, neuron_position_scores, propagate_glu
from dpa.rules.norm import rms_scale

D, I = 16, 24


@pytest.fixture
def block():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = r(2, 5, D)
    return dict(x=x, w_gate=r(I, D) / 4, w_up=r(I, D) / 4, w_down=r(D, I) / 4, gamma=1 + r(D) / 3,
                scale=rms_scale(x, 1e-6), target=r(2, 5, D))


def modified_glu(b, mu_up, mu_gate):
    """Reference: the GLU with frozen norm scale and sigmoid, branches scaled mu x in backward."""
    def f(x):
        xn = b["gamma"] * x * b["scale"]
        s, u = xn @ b["w_gate"].T, xn @ b["w_up"].T
        s_d, u_d = s.detach(), u.detach()
        sig = torch.sigmoid(s_d)
        up_branch = F.silu(s_d) * u  # gate frozen
        gate_branch = s * sig * u_d  # sigmoid and u frozen
        # value equals the block output; the gradient is mu_up * up path + mu_gate * gate path
        return (mu_up * up_branch + mu_gate * gate_branch) @ b["w_down"].T
    return f


class TestGLUPaths:
    @pytest.mark.parametrize("mu_up,mu_gate", [(1, 0), (0, 1), (0.5, 0.5), (0.3, 0.9)])
    def test_matches_autograd_on_modified_block(self, block, mu_up, mu_gate):
        b = block
        s, u, _ = glu_forward(b["gamma"] * b["x"] * b["scale"], b["w_gate"], b["w_up"], b["w_down"])
        g, _ = propagate_glu(b["target"], s, u, b["w_gate"], b["w_up"], b["w_down"], b["gamma"], b["scale"],
                             up=mu_up, gate=mu_gate)
        _, pull = vjp(modified_glu(b, mu_up, mu_gate), b["x"])
        torch.testing.assert_close(g, pull(b["target"])[0])

    @pytest.mark.parametrize("path", ["up", "gate"])
    def test_each_path_reproduces_block_output(self, block, path):
        b = block
        s, u, out = glu_forward(b["gamma"] * b["x"] * b["scale"], b["w_gate"], b["w_up"], b["w_down"])
        g, lam = propagate_glu(b["target"], s, u, b["w_gate"], b["w_up"], b["w_down"], b["gamma"], b["scale"],
                               up=float(path == "up"), gate=float(path == "gate"))
        # x . g_path = t . out  (per position), and sum of neuron scores = t . out
        torch.testing.assert_close((b["x"] * g).sum(-1), (b["target"] * out).sum(-1))
        torch.testing.assert_close(neuron_position_scores(s, u, lam).sum(-1), (b["target"] * out).sum(-1))

    def test_differs_from_true_gradient(self, block):
        b = block
        xn = b["gamma"] * b["x"] * b["scale"]
        s, u, _ = glu_forward(xn, b["w_gate"], b["w_up"], b["w_down"])
        g, _ = propagate_glu(b["target"], s, u, b["w_gate"], b["w_up"], b["w_down"], b["gamma"], b["scale"],
                             up=1.0, gate=1.0)
        _, pull = vjp(lambda x: glu_forward(b["gamma"] * x * b["scale"], b["w_gate"], b["w_up"], b["w_down"])[2],
                      b["x"])
        # the true gradient uses SiLU'(s), DPA's gate path sigmoid(s): they differ
        assert (g - pull(b["target"])[0]).abs().max() > 1e-3

    def test_sigmoid_is_silu_over_s(self):
        s = torch.linspace(-5, 5, 101, dtype=torch.float64)
        s = s[s != 0]
        torch.testing.assert_close(torch.sigmoid(s), F.silu(s) / s)
