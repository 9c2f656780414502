"""The identities of method.md section 5 on tiny float64 models of every family and head layout."""

import pytest
import torch

import dpa

from .conftest import random_ids, tiny_model
from .reference import reference_forward

PATHS = {  # (query, key, value, gate, up)
    "query": (1, 0, 0, 0, 0), "key": (0, 1, 0, 0, 0), "value": (0, 0, 1, 0, 0),
    "gate": (0, 0, 0, 1, 0), "up": (0, 0, 0, 0, 1), "default": (0.25, 0.25, 0.5, 0.5, 0.5),
    "unconstrained": (0.7, 0.1, 0.4, 0.2, 1.3),
}
TARGET = 7


def autograd_targets(model, ids, mu, target=TARGET, position=-1):
    """Gradient of the target logit w.r.t. every residual stream of the modified model."""
    emb = model.model.embed_tokens(ids[None]).detach().requires_grad_(True)
    record = []
    final = reference_forward(model, emb, mu=mu, record=record)
    for x in record:
        x.retain_grad()
    (final[0, position] @ model.lm_head.weight[target]).backward()
    return emb.grad[0], [x.grad[0] for x in record]


class TestModifiedGradient:
    @pytest.mark.parametrize("path", list(PATHS))
    def test_effective_target_equals_autograd(self, family_model, path):
        ids = random_ids(9)
        res = dpa.attribute(family_model, None, ids, target=TARGET, weights=dpa.PathWeights(*PATHS[path]),
                            effective_targets=True)
        grad, _ = autograd_targets(family_model, ids, PATHS[path])
        torch.testing.assert_close(res.effective_targets[0], grad)

    def test_every_layer_boundary(self, family_model):
        ids = random_ids(9)
        mu = PATHS["default"]
        res = dpa.attribute(family_model, None, ids, target=TARGET, effective_targets=True)
        _, grads = autograd_targets(family_model, ids, mu)
        outputs = grads[::2]  # x^(0), x^(1), ..., x^(L)
        assert len(outputs) == res.effective_targets.shape[0]
        for layer, g in enumerate(outputs):
            torch.testing.assert_close(res.effective_targets[layer], g, msg=f"boundary {layer}")

    def test_non_default_position(self, family_model):
        ids = random_ids(9)
        res = dpa.attribute(family_model, None, ids, target=TARGET, position=4, effective_targets=True)
        grad, _ = autograd_targets(family_model, ids, PATHS["default"], position=4)
        torch.testing.assert_close(res.effective_targets[0], grad)
        assert res.effective_targets[0][5:].abs().max() == 0  # nothing flows backwards in time


class TestCompleteness:
    @pytest.mark.parametrize("gate", [0.0, 0.5, 0.8, 1.0])
    def test_token_scores_sum_to_logit(self, family_model, gate):
        ids = random_ids(10)
        res = dpa.attribute(family_model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, gate, 1 - gate))
        logit = family_model(ids[None]).logits[0, -1, TARGET].item()
        assert res.target_logit == pytest.approx(logit, abs=1e-10)
        if dpa.spec_for(family_model).qkv_bias:
            # Qwen2: the gap is exactly the value biases' share, which no token owns
            assert abs(res.bias_share) > 1e-3
            assert res.completeness_gap == pytest.approx(-res.bias_share, abs=1e-10)
        else:
            assert res.bias_share == 0
            assert abs(res.completeness_gap) < 1e-6
            assert abs(res.completeness_gap) < 1e-10  # in fact to float64 rounding

    def test_query_key_paths_leave_a_gap(self, family_model):
        res = dpa.attribute(family_model, None, random_ids(10), target=TARGET)
        assert abs(res.completeness_gap + res.bias_share) > 1e-4


class TestComponentSums:
    @pytest.mark.parametrize("neuron_target", ["output", "mid"])
    def test_edges_and_neurons_sum_to_block_outputs(self, family_model, neuron_target):
        ids = random_ids(9)
        mu = PATHS["default"]
        res = dpa.attribute(family_model, None, ids, target=TARGET, edges=True, neuron_positions=True,
                            neuron_target=neuron_target)
        emb = family_model.model.embed_tokens(ids[None]).detach().requires_grad_(True)
        record = []
        final = reference_forward(family_model, emb, mu=mu, record=record)
        for x in record:
            x.retain_grad()
        (final[0, -1] @ family_model.lm_head.weight[TARGET]).backward()
        for layer in range(dpa.spec_for(family_model).n_layers):
            x_in, x_mid, x_out = record[2 * layer], record[2 * layer + 1], record[2 * layer + 2]
            t_mid, t_out = x_mid.grad[0], x_out.grad[0]
            attn_out, glu_out = (x_mid - x_in)[0].detach(), (x_out - x_mid)[0].detach()
            edges = res.edge_scores[layer]
            torch.testing.assert_close(edges.sum(), (t_mid * attn_out).sum())
            torch.testing.assert_close(edges.sum((1, 2)), res.head_scores[layer])
            assert edges.triu(1).abs().max() == 0  # causal: no key after its query
            t_n = t_out if neuron_target == "output" else t_mid
            torch.testing.assert_close(res.neuron_position_scores[layer].sum(), (t_n * glu_out).sum())
            torch.testing.assert_close(res.neuron_position_scores[layer].sum(0), res.neuron_scores[layer])

    def test_sliding_window_edges(self):
        model = tiny_model("mistral", 2)
        res = dpa.attribute(model, None, random_ids(12), target=TARGET, edges=True)
        q, k = torch.meshgrid(torch.arange(12), torch.arange(12), indexing="ij")
        assert res.edge_scores[:, :, q - k >= 5].abs().max() == 0
        last_row = res.edge_scores[-1, :, 11]  # the target's own query row in the top layer
        assert last_row[:, 7:].abs().min() > 0 and last_row[:, :7].abs().max() == 0


class TestBatching:
    @pytest.mark.parametrize("side", ["right", "left"])
    def test_batch_equals_single(self, family_model, side):
        prompts = [random_ids(9, seed=1), random_ids(5, seed=2), random_ids(12, seed=3)]
        batch = dpa.attribute(family_model, None, prompts, target=TARGET, padding_side=side, edges=True)
        for p, b in zip(prompts, batch):
            single = dpa.attribute(family_model, None, p, target=TARGET, edges=True)
            assert b.token_ids == single.token_ids
            torch.testing.assert_close(b.token_scores, single.token_scores)
            torch.testing.assert_close(b.head_scores, single.head_scores)
            torch.testing.assert_close(b.neuron_scores, single.neuron_scores)
            torch.testing.assert_close(b.edge_scores, single.edge_scores)
            assert b.target_logit == pytest.approx(single.target_logit, abs=1e-10)
            assert b.target.position == single.target.position == len(p) - 1

    def test_per_sample_targets_and_positions(self):
        model = tiny_model("llama", 2)
        prompts = [random_ids(9, seed=1), random_ids(6, seed=2)]
        batch = dpa.attribute(model, None, prompts, target=[3, 4], position=[4, -2])
        single = dpa.attribute(model, None, prompts[1], target=4, position=4)
        torch.testing.assert_close(batch[1].token_scores, single.token_scores)
        assert batch[0].target.position == 4 and batch[1].target.position == 4


ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16},
}


class TestRopeScaling:
    @pytest.mark.parametrize("kind", list(ROPE))
    def test_scaled_rope_matches_autograd(self, kind):
        model = tiny_model("llama", 2, rope_parameters=ROPE[kind])
        ids = random_ids(12)
        res = dpa.attribute(model, None, ids, target=TARGET, effective_targets=True)
        grad, _ = autograd_targets(model, ids, PATHS["default"])
        torch.testing.assert_close(res.effective_targets[0], grad)
        if kind == "dynamic":
            return  # dynamic scaling only acts beyond the context length; the identity above still holds
        base = dpa.attribute(tiny_model("llama", 2), None, ids, target=TARGET)
        assert not torch.allclose(res.token_scores, base.token_scores)  # the scaling did change something


class TestLeanMode:
    def test_lean_equals_full(self, family_model):
        ids = random_ids(10)
        full = dpa.attribute(family_model, None, ids, target=TARGET, edges=True, neuron_positions=True)
        for block in (None, 3, 1):  # blocks smaller than the sequence, down to one query row
            lean = dpa.attribute(family_model, None, ids, target=TARGET, edges=True, neuron_positions=True,
                                 memory="lean", block=block)
            for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores"):
                torch.testing.assert_close(getattr(lean, name), getattr(full, name))
            assert lean.bias_share == pytest.approx(full.bias_share, abs=1e-12)

    def test_auto_plan(self):
        from dpa.propagate import plan_memory

        spec = dpa.spec_for(tiny_model("llama", 2))
        weight = torch.zeros(1, dtype=torch.float32)
        assert plan_memory(spec, 1, 16, weight, "auto", budget=2**30).cache_projections
        small = plan_memory(spec, 1, 4096, weight, "auto", budget=2**26)
        assert not small.cache_projections and small.block is not None and small.block < 4096
