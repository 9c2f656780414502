"""CircuitWidget: its payload against the attribution it shows, trait validation and serialisation,
the live controls recomputing in the kernel, verification, and save_html."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
import traitlets

import dpa
from dpa_widgets import CircuitWidget, save_html
from dpa_widgets import live, payload
from dpa_widgets.export import _inline

from .conftest import random_ids, tiny_model

PROMPT = random_ids(7).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", kv_heads=2)


@pytest.fixture(scope="module")
def result(model):
    return dpa.attribute(model, None, PROMPT, edges=True, neuron_positions=True)


@pytest.fixture
def widget(model, result):
    return CircuitWidget(result, model, None)


def close(a, b, tol=1e-4):
    return torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.as_tensor(b).double(),
                                      rtol=tol, atol=tol * 1e-2)


class TestPayload:
    def test_scores_match_the_result(self, result):
        data = payload.view_payload(result, top_neurons=5)
        assert data["tokens"] == result.tokens
        close(data["token_scores"], result.token_scores)
        close(data["head_scores"], result.head_scores)
        assert (data["n_layers"], data["n_heads"], data["n_kv_heads"]) == (3, 4, 2)
        close(data["mlp_totals"], result.neuron_scores.sum(1))  # totals over every neuron, not the top ones

    def test_top_neurons_per_layer_by_magnitude(self, result):
        data = payload.view_payload(result, top_neurons=5)
        for layer, (index, score) in enumerate(zip(data["neurons"]["index"], data["neurons"]["score"])):
            expected = result.neuron_scores[layer].abs().topk(5).indices.tolist()
            assert index == expected
            close(score, result.neuron_scores[layer, expected])

    def test_token_routes_are_edge_sums_over_queries(self, result):
        routes = payload.token_routes(result, k=3)
        by_key = result.edge_scores.sum(2)  # [layer head key]
        npos = result.neuron_position_scores
        for j, route in enumerate(routes):
            assert len(route["heads"]) == 3
            best = by_key[:, :, j].abs().flatten().topk(3).indices.tolist()
            assert [l * 4 + h for l, h, _ in route["heads"]] == best
            for l, h, v in route["heads"]:
                close([v], [by_key[l, h, j]])
            for l, n, v in route["neurons"]:
                close([v], [npos[l, j, n]])

    def test_no_routes_without_edges(self, model):
        plain = dpa.attribute(model, None, PROMPT)
        assert payload.token_routes(plain) is None
        assert payload.head_detail(plain, 0, 1)["edges"] is None

    def test_details(self, model, result):
        head = payload.head_detail(result, 2, 3)
        close(head["edges"], result.edge_scores[2, 3])
        close(head["by_key"], result.edge_scores[2, 3].sum(0))
        close(head["by_key"], result.edge_scores[2, 3].sum(0))
        assert sum(head["by_key"]) == pytest.approx(float(result.head_scores[2, 3]), rel=1e-3, abs=1e-6)
        vocab = live.neuron_vocab(model, None, 1, 4, k=3)
        neuron = payload.neuron_detail(result, 1, 4, vocab)
        close(neuron["by_pos"], result.neuron_position_scores[1, :, 4])
        with pytest.raises(IndexError, match="outside"):
            payload.head_detail(result, 3, 0)

    def test_neuron_vocab_reads_the_down_column_through_the_unembedding(self, model):
        promotes, suppresses = live.neuron_vocab(model, None, 1, 4, k=3)
        effect = model.lm_head.weight @ (model.model.layers[1].mlp.down_proj.weight[:, 4] * model.model.norm.weight)
        assert [int(t) for t, _ in promotes] == effect.topk(3).indices.tolist()
        assert [int(t) for t, _ in suppresses] == (-effect).topk(3).indices.tolist()
        assert promotes[0][1] == pytest.approx(float(effect.max()), rel=1e-5)

    def test_rounding(self):
        assert payload.rounded(torch.tensor([[1.23456789, -2e-9]])) == [[1.2346, -2e-9]]
        assert payload.rounded(None) is None

    def test_spearman(self):
        a = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert payload.spearman(a, a * 10) == pytest.approx(1.0)
        assert payload.spearman(a, -a) == pytest.approx(-1.0)
        # ties share their mean rank: ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4)
        expected = 4.5 / math.sqrt(4.5 * 5)
        assert payload.spearman(torch.tensor([1.0, 2.0, 2.0, 3.0]), a) == pytest.approx(expected)
        assert math.isnan(payload.spearman(torch.ones(4), a))
        with pytest.raises(ValueError):
            payload.spearman(a, a[:3])


# The keys of a dense result's payload: a mixture of experts adds its own, a dense model none (nor nulls).
DENSE_KEYS = {"tokens", "token_scores", "special", "target", "target_logit", "completeness_gap", "caveats", "weights",
              "method", "model_name", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "head_scores", "mlp_totals",
              "neurons", "top_predictions", "token_routes"}
EXPERT_KEYS = {"n_experts", "d_expert", "expert_names", "expert_scores"}


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def moe(request):
    """A tiny mixture-of-experts model (4 experts, 2 per token; Qwen2-MoE with a shared expert) and its result."""
    model = tiny_model(request.param, 2)
    return model, dpa.attribute(model, None, PROMPT, edges=True, neuron_positions=True)


class TestExpertPayload:
    def test_dense_payload_is_unchanged(self, result):
        data = payload.view_payload(result)
        assert set(data) == DENSE_KEYS
        assert all(set(route) == {"heads", "neurons"} for route in data["token_routes"])
        assert payload.expert_layout(result) is None and payload.top_experts(result, 3) == []
        with pytest.raises(IndexError, match="no expert scores"):
            payload.expert_detail(result, 0, 0)

    def test_expert_scores_names_and_layout(self, moe):
        model, res = moe
        spec = dpa.spec_for(model)
        data = payload.view_payload(res, experts=(spec.n_experts, spec.d_expert))
        assert set(data) == DENSE_KEYS | EXPERT_KEYS
        json.dumps(data, allow_nan=False)
        shared = spec.d_shared > 0
        assert data["n_experts"] == 4 and data["d_expert"] == spec.d_expert
        assert data["expert_names"] == ["E0", "E1", "E2", "E3"] + (["shared"] if shared else [])
        close(data["expert_scores"], res.expert_scores)
        assert data["d_mlp"] == 4 * spec.d_expert + spec.d_shared

    def test_layout_read_off_the_result(self, moe):
        model, res = moe
        spec = dpa.spec_for(model)
        assert payload.expert_layout(res) == (4, spec.d_expert)  # the result records d_expert
        # a result without it: routed experts alone share d_mlp evenly; Qwen2-MoE's wider shared expert does not
        bare = dataclasses.replace(res, d_expert=None)
        expected = (4, None) if spec.d_shared else (4, spec.d_expert)
        assert payload.expert_layout(bare) == expected
        assert payload.view_payload(bare)["d_expert"] == expected[1]
        with pytest.raises(dpa.InputError, match="do not fit"):
            payload.expert_layout(res, (2, spec.d_expert))  # 4 or 5 slots: 4 experts (and a shared one)
        with pytest.raises(dpa.InputError, match="do not fit"):
            payload.expert_layout(res, (4, spec.d_expert + (4 if spec.d_shared else 1)))  # no room for the shared

    def test_routes_and_details_carry_the_experts(self, moe):
        _, res = moe
        routes = payload.token_routes(res, k=3)
        epos = res.expert_position_scores  # [layer pos slot]
        slots = epos.shape[2]
        for j, route in enumerate(routes):
            best = epos[:, j].abs().flatten().topk(3).indices.tolist()
            assert [l * slots + e for l, e, _ in route["experts"]] == best
            for l, e, v in route["experts"]:
                close([v], [epos[l, j, e]])
        detail = payload.expert_detail(res, 1, slots - 1)
        assert detail["kind"] == "expert" and detail["index"] == slots - 1
        close([detail["score"]], [res.expert_scores[1, -1]])
        close(detail["by_pos"], epos[1, :, -1])
        with pytest.raises(IndexError, match="outside"):
            payload.expert_detail(res, 0, slots)
        plain = dpa.attribute(moe[0], None, PROMPT)
        assert payload.expert_detail(plain, 0, 0)["by_pos"] is None

    def test_widget_shows_the_experts(self, moe):
        model, res = moe
        spec = dpa.spec_for(model)
        w = CircuitWidget(res, model, None)
        assert w._data["d_expert"] == spec.d_expert and w._data["n_experts"] == 4
        # the defaults (balanced router / experts filled in) are not the result's "custom" weights
        assert w.weights_preset == "default" and "custom" not in w._presets
        assert (w._data["weights"]["router"], w._data["weights"]["expert"]) == (0.5, 0.5)
        for layer, slot in payload.top_experts(res, 8):
            assert f"expert:{layer}:{slot}" in w._details
        layer, slot = next((l, e) for l in range(3) for e in range(spec.expert_slots)
                           if f"expert:{l}:{e}" not in w._details)
        w.selected_expert = [layer, slot]  # not sent up front: sent on selection
        close(w._details[f"expert:{layer}:{slot}"]["by_pos"], res.expert_position_scores[layer, :, slot])
        with pytest.raises(dpa.InputError, match="selected_expert"):
            w.selected_expert = [0, spec.expert_slots]
        with pytest.raises(dpa.InputError, match="whole expert"):
            w.verify("disrupt", "selection")
        w.weights_preset = "attention"  # a recompute keeps the experts on view, and the selection
        assert w._error == "" and w._data["weights"]["query"] == pytest.approx(0.25)
        assert set(w._data) == DENSE_KEYS | EXPERT_KEYS and f"expert:{layer}:{slot}" in w._details
        static = CircuitWidget(res, selected_expert=[2, 1])  # no model: the layout the result records
        assert static.selected_expert == [2, 1] and "expert:2:1" in static._details
        assert static._data["d_expert"] == spec.d_expert

    def test_save_html_carries_the_experts(self, moe, tmp_path):
        model, res = moe
        w = CircuitWidget(res, model, None, selected_expert=[1, 0])
        text = save_html(w, tmp_path / "moe.html").read_text()
        model_state = saved_state(text)
        assert model_state["selected_expert"] == [1, 0] and "expert:1:0" in model_state["_details"]
        assert len(model_state["_data"]["expert_scores"]) == 3


class TestTraits:
    def test_state_is_json_and_carries_the_module(self, widget):
        state = widget.get_state()
        text = json.dumps(state, allow_nan=False)
        assert "export default" in state["_esm"] and "@typedef Model" in state["_esm"]
        assert ".dpa-circuit" in state["_css"]
        assert json.loads(text)["_data"]["tokens"] == widget.result.tokens
        for name in ("selected_head", "selected_neuron", "selected_expert", "selected_token", "selection", "target",
                     "contrast",
                     "weights_preset", "weights_p", "method", "top_k", "_data", "_details", "_live"):
            assert name in state, name

    def test_initial_traits(self, widget, result):
        assert widget._live and widget.target == result.target.token and widget.contrast == ""
        assert widget.selected_head is None and widget.selected_token is None
        assert widget._methods[0] == "dpa"
        assert all(m.startswith(("tokens:", "components:")) for m in widget._methods[1:])

    def test_unknown_and_bad_arguments(self, result, model):
        with pytest.raises(TypeError, match="unexpected keyword argument.*colour"):
            CircuitWidget(result, colour="red")
        with pytest.raises(TypeError, match="dpa.Attribution"):
            CircuitWidget(result.to_dict())
        with pytest.raises(ValueError, match="need model and tokenizer"):
            CircuitWidget(result, target="3")
        with pytest.raises(ValueError, match="top_neurons"):
            CircuitWidget(result, top_neurons=0)
        with pytest.raises(traitlets.TraitError, match="outside"):
            CircuitWidget(result, selected_head=[3, 0])

    def test_selection_validation(self, widget):
        widget.selected_head = [2, 3]
        with pytest.raises(traitlets.TraitError):
            widget.selected_head = [0, 4]
        with pytest.raises(traitlets.TraitError):
            widget.selected_neuron = [0, 48]
        with pytest.raises(traitlets.TraitError):
            widget.selected_token = 7
        with pytest.raises(traitlets.TraitError):
            widget.weights_preset = "nonsense"
        with pytest.raises(traitlets.TraitError):
            widget.weights_p = 1.5
        assert widget.selected_head == [2, 3]

    # Every user-facing trait, set after construction to a value it cannot take: a dpa error (also a
    # traitlets.TraitError) naming the trait, and the trait keeps its value.
    BAD_TRAITS = [
        ("selected_head", [0, 4], dpa.InputError), ("selected_head", [-1, 0], dpa.InputError),
        ("selected_head", [0], dpa.InputTypeError), ("selected_head", "0,1", dpa.InputTypeError),
        ("selected_head", [0.5, 1], dpa.InputTypeError), ("selected_neuron", [0, 48], dpa.InputError),
        ("selected_neuron", [3, 0], dpa.InputError), ("selected_neuron", [1, 2, 3], dpa.InputTypeError),
        ("selected_expert", [0, 0], dpa.InputError), ("selected_expert", [0], dpa.InputTypeError),
        ("selected_token", 7, dpa.InputError), ("selected_token", -1, dpa.InputError),
        ("selected_token", "2", dpa.InputTypeError), ("selected_token", 2.5, dpa.InputTypeError),
        ("target", 5, dpa.InputTypeError), ("target", None, dpa.InputTypeError),
        ("contrast", 3.0, dpa.InputTypeError), ("weights_preset", "nonsense", dpa.InputError),
        ("weights_preset", "Default", dpa.InputError), ("weights_preset", None, dpa.InputTypeError),
        ("weights_p", 1.5, dpa.InputError), ("weights_p", -0.1, dpa.InputError),
        ("weights_p", float("nan"), dpa.InputError), ("weights_p", "half", dpa.InputTypeError),
        ("method", "nonsense", dpa.InputError), ("method", "gradient", dpa.InputError),
        ("method", 1, dpa.InputTypeError), ("top_k", 0, dpa.InputError), ("top_k", -3, dpa.InputError),
        ("top_k", 2.5, dpa.InputTypeError), ("top_k", "10", dpa.InputTypeError),
    ]

    @pytest.mark.parametrize("name,value,error", BAD_TRAITS,
                             ids=[f"{n}={v!r}" for n, v, _ in BAD_TRAITS])
    def test_bad_trait_values_are_dpa_errors(self, widget, name, value, error):
        before = getattr(widget, name)
        with pytest.raises(error, match=name) as info:
            setattr(widget, name, value)
        assert isinstance(info.value, traitlets.TraitError)
        assert getattr(widget, name) == before or (before != before)  # unchanged (NaN-safe)
        assert widget._error == ""

    def test_results_a_live_widget_cannot_show_truly_are_refused(self, model, result):
        from dpa import baselines

        with pytest.raises(dpa.InputError, match="'gradient' attribution"):  # it would be replaced by DPA
            CircuitWidget(baselines.gradient(model, None, PROMPT, 3), model, None)
        assert CircuitWidget(baselines.gradient(model, None, PROMPT, 3)).result.method == "gradient"  # no model: as is
        with pytest.raises(dpa.InputError, match="does not fit this model: it has 3 layers x 4 heads"):
            CircuitWidget(result, tiny_model("llama", num_hidden_layers=2), None)
        broken = dpa.Attribution.from_dict({**result.to_dict(), "token_scores": [None] * len(result.tokens)})
        with pytest.raises(dpa.NonFiniteError, match="token_scores"):
            CircuitWidget(broken)
        vector = dpa.attribute(model, None, PROMPT, target=torch.ones(model.config.hidden_size, dtype=torch.float64))
        w = CircuitWidget(vector, model, None)
        with pytest.raises(dpa.InputError, match="vector target"):
            w.method = "tokens:gradient"
        with pytest.raises(dpa.TargetError, match="vector target"):
            live.compare(model, None, vector, "tokens:gradient")

    def test_verify_arguments_are_checked(self, widget):
        with pytest.raises(dpa.InputError, match="mode"):
            widget.verify(mode="break")
        with pytest.raises(dpa.InputError, match="units"):
            widget.verify(units="everything")

    def test_selecting_sends_the_details(self, widget, result):
        widget.selected_neuron = [0, 47]
        detail = widget._details["neuron:0:47"]
        close(detail["by_pos"], result.neuron_position_scores[0, :, 47])
        assert detail["promotes"] is not None
        for layer, head in payload.top_heads(result, 8):
            assert f"head:{layer}:{head}" in widget._details

    def test_static_widget(self, result):
        w = CircuitWidget(result, selected_token=2)
        assert not w._live and w.selected_token == 2
        assert w._details["neuron:" + ":".join(map(str, payload.top_neurons(result, 1)[0]))]["promotes"] is None
        w.target = "5"
        assert "needs the model" in w._error


def _custom_message(widget, content: dict, monkeypatch) -> list[dict]:
    """Deliver ``content`` as the view would (a comm "custom" message); return what the widget sent back."""
    sent: list[dict] = []
    monkeypatch.setattr(widget, "_send", lambda msg, buffers=None: sent.append(msg))
    widget._handle_msg({"content": {"data": {"method": "custom", "content": content}}, "buffers": []})
    return sent


class TestKernelHandshake:
    """The view is live only once the kernel answers its hello (saved state keeps _live true with no kernel)."""

    def test_hello_is_answered_with_live(self, widget, monkeypatch):
        sent = _custom_message(widget, {"action": "hello"}, monkeypatch)
        assert sent == [{"method": "custom", "content": {"action": "hello", "live": True}}]

    def test_a_widget_without_a_model_answers_not_live(self, result, monkeypatch):
        sent = _custom_message(CircuitWidget(result), {"action": "hello"}, monkeypatch)
        assert sent == [{"method": "custom", "content": {"action": "hello", "live": False}}]

    def test_other_messages_get_no_hello(self, widget, monkeypatch):
        assert _custom_message(widget, {"action": "nonsense"}, monkeypatch) == []
        assert _custom_message(widget, ["hello"], monkeypatch) == []


class TestLive:
    def test_result_without_edges_gets_them(self, model):
        w = CircuitWidget(dpa.attribute(model, None, PROMPT), model, None)
        assert w.result.edge_scores is not None and w._data["token_routes"] is not None

    def test_target_change_recomputes(self, widget, model):
        other = next(p for p in widget._predictions if p.token_id != widget.result.target.token_id)
        widget.target = other.token
        assert widget._error == ""
        expected = dpa.attribute(model, None, PROMPT, target=other.token_id)
        assert widget._data["target"]["token_id"] == other.token_id
        close(widget._data["token_scores"], expected.token_scores)
        assert not widget._busy

    def test_contrast_and_preset(self, widget, model):
        foil = widget._predictions[1]
        with widget.hold_trait_notifications():
            widget.contrast = foil.token
            widget.weights_preset = "attention"
            widget.weights_p = 0.8
        weights = dpa.PathWeights.preset("attention", 0.8)
        expected = dpa.attribute(model, None, PROMPT, contrast=foil.token_id, weights=weights)
        assert widget._data["target"]["contrast_id"] == foil.token_id
        assert widget._data["weights"]["value"] == pytest.approx(0.8)
        close(widget._data["head_scores"], expected.head_scores)

    def test_bad_target_reports_and_keeps_the_view(self, widget):
        before = widget._data
        widget.target = "999"  # outside the tiny vocabulary
        assert widget._error.startswith("TargetError") and "vocabulary" in widget._error
        assert widget._data is before

    def test_custom_weights_survive_a_recompute(self, model):
        """A result computed with its own path weights keeps them when the target changes in the view."""
        custom = dpa.PathWeights(0.1, 0.2, 0.7, 0.3, 0.7)
        res = dpa.attribute(model, None, PROMPT, weights=custom)
        w = CircuitWidget(res, model, None)
        assert w.weights_preset == "custom" and "custom" in w._presets
        other = w._predictions[1]
        w.target = other.token
        assert w._error == "" and w._data["target"]["token_id"] == other.token_id
        assert w._data["weights"] == {"query": 0.1, "key": 0.2, "value": 0.7, "gate": 0.3, "up": 0.7}
        expected = dpa.attribute(model, None, PROMPT, target=other.token_id, weights=custom)
        close(w._data["head_scores"], expected.head_scores)
        w.weights_preset = "attention"  # another preset, then back to the result's own
        w.weights_preset = "custom"
        assert w._data["weights"]["query"] == pytest.approx(0.1)

    def test_two_widgets_on_one_model_keep_their_own_state(self, model):
        a = CircuitWidget(dpa.attribute(model, None, PROMPT), model, None)
        b = CircuitWidget(dpa.attribute(model, None, PROMPT), model, None)
        before = b._data
        a.target = a._predictions[2].token
        a.weights_preset = "mlp"
        assert b._data is before and b.weights_preset == "default" and b.target == b.result.target.token
        assert a._data["target"]["token_id"] == a._predictions[2].token_id

    def test_custom_is_refused_without_custom_weights(self, widget):
        assert "custom" not in widget._presets
        with pytest.raises(traitlets.TraitError, match="own path weights"):
            widget.weights_preset = "custom"

    def test_any_failing_recompute_is_shown(self, widget, monkeypatch):
        """Not only dpa's own errors: whatever fails in the kernel is shown, and the picture kept."""
        before = widget._data

        def broken(*_a, **_k):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(live, "recompute", broken)
        widget.weights_preset = "mlp"
        assert widget._error == "RuntimeError: out of memory" and widget._data is before and not widget._busy

    def test_kwargs_apply_on_construction(self, result, model):
        w = CircuitWidget(result, model, None, weights_preset="control_content", weights_p=1.0)
        assert w._data["weights"] == {"query": 0.0, "key": 0.0, "value": 1.0, "gate": 0.0, "up": 1.0}
        # value path only, gate + up = 1: the token scores sum to the target (book: modified-backward)
        assert sum(w._data["token_scores"]) == pytest.approx(w._data["target_logit"], rel=1e-3)

    def test_method_switch_reports_rank_correlation(self, widget, model):
        widget.method = "tokens:gradient"
        cmp = widget._comparison
        assert widget._error == "" and cmp["level"] == "input"
        fn = live.baseline_methods()["tokens:gradient"][1]
        other = fn(model, None, PROMPT, widget.result.target.token_id)
        assert cmp["rho"] == pytest.approx(payload.spearman(widget.result.token_scores, other.token_scores))
        widget.method = "dpa"
        assert widget._comparison == {}

    def test_unknown_method(self, widget):
        with pytest.raises(dpa.InputError, match="method must be one of dpa, tokens:"):
            widget.method = "nope"
        assert widget.method == "dpa" and widget._error == ""


def _prob_with_hooks(model, ids, position, target_id, *, zero_tokens=(), heads=(), neurons=()):
    """Ground truth by plain hooks: zero embedding rows, a head's slice of the o_proj input,
    a neuron's column of the down_proj input (= its SiLU(s) * u)."""
    d_head = model.config.head_dim
    handles = []

    def zero_cols(cols):
        def hook(_module, args):
            x = args[0].clone()
            x[..., cols] = 0
            return (x,)
        return hook

    for l, h in heads:
        cols = list(range(h * d_head, (h + 1) * d_head))
        handles.append(model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(zero_cols(cols)))
    for l, n in neurons:
        handles.append(model.model.layers[l].mlp.down_proj.register_forward_pre_hook(zero_cols([n])))
    try:
        emb = model.model.embed_tokens(torch.tensor([ids])).clone()
        emb[0, list(zero_tokens)] = 0
        logits = model(inputs_embeds=emb).logits[0, position]
    finally:
        for handle in handles:
            handle.remove()
    return float(logits.softmax(-1)[target_id])


class TestVerify:
    def test_disrupt_selected_head_and_neuron(self, widget, model):
        widget.selected_head = [1, 2]
        widget.selected_neuron = [0, 5]
        out = widget.verify("disrupt", "selection")
        t = widget.result.target
        assert out["units"] == ["L1.H2", "L0.N5"] and widget._verify == out
        assert out["p_before"] == pytest.approx(t.probability, rel=1e-6)
        expected = _prob_with_hooks(model, PROMPT, t.position, t.token_id, heads=[(1, 2)], neurons=[(0, 5)])
        assert out["p_after"] == pytest.approx(expected, rel=1e-6)
        assert out["p_after"] != pytest.approx(out["p_before"], rel=1e-6)

    def test_top_tokens_disrupt_and_recover(self, widget, model):
        widget.top_k = 2
        t = widget.result.target
        top = widget.result.token_scores.topk(2).indices.tolist()
        out = widget.verify("disrupt", "top_tokens")
        assert out["p_after"] == pytest.approx(_prob_with_hooks(model, PROMPT, t.position, t.token_id,
                                                                zero_tokens=top), rel=1e-6)
        out = widget.verify("recover", "top_tokens")
        rest = [p for p in range(len(PROMPT)) if p not in top]
        assert out["p_after"] == pytest.approx(_prob_with_hooks(model, PROMPT, t.position, t.token_id,
                                                                zero_tokens=rest), rel=1e-6)

    def test_top_components_recover(self, widget, model):
        widget.top_k = 3
        t = widget.result.target
        top = widget.result.top_components(3)["positive"]
        out = widget.verify("recover", "top_components")
        keep_h = {(c.layer, c.index) for c in top if c.kind == "head"}
        keep_n = {(c.layer, c.index) for c in top if c.kind == "neuron"}
        heads = [(l, h) for l in range(3) for h in range(4) if (l, h) not in keep_h]
        neurons = [(l, n) for l in range(3) for n in range(48) if (l, n) not in keep_n]
        expected = _prob_with_hooks(model, PROMPT, t.position, t.token_id, heads=heads, neurons=neurons)
        assert out["p_after"] == pytest.approx(expected, rel=1e-6)
        assert len(out["units"]) == 3

    def test_selected_token_through_the_view_message(self, widget, model):
        widget.selected_token = 3
        widget._on_message(widget, {"action": "verify", "mode": "disrupt", "units": "selection"}, [])
        t = widget.result.target
        assert widget._verify["units"] == [f"token 3 {widget.result.tokens[3]!r}"]
        assert widget._verify["p_after"] == pytest.approx(
            _prob_with_hooks(model, PROMPT, t.position, t.token_id, zero_tokens=[3]), rel=1e-6)

    def test_errors_are_shown(self, widget, result):
        widget._on_message(widget, {"action": "verify", "mode": "disrupt", "units": "selection"}, [])
        assert "nothing is selected" in widget._error
        with pytest.raises(ValueError, match="mode"):
            widget.verify("sideways", "selection")
        with pytest.raises(ValueError, match="model"):
            CircuitWidget(result).verify()


def saved_state(text: str) -> dict:
    """The traits a save_html page holds (its dpa-state script)."""
    found = re.search(r'<script type="application/json" id="dpa-state">(.*?)</script>', text, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


class TestSaveHtml:
    def test_standalone_page(self, widget, tmp_path):
        widget.selected_head = [1, 2]
        path = save_html(widget, tmp_path / "view.html")
        text = path.read_text()
        assert not re.search(r"<script[^>]+src=", text), "no external scripts"
        assert "https://" not in text.replace("https://www.w3.org/", ""), "no address outside the page"
        model_state = saved_state(text)
        assert model_state["_live"] is False, "no live controls without a kernel"
        assert model_state["selected_head"] == [1, 2] and "head:1:2" in model_state["_details"]
        esm = re.search(r'<script type="text/plain" id="dpa-esm">(.*?)</script>', text, re.S).group(1)
        assert esm.replace("<\\/", "</") == widget._esm and "export default" in esm
        assert widget._live, "the live widget itself is unchanged"
        assert "requirejs" not in text and len(text) < 2 * len(widget._esm) + 100_000, \
            f"{len(text)} bytes: the page holds the widget's script and data, not a widget manager"

    def test_from_a_result(self, result, tmp_path):
        path = save_html(result, tmp_path / "r.html")
        assert 100_000 < path.stat().st_size < 400_000
        with pytest.raises(TypeError):
            save_html("nope", tmp_path / "x.html")

    def test_inline_escaping(self):
        assert _inline('a = "</script>"; // <!-- x') == 'a = "<\\/script>"; // <\\!-- x'


def test_one_colour_scale_for_the_widget_and_the_reports():
    """The view (its bundle, the widget's _esm), the terminal and HTML reports and save_html colour a score the
    same way: the same RdBu stops, the same interpolation and rounding, the same ink threshold."""
    from dpa import report
    from dpa_widgets.bundle import bundle

    js = bundle()
    block = re.search(r"export const DIVERGING = \[(.*?)\];", js, re.S).group(1)
    stops = [tuple(int(v) for v in m) for m in re.findall(r"\[(\d+), (\d+), (\d+)\]", block)]
    assert stops == list(report.RGB)
    assert "Math.round(c + (b[k] - c) * f)" in js and "0.2126 * r + 0.7152 * g + 0.0722 * b > 140" in js
    assert report.ink_for((200, 200, 200)) == (0, 0, 0) and report.ink_for((33, 102, 172)) == (255, 255, 255)


@pytest.mark.parametrize("make, error, names", [
    (lambda r, m: CircuitWidget([r], m, None), dpa.InputTypeError, "one of its results"),
    (lambda r, m: CircuitWidget("result", m, None), dpa.InputTypeError, "result"),
    (lambda r, m: CircuitWidget(r, m, None, top_neurons=0), dpa.InputError, "top_neurons"),
    (lambda r, m: CircuitWidget(r, m, None, top_neurons=2.5), dpa.InputTypeError, "top_neurons"),
    (lambda r, m: CircuitWidget(r, m, None, colour="red"), dpa.InputTypeError, "colour"),
    (lambda r, m: CircuitWidget(r, None, None, target="x"), dpa.InputError, "target"),
    (lambda r, m: CircuitWidget(r, "model", None), dpa.InputError, "model"),
    (lambda r, m: CircuitWidget(r, m, "tokenizer"), dpa.InputTypeError, "tokenizer"),
    (lambda r, m: CircuitWidget(r, m, None, target="999"), dpa.InputError, "vocabulary"),
    (lambda r, m: CircuitWidget(dpa.Attribution.from_json(r.to_json(top_neurons=3))), dpa.InputError,
     "only the top 3 neurons of each sign per layer.*--json-neurons all"),
])
def test_bad_constructor_arguments_get_dpa_errors(result, model, make, error, names):
    with pytest.raises(error, match=names):
        make(result, model)


def test_a_saved_moe_result_names_expert_neurons_without_the_model():
    """The result records d_expert, so a page built from it alone (no model) names each neuron by its expert,
    the shared expert's too."""
    from dpa_widgets import payload

    model = tiny_model("qwen2_moe", 2)
    res = dpa.attribute(model, None, random_ids(6), target=5)
    back = dpa.Attribution.from_json(res.to_json())
    spec = dpa.spec_for(model)
    assert back.d_expert == spec.d_expert
    data = payload.view_payload(back)
    assert (data["n_experts"], data["d_expert"]) == (spec.n_experts, spec.d_expert)
    assert data["expert_names"][-1] == "shared"
    assert payload.view_payload(dpa.attribute(tiny_model("llama", 2), None, random_ids(6), target=5)).keys() \
        == payload.view_payload(back).keys() - {"n_experts", "d_expert", "expert_names", "expert_scores"}


# ---------------------------------------------------------------- the circuit graph view

from pathlib import Path  # noqa: E402

from dpa_widgets import graph  # noqa: E402

PRUNE_FIXTURE = Path(__file__).parent / "js" / "prune-fixture.json"
THRESHOLDS = (0.3, 0.5, 0.8, 0.95, 1.0)


def prune_cases() -> dict:
    """Tiny circuits (heads and neurons at positions, with biases; components over all positions; experts at
    positions) and what ``Circuit.prune`` makes of them, for tests/js/graph.test.mjs (graph.js must prune the same
    way): per threshold, the nodes kept (by label) with their score, out_rest and influence, and the edges by
    "source->destination". Write the file with ``write_prune_fixture()``."""
    cases = []
    for name, model, n, nodes, positions in (("positions", tiny_model("qwen2"), 8, 20, True),
                                             ("components", tiny_model("llama"), 6, 10, False),
                                             ("experts", tiny_model("qwen2_moe", 2), 6, 14, True)):
        circ = dpa.circuit(model, None, random_ids(n), target=5, nodes=nodes, positions=positions)
        cases.append({"name": name, "circuit": circ.to_json(), "pruned": pruned_json(circ)})
    return {"about": "dpa.Circuit.prune on tiny circuits, written by tests/test_widget.py's write_prune_fixture() "
                     "(python -c 'from tests.test_widget import write_prune_fixture; write_prune_fixture()')",
            "thresholds": list(THRESHOLDS), "cases": cases}


def pruned_json(circ: dpa.Circuit) -> dict:
    out = {}
    for threshold in THRESHOLDS:
        data = circ.prune(threshold).to_json()
        label = {node["id"]: node["label"] for node in data["nodes"]}
        out[str(threshold)] = {
            "nodes": {node["label"]: {k: node[k] for k in ("score", "out_rest", "influence")} for node in data["nodes"]},
            "edges": {f"{label[s]}->{label[d]}": e for s, d, e in data["edges"]}}
    return out


def write_prune_fixture() -> None:
    PRUNE_FIXTURE.write_text(json.dumps(prune_cases()) + "\n")


def circuit_from_json(data: dict) -> dpa.Circuit:
    """A Circuit with the nodes, edges and scores of ``Circuit.to_json()`` (no tensors to verify with)."""
    from dpa.circuit import Node
    from dpa.result import TargetInfo

    nodes = [Node(n["kind"], n["label"], n["layer"], n["index"], n["position"], n["of"]) for n in data["nodes"]]
    edges = torch.zeros(len(nodes), len(nodes), dtype=torch.float64)
    for s, d, e in data["edges"]:
        edges[s, d] = e
    column = lambda key: torch.tensor([n[key] or 0.0 for n in data["nodes"]], dtype=torch.float64)  # noqa: E731
    reads = torch.zeros(len(nodes), len(data["tokens"]), dtype=torch.float64)
    for i, n in enumerate(data["nodes"]):
        for p, v in n.get("in_positions", []):
            reads[i, p] = v or 0.0
    return dpa.Circuit(nodes=nodes, edges=edges, scores=column("score"), in_gap=column("in_gap"),
                       bias_in=column("bias_in"), out_rest=column("out_rest"), in_positions=reads,
                       tokens=data["tokens"], token_ids=data["token_ids"], target=TargetInfo(**data["target"]),
                       target_logit=data["target_logit"], weights=dpa.PathWeights(**data["weights"]),
                       positions=data["positions"], model_name=data["model"])


def test_the_js_prune_fixture_is_what_python_prunes():
    """graph.test.mjs checks graph.js's pruning against this file: its pruned graphs must be what Circuit.prune
    makes of its circuits today."""
    stored = json.loads(PRUNE_FIXTURE.read_text())
    assert [c["name"] for c in stored["cases"]] == ["positions", "components", "experts"]
    for case in stored["cases"]:
        fresh = pruned_json(circuit_from_json(case["circuit"]))
        for t in map(str, THRESHOLDS):
            a, b = case["pruned"][t], fresh[t]
            assert a["nodes"].keys() == b["nodes"].keys() and a["edges"].keys() == b["edges"].keys(), (case["name"], t)
            for label, values in a["nodes"].items():
                for k, v in values.items():
                    assert v == pytest.approx(b["nodes"][label][k], rel=1e-12, abs=1e-15), (case["name"], t, label, k)
            for key, e in a["edges"].items():
                assert e == pytest.approx(b["edges"][key], rel=1e-12, abs=1e-15), (case["name"], t, key)


@pytest.fixture(scope="module")
def circ(model):
    return dpa.circuit(model, None, PROMPT, target=5, nodes=12)


@pytest.fixture(scope="module")
def scored(model):
    return dpa.attribute(model, None, PROMPT, target=5, edges=True, neuron_positions=True)


class TestGraph:
    def test_the_graph_is_the_circuits_json(self, model, scored, circ):
        w = CircuitWidget(scored, model, None, circuit=circ)
        assert w.view == "graph", "a widget given a circuit opens on its graph"
        assert w._graph == {**circ.to_json(), "verifiable": True}
        state = json.loads(json.dumps(w.get_state(), allow_nan=False))
        assert state["_graph"]["nodes"][0]["label"] == "tok0"
        assert "export function renderGraph" in state["_esm"], "the bundle carries static/src/graph.js"
        assert CircuitWidget(scored, model, None)._graph == {}, "no circuit, no graph"

    def test_circuit_true_computes_the_results_graph(self, model, scored):
        w = CircuitWidget(scored, model, None, circuit=True, view="scores")
        assert w.view == "scores" and len(w.circuit.units) == graph.NODES
        assert w.circuit.target.token_id == 5 and w.circuit.token_ids == list(scored.token_ids)
        with pytest.raises(dpa.InputError, match="circuit=True computes"):
            CircuitWidget(scored, circuit=True)

    def test_a_circuit_of_another_prompt_target_or_weights_is_refused(self, model, scored, circ):
        other = dpa.circuit(model, None, PROMPT[:-1] + [3], target=5, nodes=4)
        with pytest.raises(dpa.InputError, match="another prompt"):
            CircuitWidget(scored, circuit=other)
        with pytest.raises(dpa.InputError, match="another target"):
            CircuitWidget(scored, circuit=dpa.circuit(model, None, PROMPT, target=6, nodes=4))
        with pytest.raises(dpa.InputError, match="other path weights"):
            CircuitWidget(scored, circuit=dpa.circuit(model, None, PROMPT, target=5, nodes=4,
                                                      weights=dpa.PathWeights.control_content(1.0)))
        with pytest.raises(dpa.InputTypeError, match="dpa.Circuit"):
            CircuitWidget(scored, circuit=circ.to_json())

    BAD = [("view", "nonsense", dpa.InputError), ("view", 3, dpa.InputTypeError),
           ("selected_node", "L9.H9@9", dpa.InputError), ("selected_node", 3, dpa.InputTypeError),
           ("selected_edge", ["tok0", "nope"], dpa.InputError), ("selected_edge", ["tok0", "tok0"], dpa.InputError),
           ("selected_edge", ["tok0"], dpa.InputTypeError), ("graph_threshold", 1.5, dpa.InputError),
           ("graph_threshold", float("nan"), dpa.InputError), ("graph_threshold", "most", dpa.InputTypeError)]

    @pytest.mark.parametrize("name,value,error", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
    def test_graph_traits_are_checked(self, scored, circ, name, value, error):
        w = CircuitWidget(scored, circuit=circ)
        before = getattr(w, name)
        with pytest.raises(error, match=name):
            setattr(w, name, value)
        assert getattr(w, name) == before or before != before

    def test_graph_traits_need_a_graph(self, scored):
        w = CircuitWidget(scored)
        for name, value in (("view", "graph"), ("selected_node", "tok0"), ("selected_edge", ["tok0", "target"])):
            with pytest.raises(dpa.InputError, match="circuit="):
                setattr(w, name, value)

    def test_selection_by_label_and_kwargs(self, scored, circ):
        unit = circ.nodes[circ.units[-1]].label
        w = CircuitWidget(scored, circuit=circ, selected_node=unit, selected_edge=["tok6", unit], graph_threshold=0.5)
        assert (w.selected_node, w.selected_edge, w.graph_threshold) == (unit, ["tok6", unit], 0.5)
        w.selected_node = ""
        w.selected_edge = None

    def test_verify_edge_from_the_view(self, model, scored, circ, monkeypatch):
        w = CircuitWidget(scored, model, None, circuit=circ)
        unit = circ.nodes[circ.units[-1]].label
        _custom_message(w, {"action": "verify_edge", "edge": ["tok6", unit]}, monkeypatch)
        assert w._error == ""
        key = f"tok6->{unit}"
        got, want = w._graph_verify[key], circ.verify(model, None, ("tok6", unit))
        assert got.keys() == want.keys() and got["source"] == "tok6" and got["destination"] == unit
        for k in ("edge", "direct", "target"):
            assert got[k] == pytest.approx(want[k])
        w.selected_edge = [unit, "target"]
        assert w.verify_edge()["destination"] == "target" and len(w._graph_verify) == 2
        json.dumps(w._graph_verify, allow_nan=False)

    def test_verify_edge_errors_are_shown(self, scored, circ, monkeypatch):
        w = CircuitWidget(scored, circuit=circ)
        _custom_message(w, {"action": "verify_edge", "edge": ["tok0", "target"]}, monkeypatch)
        assert "pass model and tokenizer" in w._error
        with pytest.raises(dpa.InputError, match="no circuit graph"):
            CircuitWidget(scored).verify_edge(("tok0", "target"))

    def test_a_new_target_recomputes_the_graph(self, model, scored, circ):
        w = CircuitWidget(scored, model, None, circuit=circ, selected_node="target")
        w.selected_edge = ["tok6", "target"]
        w.target = "7"
        assert w._error == "" and w.circuit.target.token_id == 7 and w._graph["target"]["token_id"] == 7
        assert len(w.circuit.units) == len(circ.units) and w._graph_verify == {}
        assert w.selected_node == "target" and w.selected_edge == ["tok6", "target"], "still in the graph"

    def test_save_html_carries_the_graph(self, scored, circ, tmp_path):
        w = CircuitWidget(scored, circuit=circ, selected_node="target")
        text = save_html(w, tmp_path / "graph.html").read_text()
        model_state = saved_state(text)
        assert model_state["view"] == "graph" and model_state["selected_node"] == "target"
        assert len(model_state["_graph"]["nodes"]) == len(circ.nodes)

    def test_graph_js_ships_with_dpa_widgets(self):
        """The view's sources ship with the widget package (the bundle is assembled from them at import), the
        core ships no JavaScript, and the CLI's --html page is found through its entry point."""
        import dpa_widgets

        pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
        data = re.search(r'^\[tool\.setuptools\.package-data\]\n((?:\S+ = .*\n)+)', pyproject, re.M).group(1)
        assert data.startswith('dpa_widgets = ["static/*"]\n"dpa_widgets.static.src" = ["*.js"]')
        assert "dpa = " not in data, "the core ships no static files"
        assert re.search(r'^\[project\.entry-points\."dpa\.views"\]\ncircuit_html = "dpa_widgets\.page:circuit_html"$',
                         pyproject, re.M)
        src = Path(dpa_widgets.__file__).parent / "static" / "src"
        assert (src / "graph.js").read_text().count("export function renderGraph") == 1


def test_pages_embed_token_text_that_looks_like_html(result, tmp_path):
    """Token text such as "<!--" and "<script>" would make the HTML parser end (or re-open) a page's script early
    and leave it blank: every "<" of the embedded JSON is an escape (dpa.report.script_json), in both the CLI's
    circuit page and save_html's page, and the data reads back unchanged."""
    from dpa.report import script_json
    from dpa_widgets.page import circuit_html

    data = {"tokens": ["<!--", "<script>", "</script>", "a & b", "-->"]}
    text = script_json(data)
    assert "<" not in text and ">" not in text and json.loads(text) == data
    odd = dpa.Attribution.from_dict({**result.to_dict(), "tokens": ["<!--", "<script>"] + result.tokens[2:]})
    page = save_html(odd, tmp_path / "odd.html").read_text()
    state = re.search(r'id="dpa-state">(.*?)</script>', page, re.S).group(1)
    assert "<" not in state and json.loads(state)["_data"]["tokens"][:2] == ["<!--", "<script>"]
    model = tiny_model("llama", kv_heads=2)
    circ = dpa.circuit(model, None, random_ids(5).tolist(), target=3, nodes=4)
    circ.tokens = ["<!--", "<script>", "</script>", "x", "y"]
    html = circuit_html(circ)
    embedded = html.rsplit('renderGraph(document.getElementById("graph"), ', 1)[1].split(", {});", 1)[0]
    assert "<" not in embedded and json.loads(embedded)["tokens"] == circ.tokens, "the graph's data holds no '<'"


class TestMultiToken:
    """A target of several tokens (``multi_token="sum"``) in the widget: shown with its terms, recomputed whole,
    verified as the probability of the whole continuation; what attributes one token refuses it by name."""

    @pytest.fixture
    def multi(self, model):
        from tests.test_multi_token import PROMPT as TEXT, TARGET, TOK

        res = dpa.attribute(model, TOK, TEXT, target=TARGET, multi_token="sum", edges=True, neuron_positions=True)
        return CircuitWidget(res, model, TOK), TOK, TEXT, TARGET

    def test_payload_and_recompute(self, multi, model):
        w, tok, text, target = multi
        terms = w._data["target"]["terms"]
        assert [t["token"] for t in terms] == list(target) and w._data["target"]["token"] == target
        with w.hold_trait_notifications():  # new weights: the same whole target, attributed again
            w.weights_preset = "attention"
            w.weights_p = 0.8
        assert w._error == ""
        want = dpa.attribute(model, tok, text, target=target, multi_token="sum",
                             weights=dpa.PathWeights.preset("attention", 0.8))
        close(w._data["head_scores"], want.head_scores)
        assert w.result.target.terms == want.target.terms
        w.target = "xy"  # a typed target of several tokens is attributed whole too
        assert w._error == "" and [t.token for t in w.result.target.terms] == ["x", "y"]
        assert w.result.tokens == want.tokens[:len(text) + 1] + ["x"]

    def test_verify_is_the_whole_continuation(self, multi, model):
        w, *_ = multi
        w.selected_token = 3
        out = w.verify("disrupt", "selection")
        t = w.result.target
        assert out["p_before"] == pytest.approx(t.probability, rel=1e-6)
        want = 1.0
        for term in t.terms:
            want *= _prob_with_hooks(model, list(w.result.token_ids), term.position, term.token_id, zero_tokens=[3])
        assert out["p_after"] == pytest.approx(want, rel=1e-6)

    def test_a_contrast_of_several_tokens(self, model):
        from tests.test_multi_token import PROMPT as TEXT, TARGET, TOK

        res = dpa.attribute(model, TOK, TEXT, target=TARGET, contrast="xy", multi_token="sum")
        w = CircuitWidget(res, model, TOK)
        assert w._error == "" and [t["contrast"] for t in w._data["target"]["terms"]] == [False] * 4 + [True] * 2
        w.weights_preset = "attention"  # recomputed with the same whole target and contrast
        want = dpa.attribute(model, TOK, TEXT, target=TARGET, contrast="xy", multi_token="sum",
                             weights=dpa.PathWeights.preset("attention", w.weights_p))
        assert w._error == "" and w.result.target.terms == want.target.terms
        close(w._data["head_scores"], want.head_scores)
        w.selected_token = 2
        out = w.verify("disrupt", "selection")
        assert out["p_before"] == pytest.approx(w.result.target.probability, rel=1e-6)  # the target's, not the foil's

    def test_one_token_views_refuse(self, multi, model):
        w, tok, *_ = multi
        with pytest.raises(dpa.InputError, match="circuit graph attributes one target token"):
            graph.compute(model, tok, w.result)
        with pytest.raises(dpa.TargetError, match="baselines attribute one target token"):
            live.compare(model, tok, w.result, "tokens:gradient")


class TestGenerationWidget:
    """The generation view's state: the matrix rows are the generation's, each step's heads, neurons and sources
    its own; ``step`` checked; a saved page holds it all."""

    @pytest.fixture(scope="class")
    def gen(self, model):
        from tests.test_multi_token import TOK

        return dpa.attribute_generation(model, TOK, "the cat sa", max_new_tokens=4, stop_at_eos=False)

    def test_payload(self, gen):
        from dpa_widgets import GenerationWidget

        w = GenerationWidget(gen, top=3)
        data, n = w._data, gen.prompt_length
        assert w.step == 0 and data["prompt_length"] == n and data["tokens"] == gen.tokens
        for j, (row, step) in enumerate(zip(data["rows"], data["steps"])):
            close(row, gen.scores[j, :n + j])
            close(step["head_scores"], gen.steps[j].head_scores)
            scores = gen.steps[j].neuron_scores
            best = scores.flatten().topk(3).values.tolist()
            assert [v for *_, v in step["neurons"]["positive"]] == pytest.approx(best, rel=1e-4)
            for layer, index, v in step["neurons"]["negative"]:
                assert v < 0 and float(scores[layer, index]) == pytest.approx(v, rel=1e-4)
            assert step["sources"]["positive"][0][0] == int(gen.scores[j, :n + j].argmax())

    def test_step_is_checked(self, gen):
        from dpa_widgets import GenerationWidget

        w = GenerationWidget(gen, step=None)
        w.step = 3
        with pytest.raises(dpa.InputError, match="step must be None or a step of the generation, 0 to 3"):
            w.step = 4
        with pytest.raises(dpa.InputTypeError, match="GenerationWidget shows a dpa.Generation"):
            GenerationWidget(gen.steps[0])
        with pytest.raises(dpa.InputError, match="step must be None or a step"):
            w.step = True
        data = gen.to_dict()
        data["steps"][0]["token_scores"][1] = None  # a NaN in the file
        with pytest.raises(dpa.InputError, match="NaN or infinite scores"):
            GenerationWidget(dpa.Generation.from_dict(data))
        data = gen.to_dict()
        data["steps"][1]["neuron_scores"] = None  # no neurons and no top_neurons: an AttributeError before
        with pytest.raises(dpa.InputError, match="step 1 of the generation has no neuron scores"):
            GenerationWidget(dpa.Generation.from_dict(data))

    def test_saved_page_and_a_generation_read_back(self, gen, tmp_path):
        from dpa_widgets import GenerationWidget

        save_html(gen, tmp_path / "g.html")
        text = (tmp_path / "g.html").read_text()
        assert "dpa-gen" in text and '"prompt_length"' in text and "_live" not in text
        gen.to_json(str(tmp_path / "g.json"), top_neurons=4)  # neurons saved as each layer's top 4
        back = GenerationWidget(dpa.Generation.from_json(tmp_path / "g.json"), top=3)
        assert back._data["steps"][1]["neurons"]["positive"] == GenerationWidget(gen, top=3)._data["steps"][1][
            "neurons"]["positive"]
        gen.to_json(str(tmp_path / "g2.json"), top_neurons=2)  # asked for more than were kept: the exact top 2
        back = GenerationWidget(dpa.Generation.from_json(tmp_path / "g2.json"), top=10)
        assert back._data["steps"][1]["neurons"]["positive"] == GenerationWidget(gen, top=2)._data["steps"][1][
            "neurons"]["positive"]
