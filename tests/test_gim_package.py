"""The gim-explain package as shipped (``benchmarks/mib_gim_package.py``) on MIB's graph, tiny float64 models: what
it applies and what it does not, as asserts (the module docstring there has the measurements). Skipped without
the package (an optional benchmark dependency: ``pip install gim-explain``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gim")

from dpa.errors import UnsupportedModelError  # noqa: E402
from dpa.mib.graph import Graph  # noqa: E402
from dpa.mib.methods import edge_scores  # noqa: E402
from dpa.mib.pairs import Pairs  # noqa: E402
from dpa.request import check_model  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "mib_gim_package", Path(__file__).resolve().parents[1] / "benchmarks" / "mib_gim_package.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
gim_package_scores = _module.gim_package_scores


def _pairs(metric="logit_diff", n=3, t=6):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 96, (n, t), generator=g).tolist()
    counter = torch.randint(3, 96, (n, t), generator=g).tolist()
    if metric == "prob_diff":
        return Pairs(clean, counter, [[5, 6, 9]] * n, [[7, 8]] * n, metric)
    return Pairs(clean, counter, [[5]] * n, [[7 + i] for i in range(n)])


def _model(family, attention):
    model = tiny_model(family, 2)
    model.set_attn_implementation(attention)
    return model


def _columns(graph):
    """The last layer's q, k and v readers, its MLP reader, the logits reader."""
    last, h = graph.n_layers - 1, graph.n_heads
    start = graph.attention_readers(last).start
    return (slice(start, start + h), slice(start + h, start + 2 * h), slice(start + 2 * h, start + 3 * h),
            graph.mlp_reader(last), graph.logits)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_sdpa_applies_the_qkv_scales_and_nothing_else(family):
    """Under sdpa the package is the model's own backward with the q/k/v gradient scales: no norm is frozen (HF's
    RMSNorm classes are not torch.nn.RMSNorm), no MLP rule, and the softmax temperature never reaches the fused
    kernel."""
    model, pairs = _model(family, "sdpa"), _pairs()
    graph = Graph.of(check_model(model))
    scores = gim_package_scores(model, pairs, batch_size=2)
    assert scores.shape == graph.exists.shape and scores.dtype == torch.float64
    assert bool(torch.isfinite(scores).all()) and not bool(scores[~graph.exists].any())
    eap = edge_scores(model, pairs, "eap", batch_size=2)
    gim = edge_scores(model, pairs, "gim", batch_size=2)  # dpa's GIM rules
    scale = eap.abs().max()
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * scale)  # noqa: E731
    # the temperature has no effect: T = 2 and the softmax patch off give the same scores, to the bit
    assert torch.equal(scores, gim_package_scores(model, pairs, batch_size=2, temperature=None))
    q, k, v, mlp, logits = _columns(graph)
    close(scores[:, logits], eap[:, logits])  # the final norm is not frozen
    close(scores[:, mlp], eap[:, mlp])  # no norm and no MLP rule between the last MLP's input and the logits
    close(scores[:, q], 0.25 * eap[:, q])  # the q/k/v scales at sdpa's inputs: dpa's mu_q, mu_k, mu_v
    close(scores[:, k], 0.25 * eap[:, k])
    close(scores[:, v], 0.5 * eap[:, v])
    assert (scores - eap).abs().max() > 0.1 * scale  # the scales reach the layers below
    # dpa's gim freezes the final RMSNorm: its logits reader's scores differ, by about half their size here
    assert (scores[:, logits] - gim[:, logits]).abs().max() > 0.1 * gim[:, logits].abs().max()


def test_eager_refuses_the_temperature_and_applies_nothing_without_it():
    """HF's eager attention calls softmax(..., dtype=float32), which the package's patched softmax refuses; without
    the temperature nothing of the package reaches an eager llama (no torch.nn.RMSNorm, no sdpa call): EAP."""
    model, pairs = _model("llama", "eager"), _pairs()
    with pytest.raises(UnsupportedModelError, match="softmax patch") as caught:
        gim_package_scores(model, pairs, batch_size=2)
    assert isinstance(caught.value.__cause__, TypeError) and "dtype" in str(caught.value.__cause__)
    eap = edge_scores(model, pairs, "eap", batch_size=2)
    scores = gim_package_scores(model, pairs, batch_size=2, temperature=None)
    torch.testing.assert_close(scores, eap, rtol=0, atol=1e-12 * eap.abs().max())


def test_a_hybrid_is_refused_by_name():
    """The package's rules are attention's and norms': on a Mamba-2 block's readers its scores would be EAP's."""
    model = tiny_model("bamba", 2)
    with pytest.raises(UnsupportedModelError, match="scan layers would get the model's own gradient"):
        gim_package_scores(model, _pairs(n=1), batch_size=1)


def test_the_metric_softmax_is_not_tempered():
    """The package's softmax patch is global; the probability-difference metric runs with torch's own softmax, so on
    sdpa the logits reader's scores are EAP's (the package's temperature would move them)."""
    model, pairs = _model("llama", "sdpa"), _pairs("prob_diff")
    scores = gim_package_scores(model, pairs, batch_size=2)
    eap = edge_scores(model, pairs, "eap", batch_size=2)
    logits = Graph.of(check_model(model)).logits
    torch.testing.assert_close(scores[:, logits], eap[:, logits], rtol=0, atol=1e-12 * eap.abs().max())
