"""The baselines that recompute each layer from its weights (DePass, IFR, MLP-only, norm-only) on every family:
the recomputed layers against the model's own forward, each method's defining identity, and what the
widget and the evaluation runner offer. The Llama-only details are in test_baselines.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.nn import functional as F

import dpa
from dpa import baselines
from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS, internals
from dpa.baselines.common import prepare
from dpa.baselines.depass import decompose
from dpa.baselines.internals import forward_internals, require_layout
from tests.conftest import ALL_FAMILIES, LAYOUTS, MOE_FAMILIES, edited_run, random_ids, tiny_model

T = 7
TARGET, FOIL = 7, 11
# Written here from HF's modeling files, not read from dpa's family descriptions: the norm applied to each
# block's output before it joins the residual stream, and the gated activation named by the config.
POST_NORMS = {family: ("post_attention_layernorm", "post_feedforward_layernorm")
              for family in ("gemma2", "gemma3_text", "olmo2")}
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda s: F.gelu(s, approximate="tanh")}
# Families whose layers the recomputing baselines do not read, and the reason they give.
REFUSED = {"phi3": "fused projections", "gpt2": "layer norms", "gpt_neox": "layer norms",
           **{moe: "a mixture of experts" for moe in MOE_FAMILIES}}
HANDLED = tuple(f for f in ALL_FAMILIES if f not in REFUSED)
RECOMPUTING = ("depass", "ifr", "mlp_only", "norm_only")


def activation(model):
    config = model.config
    return ACTIVATIONS[getattr(config, "hidden_activation", None) or config.hidden_act]


def pre_cap_logit(model, ids, target=TARGET, contrast=FOIL) -> float:
    """The target logit difference before any final soft-cap (Gemma 2), from HF's last hidden state."""
    with torch.no_grad():
        hidden = model.model(ids[None]).last_hidden_state[0, -1]
        w = model.lm_head.weight
    return float(hidden @ (w[target] - w[contrast]))


def bias_free(family: str, kv_heads: int = 2):
    """A tiny model of the family; Qwen2's value biases (inputs no token owns) zeroed, so sums are exact."""
    model = tiny_model(family, kv_heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    return model


@pytest.fixture(scope="module", params=HANDLED)
def model(request):
    return bias_free(request.param)


def _eps(norm) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def recorded(model, ids):
    """HF's own forward with forward hooks: each decoder layer's input, the input of each post-norm (the block's
    output), the gate pre-activations and the residual stream before the MLP (by family, from POST_NORMS)."""
    family = model.config.model_type
    store: dict = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: store.__setitem__(("resid", i), (a[0] if a else kw["hidden_states"])[0]),
            with_kwargs=True))
        handles.append(layer.mlp.gate_proj.register_forward_hook(lambda m, a, out, i=i: store.__setitem__(("gate", i), out[0])))
        for block, name in zip(("attn_out", "mlp_out"), POST_NORMS.get(family, ())):
            handles.append(getattr(layer, name).register_forward_pre_hook(
                lambda m, a, i=i, block=block: store.__setitem__((block, i), a[0][0])))
    handles.append(model.model.norm.register_forward_pre_hook(
        lambda m, a: store.__setitem__(("resid", len(model.model.layers)), a[0][0])))
    try:
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
    finally:
        for h in handles:
            h.remove()
    return store, logits


class TestForwardOracle:
    """The layers as the baselines recompute them (frozen norms, the model's activation) give the model's own
    residual streams, and the family's layout is read from its description."""

    @pytest.mark.parametrize("family", HANDLED)
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_recomputed_layers_are_the_models(self, family, layout):
        model = tiny_model(family, LAYOUTS[layout])  # Qwen2's biases kept: they are in the block outputs
        ids = random_ids(T)
        req = prepare(model, None, ids, TARGET)
        cap = forward_internals(model, req, decompose=True)
        store, _ = recorded(model, ids)
        n = len(cap.layers)
        for i, layer in enumerate(cap.layers):
            torch.testing.assert_close(layer.resid_pre[0], store[("resid", i)], rtol=0, atol=0)
            torch.testing.assert_close(layer.resid_pre[0] + layer.attn_write, layer.resid_mid[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(layer.resid_mid[0] + layer.mlp_write, store[("resid", i + 1)],
                                       rtol=1e-10, atol=1e-10)
            if family in POST_NORMS:  # the blocks' outputs before their post-norms, as HF computes them
                torch.testing.assert_close(layer.attn_out, store[("attn_out", i)], rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(layer.mlp_out, store[("mlp_out", i)], rtol=1e-10, atol=1e-10)
            act = activation(model)(store[("gate", i)])
            torch.testing.assert_close(layer.act[0], act, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cap.resid_final[0], store[("resid", n)], rtol=0, atol=0)

    def test_the_layout_comes_from_the_description(self):
        layout = lambda family: require_layout(dpa.spec_for(tiny_model(family)), "test")  # noqa: E731
        assert layout("llama") == internals.Layout("input_layernorm", "post_attention_layernorm", None, None)
        assert layout("gemma3_text") == internals.Layout("input_layernorm", "pre_feedforward_layernorm",
                                                         *POST_NORMS["gemma3_text"])
        assert layout("olmo2") == internals.Layout(None, None, *POST_NORMS["olmo2"])

    def test_a_wrong_layout_is_caught_by_the_oracle(self, monkeypatch):
        """Were a description to list Gemma's post-norms the other way round, the recomputed layers would miss
        the recorded streams: refused, not attributed."""
        model = tiny_model("gemma3_text")
        right = internals.layout
        swapped = lambda parts: dataclasses.replace(  # noqa: E731
            right(parts), post_attn=right(parts).post_mlp, post_mlp=right(parts).post_attn)
        monkeypatch.setattr(internals, "layout", swapped)
        with pytest.raises(dpa.UnsupportedModelError, match="misses the recorded residual stream"):
            baselines.norm_only(model, None, random_ids(T), TARGET)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_attention_maps_are_the_models_alpha_in_every_family(family):
    """The attention-map baselines read alpha recomputed from the recorded queries and keys (the branch's own
    features where q/k/v share one fused projection): the explicit attention path's alpha, which gives HF's
    logits (test_families_autograd)."""
    from dpa import request
    from dpa.instrument import instrument

    model = tiny_model(family)
    ids = random_ids(T)
    with torch.no_grad(), instrument(model, request.build(model, None, ids), explicit=True) as session:
        session.forward()
    rec = session.recording
    probs = torch.stack([rec.probs[i][0] for i in range(model.config.num_hidden_layers)])  # [layer head query key]
    torch.testing.assert_close(COMPONENT_METHODS["attn_only"](model, None, ids, TARGET).edge_scores, probs.float())
    got = INPUT_METHODS["last_layer_attention"](model, None, ids, TARGET).token_scores
    torch.testing.assert_close(got, probs[-1, :, -1].mean(0).float())


class TestDePass:
    def test_the_parts_sum_to_every_residual(self, model):
        """DePass's decomposition: at every position the per-token parts of the final residual add up to it."""
        ids = random_ids(T)
        req = prepare(model, None, ids, TARGET)
        cap = forward_internals(model, req, decompose=True)
        for rule in ("softmax", "up"):
            parts = decompose(cap, neuron_rule=rule)  # [pos part d_model]
            torch.testing.assert_close(parts.sum(1), cap.resid_final[0], rtol=1e-10, atol=1e-10)
            assert (parts[torch.ones(T, T, dtype=torch.bool).triu(1)] == 0).all()  # no part from a later token

    def test_scores_sum_to_the_target_logit(self, model):
        """Before any final soft-cap (Gemma 2's): the logit is linear in the final residual."""
        ids = random_ids(T)
        res = INPUT_METHODS["depass"](model, None, ids, TARGET, contrast=FOIL)
        assert math.isclose(float(res.token_scores.double().sum()), pre_cap_logit(model, ids), rel_tol=1e-5,
                            abs_tol=1e-6)

    @pytest.mark.parametrize("family", HANDLED)
    def test_the_linear_neuron_rule_is_dpa_on_the_content_paths(self, family):
        """A forward decomposition of a linear map gives what its transpose gives: DePass with act(s) frozen and
        u split over the parts equals DPA with only the value and up paths, frozen norms before and after each
        block included."""
        model = bias_free(family)
        ids = random_ids(T)
        got = INPUT_METHODS["depass"](model, None, ids, TARGET, contrast=FOIL, neuron_rule="up").token_scores
        ref = dpa.attribute(model, None, ids, TARGET, contrast=FOIL,
                            weights=dpa.PathWeights(query=0, key=0, value=1, gate=0, up=1)).token_scores.float()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


class TestIFR:
    def test_importance_is_a_distribution(self, model):
        ids = random_ids(T)
        res = INPUT_METHODS["ifr"](model, None, ids, TARGET)
        assert (res.token_scores >= 0).all() and math.isclose(float(res.token_scores.sum()), 1.0, rel_tol=1e-5)
        comp = COMPONENT_METHODS["ifr"](model, None, ids, TARGET)
        assert comp.edge_scores.shape == (3, 4, T, T) and comp.neuron_position_scores.shape == (3, T, 48)
        assert torch.isfinite(comp.edge_scores).all() and torch.isfinite(comp.neuron_position_scores).all()
        assert (comp.edge_scores >= 0).all() and (comp.neuron_position_scores >= 0).all()
        top = comp.edge_scores[-1].sum((0, 2))  # top layer: only the target position's query carries importance
        assert float(top[:-1].abs().sum()) == 0 and 0 < float(top[-1]) <= 1
        torch.testing.assert_close(res.token_scores, comp.token_scores)

    def test_edge_weight_is_the_proximity_of_what_the_edge_writes(self, model):
        """One edge's IFR weight from HF's own tensors: its write alpha v W_O^h through the block's post-norm
        frozen at the scale of HF's block output, its proximity to the layer's update, normalised."""
        from dpa.baselines.ifr import attention_weights

        ids = random_ids(T)
        family = model.config.model_type
        req = prepare(model, None, ids, TARGET)
        layer = forward_internals(model, req, decompose=True).layers[1]
        own, edges = attention_weights(layer)
        store, _ = recorded(model, ids)
        _, rec = edited_run(model, ids[None])
        hf = model.model.layers[1]
        probs = rec.probs[1][0]  # [head query key]
        resid = store[("resid", 1)]
        mid = resid + layer.attn_write  # checked against HF in TestForwardOracle
        q = 5
        o = hf.self_attn.o_proj.weight.view(32, 4, 8)
        v = layer.v[0].repeat_interleave(2, dim=0)  # [head key d_head]
        writes = torch.einsum("hk,hkd,mhd->hkm", probs[:, q, : q + 1], v[:, : q + 1], o)  # [head key d_model]
        if family in POST_NORMS:
            norm = getattr(hf, POST_NORMS[family][0])
            x = store[("attn_out", 1)][q]
            gain = (1 + norm.weight) if family.startswith("gemma") else norm.weight
            writes = writes * gain * torch.rsqrt(x.pow(2).mean() + _eps(norm))
        proximity = lambda z: (mid[q].abs().sum() - (mid[q] - z).abs().sum()).clamp_min(0)  # noqa: E731
        prox = torch.stack([proximity(z) for z in writes.reshape(-1, 32)]).view(4, q + 1)
        total = proximity(resid[q]) + prox.sum()
        torch.testing.assert_close(edges[:, q, : q + 1], prox / total, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(own[q], proximity(resid[q]) / total, rtol=1e-9, atol=1e-12)


class TestActivationBaselines:
    def test_mlp_only_is_the_gate_activation(self, model):
        ids = random_ids(T)
        store, _ = recorded(model, ids)
        got = COMPONENT_METHODS["mlp_only"](model, None, ids, TARGET).neuron_position_scores
        want = torch.stack([activation(model)(store[("gate", i)]) for i in range(3)])
        torch.testing.assert_close(got, want.float())

    def test_norm_only_is_the_norm_of_the_written_vector(self, model):
        """The written vectors from HF's own tensors (the down projection's input, alpha) through the post-norm
        frozen at the scale of HF's block output."""
        ids = random_ids(T)
        family = model.config.model_type
        res = COMPONENT_METHODS["norm_only"](model, None, ids, TARGET)
        store, _ = recorded(model, ids)
        _, rec = edited_run(model, ids[None])
        l, h, q, k, i, n = 1, 3, 5, 2, 4, 9
        hf = model.model.layers[l]

        def post(block, x, pos):  # the frozen post-norm of block at position pos (identity without one)
            if family not in POST_NORMS:
                return x
            norm = getattr(hf, POST_NORMS[family][block])
            y = store[(("attn_out", "mlp_out")[block], l)][pos]
            gain = (1 + norm.weight) if family.startswith("gemma") else norm.weight
            return x * gain * torch.rsqrt(y.pow(2).mean() + _eps(norm))

        pre = hf.input_layernorm(store[("resid", l)]) if hasattr(hf, "input_layernorm") else store[("resid", l)]
        v = hf.self_attn.v_proj(pre)[k].view(2, 8)[h // 2]
        write = post(0, rec.probs[l][0, h, q, k] * (hf.self_attn.o_proj.weight[:, h * 8:(h + 1) * 8] @ v), q)
        assert math.isclose(float(res.edge_scores[l, h, q, k]), float(write.norm()), rel_tol=1e-5)
        a = rec.neuron_inputs[l][0, i, n]
        write = post(1, a * hf.mlp.down_proj.weight[:, n], i)
        assert math.isclose(float(res.neuron_position_scores[l, i, n]), float(write.norm()), rel_tol=1e-5)
        assert res.edge_scores.shape == (3, 4, T, T) and res.neuron_position_scores.shape == (3, T, 48)
        assert torch.isfinite(res.edge_scores).all() and (res.edge_scores >= 0).all()


class TestOffered:
    @pytest.mark.parametrize("family", ALL_FAMILIES)
    def test_the_widget_and_the_runner_offer_what_handles_the_family(self, family, tmp_path):
        from dpa.evaluate.runner import Settings, evaluate
        from dpa_widgets.live import baseline_methods  # the widget's method menu

        model = tiny_model(family)
        spec = dpa.spec_for(model)
        handled = family not in REFUSED
        for fn in baselines.RECOMPUTE_LAYERS:
            assert baselines.supports(fn, spec) == handled
        menu = baseline_methods(spec)
        assert "tokens:gradient" in menu
        for name in RECOMPUTING:
            assert (f"tokens:{name}" in menu or f"components:{name}" in menu) == handled
        if not handled:
            settings = Settings(dataset="known_1000", unit="input", methods=("dpa", "ifr"), data_dir=str(tmp_path))
            with pytest.raises(dpa.UnsupportedModelError, match=f"ifr .*layers of {family}"):
                evaluate(model, None, settings, tmp_path / "out", progress=False)
            assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

    @pytest.mark.parametrize("family", [f for f in ALL_FAMILIES if f in REFUSED])
    def test_families_they_do_not_read_are_refused_by_name(self, family):
        model = tiny_model(family)
        spec = dpa.spec_for(model)
        for fn in baselines.RECOMPUTE_LAYERS:
            assert not baselines.supports(fn, spec)
        for name in RECOMPUTING:
            method = INPUT_METHODS.get(name) or COMPONENT_METHODS[name]
            with pytest.raises(dpa.UnsupportedModelError, match=f"{name} .* layers of {family}: {REFUSED[family]}"):
                method(model, None, random_ids(T), TARGET)
        assert torch.isfinite(baselines.gradient(model, None, random_ids(T), TARGET).token_scores).all()

    @pytest.mark.parametrize("norms, problem", [
        (("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"), "1 norm"),
        (("input_layernorm",), "1 block input"),
    ])
    def test_a_layout_the_description_does_not_pin_down_is_refused_by_name(self, norms, problem):
        model = tiny_model("llama")
        spec = dpa.spec_for(model)
        parts = spec.parts.with_(norms=norms, block_inputs=norms[:1] if problem == "1 block input" else
                                 spec.parts.block_inputs)
        odd = dataclasses.replace(spec, family="oddity", parts=parts)
        for fn in baselines.RECOMPUTE_LAYERS:
            assert not baselines.supports(fn, odd)
        assert baselines.supports(baselines.gradient, odd)
        with pytest.raises(dpa.UnsupportedModelError, match=f"depass .*oddity: {problem}"):
            require_layout(odd, "depass")
