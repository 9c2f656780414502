"""``dpa.attribute`` against the ground truths: autograd through an independently written modified
model (book: modified-backward, identity 1), the hand rules of the book (``dpa/rules/hand.py``), and the
identities of that chapter, on tiny float64 models of every family and head layout."""

import pytest
import torch

import dpa
from dpa.tiny import FAMILIES

from .conftest import random_ids, tiny_model
from dpa.rules.hand import hand_attribute
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
            # Qwen2: the tokens miss exactly the value biases' share, which no token owns; the gap counts it
            assert abs(res.bias_share) > 1e-3
            assert float(res.token_scores.sum()) - logit == pytest.approx(-res.bias_share, abs=1e-10)
            assert abs(res.completeness_gap) < 1e-10
        else:
            assert res.bias_share == 0
            assert abs(res.completeness_gap) < 1e-6
            assert abs(res.completeness_gap) < 1e-10  # in fact to float64 rounding

    @pytest.mark.parametrize("path", ["default", "unconstrained", "query", "key"])
    def test_bias_share_is_bias_times_branch_gradient(self, path):
        """Each projection bias is an input no token owns: its share is mu_branch * (b . df/db)."""
        model = tiny_model("qwen2", 2)
        ids = random_ids(9)
        mu = PATHS[path]
        res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
        biases = []
        for layer in model.model.layers:
            for proj, m in ((layer.self_attn.q_proj, mu[0]), (layer.self_attn.k_proj, mu[1]),
                            (layer.self_attn.v_proj, mu[2])):
                proj.bias.requires_grad_(True)
                biases.append((proj.bias, m))
        try:
            emb = model.model.embed_tokens(ids[None]).detach()
            final = reference_forward(model, emb, mu=mu)
            value = final[0, -1] @ model.lm_head.weight[TARGET]
            grads = torch.autograd.grad(value, [b for b, _ in biases])  # unscaled: mu acts at the branch input
        finally:
            model.requires_grad_(False)
        share = sum(m * float(b @ g) for (b, m), g in zip(biases, grads))
        assert abs(share) > 1e-3
        assert res.bias_share == pytest.approx(share, rel=1e-9, abs=1e-11)

    def test_query_key_paths_leave_a_gap(self, family_model):
        res = dpa.attribute(family_model, None, random_ids(10), target=TARGET)
        assert abs(res.completeness_gap) > 1e-4


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
    def test_batch_equals_single(self, family_model):
        prompts = [random_ids(9, seed=1), random_ids(5, seed=2), random_ids(12, seed=3)]
        batch = dpa.attribute(family_model, None, prompts, target=TARGET, edges=True)
        for p, b in zip(prompts, batch):
            single = dpa.attribute(family_model, None, p, target=TARGET, edges=True)
            assert b.token_ids == single.token_ids
            torch.testing.assert_close(b.token_scores, single.token_scores)
            torch.testing.assert_close(b.head_scores, single.head_scores)
            torch.testing.assert_close(b.neuron_scores, single.neuron_scores)
            torch.testing.assert_close(b.edge_scores, single.edge_scores)
            assert b.target_logit == pytest.approx(single.target_logit, abs=1e-10)
            assert b.target.position == single.target.position == len(p) - 1

    @pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "mistral", "gpt_oss"])
    def test_padding_longer_than_the_sliding_window(self, family, monkeypatch):
        """A padded row past a local layer's window has no real key to read: dpa must not mask it out (Gemma 2's own
        eager attention, float32 softmax of float64 scores, made such a row NaN and the batch failed)."""
        from transformers.models.gemma2 import modeling_gemma2

        eager = modeling_gemma2.eager_attention_forward
        monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", getattr(eager, "original", eager))
        model = tiny_model(family, 2)
        prompts = [random_ids(14, seed=1), random_ids(3, seed=2)]  # 11 padded positions, windows of 5
        batch = dpa.attribute(model, None, prompts, target=TARGET)
        for p, b in zip(prompts, batch):
            single = dpa.attribute(model, None, p, target=TARGET)
            # HF's Gemma 2 takes its softmax in float32: equal to float32 rounding
            torch.testing.assert_close(b.token_scores, single.token_scores, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b.head_scores, single.head_scores, rtol=1e-5, atol=1e-6)

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


class TestHandRules:
    """Each rule the book derives, chained top-down, equals the library's autograd result: path by path
    (one mu non-zero at a time), all together, and off the paper's constraints."""

    @pytest.mark.parametrize("path", list(PATHS))
    def test_every_score_equals_the_hand_sweep(self, family_model, path):
        ids = random_ids(9)
        mu = PATHS[path]
        res = dpa.attribute(family_model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu), edges=True,
                            neuron_positions=True, effective_targets=True)
        hand = hand_attribute(family_model, dpa.spec_for(family_model), ids, TARGET, mu=mu)
        for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores",
                     "effective_targets"):
            torch.testing.assert_close(getattr(res, name), getattr(hand, name), rtol=1e-9, atol=1e-11, msg=name)
        assert res.target_logit == pytest.approx(hand.target_logit, abs=1e-10)
        if mu == (0, 0, 1, 0, 0):  # value path only: the bias share is the value biases'
            assert res.bias_share == pytest.approx(hand.value_bias_share, abs=1e-10)

    def test_mid_neuron_target(self, family_model):
        ids = random_ids(9)
        res = dpa.attribute(family_model, None, ids, target=TARGET, neuron_positions=True, neuron_target="mid")
        hand = hand_attribute(family_model, dpa.spec_for(family_model), ids, TARGET, neuron_target="mid")
        torch.testing.assert_close(res.neuron_position_scores, hand.neuron_position_scores, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(res.neuron_scores, hand.neuron_scores, rtol=1e-9, atol=1e-11)


class TestLeanMode:
    def test_lean_equals_full(self, family_model):
        ids = random_ids(10)
        kw = dict(target=TARGET, edges=True, neuron_positions=True, effective_targets=True)
        full = dpa.attribute(family_model, None, ids, memory="full", **kw)
        lean = dpa.attribute(family_model, None, ids, memory="lean", **kw)
        for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores", "neuron_position_scores",
                     "effective_targets"):
            torch.testing.assert_close(getattr(lean, name), getattr(full, name), rtol=1e-12, atol=1e-13)
        assert lean.bias_share == pytest.approx(full.bias_share, abs=1e-12)

    def test_lean_mid_target(self):
        model = tiny_model("qwen3", 2)
        ids = random_ids(10)
        full = dpa.attribute(model, None, ids, target=TARGET, neuron_target="mid", memory="full")
        lean = dpa.attribute(model, None, ids, target=TARGET, neuron_target="mid", memory="lean")
        torch.testing.assert_close(lean.neuron_scores, full.neuron_scores, rtol=1e-12, atol=1e-13)

    def test_auto_plan(self):
        from dpa.attribute import graph_bytes, plan_memory

        model = tiny_model("llama", 2)
        spec = dpa.spec_for(model)
        assert not plan_memory(model, spec, 1, 16, "auto", budget=2**30)
        assert plan_memory(model, spec, 1, 4096, "auto", budget=graph_bytes(model, spec, 1, 4096))
        assert plan_memory(model, spec, 1, 4, "lean") and not plan_memory(model, spec, 1, 10**6, "full")

    @pytest.mark.parametrize("family", FAMILIES)
    def test_the_full_graph_estimate_bounds_what_the_graph_keeps(self, family):
        """``memory='auto'`` decides from ``graph_bytes``: it must not be below what a full-mode call's autograd graph
        keeps (an estimate below it picked full mode where it did not fit: Gemma 3's sandwich norms and q/k norms
        doubled the old count), nor far above it (lean, 1.3-1.5x slower, where full fits)."""
        from dpa.attribute import graph_bytes

        model = tiny_model(family, 2)
        ids = random_ids(64)
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            dpa.attribute(model, None, ids, target=TARGET, memory="full")
        estimate = graph_bytes(model, dpa.spec_for(model), 1, len(ids))
        assert sum(kept.values()) <= estimate <= 2 * sum(kept.values())


class TestProbabilities:
    def test_without_probabilities_the_scores_are_the_same(self):
        model = tiny_model("qwen2", 2)
        ids = random_ids(8)
        full = dpa.attribute(model, None, ids, target=TARGET)
        lean = dpa.attribute(model, None, ids, target=TARGET, probabilities=False)
        assert torch.equal(full.token_scores, lean.token_scores) and full.target_logit == lean.target_logit
        assert lean.target.probability is None and lean.top_predictions == []
        assert full.target.probability > 0 and len(full.top_predictions) == 5

    def test_the_prediction_needs_them_anyway(self):
        model = tiny_model("llama", 2)
        res = dpa.attribute(model, None, random_ids(8), probabilities=False)
        assert res.target.token_id == int(model(random_ids(8)[None]).logits[0, -1].argmax())
        assert res.target.probability is not None
