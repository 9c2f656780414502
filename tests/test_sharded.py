"""Models split across devices with a device map (accelerate's dispatch, as device_map="auto" does).

On CPU the two "devices" are both the CPU: this checks that dispatch hooks (``force_hooks``: accelerate adds none for
a map on one device) do not disturb the instrumented forward or the backward. With CUDA the layers are split between the GPU and the CPU, each run where
its weights are (``main_device="cpu"``), so the backward crosses devices at a layer boundary. accelerate's default
(and from_pretrained's device_map) makes "cpu" beside a GPU an offload instead: weights on the meta device, loaded
for each forward; dpa refuses that by name.
"""

import pytest
import torch
from accelerate import dispatch_model

import dpa

from .conftest import random_ids, tiny_model


def split_map(model, devices):
    n = len(model.model.layers)
    layout = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    for i in range(n):
        layout[f"model.layers.{i}"] = devices[0] if i < n // 2 else devices[1]
    layout.update({"model.norm": devices[1], "lm_head": devices[1]})
    return layout


DEVICES = [("cpu", "cpu")] + ([("cuda:0", "cpu"), ("cpu", "cuda:0")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("devices", DEVICES, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("memory", ["full", "lean"])
def test_sharded_equals_single_device(family, devices, memory):
    ids = random_ids(10)
    ref = dpa.attribute(tiny_model(family, 2), None, ids, target=5, edges=True, effective_targets=True)
    model = tiny_model(family, 2)
    sharded = dispatch_model(model, device_map=split_map(model, devices), main_device="cpu", force_hooks=True)
    res = dpa.attribute(sharded, None, ids, target=5, edges=True, effective_targets=True, memory=memory)
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "effective_targets"):
        torch.testing.assert_close(getattr(res, name), getattr(ref, name), msg=name)
    if "cuda:0" in devices:
        layers = model.model.layers
        assert {layers[0].self_attn.q_proj.weight.device.type, layers[-1].self_attn.q_proj.weight.device.type} == {
            "cuda", "cpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_beside_a_gpu_is_an_offload_and_refused_by_name():
    model = tiny_model("llama", 2)
    sharded = dispatch_model(model, device_map=split_map(model, ("cuda:0", "cpu")))
    with pytest.raises(dpa.ModelStateError, match="offloaded"):
        dpa.attribute(sharded, None, random_ids(10), target=5)


SPLITS = [("cuda:0", "cpu"), ("cpu", "cuda:0")] if torch.cuda.is_available() else []


@pytest.mark.parametrize("devices", SPLITS, ids=lambda d: "+".join(d))
def test_circuits_on_a_split_model_equal_one_device(devices):
    """Across a device boundary: a circuit graph equals one device's; MIB's run refuses the split by name."""
    from dpa.mib.methods import edge_scores

    from .test_mib import _pairs

    ids = random_ids(10)
    ref = tiny_model("qwen3", 2)
    model = tiny_model("qwen3", 2)
    split = dispatch_model(model, device_map=split_map(model, devices), main_device="cpu")
    a, b = dpa.circuit(ref, None, ids, 5, nodes=8), dpa.circuit(split, None, ids, 5, nodes=8)
    assert [(n.kind, n.layer, n.index, n.position) for n in a.nodes] == [
        (n.kind, n.layer, n.index, n.position) for n in b.nodes]
    torch.testing.assert_close(b.edges.cpu(), a.edges)
    with pytest.raises(dpa.UnsupportedModelError, match="split across"):  # MIB's run keeps to one device
        edge_scores(split, _pairs(n=2), "dpa-cf", batch_size=2)
