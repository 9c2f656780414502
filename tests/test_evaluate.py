"""The benchmark: AUC arithmetic by hand, grids, ranking, data, prompts, filter, curves, the runner and CLI."""

from __future__ import annotations

import json
import warnings
import re
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from dpa.baselines import COMPONENT_METHODS, INPUT_METHODS
from dpa.evaluate import (COMPONENT_GRID, KNOWN_GRID, SIGMOID_GRID, DataError, Settings, auc, auc_summary,
                          component_ablation_prob, component_ablation_probs, encode_example, evaluate, find_data_dir,
                          fraction_grid, generate_ioi, input_ablation_prob, load_examples, sweep)
from dpa.evaluate.cli import main
from dpa.evaluate.ablation import component_ablation_probs_both, input_ablation_probs_both
from dpa.evaluate.curves import component_curves, component_units, input_curves, rank, unit_count
from dpa.evaluate.datasets import Example, subject_name
from dpa.evaluate.filter import check
from dpa.evaluate.prompts import Sample
from tests.conftest import tiny_model

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


class TestAUC:
    def test_trapezoid_by_hand_in_both_modes(self):
        f, dis, rec = [0.1, 0.5, 1.0], [40.0, 10.0, 5.0], [30.0, 70.0, 100.0]
        # clean: 0.4 * 25 + 0.5 * 7.5 = 13.75; paper adds (0, 100): + 0.1 * 70 = 20.75
        assert math.isclose(auc(f, dis, curve="disruption", unit="input", mode="clean"), 13.75)
        assert math.isclose(auc(f, dis, curve="disruption", unit="input", mode="paper"), 20.75)
        # recovery: 0.4 * 50 + 0.5 * 85 = 62.5; the anchor (1, 100) sits on the last point: no area
        assert math.isclose(auc(f, rec, curve="recovery", unit="input", mode="paper"), 62.5)
        s = auc_summary(f, dis, rec, unit="input")
        assert math.isclose(s["paper"]["total"], 62.5 - 20.75) and math.isclose(s["clean"]["total"], 62.5 - 13.75)

    def test_input_recovery_anchor_closes_the_sigmoid_grid(self):
        f, y = [0.25, 0.75], [20.0, 60.0]
        assert math.isclose(auc(f, y, curve="recovery", unit="input", mode="clean"), 20.0)
        assert math.isclose(auc(f, y, curve="recovery", unit="input", mode="paper"), 20.0 + 0.25 * 80)

    def test_component_anchors_are_sorted_into_the_grid(self):
        f, y = [1e-7, 1e-5, 0.5], [50.0, 50.0, 50.0]
        # recovery gets (1e-6, 0) between the first two points and (1, 100) at the end
        expected = (1e-6 - 1e-7) * 25 + (1e-5 - 1e-6) * 25 + (0.5 - 1e-5) * 50 + 0.5 * 75
        assert math.isclose(auc(f, y, curve="recovery", unit="component", mode="paper"), expected, rel_tol=1e-12)
        expected = (1e-7 - 1e-10) * 75 + (0.5 - 1e-7) * 50
        assert math.isclose(auc(f, y, curve="disruption", unit="component", mode="paper"), expected, rel_tol=1e-12)
        assert math.isclose(auc(f, y, curve="disruption", unit="component", mode="clean"), (0.5 - 1e-7) * 50)

    def test_paper_floors(self):
        zeros = lambda grid: [0.0] * len(grid)  # noqa: E731
        assert math.isclose(auc(KNOWN_GRID, zeros(KNOWN_GRID), curve="disruption", unit="input", mode="paper"), 5.0)
        floor = auc(COMPONENT_GRID, zeros(COMPONENT_GRID), curve="recovery", unit="component", mode="paper")
        assert math.isclose(floor, (1 - math.exp(-0.8)) * 50, rel_tol=1e-12) and 27.5 < floor < 27.6
        assert auc(KNOWN_GRID, zeros(KNOWN_GRID), curve="disruption", unit="input", mode="clean") == 0

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="fractions"):
            auc([0.1, 0.2], [1.0], curve="recovery", unit="input")
        with pytest.raises(ValueError, match="mode"):
            auc([0.1], [1.0], curve="recovery", unit="input", mode="other")
        with pytest.raises(ValueError, match="curve must be one of"):
            auc([0.1], [1.0], curve="sideways", unit="input")


class TestGrids:
    def test_the_papers_grids(self):
        assert KNOWN_GRID == (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
        assert len(SIGMOID_GRID) == 11 and math.isclose(SIGMOID_GRID[0], 1 / (1 + math.exp(6)))
        assert math.isclose(SIGMOID_GRID[5], 0.5) and math.isclose(SIGMOID_GRID[1], 1 / (1 + math.exp(4.8)))
        assert len(COMPONENT_GRID) == 10 and math.isclose(COMPONENT_GRID[0], math.exp(-17))
        assert math.isclose(COMPONENT_GRID[-1], math.exp(-0.8)) and math.isclose(COMPONENT_GRID[1], math.exp(-15.2))
        assert fraction_grid("known_1000", "input") == KNOWN_GRID
        assert fraction_grid("imdb", "input") == fraction_grid("squad_v2.0", "input") == SIGMOID_GRID
        assert fraction_grid("ioi", "component") == COMPONENT_GRID

    def test_unit_counts(self):
        assert [unit_count(f, 10) for f in KNOWN_GRID] == list(range(1, 11))  # 0.3 * 10 is 3, not 4
        assert unit_count(math.exp(-17), 10 ** 6) == 1 and unit_count(0.5, 7) == 4 and unit_count(1e-9, 3) == 1

    def test_rank_is_descending_with_seeded_ties(self):
        scores = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.5, 0.5])
        order = rank(scores, seed=1)
        assert scores[order].tolist() == sorted(scores.tolist(), reverse=True)
        assert torch.equal(order, rank(scores, seed=1))
        orders = {tuple(rank(scores, seed=s).tolist()) for s in range(20)}
        assert len(orders) > 1  # ties broken differently by different seeds


def write_data(folder: Path, name: str, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(records))


class TestData:
    def test_missing_data_says_where_to_get_it(self, tmp_path, monkeypatch):
        with pytest.raises(DataError, match="not a folder"):
            find_data_dir(tmp_path / "nope")
        with pytest.raises(DataError, match="does not exist"):
            load_examples("imdb", tmp_path)
        monkeypatch.setenv("DPA_DATA", str(tmp_path))
        assert find_data_dir() == tmp_path
        with pytest.raises(ValueError, match="unknown dataset"):
            load_examples("mnist", tmp_path)

    def test_default_finds_the_shared_folder(self, monkeypatch):
        monkeypatch.delenv("DPA_DATA", raising=False)
        if not SHARED_DATA.is_dir():
            with pytest.raises(DataError, match="--data-dir"):
                find_data_dir()
        else:
            assert find_data_dir() == SHARED_DATA

    def test_reference_formats(self, tmp_path):
        write_data(tmp_path, "known_1000", [{"known_id": 3, "prompt": "Paris is in", "attribute": "France"}])
        write_data(tmp_path, "ioi", [{"case_id": 0, "prompt": "When Ann and Bob met, Bob gave it to",
                                      "answer": "Ann"}])
        write_data(tmp_path, "squad_v2.0", [{"id": "q", "question": "Where?", "answer": "Rome", "context": "In Rome."}])
        write_data(tmp_path, "imdb", [{"id": 1, "text": "Bad.", "answer": "Negative", "label": 0}])
        known, = load_examples("known_1000", tmp_path)
        assert (known.text, known.answer, known.id, known.chat) == ("Paris is in", "France", "3", False)
        ioi, = load_examples("ioi", tmp_path)
        assert (ioi.answer, ioi.contrast) == ("Ann", "Bob")
        squad, = load_examples("squad_v2.0", tmp_path)
        assert squad.chat and squad.user == "Context: In Rome.\nQuestion: Where?" and squad.prefill == "Answer:"
        imdb, = load_examples("imdb", tmp_path)
        assert imdb.user == "Review: Bad." and imdb.answer == "Negative" and "sentiment" in imdb.system
        write_data(tmp_path, "imdb", [{"id": 1, "answer": "Negative"}])
        with pytest.raises(DataError, match="'text'"):
            load_examples("imdb", tmp_path)

    def test_ioi_subject(self):
        assert subject_name("Then, Eleanor and Deanna went out. Eleanor gave a pen to", "Deanna") == "Eleanor"
        with pytest.raises(DataError, match="subject"):
            subject_name("Ann met Bob. Carl gave it to", "Ann")

    def test_shared_files_load(self, benchmark_data):  # conftest.py: missing data fails, --no-data skips
        data = benchmark_data
        assert len(load_examples("known_1000", data)) == 1209
        ioi = load_examples("ioi", data)
        assert len(ioi) == 841 and all(ex.contrast and ex.contrast != ex.answer for ex in ioi)
        assert len(load_examples("squad_v2.0", data)) == 1978 and len(load_examples("imdb", data)) == 1000

    def test_generated_ioi(self):
        records = generate_ioi(40, seed=3)
        assert records == generate_ioi(40, seed=3) and records != generate_ioi(40, seed=4)
        for r in records:
            assert r["prompt"].count(r["contrast"]) == 2 and r["prompt"].count(r["answer"]) == 1
            assert subject_name(r["prompt"], r["answer"]) == r["contrast"]
        assert {r["order"] for r in records} == {"ABBA", "BABA"}
        assert len(load_examples("ioi_templates", n_generated=5)) == 5


def word_tokenizer():
    """A word-level fast tokenizer over the tiny models' 96 ids, with a chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, **{f"w{i}": i for i in range(4, 96)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }}"
                         "{% if not loop.last %} <|im_end|> {% endif %}{% endfor %}")
    return tok


class TestPrompts:
    def test_raw_text_is_all_context(self):
        tok = word_tokenizer()
        s = encode_example(tok, Example(id="1", answer="w9", text="w4 w5 w6"))
        assert s.input_ids == [4, 5, 6] and s.context == [True] * 3 and s.target_id == 9 and s.contrast_id is None
        assert s.position == 2

    def test_chat_context_is_the_user_turn(self):
        tok = word_tokenizer()
        ex = Example(id="1", answer="w9", contrast="w8", system="w10 w20", user="w20 w21 w22", prefill="w30")
        s = encode_example(tok, ex)
        words = tok.convert_ids_to_tokens(s.input_ids)
        assert [w for w, c in zip(words, s.context) if c] == ["w20", "w21", "w22"]
        assert words[-1] == "w30" and words[0] == "<|im_start|>" and s.contrast_id == 8

    def test_chat_units_are_the_paragraph_not_its_label_or_the_question(self):
        """SQuAD's units are its context paragraph (the reference data: "the context is the paragraph"), IMDb's
        the review: the "Context:" label and the question stay, like the template, never ablated."""
        tok = word_tokenizer()
        ex = Example(id="1", answer="w9", system="w10", user="w11 w20 w21 w12 w22", prefill="w30", units="w20 w21")
        s = encode_example(tok, ex)
        words = tok.convert_ids_to_tokens(s.input_ids)
        assert [w for w, c in zip(words, s.context) if c] == ["w20", "w21"]
        with pytest.raises(ValueError, match="not inside its user turn"):
            encode_example(tok, Example(id="2", answer="w9", system="w10", user="w11 w20", prefill="w30", units="w23"))

    def test_squad_and_imdb_units(self, tmp_path):
        from dpa.evaluate.datasets import _example

        squad = _example("squad_v2.0", {"id": "q", "question": "Where?", "answer": "Rome", "context": "In Rome."})
        assert squad.units == "In Rome." and squad.user == "Context: In Rome.\nQuestion: Where?"
        imdb = _example("imdb", {"id": "r", "text": "Dull.", "answer": "Negative"})
        assert imdb.units == "Dull." and imdb.user == "Review: Dull."

    def test_plain_prompt_for_a_base_model(self):
        """A tokenizer without a chat template (a base model: Gemma 3 270M) reads the instruction, the user turn and
        "Answer:" as plain text after its BOS; the units are still the paragraph alone, never the BOS."""
        from tokenizers.processors import TemplateProcessing

        tok = word_tokenizer()
        tok.chat_template = None
        tok._tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A",
                                                           special_tokens=[("<|im_start|>", 1)])
        ex = Example(id="1", answer="w9", system="w10", user="w11 w20 w21 w12 w22", prefill="w30", units="w20 w21")
        s = encode_example(tok, ex, prompt="plain")
        words = tok.convert_ids_to_tokens(s.input_ids)
        assert words == ["<|im_start|>", "w10", "w11", "w20", "w21", "w12", "w22", "w30"]
        assert [w for w, c in zip(words, s.context) if c] == ["w20", "w21"] and s.target_id == 9
        with pytest.raises(ValueError, match="prompt='plain'"):
            encode_example(tok, ex)  # the chat form, without a template
        with pytest.raises(ValueError, match="prompt must be one of"):
            encode_example(tok, ex, prompt="raw")
        raw = encode_example(tok, Example(id="2", answer="w9", text="w4 w5"), prompt="plain")  # raw text: as is
        assert raw.input_ids == [1, 4, 5] and raw.context == [False, True, True]

    def test_prompt_setting(self):
        chat = Settings("squad_v2.0", "input").identity()
        assert "prompt" not in chat and chat["context_units"] == "paragraph"  # every earlier run: resumable
        assert Settings("imdb", "input", prompt="plain").identity()["prompt"] == "plain"
        with pytest.raises(ValueError, match="raw text already"):
            Settings("known_1000", "input", prompt="plain")
        with pytest.raises(ValueError, match="prompt must be one of"):
            Settings("squad_v2.0", "input", prompt="Plain")

    def test_chat_needs_a_template(self):
        tok = word_tokenizer()
        tok.chat_template = None
        with pytest.raises(ValueError, match="chat template"):
            encode_example(tok, Example(id="1", answer="w9", system="w6", user="w4", prefill="w5"))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", kv_heads=2)


def predicted(model, ids: list[int]) -> int:
    return int(model(torch.tensor([ids])).logits[0, -1].argmax())


class TestFilter:
    def test_reasons(self, llama):
        tok = word_tokenizer()
        ids = [3, 4, 5, 6]
        top = predicted(llama, ids)
        other = 10 if top != 10 else 11
        sample = lambda target, context=(True,) * 4: Sample("x", ids, list(context), target, None)  # noqa: E731
        assert check(llama, tok, sample(top), min_probability=0.0).valid
        assert check(llama, tok, sample(top), min_probability=0.99).reason.startswith("p(target) <=")
        assert check(llama, tok, sample(other), min_probability=0.0).reason == "argmax is not the target"
        assert check(llama, tok, sample(top), max_tokens=3).reason == "longer than 3 tokens"
        assert check(llama, tok, sample(top, (False,) * 4)).reason == "no context tokens"
        assert check(llama, tok, sample(3)).reason == "target token is one character"  # "a"
        assert check(llama, tok, sample(other), correct_only=False).valid  # --filter length
        assert check(llama, tok, sample(top), max_tokens=3, correct_only=False).reason == "longer than 3 tokens"

    def test_probability_is_the_models(self, llama):
        tok = word_tokenizer()
        ids = [3, 4, 5, 6]
        top = predicted(llama, ids)
        v = check(llama, tok, Sample("x", ids, [True] * 4, top, None), min_probability=0.0)
        expected = float(llama(torch.tensor([ids])).logits[0, -1].softmax(-1)[top])
        assert math.isclose(v.probability, expected, rel_tol=1e-6) and v.predicted == top and v.n_tokens == 4


def assert_curves_match_listed(model, ids, target, curves, listed, scores, fractions):
    """Component curves against units listed as ("edge", (layer, head, query, key)) and ("neuron",
    (layer, pos, neuron)) tuples, sorted by score (descending) and ablated one list at a time through
    ``component_ablation_prob``: independent of the curves' index arithmetic."""
    order = [listed[i] for i in sorted(range(len(listed)), key=lambda i: -scores[i])]

    def p(chosen):
        edges = [u for kind, u in chosen if kind == "edge"]
        neurons = [u for kind, u in chosen if kind == "neuron"]
        return component_ablation_prob(model, ids, edges, neurons, len(ids) - 1, target)

    clean = p([])
    assert curves.n_units == len(listed) and math.isclose(curves.p_clean, clean, rel_tol=1e-9)
    for j, f in enumerate(fractions):
        k = unit_count(f, len(listed))
        assert math.isclose(curves.disruption[j], 100 * p(order[:k]) / clean, rel_tol=1e-9)
        assert math.isclose(curves.recovery[j], 100 * p(order[k:]) / clean, rel_tol=1e-9)


class TestCurves:
    def test_input_curves_match_single_ablations(self, llama):
        ids = [3, 17, 25, 40, 8, 61, 9]
        context = [False, True, True, True, True, True, False]  # ends are template: never ablated
        sample = Sample("x", ids, context, 12, None)
        res = INPUT_METHODS["random"](llama, None, ids, 12, seed=5)
        fractions = [0.2, 0.5, 1.0]
        curves = input_curves(llama, sample, res, fractions, seed=0, batch_size=3)
        positions = [1, 2, 3, 4, 5]
        order = sorted(positions, key=lambda p: -float(res.token_scores[p]))
        clean = input_ablation_prob(llama, ids, [], 6, 12)
        assert curves.n_units == 5 and math.isclose(curves.p_clean, clean, rel_tol=1e-9)
        for j, f in enumerate(fractions):
            k = unit_count(f, 5)
            dis = input_ablation_prob(llama, ids, order[:k], 6, 12)
            rec = input_ablation_prob(llama, ids, order[k:], 6, 12)
            assert math.isclose(curves.disruption[j], 100 * dis / clean, rel_tol=1e-9)
            assert math.isclose(curves.recovery[j], 100 * rec / clean, rel_tol=1e-9)
        assert curves.recovery[-1] == 100.0

    def test_fine_component_units(self):
        sample = Sample("x", [3, 4, 5, 6], [False, True, True, True], 9, None)
        units = component_units(sample, 2, 3, 5, "fine")
        assert len(units.attn_index) == 2 * 3 * (3 + 2 + 1)  # causal pairs with a context key
        assert len(units.neuron_index) == 2 * 3 * 5  # context positions only
        edges = torch.zeros(2 * 3 * 4 * 4, dtype=torch.bool)
        edges[units.attn_index] = True
        edges = edges.view(2, 3, 4, 4)
        assert not edges[..., 0].any() and not edges[..., 1, 2].any() and edges[1, 2, 3, 1]
        coarse = component_units(sample, 2, 3, 5, "coarse")
        assert coarse.n == 2 * 3 + 2 * 5 and coarse.attn_shape == (2, 3, 1, 1)
        only_edges, only_neurons = component_units(sample, 2, 3, 5, "edges"), component_units(sample, 2, 3, 5, "neurons")
        assert torch.equal(only_edges.attn_index, units.attn_index) and only_edges.n == len(units.attn_index)
        assert torch.equal(only_neurons.neuron_index, units.neuron_index) and only_neurons.n == len(units.neuron_index)
        with pytest.raises(ValueError, match="component units"):
            component_units(sample, 2, 3, 5, "heads")

    def test_component_curves_ablate_the_ranked_units(self, llama):
        ids = [3, 17, 25, 40, 8]
        sample = Sample("x", ids, [True] * 5, 12, None)
        res = COMPONENT_METHODS["atp"](llama, None, ids, 12)
        units = component_units(sample, 3, 4, 48, "fine")
        fractions = [0.01, 0.3, 1.0]
        curves = component_curves(llama, sample, res, units, fractions, batch_size=2)
        scores = torch.cat([res.edge_scores.flatten()[units.attn_index],
                            res.neuron_position_scores.flatten()[units.neuron_index]])
        order = rank(scores, 0)
        n_attn = len(units.attn_index)

        def p(ablated):
            attn = torch.ones(3 * 4 * 5 * 5, dtype=torch.bool)
            neurons = torch.ones(3 * 5 * 48, dtype=torch.bool)
            attn[units.attn_index[ablated[ablated < n_attn]]] = False
            neurons[units.neuron_index[ablated[ablated >= n_attn] - n_attn]] = False
            return float(component_ablation_probs(llama, ids, attn.view(1, 3, 4, 5, 5), neurons.view(1, 3, 5, 48),
                                                  4, 12)[0])

        clean = p(order[:0])
        assert math.isclose(curves.p_clean, clean, rel_tol=1e-9)
        for j, f in enumerate(fractions):
            k = unit_count(f, units.n)
            assert math.isclose(curves.disruption[j], 100 * p(order[:k]) / clean, rel_tol=1e-9)
            assert math.isclose(curves.recovery[j], 100 * p(order[k:]) / clean, rel_tol=1e-9)

    @pytest.mark.parametrize("granularity", ["fine", "edges", "neurons"])
    def test_component_curves_equal_ablating_the_listed_units(self, llama, granularity):
        """``edges`` and ``neurons`` list one kind only; the other is never ablated."""
        t, target = 6, 4
        ids = [7, 3, 17, 25, 40, 8]
        sample = Sample("x", ids, [False] + [True] * (t - 1), target, None)  # position 0 plays BOS
        res = COMPONENT_METHODS["random"](llama, None, ids, target, seed=3)  # no ties (AtP has exact zeros)
        units = component_units(sample, 3, 4, 48, granularity)
        fractions = [1e-3, 0.05, 0.6]
        curves = component_curves(llama, sample, res, units, fractions, batch_size=2)
        listed = [("edge", (l, h, q, k)) for l in range(3) for h in range(4) for q in range(t) for k in range(1, q + 1)]
        listed += [("neuron", (l, p, n)) for l in range(3) for p in range(1, t) for n in range(48)]
        listed = [u for u in listed if granularity == "fine" or u[0] + "s" == granularity]
        scores = [float((res.edge_scores if kind == "edge" else res.neuron_position_scores)[u]) for kind, u in listed]
        assert len(set(scores)) == len(scores)  # no ties, so the order is the plain sort
        assert_curves_match_listed(llama, ids, target, curves, listed, scores, fractions)


class TestPaperProtocol:
    """The paper's unit sets (all context (query, key) pairs; one kind for one-kind methods) and its
    softmax dtype, each against an enumeration written out by hand. (That zeroing a non-causal
    probability changes nothing is tested in test_ablation.py.)"""

    def test_paper_units(self):
        sample = Sample("x", [3, 4, 5, 6], [False, True, True, True], 9, None)
        clean = component_units(sample, 2, 3, 5, "fine")
        paper = component_units(sample, 2, 3, 5, "fine", protocol="paper", method="dpa")
        assert len(paper.attn_index) == 2 * 3 * 3 * 3  # context query x context key, both triangles
        assert torch.equal(paper.neuron_index, clean.neuron_index)
        edges = torch.zeros(2 * 3 * 4 * 4, dtype=torch.bool)
        edges[paper.attn_index] = True
        edges = edges.view(2, 3, 4, 4)
        assert edges[1, 2, 1, 3] and not edges[..., 0, :].any() and not edges[..., 0].any()  # non-causal in; BOS out
        attn = component_units(sample, 2, 3, 5, "fine", protocol="paper", method="attn_only")
        assert torch.equal(attn.attn_index, paper.attn_index) and len(attn.neuron_index) == 0
        mlp = component_units(sample, 2, 3, 5, "fine", protocol="paper", method="mlp_only")
        assert len(mlp.attn_index) == 0 and torch.equal(mlp.neuron_index, paper.neuron_index)
        # the clean protocol ranks every method on the same units
        assert component_units(sample, 2, 3, 5, "fine", method="attn_only").same_as(clean)
        coarse = component_units(sample, 2, 3, 5, "coarse", protocol="paper", method="attn_only")
        assert coarse.n == 2 * 3 and coarse.attn_shape == (2, 3, 1, 1)
        assert component_units(sample, 2, 3, 5, "coarse", protocol="paper").same_as(component_units(sample, 2, 3, 5,
                                                                                                    "coarse"))
        with pytest.raises(ValueError, match="no neurons"):
            component_units(sample, 2, 3, 5, "neurons", protocol="paper", method="attn_only")
        with pytest.raises(ValueError, match="protocol"):
            component_units(sample, 2, 3, 5, "fine", protocol="reference")

    @pytest.mark.parametrize("method", ["random", "attn_only", "mlp_only"])
    def test_paper_curves_equal_ablating_the_listed_units(self, llama, method):
        """Units listed as tuples the way the reference lists them (every context pair of every head,
        non-causal ones included, which ablate nothing), sorted by score, ablated one list at a time."""
        t, target = 6, 4
        ids = [7, 3, 17, 25, 40, 8]
        sample = Sample("x", ids, [False] + [True] * (t - 1), target, None)
        kw = {"seed": 3} if method == "random" else {}
        res = COMPONENT_METHODS[method](llama, None, ids, target, **kw)
        units = component_units(sample, 3, 4, 48, "fine", protocol="paper", method=method)
        fractions = [1e-3, 0.05, 0.3, 0.6]
        curves = component_curves(llama, sample, res, units, fractions, batch_size=3).native
        listed = []
        if method != "mlp_only":
            listed += [("edge", (l, h, q, k)) for l in range(3) for h in range(4) for q in range(1, t)
                       for k in range(1, t)]
        if method != "attn_only":
            listed += [("neuron", (l, p, n)) for l in range(3) for p in range(1, t) for n in range(48)]
        scores = [float((res.edge_scores if kind == "edge" else res.neuron_position_scores)[u]) for kind, u in listed]
        ties = {s for s in scores if scores.count(s) > 1} if len(set(scores)) < len(scores) else set()
        # the only ties are the zeros of non-causal pairs, whose order cannot matter (they ablate nothing)
        assert all(kind == "edge" and u[3] > u[2] for (kind, u), s in zip(listed, scores) if s in ties)
        assert_curves_match_listed(llama, ids, target, curves, listed, scores, fractions)

    def test_native_softmax_is_in_the_models_dtype(self):
        model = tiny_model("llama").to(torch.bfloat16)
        ids = [3, 17, 25, 40, 8]
        keep = torch.ones(3, 5)
        keep[1, 2] = keep[2, 1:4] = 0
        wide, native = input_ablation_probs_both(model, ids, keep, 4, 12)
        emb = model.model.embed_tokens(torch.tensor([ids]))
        for r in range(3):
            logits = model(inputs_embeds=emb * keep[r, None, :, None].to(emb.dtype)).logits[0, -1]
            assert logits.dtype == torch.bfloat16
            assert wide[r] == logits.float().softmax(-1)[12] and wide.dtype == torch.float32
            assert native[r] == logits.softmax(-1)[12].float()
        attn = torch.ones(1, 3, 4, 5, 5)
        wide, native = component_ablation_probs_both(model, ids, attn, None, 4, 12)
        assert wide.dtype == native.dtype == torch.float32 and not torch.equal(wide, native)
        wide64, native64 = component_ablation_probs_both(tiny_model("llama"), ids, attn.double(), None, 4, 12)
        assert torch.equal(wide64, native64)  # float64 model: one softmax


def tiny_dataset(model, folder: Path, n: int = 4) -> None:
    """Known-1000-style records whose answers are the tiny model's own predictions (plus one it gets wrong)."""
    records = []
    for i in range(n):
        ids = [4 + i, 20 + 2 * i, 40 + i, 60 + 3 * i]
        records.append({"known_id": i, "prompt": " ".join(f"w{j}" for j in ids),
                        "attribute": f"w{predicted(model, ids)}"})
    wrong = [5, 6, 7, 8]
    records.insert(1, {"known_id": 99, "prompt": "w5 w6 w7 w8",
                       "attribute": f"w{(predicted(model, wrong) + 1) % 92 + 4}"})
    write_data(folder, "known_1000", records)


class TestRunner:
    def test_a_resume_on_other_data_or_another_tokenizer_is_refused(self, llama, tmp_path):
        """A run resumed with a data file whose records moved (or another tokenizer) would mix two datasets:
        refused by name, where the old verdicts and rows would be reused."""
        from dpa.evaluate.datasets import DataError

        tok = word_tokenizer()
        tiny_dataset(llama, tmp_path / "data")
        settings = Settings(dataset="known_1000", unit="input", methods=("random",), limit=2, min_probability=0.0,
                            data_dir=str(tmp_path / "data"))
        evaluate(llama, tok, settings, tmp_path / "run", progress=False, figures=False)
        records = json.loads((tmp_path / "data" / "known_1000.json").read_text())
        write_data(tmp_path / "moved", "known_1000", records[::-1])
        with pytest.raises(DataError, match="sample 0 was record '0'.*is record '3'"):
            evaluate(llama, tok, Settings(**{**settings.__dict__, "data_dir": str(tmp_path / "moved")}),
                     tmp_path / "run", progress=False, figures=False)
        other = word_tokenizer()
        other.add_tokens(["extra"])
        with pytest.raises(ValueError, match="tokenizer_sha256"):
            evaluate(llama, other, settings, tmp_path / "run", progress=False, figures=False)

    def test_a_run_says_its_length_and_that_few_samples_cannot_rank_methods(self, llama, tmp_path, capsys):
        """After its first sample a run says how long it will take; a run of fewer than 30 samples warns that it
        cannot rank methods, with the paired intervals it gives."""
        from dpa.evaluate.runner import FewSamplesWarning
        from dpa.evaluate.stats import paired_difference

        tok = word_tokenizer()
        tiny_dataset(llama, tmp_path / "data")
        settings = Settings(dataset="known_1000", unit="input", methods=("dpa", "random"), limit=3,
                            min_probability=0.0, data_dir=str(tmp_path / "data"))
        with pytest.warns(FewSamplesWarning, match=r"3 samples cannot rank methods") as caught:
            evaluate(llama, tok, settings, tmp_path / "run", progress=True, figures=False)
        err = capsys.readouterr().err
        assert re.search(r"the first sample took \d+\.\d s \(2 methods\): about \d+ s for the 2 samples left", err)
        line = next(x for x in str(caught[0].message).splitlines() if x.strip().startswith("dpa - random"))
        rows = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
        from dpa.evaluate.curves import fraction_grid
        from dpa.evaluate.stats import sample_total

        totals = {m: {r["index"]: sample_total(r, fraction_grid("known_1000", "input"), "input")
                      for r in rows if r["method"] == m} for m in ("dpa", "random")}
        want = paired_difference(totals["dpa"], totals["random"])
        assert f"{want['difference']:+.2f} [{want['interval'][0]:+.2f}, {want['interval'][1]:+.2f}]" in line
        with warnings.catch_warnings():
            warnings.simplefilter("error", FewSamplesWarning)  # one method alone: nothing to rank
            evaluate(llama, tok, Settings(**{**settings.__dict__, "methods": ("random",)}), tmp_path / "one",
                     progress=False, figures=False)

    def test_evaluate_writes_results_and_resumes(self, llama, tmp_path):
        tok = word_tokenizer()
        tiny_dataset(llama, tmp_path / "data")
        out = tmp_path / "run"
        settings = Settings(dataset="known_1000", unit="input", methods=("dpa", "random"), limit=3,
                            min_probability=0.0, data_dir=str(tmp_path / "data"))
        results = evaluate(llama, tok, settings, out, progress=False)
        assert set(results["methods"]) == {"dpa", "random"}
        assert results["n_evaluated"] == 3 and results["n_checked"] == 4 and results["n_valid"] == 3
        assert results["dropped"] == {"argmax is not the target": 1}
        m = results["methods"]["dpa"]
        assert m["n_samples"] == 3 and m["seconds_per_sample"] > 0 and len(m["disruption"]) == 10
        assert m["auc"] == auc_summary(KNOWN_GRID, m["disruption"], m["recovery"], unit="input")
        for name in ("results.json", "results.csv", "results.md", "curves.png", "auc.png"):
            assert (out / name).stat().st_size > 0
        assert json.loads((out / "results.json").read_text())["methods"]["random"]["n_samples"] == 3
        lines = (out / "samples.jsonl").read_text().splitlines()
        assert len(lines) == 6
        # a restart redoes nothing; a new method only adds its own lines; a cut-off last line is ignored
        with open(out / "samples.jsonl", "a") as fh:
            fh.write('{"index": 0, "meth')
        evaluate(llama, tok, settings, out, progress=False, figures=False)
        again = evaluate(llama, tok, Settings(**{**settings.__dict__, "methods": ("dpa", "gradient")}), out,
                         progress=False, figures=False)
        rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.endswith("}")]
        assert len(rows) == 9 and sum(r["method"] == "gradient" for r in rows) == 3
        assert again["methods"]["dpa"] == results["methods"]["dpa"]
        with pytest.raises(ValueError, match="other settings"):
            evaluate(llama, tok, Settings(**{**settings.__dict__, "unit": "component"}), out, progress=False)
        # the model's dtype is part of the run (float32 is recorded by its absence): a float64 folder is
        # refused to the same model in float32, though the float32 identity has no dtype key to compare
        assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
        with pytest.raises(ValueError, match="asks for float32, but .* holds a run in float64"):
            evaluate(tiny_model("llama", kv_heads=2).float(), tok, settings, out, progress=False)

    def test_component_run_and_sweep(self, llama, tmp_path):
        tok = word_tokenizer()
        tiny_dataset(llama, tmp_path / "data", n=2)
        settings = Settings(dataset="known_1000", unit="component", methods=("dpa", "dpa_mid", "attn_only"),
                            min_probability=0.0, data_dir=str(tmp_path / "data"))
        results = evaluate(llama, tok, settings, tmp_path / "component", progress=False, figures=False)
        assert set(results["methods"]) == {"dpa", "dpa_mid", "attn_only"} and results["n_evaluated"] == 2
        assert results["fractions"] == list(COMPONENT_GRID)
        # each AUC mode integrates its own protocol's curves; attn_only's paper units are the edges alone
        for m in results["methods"].values():
            assert m["auc"] == auc_summary(COMPONENT_GRID, m["disruption"], m["recovery"], unit="component",
                                           paper=(m["paper_disruption"], m["paper_recovery"]))
        rows = {r["method"]: r for r in map(json.loads, (tmp_path / "component" / "samples.jsonl").read_text()
                                            .splitlines()) if r["index"] == 0}
        t = rows["dpa"]["n_tokens"]
        assert rows["dpa"]["n_units"] == 3 * 4 * t * (t + 1) // 2 + 3 * t * 48
        assert rows["dpa"]["paper_n_units"] == 3 * 4 * t * t + 3 * t * 48
        assert rows["attn_only"]["paper_n_units"] == 3 * 4 * t * t
        assert rows["attn_only"]["paper_recovery"] != rows["attn_only"]["recovery"]
        coarse = evaluate(llama, tok, Settings(**{**settings.__dict__, "component_units": "coarse",
                                                  "methods": ("activation_patching", "dpa")}),
                          tmp_path / "coarse", progress=False, figures=False)
        assert set(coarse["methods"]) == {"activation_patching", "dpa"}
        summary = sweep(llama, tok, settings, tmp_path / "sweep", families=["attention", "mlp"], ps=[0.0, 0.5],
                        progress=False)
        assert len(summary["points"]) == 4 and all(pt["auc"] is not None for pt in summary["points"])
        # p = 0.5 is the default weights in both families: one method, evaluated once
        assert summary["points"][1]["method"] == summary["points"][3]["method"] == "dpa[0.25,0.25,0.5,0.5,0.5]"
        assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
        assert len((tmp_path / "sweep" / "sweep.csv").read_text().splitlines()) == 5

    def test_rows_without_paper_curves(self, llama, tmp_path):
        """Rows of older versions hold the clean curves only: they serve input runs of a float32 / float64
        model (same units, same softmax); component samples are measured again."""
        tok = word_tokenizer()
        tiny_dataset(llama, tmp_path / "data", n=2)
        for unit, remeasured in (("input", 0), ("component", 2)):
            settings = Settings(dataset="known_1000", unit=unit, methods=("dpa",), min_probability=0.0,
                                data_dir=str(tmp_path / "data"))
            out = tmp_path / unit
            first = evaluate(llama, tok, settings, out, progress=False, figures=False)
            path = out / "samples.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("paper_")}) + "\n"
                                    for r in rows))
            again = evaluate(llama, tok, settings, out, progress=False, figures=False)
            kept = [json.loads(x) for x in path.read_text().splitlines()]  # one row per sample (merged)
            assert len(kept) == len(rows) and sum("paper_disruption" in r for r in kept) == remeasured
            for mode in ("paper", "clean"):
                assert again["methods"]["dpa"]["auc"][mode] == pytest.approx(first["methods"]["dpa"]["auc"][mode])

    def test_one_kind_methods_refuse_the_other_kind(self, llama, tmp_path):
        settings = Settings(dataset="known_1000", unit="component", methods=("dpa", "attn_only"),
                            component_units="neurons")
        with pytest.raises(ValueError, match="attn_only score.s. edges only"):
            evaluate(llama, word_tokenizer(), settings, tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()  # refused before anything was written

    def test_unknown_method(self, llama, tmp_path):
        with pytest.raises(ValueError, match="unknown input method"):
            evaluate(llama, word_tokenizer(), Settings(dataset="known_1000", unit="input", methods=("dpaa",)),
                     tmp_path, progress=False)


class TestCLI:
    def test_help_and_bad_options_fail_before_loading_a_model(self, capsys, tmp_path):
        with pytest.raises(SystemExit) as info:
            main(["evaluate", "--help"])
        assert info.value.code == 0 and "--methods" in capsys.readouterr().out
        args = ["evaluate", "--dataset", "known_1000", "--unit", "input", "--out", str(tmp_path)]
        assert main(args + ["--methods", "dpa,nonsense"]) == 2
        assert "unknown input method(s) nonsense" in capsys.readouterr().err
        assert main(args + ["--limit", "0"]) == 2
        assert main(args + ["--threads", "0"]) == 2
        assert main(args + ["--steps", "0"]) == 2 and "--steps must be at least 1" in capsys.readouterr().err
        with pytest.raises(SystemExit) as info:  # torchrun splits the work now; dpa keeps no scheme of its own
            main(args + ["--shard", "0/2"])
        assert info.value.code == 2 and "unrecognized arguments: --shard" in capsys.readouterr().err
        assert main(["sweep", "--dataset", "ioi", "--unit", "component", "--out", str(tmp_path),
                     "--families", "attention,colour"]) == 2
        assert "unknown family colour" in capsys.readouterr().err

    def test_evaluate_a_saved_model_on_a_chosen_device(self, capsys, tmp_path):
        """The whole command on a tiny saved Llama: --model, --device, --data-dir, tables and files."""
        import dpa
        from tests.test_cli import save_tiny_model

        folder = save_tiny_model(tmp_path / "model")
        sharp = transformers.LlamaForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            sharp.lm_head.weight.mul_(40)  # confident predictions, so samples pass the p > 0.1 filter
        sharp.save_pretrained(folder)
        model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float32)
        records = []
        for i, prompt in enumerate(["the capital of france is", "a big old city in", "the river of london is"]):
            ids = tok(prompt)["input_ids"]
            answer = tok.convert_ids_to_tokens(predicted(model, ids))
            records.append({"known_id": i, "prompt": prompt, "attribute": answer})
        write_data(tmp_path / "data", "known_1000", records)
        out = tmp_path / "run"
        code = main(["evaluate", "--dataset", "known_1000", "--unit", "input", "--methods", "dpa,random,gradient",
                     "--limit", "2", "--data-dir", str(tmp_path / "data"), "--model", str(folder), "--device", "cpu",
                     "--threads", "1", "--out", str(out), "--quiet"])
        printed = capsys.readouterr().out
        assert code == 0 and "| dpa |" in printed and "2 samples" in printed
        results = json.loads((out / "results.json").read_text())
        assert set(results["methods"]) == {"dpa", "random", "gradient"} and results["device"].startswith("cpu")
        assert all(m["n_samples"] == 2 for m in results["methods"].values())
        for name in ("results.csv", "results.md", "curves.png", "auc.png", "samples.jsonl", "filter.jsonl"):
            assert (out / name).is_file()
        assert f"wrote {out / 'results.json'}, results.csv, results.md, curves.png and auc.png" in printed
        code = main(["evaluate", "--dataset", "known_1000", "--unit", "input", "--methods", "dpa,random,gradient",
                     "--limit", "2", "--data-dir", str(tmp_path / "data"), "--model", str(folder), "--device", "cpu",
                     "--threads", "1", "--out", str(out), "--quiet", "--no-figures"])  # resumed: nothing to measure
        printed = capsys.readouterr().out
        assert code == 0 and f"wrote {out / 'results.json'}, results.csv and results.md\n" in printed
        assert "figures" not in printed and "png" not in printed


def test_two_gloo_processes_under_torchrun_give_one_process_results(tmp_path):
    """``torchrun --nproc-per-node 2 -m dpa evaluate`` and ``... sweep``: rank 0 merges; the folder holds what one
    process writes, row for row in the same order (equal to 1e-6), and the same tables."""
    import os
    import subprocess
    import sys

    import dpa
    from tests.test_cli import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    sharp = transformers.LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(40)
    sharp.save_pretrained(folder)
    model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float32)
    records = []
    for i, prompt in enumerate(["the capital of france is", "a big old city in", "the river of london is",
                                "a new city in", "the small river of", "old london is a"]):
        records.append({"known_id": i, "prompt": prompt,
                        "attribute": tok.convert_ids_to_tokens(predicted(model, tok(prompt)["input_ids"]))})
    write_data(tmp_path / "data", "known_1000", records)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command, extra in (("evaluate", ["--methods", "dpa,random,gradient"]),
                           ("sweep", ["--families", "attention", "--ps", "0,1"])):
        args = [command, "--dataset", "known_1000", "--unit", "input", "--data-dir", str(tmp_path / "data"),
                "--model", str(folder), "--quiet", "--no-figures", *extra]
        one = subprocess.run([sys.executable, "-m", "dpa", *args, "--out", str(tmp_path / f"{command}-1")],
                             capture_output=True, text=True, env=env, timeout=600)
        assert one.returncode == 0, one.stderr[-2000:]
        two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              str(29600 + os.getpid() % 1000), "-m", "dpa", *args, "--out", str(tmp_path / f"{command}-2")],
                             capture_output=True, text=True, env=env, timeout=600)
        assert two.returncode == 0, two.stderr[-3000:]
        a, b = (json.loads((tmp_path / f"{command}-{n}" / "results.json").read_text()) for n in (1, 2))
        assert a["n_evaluated"] == b["n_evaluated"] == 6
        rows_a, rows_b = ([json.loads(x) for x in (tmp_path / f"{command}-{n}" / "samples.jsonl").read_text().splitlines()]
                          for n in (1, 2))
        assert [(r["index"], r["method"]) for r in rows_a] == [(r["index"], r["method"]) for r in rows_b]
        for x, y in zip(rows_a, rows_b):
            for key in ("disruption", "recovery", "paper_disruption", "paper_recovery"):
                assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-6), (x["index"], x["method"], key)
        assert not list((tmp_path / f"{command}-2").glob("samples.rank*.jsonl"))  # merged and removed
        for name in a["methods"]:
            assert a["methods"][name]["auc"]["paper"]["total"] == pytest.approx(
                b["methods"][name]["auc"]["paper"]["total"], rel=1e-6, abs=1e-6)
        if command == "sweep":
            assert (tmp_path / "sweep-2" / "sweep.csv").read_text().count("\n") == 3
            assert "sweep.json and sweep.csv (6 samples)" in one.stdout  # --no-figures: no sweep.png claimed


@pytest.mark.slow
def test_dpa_evaluate_command_end_to_end(benchmark_data, tmp_path):
    """The command of issue 3, as a user runs it (a fresh process, the default model), on 2 samples."""
    methods = "dpa,gradient,input_x_gradient,integrated_gradients,random"
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dpa", "evaluate", "--dataset", "known_1000", "--unit", "input",
                           "--methods", methods, "--limit", "2", "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == set(methods.split(","))
    assert results["n_evaluated"] == 2 and results["model"] == "SmolLM2-135M-Instruct"
    for m in results["methods"].values():
        assert m["n_samples"] == 2 and all(math.isfinite(y) for y in m["disruption"] + m["recovery"])
        assert m["auc"]["paper"]["disruption"] >= 5 - 1e-9  # the anchor's floor
    assert "| dpa |" in proc.stdout and (out / "curves.png").is_file()


# Records the default model answers right (found by the filter): SQuAD and IMDb keep few samples
# (SmolLM2-135M often answers " negative" where IMDb's target is " Negative"; about 1 in 5 IMDb
# records and few SQuAD records pass), so the test reads these records instead of scanning long prompts.
VALID = {"squad_v2.0": (45, 49), "imdb": (13, 29)}


@pytest.fixture(scope="module")
def default_model():
    import dpa

    return dpa.load_model(device="cpu", dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("dataset,unit,methods", [
    ("squad_v2.0", "input", "dpa"),  # long prompts: the curves' forward passes dominate, so one method
    ("imdb", "input", "dpa"),
    ("known_1000", "component", "dpa,dpa_mid,atp,random"),
    ("ioi", "component", "dpa,attn_only"),
])
def test_evaluate_each_dataset_and_unit(benchmark_data, default_model, tmp_path, dataset, unit, methods):
    """A valid sample of each other dataset x unit of the paper's tables, in process (one model load); the
    command's end-to-end test above averages two."""
    data = benchmark_data  # missing data fails (conftest.py), --no-data skips before the model loads
    if dataset in VALID:
        records = json.loads((data / f"{dataset}.json").read_text())
        write_data(tmp_path / "data", dataset, [records[i] for i in VALID[dataset]])
        data = tmp_path / "data"
    model, tok = default_model
    settings = Settings(dataset, unit, methods=tuple(methods.split(",")), limit=1, data_dir=str(data))
    results = evaluate(model, tok, settings, tmp_path / "run", progress=False, figures=False)
    assert results["n_evaluated"] == 1, results["dropped"]
    assert set(results["methods"]) == set(settings.methods)
    for m in results["methods"].values():
        assert m["n_samples"] == 1 and len(m["disruption"]) == len(fraction_grid(dataset, unit))
        assert all(math.isfinite(y) and y >= 0 for y in m["disruption"] + m["recovery"])
        if unit == "component":
            assert m["auc"]["paper"]["recovery"] >= 50 * (1 - math.exp(-0.8)) - 1e-9  # the anchors' floor
