"""CUDA checks (skipped without a GPU): a bf16 model with float32 targets agrees with float32 on CPU; the
benchmark's methods and curves on CUDA equal the CPU's."""

import json

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


def _close(a, b, name):
    if a is None or b is None:
        assert a is None and b is None, name
    else:
        torch.testing.assert_close(a.cpu(), b.cpu(), msg=lambda m, w=name: f'{w}: {m}')


@pytest.mark.parametrize("unit", ["input", "component"])
def test_every_baseline_on_cuda_matches_cpu(unit):
    """The benchmark's methods keep their tensors on the model's device and give the CPU's scores."""
    from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS

    cpu_model, gpu_model = tiny_model("llama", 2), tiny_model("llama", 2).cuda()
    ids = random_ids(7).tolist()
    for name, fn in (INPUT_METHODS if unit == "input" else COMPONENT_METHODS).items():
        cpu, gpu = fn(cpu_model, None, ids, 5), fn(gpu_model, None, ids, 5)
        for field in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores"):
            _close(getattr(gpu, field), getattr(cpu, field), f"{name}.{field}")


def test_curves_on_cuda_match_cpu_in_both_protocols():
    from dpa.baselines import COMPONENT_METHODS
    from dpa.evaluate import COMPONENT_GRID, Sample
    from dpa.evaluate.curves import component_curves, component_units

    cpu_model, gpu_model = tiny_model("llama", 2), tiny_model("llama", 2).cuda()
    ids = random_ids(6).tolist()
    sample = Sample("x", ids, [False] + [True] * 5, 5, None)
    for method in ("dpa", "attn_only"):
        res = COMPONENT_METHODS[method](cpu_model, None, ids, 5)
        for protocol in ("clean", "paper"):
            units = component_units(sample, 3, 4, 48, "fine", protocol=protocol, method=method)
            a = component_curves(cpu_model, sample, res, units, COMPONENT_GRID)
            b = component_curves(gpu_model, sample, res, units, COMPONENT_GRID)
            assert a.n_units == b.n_units
            for x, y in ((a, b), (a.native, b.native)):
                assert x.disruption == pytest.approx(y.disruption) and x.recovery == pytest.approx(y.recovery)


def test_bf16_evaluation_on_cuda_takes_the_paper_softmax_in_bf16(tmp_path):
    """A bf16 model on CUDA, as the paper ran: both protocols measured, the paper's from a bf16 softmax."""
    from dpa.evaluate import Settings, evaluate

    from .test_evaluate import tiny_dataset, word_tokenizer

    model = tiny_model("llama", 2)
    tiny_dataset(model, tmp_path / "data", n=3)
    model = model.cuda().to(torch.bfloat16)
    for unit in ("input", "component"):
        settings = Settings(dataset="known_1000", unit=unit, methods=("dpa", "random", "gradient"),
                            min_probability=0.0, filter="length", data_dir=str(tmp_path / "data"))
        results = evaluate(model, word_tokenizer(), settings, tmp_path / unit, progress=False, figures=False)
        assert results["dtype"] == "torch.bfloat16" and not results["device"].startswith("cpu")
        rows = [json.loads(x) for x in (tmp_path / unit / "samples.jsonl").read_text().splitlines()]
        assert all(r["paper_p_clean"] > 0 and r["p_clean"] > 0 for r in rows)
        assert any(r["paper_p_clean"] != r["p_clean"] for r in rows)  # bf16 softmax vs float32 softmax


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_mib_edge_scores_and_curves_on_cuda_match_cpu(family):
    """MIB: every method's edge scores, and the one-pass patched evaluation, on CUDA equal the CPU's (float64, to
    float32's precision: HF computes the rotary tables, and Gemma its norms, in float32 even in a float64 model, and
    CUDA rounds those float32 steps differently from the CPU; measured 2026-11-27 on an H200, up to 3e-6 relative)."""
    from dpa.mib.evaluate import evaluate
    from dpa.mib.methods import edge_scores

    from .test_mib import _pairs

    cpu, gpu = tiny_model(family, 1), tiny_model(family, 1).cuda()
    pairs = _pairs(n=3)
    for method in ("dpa", "dpa-cf", "eap", "eap-ig", "gim", "dpa-ig", "random"):
        a = edge_scores(cpu, pairs, method, batch_size=2)
        b = edge_scores(gpu, pairs, method, batch_size=2)
        assert b.device.type == "cpu", method
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()),
                                   msg=lambda m, w=method: f'{w}: {m}')
    scores = edge_scores(cpu, pairs, "dpa-cf", batch_size=2)
    x, y = evaluate(cpu, pairs, scores, batch_size=2), evaluate(gpu, pairs, scores, batch_size=2)
    for c, d in ((x.cpr_curve, y.cpr_curve), (x.cmd_curve, y.cmd_curve)):
        torch.testing.assert_close(d.f, c.f, rtol=1e-5, atol=1e-6)
    assert y.cpr_curve.f[-1].item() == 1.0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float32_on_cudas_fused_attention_matches_float64(family):
    """float32 on CUDA runs SDPA's fused kernels (not the math path float64 takes): DPA's scores and GIM's
    tempered edges through them agree with the float64 CPU reference to float32's precision."""
    from dpa.mib.methods import edge_scores

    from .test_mib import _pairs

    ref = tiny_model(family, 2)
    gpu = tiny_model(family, 2).float().cuda()
    assert gpu.config._attn_implementation == "sdpa"
    ids = random_ids(24)
    a = dpa.attribute(ref, None, ids, target=5, edges=True)
    b = dpa.attribute(gpu, None, ids, target=5, edges=True)
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
        x, y = getattr(a, name), getattr(b, name)
        torch.testing.assert_close(y.double().cpu(), x, rtol=1e-3, atol=1e-4 * float(x.abs().max()),
                                   msg=lambda m, w=name: f'{w}: {m}')
    pairs = _pairs(n=2)
    for method in ("dpa-cf", "gim"):
        x = edge_scores(ref, pairs, method, batch_size=2)
        y = edge_scores(gpu, pairs, method, batch_size=2)
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-4 * float(x.abs().max()),
                                   msg=lambda m, w=method: f'{w}: {m}')


def test_bf16_mib_evaluation_on_cuda_keeps_its_ends_exact():
    """A bf16 model on CUDA: f(empty) = 0 and f(full) = 1 exactly (the same code with no / every edge excluded)
    and the areas near float32's."""
    from dpa.mib.evaluate import evaluate
    from dpa.mib.methods import edge_scores

    from .test_mib import _pairs

    model = tiny_model("llama", 2).float()
    pairs = _pairs(n=4)
    scores = edge_scores(model, pairs, "dpa-cf", batch_size=2)
    ref = evaluate(model, pairs, scores, batch_size=4)
    res = evaluate(model.cuda().to(torch.bfloat16), pairs, scores, batch_size=4)
    for curve in (res.cpr_curve, res.cmd_curve):
        assert curve.f[0].item() == 0.0 and curve.f[-1].item() == 1.0
    assert res.cpr == pytest.approx(ref.cpr, abs=0.1) and res.cmd == pytest.approx(ref.cmd, abs=0.1)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_circuit_on_cuda_matches_cpu(family):
    cpu, gpu = tiny_model(family, 1), tiny_model(family, 1).cuda()
    ids = random_ids(10)
    a, b = dpa.circuit(cpu, None, ids, 5, nodes=8), dpa.circuit(gpu, None, ids, 5, nodes=8)
    assert [(n.kind, n.layer, n.index, n.position) for n in a.nodes] == [
        (n.kind, n.layer, n.index, n.position) for n in b.nodes]
    torch.testing.assert_close(b.edges.cpu(), a.edges, rtol=1e-5, atol=1e-5 * float(a.edges.abs().max()))
    edge = next((a.nodes[i].label, a.nodes[j].label) for i, j in zip(*torch.nonzero(a.edges, as_tuple=True))
                if a.nodes[i].kind in ("head", "neuron") and a.nodes[j].kind in ("head", "neuron", "target"))
    x, y = a.verify(cpu, None, edge), b.verify(gpu, None, edge)  # path patching on the GPU model
    for key in ("edge", "first_order", "direct", "target"):
        assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-8), key
