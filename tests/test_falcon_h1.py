"""Falcon-H1 (``falcon_h1``): attention AND a Mamba-2 block on every layer, side by side on the layer's one normalised
input (book: parallel-mixers), then a SwiGLU MLP; µP scalars around every block (the key, attention's input and
output, the SSM's input, output and in_proj's five groups of features, the MLP's gate inside its activation and its
down projection, the embeddings, the logits).

The autograd suite (test_families_autograd: each path alone against autograd through the model's own modules, the
forward oracle, completeness to 1e-10, lean = full, edges summing to the units) runs the tiny Falcon-H1 with the other
families. Here: its layout as dpa reads it (a layer's row: its attention heads, then its SSM heads), the block's
variants the configs allow (no gated norm, as released; the norm before or after the gate), the embedding multiplier
the model applies to ids alone, edits dpa reads as the model runs them, and what does not read two mixers per layer
yet refused by name, the model left as it was.
"""

from __future__ import annotations

import json

import pytest
import torch

import dpa
from dpa.families import layer_modules

from .conftest import random_ids, tiny_model
from .test_families_autograd import check_path_against_autograd
from .test_hybrid import _state

TARGET = 5
CONSERVATIVE = dpa.PathWeights(0, 0, 1, 0.5, 0.5)


@pytest.fixture(scope="module")
def model():
    return tiny_model("falcon_h1")


def test_the_layers_hold_attention_and_a_scan_side_by_side(model):
    spec = dpa.spec_for(model)
    assert spec.layer_kinds == () and not spec.mixed and spec.n_heads == 4 and spec.n_beside == 4
    assert spec.beside_kind == "scan" and spec.beside_width == 16 and spec.row_width == 8
    assert spec.embedding_multiplier == spec.ids_only_multiplier == 1.5 and spec.logits_multiplier == 0.7
    for mods, layer in zip(layer_modules(model, spec), model.model.layers):
        assert mods.attention is layer.self_attn and mods.heads is layer.self_attn.o_proj
        assert mods.beside.attention is layer.mamba and mods.beside.heads is layer.mamba.out_proj
        assert mods.beside.kind == "scan" and mods.neurons is layer.feed_forward.down_proj


def test_a_layers_row_is_its_heads_then_its_ssm_heads(model):
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=CONSERVATIVE, edges=True)
    assert res.beside == ("scan", 4) and res.unit_kinds == ("head", "scan") and res.head_scores.shape == (3, 8)
    assert res.head_scores[:, :4].abs().sum() > 0 and res.head_scores[:, 4:].abs().sum() > 0
    torch.testing.assert_close(res.edge_scores.sum((2, 3)), res.head_scores, rtol=1e-9, atol=1e-12)
    assert float(res.token_scores.sum()) + res.bias_share == pytest.approx(res.target_logit, rel=1e-9, abs=1e-11)
    top = res.top_components(50)
    picked = top["positive"] + top["negative"]
    for c in picked:  # each unit named by its kind, its index within its kind
        if c.kind == "head":
            assert 0 <= c.index < 4 and c.score == pytest.approx(float(res.head_scores[c.layer, c.index]))
        if c.kind == "scan":
            assert 0 <= c.index < 4 and c.score == pytest.approx(float(res.head_scores[c.layer, 4 + c.index]))
    assert {c.kind for c in picked} >= {"head", "scan", "neuron"}
    assert len([c for c in picked if c.kind in ("head", "scan")]) == int((res.head_scores != 0).sum())  # every unit
    assert "4 attention heads beside 4 scan units" in res.summary() and "scan L" in res.summary(20)
    back = dpa.Attribution.from_dict(json.loads(json.dumps(res.to_dict())))
    assert back.beside == ("scan", 4) and back.top_components(5) == res.top_components(5)
    bad = res.to_dict()
    for beside in (["scan", 8], ["scan", 0], ["conv", 4.5], "scan"):
        with pytest.raises(dpa.InputError, match="beside"):
            dpa.Attribution.from_dict({**bad, "beside": beside})


@pytest.mark.parametrize("before", [True, False])
@pytest.mark.parametrize("path", ["query", "key", "value", "gate", "up", "default"])
def test_the_gated_norm_where_a_config_asks_for_one(path, before):
    """Released configs set mamba_rms_norm false (y * SiLU(z), no norm: the suite's model); with it, the norm of y
    before the gate (mamba_norm_before_gate) or of y * SiLU(z) after it, its scale frozen either way."""
    model = tiny_model("falcon_h1", mamba_rms_norm=True, mamba_norm_before_gate=before)
    assert dpa.spec_for(model).n_beside == 4
    check_path_against_autograd(model, path)


def test_the_embedding_multiplier_reaches_embeddings_dpa_hands_the_model(model):
    """Falcon-H1 multiplies the embeddings it looks up from ids, not inputs_embeds given to it: dpa's ablations and
    gradient baselines hand it embeddings, so dpa multiplies them (ModelSpec.ids_only_multiplier)."""
    from dpa.evaluate import input_ablation_probs

    ids = random_ids(9)
    own = model(ids[None]).logits[0, -1].softmax(-1)[TARGET]
    keep = torch.ones(1, len(ids))
    assert float(input_ablation_probs(model, ids, keep, len(ids) - 1, TARGET)[0]) == pytest.approx(float(own),
                                                                                                  rel=1e-12)
    grads = dpa.baselines.input_x_gradient(model, None, ids, target=TARGET)
    e = model.model.embed_tokens(ids[None]).detach().requires_grad_(True)
    with torch.enable_grad():
        logit = model(inputs_embeds=e * model.config.embedding_multiplier).logits[0, -1, TARGET]
        (g,) = torch.autograd.grad(logit, e)
    torch.testing.assert_close(grads.token_scores.double(), (e * g).sum(-1)[0].detach(), rtol=1e-5, atol=1e-7)


def test_edits_dpa_reads_as_the_model_runs_them():
    """The µP scalars inside the blocks are read where the model's forward reads them (the block's mup_vector and
    ssm_in_multiplier, the attention's key_multiplier): an edit after loading is the model's, and dpa's scores stay
    its gradient."""
    model = tiny_model("falcon_h1", seed=3)
    with torch.no_grad():
        model.model.layers[1].mamba.mup_vector.mul_(torch.linspace(0.5, 1.5, model.model.layers[1].mamba.mup_vector
                                                                   .numel()).view_as(model.model.layers[1].mamba
                                                                                     .mup_vector))
    model.model.layers[0].mamba.ssm_in_multiplier = 0.4
    model.model.layers[2].self_attn.key_multiplier = 2.5
    for path in ("query", "value", "default"):
        check_path_against_autograd(model, path)


@pytest.mark.parametrize("setting", [{"mamba_proj_bias": True}, {"projectors_bias": True}])
def test_biases_in_the_ssm_block_are_refused_by_name(setting):
    key = next(iter(setting))
    with pytest.raises(dpa.UnsupportedModelError, match=rf"{key}|bias"):
        dpa.attribute(tiny_model("falcon_h1", **setting), None, random_ids(6), target=TARGET)


def test_what_reads_one_mixer_per_layer_is_refused_by_name(model):
    from dpa import baselines, evaluate
    from dpa_widgets.payload import view_payload

    ids = random_ids(8)
    before = _state(model)
    calls = {
        "activation patching": lambda: baselines.activation_patching(model, None, ids, target=TARGET),
        "the random component baseline": lambda: baselines.random_component(model, None, ids, target=TARGET),
        "ablating heads": lambda: evaluate.component_ablation_prob(model, ids, [(0, 0, 7, 7)], [], 7, TARGET),
    }
    for what, call in calls.items():
        with pytest.raises(dpa.UnsupportedModelError, match=rf"{what}.*not yet supported on falcon_h1.*side by side"):
            call()
        assert _state(model) == before
    assert view_payload(dpa.attribute(model, None, ids, target=TARGET))["beside"] == ["scan", 4]  # the widget draws
    assert _state(model) == before  # it (tests/test_widget_falcon_h1.py)


def test_a_circuit_holds_heads_and_ssm_heads_and_verifies_on_the_model(model):
    """The circuit graph's block 0 holds both mixers' units (the suite of test_circuit checks every edge against
    autograd and the flow identities on the tiny Falcon-H1); path patching on the real model hooks a unit's own
    output projection: with every path at weight one the first-order prediction is the edge, in both directions
    between an SSM head and an attention head."""
    ids = random_ids(6)
    circ = dpa.circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(1, 1, 1, 1, 1), nodes=None)
    units = [circ.nodes[i] for i in circ.units]
    assert {u.label.split(".")[1][0] for u in units} == {"H", "S", "N"}
    assert all(u.index >= 4 for u in units if ".S" in u.label) and all(u.index < 4 for u in units if ".H" in u.label)
    scan = [i for i in circ.units if ".S" in circ.nodes[i].label]
    head = [i for i in circ.units if ".H" in circ.nodes[i].label]
    for sources, dests in ((scan, head), (head, scan)):
        u, d = max(((s, t) for s in sources for t in dests), key=lambda p: abs(circ.edge(*p)))
        assert abs(circ.edge(u, d)) > 0
        out = circ.verify(model, None, (u, d))
        assert out["first_order"] == pytest.approx(out["edge"], rel=1e-8, abs=1e-12)
        assert out["direct"] * out["edge"] > 0
    s = max(scan, key=lambda i: abs(circ.score(i)))
    same = circ.patch_read(model, None, s, 0, ids)
    assert same["change"] == 0 and same["clean"] == pytest.approx(circ.score(s), rel=1e-9)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_a_neurons_readout_carries_the_mlps_down_multiplier(model):
    """What a neuron writes per unit of activation reaches the logits through the MLP's down multiplier, the final
    norm's gain and the logits' multiplier (``dpa.lens.neuron_logit_effect``)."""
    from dpa.lens import neuron_logit_effect

    layer = model.model.layers[2]
    column = layer.feed_forward.down_proj.weight[:, 7] * layer.feed_forward.down_multiplier
    want = model.lm_head(column * model.model.final_layernorm.weight) * model.config.lm_head_multiplier
    torch.testing.assert_close(neuron_logit_effect(model, 2, 7).double(), want, rtol=1e-6, atol=1e-8)


def test_the_heat_map_figure_parts_the_heads_from_the_ssm_heads(model):
    import matplotlib

    matplotlib.use("Agg")
    fig = dpa.attribute(model, None, random_ids(7), target=TARGET).plot_heads()
    ax = fig.axes[0]
    assert ax.get_title() == "attention heads | scan units\n(summed over positions)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["H0", "H1", "H2", "H3", "S0", "S1", "S2", "S3"]
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [3.5]  # the rule between them


def test_a_batch_run_reads_back(tmp_path):
    """A folder of results (``dpa.attribute_file``) keeps each row's [heads | SSM heads] and reads back equal to
    ``dpa.attribute`` on each prompt (its records checked against the rows' real width)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from .test_cli import WORDS

    vocab = ["[UNK]", "<s>"] + WORDS + [f"w{i}" for i in range(128 - 2 - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    model = tiny_model("falcon_h1", vocab_size=128)
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{WORDS[0]} {WORDS[3]} {WORDS[5]}\n{WORDS[2]} {WORDS[1]}\n")
    dpa.attribute_file(model, tok, prompts, tmp_path / "out", target=WORDS[4], progress=False)
    back = dpa.read_results(tmp_path / "out")
    assert len(back) == 2
    for res, text in zip(back, prompts.read_text().splitlines()):
        fresh = dpa.attribute(model, tok, text, target=WORDS[4])
        assert res.beside == ("scan", 4)
        torch.testing.assert_close(res.head_scores.double(), fresh.head_scores.double(), rtol=1e-6, atol=1e-7)


def test_baselines_that_score_the_attention_heads_alone_leave_the_ssm_heads_unscored(model):
    """gradient, AtP and attention-only read the attention heads; their rows keep the SSM heads' columns as NaN (not
    scored), so the result still says what each column is, and reads back; the methods that ablate or draw one
    mixer's units per layer are not offered for this family."""
    from dpa import baselines

    ids = random_ids(8)
    for name in ("gradient", "atp", "attn_only"):
        res = baselines.COMPONENT_METHODS[name](model, None, ids, target=TARGET)
        assert res.beside == ("scan", 4) and res.head_scores.shape == (3, 8)
        assert bool(res.head_scores[:, 4:].isnan().all()) and not bool(res.head_scores[:, :4].isnan().any())
        assert not res.top_components(5, kinds=("scan",))["positive"]
        back = dpa.Attribution.from_dict(json.loads(json.dumps(res.to_dict())))
        assert bool(back.head_scores[:, 4:].isnan().all()) and back.beside == ("scan", 4)
    spec = dpa.spec_for(model)
    offered = {n for n, f in baselines.COMPONENT_METHODS.items() if baselines.supports(f, spec)}
    assert {"random", "activation_patching"}.isdisjoint(offered) and {"gradient", "atp", "dpa"} <= offered


def test_a_neuron_is_ablated_as_on_any_model(model):
    """Ablating neurons reads no token mixer (the benchmark's neurons alone run on Falcon-H1 as on the hybrids:
    tests/test_hybrid.py); a neuron ablated changes the target's probability, nothing ablated leaves it."""
    from dpa.evaluate import component_ablation_prob

    ids = random_ids(8)
    own = float(model(ids[None]).logits[0, -1].softmax(-1)[TARGET])
    assert component_ablation_prob(model, ids, [], [], 7, TARGET) == pytest.approx(own, rel=1e-9)
    assert component_ablation_prob(model, ids, [], [(1, 7, 3)], 7, TARGET) != pytest.approx(own, rel=1e-9)
