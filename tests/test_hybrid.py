"""Hybrid families (book: Beyond attention): LFM2's gated short convolutions beside attention layers.

The autograd suite (test_families_autograd), the circuit graphs (test_circuit) and MIB (test_mib) run on the hybrids
with every other family. Here: the convolution's edge scores against the block's own forward run one key at a time,
its units named by kind in results, reports, files and graphs, and every edit that would make the rule wrong
refused by name with the model left as it was.
"""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch

import dpa
from dpa.families import layer_modules

from .conftest import random_ids, tiny_model

TARGET = 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("lfm2", 2)


def _state(model):
    return [(n, p.data_ptr(), p.dtype, p.requires_grad) for n, p in model.named_parameters()] + [
        (n, type(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks), "forward" in vars(m))
        for n, m in model.named_modules()]


def test_the_layers_and_their_units(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == ("conv", "attention", "conv") and spec.mixed
    mods = layer_modules(model, spec)
    assert [m.kind for m in mods] == ["conv", "attention", "conv"]
    conv = mods[0]
    assert conv.attention is model.model.layers[0].conv and conv.heads is model.model.layers[0].conv.out_proj
    # B, C and x: the three blocks of in_proj, in the modelling code's order (BCx.chunk(3)), as key, query, value
    d = spec.d_model
    assert (conv.columns["key"], conv.columns["query"], conv.columns["value"]) == (
        slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d))
    assert mods[1].columns["query"] is None  # the attention layer's own projections


def test_conv_edges_are_the_block_run_one_key_at_a_time(model):
    """Edge (query t, key s) of unit h of a convolution layer: lambda_t . the block's output at t when only position
    s of B * x reaches the convolution, over the unit's channels. Computed here by running the module's own
    convolution on a masked input (no lag arithmetic of dpa's), with lambda the gradient at out_proj's input."""
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True)
    spec = dpa.spec_for(model)
    layer = 2
    block = model.model.layers[layer].conv
    res_lam = _lambda_at(model, ids, block.out_proj)
    seen = {}
    hooks = [block.in_proj.register_forward_hook(lambda _m, _a, out: seen.__setitem__("bcx", out.detach())),
             block.out_proj.register_forward_pre_hook(lambda _m, a: seen.__setitem__("y", a[0]))]
    try:
        with torch.no_grad():
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()
    B, C, x = seen["bcx"].transpose(-1, -2).chunk(3, dim=-2)  # as Lfm2ShortConv.forward: [1 d t] each
    t, width = len(ids), spec.d_model // spec.n_heads
    want = torch.zeros(spec.n_heads, t, t, dtype=torch.float64)
    for s in range(t):
        z = torch.zeros_like(B)
        z[..., s] = (B * x)[..., s]
        conv = torch.nn.functional.conv1d(z, block.conv.weight, padding=block.conv.padding[0], groups=spec.d_model)
        y = (C * conv[..., :t])[0].T  # [t d]: the block's output (before out_proj) from key s alone
        want[:, :, s] = (res_lam * y).view(t, spec.n_heads, width).sum(-1).T
    torch.testing.assert_close(res.edge_scores[layer], want, rtol=1e-10, atol=1e-12)
    assert (want.abs() > 0).sum() > t  # not vacuous: several keys per query
    torch.testing.assert_close(res.edge_scores[layer].sum((1, 2)), res.head_scores[layer], rtol=1e-10, atol=1e-12)


def _lambda_at(model, ids, module, layer=2):
    """The linearised model's gradient of the target at ``module``'s input, layer ``layer``'s output projection (the
    default weights), by dpa's read-out of the head inputs."""
    from dpa.backward import Readout, run
    from dpa.request import build

    class HeadInputs(Readout):
        record = frozenset({"head_inputs"})

        def tensors(self, rec, spec):
            return [rec.head_inputs[layer]]

        def read(self, ctx, grads):
            return grads[0]

    req = build(model, None, ids, TARGET)
    out = run(model, req, {"lam": HeadInputs()}).out["lam"]
    return out[0]


def test_units_are_named_by_kind_in_results_reports_files_and_graphs(model, tmp_path):
    res = dpa.attribute(model, None, random_ids(9), target=TARGET)
    assert res.layer_kinds == ["conv", "head", "conv"] and res.unit_kinds == ("conv", "head")
    top = res.top_components(50)
    kinds = {c.kind for c in top["positive"] + top["negative"]}
    assert kinds == {"conv", "head", "neuron"}
    assert all(res.layer_kinds[c.layer] == c.kind for c in top["positive"] + top["negative"] if c.kind != "neuron")
    only = res.top_components(3, kinds=("head",))
    assert {c.layer for c in only["positive"] + only["negative"]} == {1}
    with pytest.raises(dpa.InputError, match="'conv'"):
        res.top_components(3, kinds=("ssm",))
    assert "conv L" in res.summary() and "conv units, attention heads and MLP neurons ranked together" in res.summary()
    path = tmp_path / "r.json"
    res.to_json(str(path))
    back = dpa.Attribution.from_json(path)
    assert back.layer_kinds == res.layer_kinds
    bad = res.to_dict()
    bad["layer_kinds"] = ["conv", "head"]
    with pytest.raises(dpa.InputError, match="layer_kinds"):
        dpa.Attribution.from_dict(bad)
    circ = dpa.circuit(model, None, random_ids(9), target=TARGET, nodes=12)
    labels = [n.label for n in circ.nodes if n.kind == "head"]
    assert labels and all((".C" in lab) == (not lab.startswith("L1.")) for lab in labels)


def test_the_widget_payload_says_what_each_row_is(model):
    from dpa_widgets.payload import view_payload as payload

    data = payload(dpa.attribute(model, None, random_ids(9), target=TARGET, effective_targets=True))
    assert data["layer_kinds"] == ["conv", "head", "conv"] and data["unit_letters"] == {"conv": "C", "head": "H"}
    assert data["unit_widths"] == {"conv": 8}  # d_model 32 over 4 units
    plain = payload(dpa.attribute(tiny_model("llama", 2), None, random_ids(9), target=TARGET))
    assert "layer_kinds" not in plain


def test_methods_that_read_attention_probabilities_are_not_offered_and_refuse_by_name(model):
    from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS, READ_ATTENTION, supports

    spec = dpa.spec_for(model)
    offered = {n for table in (INPUT_METHODS, COMPONENT_METHODS) for n, f in table.items() if supports(f, spec)}
    assert offered == {"dpa", "dpa_mid", "random", "gradient", "input_x_gradient", "integrated_gradients", "occlusion"}
    before = _state(model)
    for fn in READ_ATTENTION:
        with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[0\].*conv|conv layers"):
            fn(model, None, random_ids(6), target=TARGET)
        assert _state(model) == before


def _copy():
    return tiny_model("lfm2", 2)


def test_a_bias_inside_the_product_is_refused():
    model = tiny_model("lfm2", 2, conv_bias=True)
    with pytest.raises(dpa.UnsupportedModelError, match="conv_bias"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)


@pytest.mark.parametrize("edit, match", [
    ("patched forward", r"layers\[0\]\.conv is a .* forward is its own"),
    ("conv bias", r"layers\[0\]\.conv\.conv .*bias"),
    ("extra parameter", r"layers\[0\]\.conv holds the parameters"),
    ("lora in_proj", r"layers\[0\]\.conv\.in_proj"),
    ("gelu mlp", r"layers\[1\]\.feed_forward .*does not compute w2\(silu"),
    ("swapped layer", r"does not have the modules of a lfm2 layer"),
], ids=lambda x: x if " " in x else "")
def test_edits_that_break_the_rule_are_refused_by_name_and_the_model_left_as_it_was(edit, match):
    model = _copy()
    layers = model.model.layers
    if edit == "patched forward":
        cls = type(layers[0].conv)
        forward = lambda self, *a, **k: cls.forward(self, *a, **k)  # noqa: E731
        layers[0].conv.__class__ = type("Patched", (cls,), {"forward": forward})
    elif edit == "conv bias":
        layers[0].conv.conv.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64), requires_grad=False)
    elif edit == "extra parameter":
        layers[0].conv.register_parameter("scale", torch.nn.Parameter(torch.ones(1, dtype=torch.float64)))
    elif edit == "lora in_proj":
        class Lora(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x) * 1.01
        old = layers[0].conv.in_proj
        new = Lora(32, 96, bias=False).double()
        new.weight = old.weight
        layers[0].conv.in_proj = new
    elif edit == "gelu mlp":
        mlp = layers[1].feed_forward
        mlp.forward = types.MethodType(lambda self, x: self.w2(torch.nn.functional.gelu(self.w1(x)) * self.w3(x)), mlp)
    elif edit == "swapped layer":
        layers[0], layers[1] = layers[1], layers[0]
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    assert _state(model) == before


def test_model_state_after_a_refused_explicit_call_is_unchanged(model):
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match="conv layer"):
        dpa.baselines.activation_patching(model, None, random_ids(6), target=TARGET)
    assert _state(model) == before


@pytest.mark.parametrize("family, refusal", [(f, f"{k} layers, without attention probabilities") for f, k in
                                             (("lfm2", "conv"), ("bamba", "scan"), ("granitemoehybrid", "scan"),
                                              ("qwen3_next", "delta"))]
                         + [("falcon_h1", "scan block beside attention on every layer")])  # (its SSM heads)
def test_the_benchmark_runs_what_a_hybrid_has_and_refuses_head_ablations_before_any_work(family, refusal, tmp_path):
    from dpa.evaluate import Settings, evaluate

    from .test_evaluate import tiny_dataset, word_tokenizer

    model = tiny_model(family, 2)
    tok = word_tokenizer()
    tiny_dataset(model, tmp_path / "data", n=2)
    common = dict(dataset="known_1000", min_probability=0.0, data_dir=str(tmp_path / "data"))
    inputs = evaluate(model, tok, Settings(unit="input", methods=("dpa", "gradient"), **common), tmp_path / "in",
                      progress=False, figures=False)
    assert set(inputs["methods"]) == {"dpa", "gradient"} and inputs["n_evaluated"] >= 1
    neurons = evaluate(model, tok, Settings(unit="component", component_units="neurons", methods=("dpa",), **common),
                       tmp_path / "neurons", progress=False, figures=False)
    assert neurons["n_evaluated"] == inputs["n_evaluated"]
    with pytest.raises(dpa.UnsupportedModelError, match=refusal):
        evaluate(model, tok, Settings(unit="component", methods=("dpa",), **common), tmp_path / "heads",
                 progress=False, figures=False)
    assert not (tmp_path / "heads").exists() or not any((tmp_path / "heads").iterdir())


def _gelu_mlp(self, x):
    return self.w2(torch.nn.functional.gelu(self.w1(x)) * self.w3(x))


def _tanh_of(forward):
    @functools.wraps(forward)  # copies the name and the module, not the code
    def patched(self, *args, **kwargs):
        return torch.tanh(forward(self, *args, **kwargs))
    return patched


@pytest.mark.parametrize("patch", ["mlp class", "conv class wrapped", "conv function", "norm class"])
def test_patches_made_after_a_first_call_are_refused_by_name(patch, monkeypatch):
    """A class's forward or a function of its modelling file patched after dpa checked the model once: the checks
    run again (their cache keys on each class's forward and its file's functions) and refuse it by name."""
    from transformers.models.lfm2 import modeling_lfm2 as lfm2

    model = _copy()
    ids = random_ids(7)
    dpa.attribute(model, None, ids, target=TARGET)
    conv_fn = lfm2.causal_conv1d_fn
    change = {"mlp class": (lfm2.Lfm2MLP, "forward", _gelu_mlp, "MLP is a Lfm2MLP whose forward is its own"),
              "conv class wrapped": (lfm2.Lfm2ShortConv, "forward", _tanh_of(lfm2.Lfm2ShortConv.forward),
                                     "forward is its own"),
              "conv function": (lfm2, "causal_conv1d_fn", lambda h, w, b=None, activation=None, **k:
                                torch.nn.functional.silu(conv_fn(h, w, b)), r"does not compute out_proj\(C"),
              "norm class": (lfm2.Lfm2RMSNorm, "forward", _tanh_of(lfm2.Lfm2RMSNorm.forward), "forward is its own|rms")}
    owner, name, value, match = change[patch]
    monkeypatch.setattr(owner, name, value)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(model, None, ids, target=TARGET)
    assert _state(model) == before


def test_a_block_compiled_in_place_is_refused():
    model = _copy()
    model.model.layers[0].conv.compile()
    with pytest.raises(dpa.DPAError, match=r"compiled in place"):
        dpa.attribute(model, None, random_ids(5), target=TARGET, edges=True)


@pytest.mark.parametrize("overrides, match", [
    (dict(layer_types=["conv", "sliding_attention", "conv"]), "knows the layer types full_attention, conv"),
    (dict(head_dim=16), r"not num_attention_heads x head_dim"),
])
def test_configs_the_rule_does_not_describe_are_refused(overrides, match):
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(tiny_model("lfm2", 2, **overrides), None, random_ids(5), target=TARGET)


def test_the_recomputing_baselines_refuse_an_mlp_without_an_activation_module():
    from dpa.baselines import RECOMPUTE_LAYERS, depass, supports

    model = tiny_model("lfm2", 2, layer_types=["full_attention"] * 3)  # no convolution: attention only
    assert not any(supports(fn, dpa.spec_for(model)) for fn in RECOMPUTE_LAYERS)
    with pytest.raises(dpa.UnsupportedModelError, match="activation as a function"):
        depass(model, None, random_ids(6), target=TARGET)


def test_verifying_the_top_components_ablates_heads_and_neurons_only(model):
    from dpa_widgets.verify import run

    res = dpa.attribute(model, None, random_ids(9), target=TARGET)
    out = run(model, res, mode="disrupt", units="top_components", k=4)
    top = res.top_components(4, kinds=("head", "neuron"))["positive"]
    assert sorted(out["units"]) == sorted(f"L{c.layer}.{'H' if c.kind == 'head' else 'N'}{c.index}" for c in top)
    assert any(c.kind == "conv" for c in res.top_components(4)["positive"])  # they were among the top: left out


@pytest.mark.parametrize("family, letter", [("lfm2", "C"), ("bamba", "S"), ("granitemoehybrid", "S"),
                                            ("qwen3_next", "D")])
def test_verification_refuses_what_ablation_cannot_reach_before_any_work(family, letter):
    """A selected mixer unit, or "recover" (which would ablate every unit but the selection, the mixer's included),
    is refused by name; "disrupt" on an attention head runs."""
    from dpa_widgets.verify import run

    model = tiny_model(family, 2)
    res = dpa.attribute(model, None, random_ids(7), target=TARGET)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=rf"L0\.{letter}1 is a \w+ unit"):
        run(model, res, mode="disrupt", units="selection", k=1, head=[0, 1])
    with pytest.raises(dpa.UnsupportedModelError, match="recover ablates every unit but the selection"):
        run(model, res, mode="recover", units="selection", k=1, head=[1, 1])
    assert _state(model) == before
    assert run(model, res, mode="disrupt", units="selection", k=1, head=[1, 1])["units"] == ["L1.H1"]


@pytest.mark.parametrize("family, kind, letter", [("lfm2", "conv", "C"), ("bamba", "scan", "S"),
                                                  ("qwen3_next", "delta", "D"),
                                                  ("granitemoehybrid", "scan", "S")])
def test_the_command_line_attributes_a_saved_hybrid(family, kind, letter, tmp_path, capsys):
    """``dpa attribute`` and ``dpa circuit`` on a hybrid's folder (random weights, a word-level tokenizer): the report
    names the mixer's units, the JSON keeps the layer kinds, the circuit labels them."""
    from dpa.cli import main

    from .test_evaluate import word_tokenizer

    folder = tmp_path / family
    model = tiny_model(family, 2, dtype=torch.float32)
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    out_json = tmp_path / "r.json"
    assert main(["attribute", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--json", str(out_json),
                 "--top", "40"]) == 0
    report = capsys.readouterr().out
    listed = ("attention heads, experts and" if family in ("granitemoehybrid", "qwen3_next")  # (their experts)
              else "attention heads and")
    assert f"{kind} L" in report and f"{kind} units, {listed} MLP neurons" in report
    assert json.loads(out_json.read_text())["layer_kinds"] == [kind, "head", kind]
    graph = tmp_path / "g.json"
    assert main(["circuit", "w4 w5 w6 w7", "--model", str(folder), "--target", "w9", "--nodes", "200",
                 "--json", str(graph)]) == 0
    assert any(f".{letter}" in n["label"] for n in json.loads(graph.read_text())["nodes"])


def test_a_layer_appended_without_the_config_is_refused_by_name():
    """The layer count is checked before the per-layer checks, which read each layer's kind from the config."""
    import copy

    model = _copy()
    model.model.layers.append(copy.deepcopy(model.model.layers[1]))
    with pytest.raises(dpa.UnsupportedModelError, match="holds 4 layers, while the config's num_hidden_layers is 3"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)


@pytest.mark.parametrize("family, attribute, value, match", [
    ("lfm2", "is_attention_layer", True, r"layers\[0\]\.is_attention_layer is True, while the config makes it a conv"),
    ("bamba", "block_type", "full_attention", r"layers\[0\]\.block_type is 'full_attention'"),
    ("qwen3_next", "block_type", "full_attention", r"layers\[0\]\.block_type is 'full_attention'"),
])
def test_a_layers_own_record_of_its_block_must_be_the_configs(family, attribute, value, match):
    """A hybrid's layer runs the block its own attribute names (set from the config when it was built); dpa reads the
    config's layer types: an attribute edited since is refused by name, the model left as it was."""
    model = tiny_model(family, 2)
    setattr(model.model.layers[0], attribute, value)
    before = _state(model)
    with pytest.raises(dpa.UnsupportedModelError, match=match):
        dpa.attribute(model, None, [random_ids(6, seed=1), random_ids(6, seed=2)], target=TARGET)
    assert _state(model) == before
