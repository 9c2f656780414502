"""Mamba-2 blocks beside attention (Bamba; book: state-space-duality), linearised by dpa's own Function (ssd.py).

The autograd suite (test_families_autograd) runs Bamba with every other family: the forward oracle, each path and the
default weights against an independent recurrence, completeness, edges summing to units, lean = full; so does the
circuit suite (test_circuit: every direct effect of the circuit graph against autograd through that recurrence).
Here: each factor of the scan alone (with the content carried through the gated norm, which the suite's single paths
cut), the conservation law of the scan (q + k + v = 1 conserves a model of Mamba-2 blocks only, with the skip at
weight one), the edges against transformers' own scan run one key at a time, padded batches, float32, the units named
by kind, what does not apply refused by name before any work, and every edit that would make the rule wrong refused
by name with the model left as it was.
"""

from __future__ import annotations

import functools

import pytest
import torch

import dpa
from dpa.families import layer_modules

from .conftest import check_batch_lean_and_float32, random_ids, tiny_model
from .test_families_autograd import autograd_scores, pre_cap_logits
from .test_hybrid import _state

TARGET = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("bamba", 2)


def test_the_layers_and_their_units(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("scan", "attention", "scan") and spec.mixed
    assert [spec.scans(i) for i in range(3)] == [True, False, True]
    mods = layer_modules(model, spec)
    assert mods[0].attention is model.model.layers[0].mamba and mods[0].heads is model.model.layers[0].mamba.out_proj
    res = dpa.attribute(model, None, random_ids(9), target=TARGET)
    assert res.layer_kinds == ["scan", "head", "scan"] and res.unit_kinds == ("scan", "head")
    assert {c.kind for c in res.top_components(12)["positive"] + res.top_components(12)["negative"]} >= {"scan"}
    assert "scan L" in res.summary() and "scan units, attention heads and MLP neurons" in res.summary()


@pytest.mark.parametrize("mu", [(1, 0, 0, 0, 1), (0, 1, 0, 0, 1), (0, 0, 1, 0, 1), (0, 0, 0, 1, 0),
                                (0.2, 0.3, 0.5, 0.4, 0.6)], ids=["C", "B", "x", "z", "mixed"])
def test_each_factor_of_the_scan_alone_equals_autograd(model, mu):
    """mu_up = 1 carries the target through the gated norm into the scan, where one factor at a time is open: the
    query (C), the key (B) or the value (x) path; or the gate z alone. Against the suite's recurrence."""
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
    tokens, heads, neurons, _, _ = autograd_scores(model, ids, mu)
    torch.testing.assert_close(res.token_scores, tokens, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.head_scores, heads, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.neuron_scores, neurons, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("mu", [(0.2, 0.3, 0.5, 0.4, 0.6), (1, 0, 0, 1, 0), (0, 1, 0, 0.5, 0.5), (0, 0, 1, 0, 1)])
def test_a_model_of_scans_conserves_whenever_query_key_and_value_sum_to_one(mu):
    """Euler's identity for the trilinear scan: on a model with no attention layer, any q + k + v = 1 with
    gate + up = 1 gives token scores and the bias share (the convolution's bias) that add up to the logit. The
    skip D x must carry weight one for this: with weight mu_value it would lose (1 - mu_value) lambda . D x."""
    model = tiny_model("bamba", 2, attn_layer_indices=[])
    assert dpa.spec_for(model).layer_kinds == ("scan",) * 3
    ids = random_ids(10)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
    logit = model(ids[None], use_cache=False).logits[0, -1, TARGET].item()  # transformers' cache needs attention
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-9, abs=1e-10)
    assert res.conserves and not res.caveats and "gap is expected" not in res.summary()


def test_the_report_says_which_weights_conserve_on_a_model_of_scans():
    model = tiny_model("bamba", 2, attn_layer_indices=[])
    res = dpa.attribute(model, None, random_ids(6), target=TARGET, weights=dpa.PathWeights(0.5, 0.5, 0.5, 0.5, 0.5))
    assert not res.conserves and "on these layers, q+k+v=1 with gate+up=1 conserves" in res.summary()
    hybrid = dpa.attribute(tiny_model("bamba", 2), None, random_ids(6), target=TARGET)  # an attention layer too
    assert not hybrid.conserves and "only q=k=0, v=1, gate+up=1 conserves" in hybrid.summary()


def test_a_padded_batch_gives_each_prompt_its_scores_alone(model):
    check_batch_lean_and_float32(model, TARGET, float32=False)


def test_lean_memory_effective_targets_and_neuron_positions(model):
    ids = random_ids(13)  # not a multiple of the chunk (4)
    full = dpa.attribute(model, None, ids, target=TARGET, memory="full", effective_targets=True,
                         neuron_positions=True)
    lean = dpa.attribute(model, None, ids, target=TARGET, memory="lean")
    torch.testing.assert_close(lean.token_scores, full.token_scores, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lean.head_scores, full.head_scores, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(full.neuron_position_scores.sum(1), full.neuron_scores, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close((full.effective_targets[0] * model.model.embed_tokens(ids)).sum(-1),
                               full.token_scores, rtol=1e-9, atol=1e-11)


def test_scan_edges_are_the_blocks_own_scan_run_one_key_at_a_time(model, monkeypatch):
    """Edge (query t, key s) of a unit of a Mamba-2 layer: lambda_t . y_t when only position s of the scan's input x
    reaches transformers' own scan (``mamba2_chunk_scan`` run on x zeroed elsewhere: its skip D x then sits at t = s
    alone), with lambda the target on y (dpa's gradient at out_proj's input times the gated norm's gamma, frozen
    scale and SiLU(z), read off the block's own forward). No arithmetic of dpa's copy."""
    from transformers.models.bamba import modeling_bamba as bamba

    from .test_hybrid import _lambda_at

    ids, layer = random_ids(9), 0  # the first layer: every query position reads
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True)
    block = model.model.layers[layer].mamba
    lam_n = _lambda_at(model, ids, block.out_proj, layer)  # [pos inner]
    seen = {}
    hooks = [block.register_forward_pre_hook(lambda _m, a, k: None if a else seen.__setitem__("h", k["hidden_states"]),
                                             with_kwargs=True),  # the model calls it with keywords
             block.norm.register_forward_pre_hook(lambda _m, a: seen.__setitem__("y", a))]  # (y, z)
    try:
        with torch.no_grad():
            model(ids[None], use_cache=False)
        y, z = (v[0] for v in seen["y"])
        gate = torch.nn.functional.silu(z)
        grouped = (y * gate).view(len(ids), -1, block.norm.group_size)
        r = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + block.norm.variance_epsilon)
        lam = lam_n * block.norm.weight * r.expand_as(grouped).flatten(1) * gate  # [pos inner]
        scan, edges = bamba.mamba2_chunk_scan, torch.zeros(4, len(ids), len(ids), dtype=torch.float64)
        for key in range(len(ids)):
            only = torch.zeros(len(ids), dtype=torch.float64)
            only[key] = 1
            monkeypatch.setattr(bamba, "mamba2_chunk_scan",
                                lambda x, *a, **k: scan(x * only[None, :, None, None], *a, **k))
            with torch.no_grad():
                block(seen["h"])
            monkeypatch.setattr(bamba, "mamba2_chunk_scan", scan)
            edges[:, :, key] = (lam * seen["y"][0][0]).view(len(ids), 4, -1).sum(-1).T
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(res.edge_scores[layer], edges, rtol=1e-9, atol=1e-12)
    assert int((edges.abs() > 1e-6).sum()) > 4 * len(ids)  # not the diagonal alone
    assert float(edges.abs().max()) > 1e-3


def test_a_float32_model_agrees_with_float64():
    """The block's own float32 scan gives the value; dpa's backward runs in float64 from it."""
    import copy

    ids = random_ids(9)
    model = tiny_model("bamba", 2)
    wide = dpa.attribute(model, None, ids, target=TARGET)
    narrow = dpa.attribute(copy.deepcopy(model).float(), None, ids, target=TARGET)
    torch.testing.assert_close(narrow.token_scores.double(), wide.token_scores, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(narrow.head_scores.double(), wide.head_scores, rtol=1e-4, atol=1e-5)


def test_what_does_not_apply_to_a_scan_is_refused_by_name_and_the_model_left_as_it_was(model):
    from dpa import baselines

    ids = random_ids(7)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[0\] is a scan layer"):
        baselines.activation_patching(model, None, ids, target=TARGET)  # an attention map
    assert _state(model) == before


def test_the_baselines_a_scan_model_supports_run(model):
    from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS, READ_ATTENTION, supports

    spec = dpa.spec_for(model)
    ids = random_ids(7)
    inputs = {name for name, fn in INPUT_METHODS.items() if supports(fn, spec)}
    components = {name for name, fn in COMPONENT_METHODS.items() if supports(fn, spec)}
    assert inputs == {"dpa", "random", "gradient", "input_x_gradient", "integrated_gradients", "occlusion"}
    assert components == {"dpa", "dpa_mid", "random"}
    assert not any(supports(fn, spec) for fn in READ_ATTENTION)
    for name, fn in INPUT_METHODS.items():
        if supports(fn, spec):
            scores = fn(model, None, ids, target=TARGET)
            assert torch.isfinite(torch.as_tensor(getattr(scores, "token_scores", scores))).all(), name


def _tanh_of(forward):
    @functools.wraps(forward)  # copies the name and the module, not the code
    def patched(self, *args, **kwargs):
        return torch.tanh(forward(self, *args, **kwargs))
    return patched


@pytest.mark.parametrize("edit, match", [
    ("patched forward", r"layers\[0\]\.mamba is a .* forward is its own"),
    ("extra parameter", r"layers\[0\]\.mamba holds the parameters"),
    ("lora in_proj", r"layers\[0\]\.mamba\.in_proj"),
    ("out_proj bias", r"layers\[0\]\.mamba\.out_proj has a bias \(inside the scan block\)"),
    ("fewer heads", r"layers\[0\]\.mamba .*heads of"),
    ("conv module", r"layers\[0\]\.mamba\.conv1d is"),
], ids=lambda x: x if " " in x else "")
def test_edits_that_break_the_rule_are_refused_by_name_and_the_model_left_as_it_was(edit, match):
    model = tiny_model("bamba", 2)
    block = model.model.layers[0].mamba
    if edit == "patched forward":
        cls = type(block)
        block.__class__ = type("Patched", (cls,), {"forward": lambda self, *a, **k: cls.forward(self, *a, **k)})
    elif edit == "extra parameter":
        block.register_parameter("scale", torch.nn.Parameter(torch.ones(1, dtype=torch.float64)))
    elif edit == "lora in_proj":
        class Lora(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x) * 1.01
        new = Lora(32, block.in_proj.out_features, bias=False).double()
        new.weight = block.in_proj.weight
        block.in_proj = new
    elif edit == "out_proj bias":
        block.out_proj.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64))
    elif edit == "fewer heads":
        block.num_heads = 2
    elif edit == "conv module":
        block.conv1d = torch.nn.Conv1d(block.conv_dim, block.conv_dim, 4, groups=block.conv_dim // 2,
                                       padding=3).double()
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    assert _state(model) == before


def test_a_step_limit_set_on_the_blocks_is_the_one_frozen():
    """The step is clamped to the block's own ``time_step_limit`` (read from the module, as its forward does): a
    limit that binds changes the mask and the factor Delta_s, in the value and in the rule alike."""
    model = tiny_model("bamba", 2)
    for i in (0, 2):
        model.model.layers[i].mamba.time_step_limit = (0.0, 0.3)
    ids, mu = random_ids(9), (0.25, 0.25, 0.5, 0.5, 0.5)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
    tokens, heads, *_ = autograd_scores(model, ids, mu)
    torch.testing.assert_close(res.token_scores, tokens, rtol=1e-9, atol=1e-11)
    free = dpa.attribute(tiny_model("bamba", 2), None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
    assert not torch.allclose(free.token_scores, res.token_scores, rtol=1e-3)


@pytest.mark.parametrize("patch", ["scan function", "conv function", "block class wrapped", "gated norm class"])
def test_patches_made_after_a_first_call_are_refused_by_name(patch, monkeypatch):
    """A function of the modelling file or a class's forward patched after dpa checked the model once: the block is
    probed again against dpa's copy (the checks' cache keys on each class's forward and its file's functions)."""
    from transformers.models.bamba import modeling_bamba as bamba

    model = tiny_model("bamba", 2)
    ids = random_ids(7)
    dpa.attribute(model, None, ids, target=TARGET)
    scan, conv = bamba.mamba2_chunk_scan, bamba.causal_conv1d_fn
    change = {"scan function": (bamba, "mamba2_chunk_scan", lambda h, *a, **k: 1.01 * scan(h, *a, **k)),
              "conv function": (bamba, "causal_conv1d_fn", lambda h, w, b=None, activation=None, **k:
                                conv(h, w, b, activation="relu")),
              "block class wrapped": (bamba.BambaMixer, "forward", _tanh_of(bamba.BambaMixer.forward)),
              "gated norm class": (bamba.BambaRMSNormGated, "forward", _tanh_of(bamba.BambaRMSNormGated.forward))}
    owner, name, value = change[patch]
    monkeypatch.setattr(owner, name, value)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match="forward is its own|does not compute the Mamba-2 block"):
        dpa.attribute(model, None, ids, target=TARGET)
    assert _state(model) == before


@pytest.mark.parametrize("change", ["scan across chunks", "forward behind a hook", "activation remapped"])
def test_a_block_computing_another_output_on_the_call_itself_is_refused(change, monkeypatch):
    """What the probe of a short input cannot see, the call's own input does: dpa's copy of each block must give the
    block's own output on it (``ssd.LinearisedScan``). A scan wrong only across a chunk boundary, a forward changed
    behind accelerate's hook after a first call, the SiLU the convolution looks up by name remapped after one."""
    from transformers import activations
    from transformers.models.bamba import modeling_bamba as bamba

    model = tiny_model("bamba", 2, mamba_chunk_size=8)
    ids = random_ids(20, seed=3)
    dpa.attribute(model, None, ids, target=TARGET)  # checked and cached
    scan = bamba.mamba2_chunk_scan
    if change == "scan across chunks":  # each chunk scanned from a zero state: right on inputs of one chunk
        def per_chunk(h, dt, A, B, C, chunk_size, **kw):
            if h.shape[1] <= chunk_size:
                return scan(h, dt, A, B, C, chunk_size=chunk_size, **kw)
            return torch.cat([scan(h[:, i:i + chunk_size], dt[:, i:i + chunk_size], A, B[:, i:i + chunk_size],
                                   C[:, i:i + chunk_size], chunk_size=chunk_size, **kw)
                              for i in range(0, h.shape[1], chunk_size)], dim=1)
        monkeypatch.setattr(bamba, "mamba2_chunk_scan", per_chunk)
    elif change == "forward behind a hook":
        from accelerate.hooks import AlignDevicesHook, add_hook_to_module

        block = model.model.layers[0].mamba
        add_hook_to_module(block, AlignDevicesHook(execution_device="cpu"))
        old = block._old_forward
        block._old_forward = lambda *a, **k: old(*a, **k) * 1.5
    else:
        silu = dict.__getitem__(activations.ACT2FN, "silu")
        monkeypatch.setitem(activations.ACT2FN, "silu", lambda: (lambda x: x * torch.sigmoid(1.2 * x)))
        assert dict.__getitem__(activations.ACT2FN, "silu") is not silu
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[\d\]\.mamba \(BambaMixer\) (computed|returned) "
                                                        r"another output"):
        dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    assert _state(model) == before


def test_a_step_limit_without_an_upper_bound_is_read_as_none():
    model = tiny_model("bamba", 2)
    for i in (0, 2):  # transformers clamps with max=None: no bound
        model.model.layers[i].mamba.time_step_limit = (0.0, None)
    ids = random_ids(8)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5))
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-9, abs=1e-10)


@pytest.mark.parametrize("overrides, match", [
    (dict(mamba_proj_bias=True), r"mamba_proj_bias.*state-space-duality"),
])
def test_configs_the_rule_does_not_describe_are_refused(overrides, match):
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(tiny_model("bamba", 2, **overrides), None, random_ids(5), target=TARGET)


@pytest.mark.parametrize("overrides", [dict(mamba_conv_bias=False), dict(mamba_n_groups=1),
                                       dict(mamba_n_heads=8, mamba_d_head=8), dict(attn_layer_indices=[0, 1, 2])],
                         ids=["no conv bias", "one group", "8 ssm heads", "attention only"])
def test_the_settings_the_rule_covers_conserve(overrides):
    """Without the convolution's bias, with one group of B and C, with two SSM heads per unit (8 heads for the
    4 attention heads' places), with no Mamba-2 layer at all: completeness under the value path, to 1e-10."""
    model = tiny_model("bamba", 2, **overrides)
    ids = random_ids(10)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.3, 0.7))
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(logit, rel=1e-9, abs=1e-10)
    assert res.head_scores.shape == (3, 4)


def test_the_circuit_graph_names_the_scan_units(model):
    circ = dpa.circuit(model, None, random_ids(5), target=TARGET, nodes=None)
    labels = [n.label for n in circ.nodes if n.kind == "head"]
    assert any(label.startswith("L0.S") for label in labels) and any(label.startswith("L1.H") for label in labels)


def test_the_widget_payload_names_the_scan_units(model):
    from dpa_widgets.payload import unit_layout

    res = dpa.attribute(model, None, random_ids(9), target=TARGET, effective_targets=True)
    assert unit_layout(res) == {"layer_kinds": ["scan", "head", "scan"], "unit_letters": {"scan": "S", "head": "H"},
                                "unit_kinds": ["scan", "head"],  # (the kinds in the result's order)
                                "unit_widths": {}}  # a scan unit groups the block's inner channels, not d_model's


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid"])
@pytest.mark.parametrize("closed", ["query", "key", "value"])
def test_mibs_readers_of_a_scan_unit_carry_their_factors(family, closed):
    """MIB's graph gives a scan unit three readers, as a head: the query reads z and C, the key B and the step, the
    value x (``ssd_shape.factor_columns``). DPA's edges into a reader whose factors' paths are all closed vanish, the others
    do not: each reader's gradient is its own factors' (the DPA edges summing to the units' scores is test_mib's). The
    query's z is the gate (mu_gate), the value's x also feeds the skip D x (weight one: D zeroed here)."""
    from dpa.mib.graph import Graph
    from dpa.mib.methods import edge_scores
    from dpa.request import check_model

    from .test_mib import _pairs

    model = tiny_model(family, 2)
    if closed == "value":
        for i in dpa.spec_for(model).scan_layers:
            layer_modules(model, dpa.spec_for(model))[i].attention.D.zero_()
    graph = Graph.of(check_model(model))
    mu = {"query": 0.5, "key": 0.25, "value": 0.25, "gate": 0.5, "up": 0.5, closed: 0.0,
          **({"gate": 0.0} if closed == "query" else {})}
    scores = edge_scores(model, _pairs(n=2), "dpa", batch_size=2, weights=dpa.PathWeights(**mu))
    spec = dpa.spec_for(model)
    for layer in spec.scan_layers:
        for c, name in enumerate(("query", "key", "value")):
            into = scores[:, [graph.reads(layer, c, h) for h in range(spec.n_heads)]]
            if name == closed:
                assert into.abs().max() == 0
            else:
                assert into.abs().max() > 1e-6
