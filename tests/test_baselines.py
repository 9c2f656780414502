"""Baselines against ground truth: autograd, finite differences, re-running the model with a unit zeroed."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch.nn import functional as F

import dpa
from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS, activation_patching, atp, component_gradient
from dpa.baselines.common import prepare
from dpa.baselines.gradient import component_gradients
from tests.conftest import edited_run, random_ids, tiny_model

T = 6
TARGET, FOIL = 7, 11


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", kv_heads=2)


def f_of_embeddings(model, e, contrast=None):
    """The target logit (minus the foil's) from HF's own forward on embeddings [1 pos d_model]."""
    logits = model(inputs_embeds=e).logits[0, -1]
    return logits[TARGET] - (logits[contrast] if contrast is not None else 0)


def embed(model, ids):
    return model.model.embed_tokens(ids[None]).detach()


class TestContract:
    @pytest.mark.parametrize("name", list(INPUT_METHODS))
    def test_input_methods(self, llama, name):
        ids = random_ids(T)
        res = INPUT_METHODS[name](llama, None, ids.tolist(), TARGET, contrast=FOIL)
        assert isinstance(res, dpa.Attribution) and res.method == name
        assert res.token_scores.shape == (T,) and torch.isfinite(res.token_scores).all()
        assert res.head_scores.shape == (3, 4) and res.neuron_scores.shape == (3, 48)
        assert res.target.token_id == TARGET and res.target.contrast_id == FOIL and res.target.position == T - 1

    @pytest.mark.parametrize("name", [n for n in COMPONENT_METHODS if n != "activation_patching"])
    def test_component_methods(self, llama, name):
        ids = random_ids(T)
        res = COMPONENT_METHODS[name](llama, None, ids, TARGET)
        assert res.method == name
        assert res.edge_scores.shape == (3, 4, T, T) and res.neuron_position_scores.shape == (3, T, 48)
        torch.testing.assert_close(res.head_scores, res.edge_scores.sum((-1, -2)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res.neuron_scores, res.neuron_position_scores.sum(1), rtol=1e-5, atol=1e-6)
        upper = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert (res.edge_scores[..., upper] == 0).all()  # non-causal pairs are not units

    def test_default_target_is_the_prediction_and_position_counts_from_the_end(self, llama):
        ids = random_ids(T)
        predicted = int(llama(ids[None]).logits[0, -1].argmax())
        assert INPUT_METHODS["gradient"](llama, None, ids).target.token_id == predicted
        assert INPUT_METHODS["gradient"](llama, None, ids, position=-3).target.position == T - 3

    def test_bad_inputs(self, llama):
        with pytest.raises(ValueError, match="outside"):
            INPUT_METHODS["gradient"](llama, None, random_ids(T), position=T)
        with pytest.raises(ValueError, match="same token"):
            INPUT_METHODS["gradient"](llama, None, random_ids(T), TARGET, contrast=TARGET)
        with pytest.raises(ValueError, match="empty"):
            INPUT_METHODS["random"](llama, None, [])

    def test_dpa_twice(self, llama):
        ids = random_ids(T)
        out, mid = COMPONENT_METHODS["dpa"](llama, None, ids, TARGET), COMPONENT_METHODS["dpa_mid"](llama, None, ids, TARGET)
        assert out.neuron_target == "output" and mid.neuron_target == "mid" and mid.method == "dpa_mid"
        torch.testing.assert_close(out.edge_scores, mid.edge_scores)  # only the neurons differ
        assert not torch.allclose(out.neuron_position_scores, mid.neuron_position_scores)


class TestInputGradients:
    def test_gradient_and_input_x_gradient_equal_autograd(self, llama):
        ids = random_ids(T)
        e = embed(llama, ids).requires_grad_(True)
        (grad,) = torch.autograd.grad(f_of_embeddings(llama, e, FOIL), e)
        got = INPUT_METHODS["gradient"](llama, None, ids, TARGET, contrast=FOIL).token_scores
        torch.testing.assert_close(got, grad[0].sum(-1).float(), rtol=1e-5, atol=1e-6)
        got = INPUT_METHODS["input_x_gradient"](llama, None, ids, TARGET, contrast=FOIL).token_scores
        torch.testing.assert_close(got, (e * grad)[0].sum(-1).detach().float(), rtol=1e-5, atol=1e-6)

    def test_integrated_gradients_sum_approaches_f_x_minus_f_0(self):
        """Midpoint rule: the error of sum_i S_i against f(e) - f(0) falls as 1/steps^2. (A large norm eps
        keeps f smooth along the path; with eps 1e-2 this random model is steep within 1e-4 of zero.)"""
        model = tiny_model("llama", kv_heads=2, rms_norm_eps=1.0)
        ids = random_ids(T)
        e = embed(model, ids)
        gap = float(f_of_embeddings(model, e) - f_of_embeddings(model, torch.zeros_like(e)))
        errors = [abs(float(INPUT_METHODS["integrated_gradients"](model, None, ids, TARGET, steps=s, batch_size=7)
                            .token_scores.double().sum()) - gap) for s in (4, 16, 64)]
        assert errors[0] > 8 * errors[1] > 64 * errors[2] and errors[2] < 1e-3 * abs(gap)

    def test_integrated_gradients_one_step_is_the_midpoint_gradient(self, llama):
        ids = random_ids(T)
        e = embed(llama, ids)
        half = (0.5 * e).requires_grad_(True)
        (grad,) = torch.autograd.grad(f_of_embeddings(llama, half), half)
        got = INPUT_METHODS["integrated_gradients"](llama, None, ids, TARGET, steps=1).token_scores
        torch.testing.assert_close(got, (e * grad)[0].sum(-1).detach().float(), rtol=1e-5, atol=1e-6)

    def test_occlusion_equals_rerunning_with_the_embedding_zeroed(self, llama):
        ids = random_ids(T)
        e = embed(llama, ids)
        clean = float(f_of_embeddings(llama, e))
        got = INPUT_METHODS["occlusion"](llama, None, ids, TARGET, batch_size=4).token_scores
        for i in range(T):
            zeroed = e.clone()
            zeroed[0, i] = 0
            assert math.isclose(float(got[i]), clean - float(f_of_embeddings(llama, zeroed)), rel_tol=1e-5,
                                abs_tol=1e-6)


class TestComponentGradients:
    def test_atp_matches_a_finite_difference(self, llama):
        """AtP = alpha df/dalpha = d/d(eps) f(unit scaled by 1 + eps) at eps = 0 (central difference)."""
        ids = random_ids(T)
        problem = prepare(llama, None, ids, TARGET, FOIL)
        res = atp(llama, None, ids, TARGET, contrast=FOIL)
        eps = 1e-5

        def f(attn=None, neurons=None):
            hidden, _ = edited_run(llama, ids[None], attn=attn, neurons=neurons)
            return float(problem.metric(llama.lm_head(hidden[:, -1])))

        for l, h, q, k in [(0, 1, 4, 2), (2, 3, 5, 5), (1, 0, 5, 0)]:
            keep = lambda s: {l: torch.ones(1, 4, T, T, dtype=torch.float64).index_put_(  # noqa: E731
                (torch.tensor(0), torch.tensor(h), torch.tensor(q), torch.tensor(k)), torch.tensor(s, dtype=torch.float64))}
            fd = (f(attn=keep(1 + eps)) - f(attn=keep(1 - eps))) / (2 * eps)
            assert math.isclose(float(res.edge_scores[l, h, q, k]), fd, rel_tol=1e-4, abs_tol=1e-6)
        for l, p, n in [(0, 2, 5), (2, 5, 40), (1, 5, 0)]:
            keep = lambda s: {l: torch.ones(1, T, 48, dtype=torch.float64).index_put_(  # noqa: E731
                (torch.tensor(0), torch.tensor(p), torch.tensor(n)), torch.tensor(s, dtype=torch.float64))}
            fd = (f(neurons=keep(1 + eps)) - f(neurons=keep(1 - eps))) / (2 * eps)
            assert math.isclose(float(res.neuron_position_scores[l, p, n]), fd, rel_tol=1e-4, abs_tol=1e-6)

    def test_gradient_is_atp_over_the_activation(self, llama):
        ids = random_ids(T)
        problem = prepare(llama, None, ids, TARGET)
        probs, d_probs, acts, d_acts = component_gradients(llama, problem)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        res = component_gradient(llama, None, ids, TARGET)
        torch.testing.assert_close(res.edge_scores, (d_probs * causal).float())
        torch.testing.assert_close(res.neuron_position_scores, d_acts.float())
        torch.testing.assert_close(atp(llama, None, ids, TARGET).edge_scores, (probs * d_probs).float())
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4, T, dtype=torch.float64))


class TestActivationPatching:
    def _f_with_hook(self, model, ids, module, hook, pre=False):
        handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
        try:
            with torch.no_grad():
                return float(f_of_embeddings(model, embed(model, ids)))
        finally:
            handle.remove()

    def test_coarse_units_equal_rerunning_with_the_unit_zeroed(self, llama):
        ids = random_ids(T)
        res = activation_patching(llama, None, ids, TARGET, batch_size=50)
        with torch.no_grad():
            clean = float(f_of_embeddings(llama, embed(llama, ids)))
        for l, h in [(0, 0), (1, 3), (2, 2)]:
            def zero_head(_m, args, h=h):  # the head's slice of the o_proj input is its output z_h
                z = args[0].clone()
                z[..., h * 8:(h + 1) * 8] = 0
                return (z,)
            rerun = self._f_with_hook(llama, ids, llama.model.layers[l].self_attn.o_proj, zero_head, pre=True)
            assert math.isclose(float(res.head_scores[l, h]), clean - rerun, rel_tol=1e-5, abs_tol=1e-6)
        for l, n in [(0, 3), (2, 47)]:
            def zero_silu(_m, _args, out, n=n):
                out = out.clone()
                out[..., n] = 0
                return out
            rerun = self._f_with_hook(llama, ids, llama.model.layers[l].mlp.act_fn, zero_silu)
            assert math.isclose(float(res.neuron_scores[l, n]), clean - rerun, rel_tol=1e-5, abs_tol=1e-6)

    def test_fine_units_equal_rerunning_with_the_unit_zeroed(self):
        model = tiny_model("llama", kv_heads=1, num_hidden_layers=1, intermediate_size=8)
        ids = random_ids(4)
        res = activation_patching(model, None, ids, TARGET, units="fine", batch_size=16)
        with torch.no_grad():
            clean = float(f_of_embeddings(model, embed(model, ids)))
        for h, q, k in [(0, 3, 1), (2, 2, 2), (3, 3, 0)]:
            keep = torch.ones(1, 4, 4, 4, dtype=torch.float64)
            keep[0, h, q, k] = 0
            hidden, _ = edited_run(model, ids[None], attn={0: keep})
            rerun = float(model.lm_head(hidden[0, -1])[TARGET])
            assert math.isclose(float(res.edge_scores[0, h, q, k]), clean - rerun, rel_tol=1e-6, abs_tol=1e-9)
        for p, n in [(0, 0), (3, 7)]:
            def zero_silu(_m, _args, out, p=p, n=n):
                out = out.clone()
                out[0, p, n] = 0
                return out
            handle = model.model.layers[0].mlp.act_fn.register_forward_hook(zero_silu)
            with torch.no_grad():
                rerun = float(f_of_embeddings(model, embed(model, ids)))
            handle.remove()
            assert math.isclose(float(res.neuron_position_scores[0, p, n]), clean - rerun, rel_tol=1e-6, abs_tol=1e-9)
        assert (res.edge_scores[0, :, 1, 2] == 0).all()  # non-causal: never patched

    def test_refuses_too_many_units(self, llama):
        with pytest.raises(ValueError, match="one forward pass per unit"):
            activation_patching(llama, None, random_ids(T), units="fine", max_units=100)


class TestDecompositions:
    def test_depass_is_complete(self, llama):
        ids = random_ids(T)
        res = INPUT_METHODS["depass"](llama, None, ids, TARGET, contrast=FOIL)
        assert math.isclose(float(res.token_scores.double().sum()), res.target_logit, rel_tol=1e-5, abs_tol=1e-6)

    @pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
    def test_depass_with_the_linear_neuron_rule_is_dpa_on_the_content_paths(self, family):
        """A forward decomposition of a linear map gives what its transpose gives: DePass with SiLU(s)
        frozen and u split over the parts equals DPA with only the value and up paths."""
        model = tiny_model(family, kv_heads=2)
        ids = random_ids(T)
        got = INPUT_METHODS["depass"](model, None, ids, TARGET, contrast=FOIL, neuron_rule="up").token_scores
        ref = dpa.attribute(model, None, ids, TARGET, contrast=FOIL,
                            weights=dpa.PathWeights(query=0, key=0, value=1, gate=0, up=1)).token_scores.float()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        first = INPUT_METHODS["depass"](model, None, ids, TARGET, skip_first=False).token_scores
        assert not torch.allclose(first, INPUT_METHODS["depass"](model, None, ids, TARGET).token_scores)

    @pytest.mark.parametrize("rows", [1, 3])
    def test_depass_in_row_chunks_equals_one_chunk(self, llama, monkeypatch, rows):
        """Chunks of rows skip the parts a row cannot hold yet (causality); skipping a part that a
        row does hold would still add up (the shares renormalise), so compare with one chunk."""
        module = importlib.import_module("dpa.baselines.depass")  # the package re-exports the function
        ids = random_ids(T)
        monkeypatch.setattr(module, "_ROWS", 10 ** 9)
        whole = INPUT_METHODS["depass"](llama, None, ids, TARGET, contrast=FOIL).token_scores
        monkeypatch.setattr(module, "_ROWS", rows)
        chunked = INPUT_METHODS["depass"](llama, None, ids, TARGET, contrast=FOIL).token_scores
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)

    @pytest.mark.parametrize("rows", [1, 4])
    def test_ifr_in_row_chunks_equals_one_chunk(self, llama, monkeypatch, rows):
        module = importlib.import_module("dpa.baselines.ifr")
        ids = random_ids(T)
        monkeypatch.setattr(module, "_ROWS", 10 ** 9)
        whole = COMPONENT_METHODS["ifr"](llama, None, ids, TARGET)
        monkeypatch.setattr(module, "_ROWS", rows)
        chunked = COMPONENT_METHODS["ifr"](llama, None, ids, TARGET)
        torch.testing.assert_close(chunked.token_scores, whole.token_scores, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(chunked.edge_scores, whole.edge_scores, rtol=1e-6, atol=1e-7)

    def test_depass_with_a_hard_neuron_rule_still_adds_up(self, llama):
        ids = random_ids(T)
        res = INPUT_METHODS["depass"](llama, None, ids, TARGET, temperature=1e-4)
        assert math.isclose(float(res.token_scores.double().sum()), res.target_logit, rel_tol=1e-5, abs_tol=1e-6)

    def test_ifr_importance_is_a_distribution(self, llama):
        ids = random_ids(T)
        res = INPUT_METHODS["ifr"](llama, None, ids)
        assert (res.token_scores >= 0).all() and math.isclose(float(res.token_scores.sum()), 1.0, rel_tol=1e-5)
        comp = COMPONENT_METHODS["ifr"](llama, None, ids)
        assert (comp.edge_scores >= 0).all() and (comp.neuron_position_scores >= 0).all()
        top = comp.edge_scores[-1].sum((0, 2))  # top layer: only the target position's query carries importance
        assert float(top[:-1].abs().sum()) == 0 and 0 < float(top[-1]) <= 1

    def test_norm_only_is_the_norm_of_the_written_vector(self, llama):
        ids = random_ids(T)
        res = COMPONENT_METHODS["norm_only"](llama, None, ids)
        _, rec = edited_run(llama, ids[None])
        l, h, q, k = 1, 3, 5, 2
        layer = llama.model.layers[l]
        x = layer.input_layernorm(_resid_pre(llama, ids, l))
        v = layer.self_attn.v_proj(x)[0, k].view(2, 8)[h // 2]
        write = rec.probs[l][0, h, q, k] * (layer.self_attn.o_proj.weight[:, h * 8:(h + 1) * 8] @ v)
        assert math.isclose(float(res.edge_scores[l, h, q, k]), float(write.norm()), rel_tol=1e-5)
        a = rec.neuron_inputs[l][0, 4, 9]
        assert math.isclose(float(res.neuron_position_scores[l, 4, 9]),
                            float(a.abs() * layer.mlp.down_proj.weight[:, 9].norm()), rel_tol=1e-5)

    def test_attention_maps(self, llama):
        ids = random_ids(T)
        _, rec = edited_run(llama, ids[None])
        probs = torch.stack([rec.probs[i][0] for i in range(3)])  # [layer head query key]
        got = INPUT_METHODS["last_layer_attention"](llama, None, ids).token_scores
        torch.testing.assert_close(got, probs[-1, :, -1].mean(0).float())
        got = INPUT_METHODS["mean_attention"](llama, None, ids).token_scores
        torch.testing.assert_close(got, probs[:, :, -1].mean((0, 1)).float())
        a = [0.5 * probs[i].mean(0) + 0.5 * torch.eye(T, dtype=torch.float64) for i in range(3)]
        got = INPUT_METHODS["attention_rollout"](llama, None, ids).token_scores
        torch.testing.assert_close(got, (a[2] @ a[1] @ a[0])[-1].float())
        assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-5)
        edges = COMPONENT_METHODS["attn_only"](llama, None, ids).edge_scores
        torch.testing.assert_close(edges, probs.float())
        neurons = COMPONENT_METHODS["mlp_only"](llama, None, ids).neuron_position_scores
        gate = torch.stack([F.silu(_gate(llama, ids, i)) for i in range(3)])
        torch.testing.assert_close(neurons, gate.float())


def _resid_pre(model, ids, layer):
    return model(ids[None], output_hidden_states=True).hidden_states[layer].detach()


def _gate(model, ids, layer):
    m = model.model.layers[layer]
    x = _resid_pre(model, ids, layer)
    with torch.no_grad():
        x = x + m.self_attn(m.input_layernorm(x), position_embeddings=model.model.rotary_emb(x, torch.arange(T)[None]))[0]
        return m.mlp.gate_proj(m.post_attention_layernorm(x))[0]


class TestRandom:
    def test_seeded_and_per_prompt(self, llama):
        a = INPUT_METHODS["random"](llama, None, random_ids(T), seed=3).token_scores
        assert torch.equal(a, INPUT_METHODS["random"](llama, None, random_ids(T), seed=3).token_scores)
        assert not torch.equal(a, INPUT_METHODS["random"](llama, None, random_ids(T), seed=4).token_scores)
        assert not torch.equal(a, INPUT_METHODS["random"](llama, None, random_ids(T, seed=2), seed=3).token_scores)


def test_a_baselines_target_is_the_models_own_logit_in_float64():
    """The one result builder keeps a baseline's target in full precision; under a final soft-cap (Gemma 2) a
    baseline explains the model's own logit, after the cap: target_logit and capped_logit are that value."""
    from dpa.instrument import clean_logits
    from dpa.request import build

    from .conftest import random_ids, tiny_model

    ids = random_ids(8)
    for family in ("llama", "gemma2"):
        model = tiny_model(family, 2)
        res = INPUT_METHODS["gradient"](model, None, ids, 3)
        want = float(clean_logits(model, build(model, None, ids, 3))[0, 3])
        assert res.target_logit == want
        assert res.target.capped_logit == (want if family == "gemma2" else None)
