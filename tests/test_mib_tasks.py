"""MIB's tasks rebuilt offline (dpa.mib.tasks): pairs of equal length, one-token answers, MIB's counterfactuals."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dpa
from dpa.errors import InputError
from dpa.mib.tasks import RULES, TASKS, candidates, task_pairs

IOI_RECORDS = [
    {"case_id": 0, "prompt": "After the lunch, Mary and John went to the store. John gave a drink to", "answer": "Mary"},
    {"case_id": 1, "prompt": "Then, John and Mary had a lot of fun at the park. Mary gave a ball to", "answer": "John"},
    {"case_id": 2, "prompt": "When Sarah and Tom got a book at the school, Tom decided to give it to",
     "answer": "Sarah"},
]


@pytest.fixture(scope="module")
def smollm():
    return dpa.load_model()


@pytest.fixture
def ioi_file(tmp_path):
    path = tmp_path / "ioi.json"
    path.write_text(json.dumps(IOI_RECORDS), encoding="utf-8")
    return path


def _build(task, tok, ioi_file, **kw):
    return candidates(task, tok, data=ioi_file if task == "ioi" else None, **kw)


@pytest.mark.parametrize("task", TASKS)
def test_pairs_have_equal_lengths_and_one_token_answers(smollm, ioi_file, task):
    _, tok = smollm
    pairs = _build(task, tok, ioi_file, n=60)
    assert len(pairs) == (len(IOI_RECORDS) if task == "ioi" else 60)
    assert pairs.metric == ("prob_diff" if task == "greater-than" else "logit_diff")
    assert task in RULES and len(RULES[task]) > 200
    for clean, counter, good, bad in zip(pairs.clean, pairs.counter, pairs.answers, pairs.wrong):
        assert len(clean) == len(counter) and clean != counter
        assert list(clean) == tok(tok.decode(clean)).input_ids  # the ids are the prompt as the model reads it
        assert not set(good) & set(bad)
        if pairs.metric == "logit_diff":
            assert len(good) == len(bad) == 1
            assert len(tok.decode(good)) >= 1 and tok(tok.decode(clean) + tok.decode(good)).input_ids == list(clean + good)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_for_a_seed(smollm, ioi_file, task):
    _, tok = smollm
    a, b = _build(task, tok, ioi_file, n=30, seed=3), _build(task, tok, ioi_file, n=30, seed=3)
    assert (a.clean, a.counter, a.answers, a.wrong, a.names) == (b.clean, b.counter, b.answers, b.wrong, b.names)
    c = _build(task, tok, ioi_file, n=30, seed=4)
    assert c.clean != a.clean  # another seed, another draw (IOI: another order of the file)


def test_ioi_counterfactual_flips_the_second_subject(smollm, ioi_file):
    _, tok = smollm
    pairs = candidates("ioi", tok, data=ioi_file)
    by_case = {r["case_id"]: r for r in IOI_RECORDS}
    for i in range(len(pairs)):
        record = by_case[int(pairs.names[i].rsplit(" ", 1)[1])]
        io, s = tok.decode(pairs.answers[i]).strip(), tok.decode(pairs.wrong[i]).strip()
        assert io == record["answer"] and tok.decode(pairs.clean[i]) == record["prompt"]
        head, _, tail = record["prompt"].rpartition(s)
        assert tok.decode(pairs.counter[i]) == head + io + tail  # s2_io_flip: S2 becomes IO


def test_mcqa_symbol_counterfactual(smollm):
    _, tok = smollm
    pairs = candidates("mcqa", tok, n=40)
    for i in range(len(pairs)):
        clean, counter = tok.decode(pairs.clean[i]), tok.decode(pairs.counter[i])
        assert clean.startswith("Question: The ") and clean.endswith("\nAnswer:")
        color = re.match(r"Question: The .+ is (\w+)\. What color", clean).group(1)
        lines = dict(re.findall(r"\n([A-Z])\. (\w+)", clean))
        moved = dict(re.findall(r"\n([A-Z])\. (\w+)", counter))
        assert list(lines) == ["A", "B", "C", "D"] and sorted(moved) == ["A", "B", "C", "D"]
        assert list(lines.values()) == list(moved.values())  # same colours, same order
        assert all(a != b for a, b in zip(lines, moved))  # every symbol changes
        assert tok.decode(pairs.answers[i]) == " " + next(k for k, v in lines.items() if v == color)
        assert tok.decode(pairs.wrong[i]) == " " + next(k for k, v in moved.items() if v == color)


@pytest.mark.parametrize("task,op", [("arithmetic-add", "plus"), ("arithmetic-sub", "minus")])
def test_arithmetic_answers_are_the_results(smollm, task, op):
    _, tok = smollm
    pairs = candidates(task, tok, n=100)

    def result(text):
        a, b = (int(x) for x in re.findall(r"\d+", text))
        if "subtract" in text or "away from" in text:  # "subtract b from a"
            a, b = b, a
        return a + b if task == "arithmetic-add" else a - b

    for i in range(len(pairs)):
        clean, counter = tok.decode(pairs.clean[i]), tok.decode(pairs.counter[i])
        assert clean.startswith("Q: ") and clean.endswith("A: ")
        assert tok.decode(pairs.answers[i]) == str(result(clean))
        assert tok.decode(pairs.wrong[i]) == str(result(counter)) != str(result(clean))
        assert re.sub(r"\d+", "#", clean) == re.sub(r"\d+", "#", counter)  # the same template, other operands
    assert any(op in tok.decode(c) for c in pairs.clean)


def test_greater_than_year_sets_split_at_yy(smollm):
    _, tok = smollm
    pairs = candidates("greater-than", tok, n=200)
    for i in range(len(pairs)):
        clean, counter = tok.decode(pairs.clean[i]), tok.decode(pairs.counter[i])
        century, yy, decade = re.fullmatch(r"The \w+ lasted from the year (\d\d)(\d\d) to the year \1(\d)", clean).groups()
        assert counter == clean.replace(f"year {century}{yy} ", f"year {century}01 ")  # MIB's "01" start year
        assert decade == yy[0]  # SmolLM2 writes digits one by one: the prompt ends with the decade digit
        later = [int(tok.decode([t])) for t in pairs.answers[i]]
        earlier = [int(tok.decode([t])) for t in pairs.wrong[i]]
        assert sorted(later + earlier) == list(range(10))
        assert min(later) > int(yy[1]) >= max(earlier)


class _TwoDigitTokenizer:
    """A word-level tokenizer writing digits two by two, like GPT-2 writes a year's last two digits."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text):
        pieces = re.findall(r"\d\d|\d| ?[A-Za-z]+|\s|[^\sA-Za-z\d]", text)
        ids = [self.vocab.setdefault(p, len(self.vocab)) for p in pieces]
        return type("Encoding", (), {"input_ids": ids})()

    def decode(self, ids):
        words = {i: p for p, i in self.vocab.items()}
        return "".join(words[i] for i in ids)


def test_greater_than_with_two_digit_tokens_is_mibs_gpt2_set():
    tok = _TwoDigitTokenizer()
    pairs = candidates("greater-than", tok, n=50)
    for i in range(len(pairs)):
        clean = tok.decode(pairs.clean[i])
        century, yy = re.fullmatch(r"The \w+ lasted from the year (\d\d)(\d\d) to the year \1", clean).groups()
        assert tok.decode(pairs.counter[i]) == clean.replace(f"{century}{yy} ", f"{century}01 ")
        assert [tok.decode([t]) for t in pairs.answers[i]] == [f"{y:02d}" for y in range(int(yy) + 1, 100)]
        assert [tok.decode([t]) for t in pairs.wrong[i]] == [f"{y:02d}" for y in range(int(yy) + 1)]


def test_unknown_task_lists_the_known_ones(smollm):
    _, tok = smollm
    with pytest.raises(InputError, match=r"unknown MIB task 'ioi2'.*ioi, mcqa, arithmetic-add, arithmetic-sub, "
                                         r"greater-than"):
        candidates("ioi2", tok)
    with pytest.raises(InputError, match="n must be a positive integer"):
        candidates("mcqa", tok, n=0)


def test_missing_data_file_names_the_path_and_dpa_data(smollm, tmp_path, monkeypatch):
    _, tok = smollm
    missing = tmp_path / "nowhere" / "ioi.json"
    with pytest.raises(InputError, match=re.escape(str(missing)) + ".*DPA_DATA"):
        candidates("ioi", tok, data=missing)
    monkeypatch.setenv("DPA_DATA", str(tmp_path))  # a folder without ioi.json
    with pytest.raises(InputError, match=re.escape(str(tmp_path / "ioi.json")) + ".*DPA_DATA"):
        candidates("ioi", tok)


def test_data_may_be_the_folder(smollm, ioi_file, monkeypatch):
    _, tok = smollm
    a = candidates("ioi", tok, data=ioi_file)
    assert a.clean == candidates("ioi", tok, data=ioi_file.parent).clean
    monkeypatch.setenv("DPA_DATA", str(ioi_file.parent))
    assert a.clean == candidates("ioi", tok).clean


@pytest.mark.slow
def test_task_pairs_ioi_keeps_pairs_the_model_gets_right(smollm, benchmark_data):
    model, tok = smollm
    pairs = task_pairs(model, tok, "ioi", n=10, data=benchmark_data)
    assert len(pairs) == 10
    for clean, good, bad in zip(pairs.clean, pairs.answers, pairs.wrong):
        logits = model(torch.tensor([clean])).logits[0, -1]
        assert int(logits.argmax()) == good[0] and logits[good[0]] > logits[bad[0]]


@pytest.mark.slow
def test_task_pairs_says_how_many_survive(smollm, ioi_file):
    model, tok = smollm
    with pytest.raises(InputError, match=r"ioi: only \d of 3 candidate pairs are answered right.*n=5"):
        task_pairs(model, tok, "ioi", n=5, data=ioi_file)


class _Answers(torch.nn.Module):
    """A stand-in model whose top next token is ``answer(prompt ids)``."""

    def __init__(self, vocab: int, answer):
        super().__init__()
        self.vocab, self.answer = vocab, answer
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # task_pairs reads the device off a parameter

    def forward(self, ids, logits_to_keep=None):
        from types import SimpleNamespace

        logits = torch.zeros(ids.shape[0], 1, self.vocab)
        for b, row in enumerate(ids.tolist()):
            logits[b, 0, self.answer(tuple(row))] = 1
        return SimpleNamespace(logits=logits)


def test_mcqa_refuses_a_model_that_names_one_symbol(smollm):
    """Four symbols in random order: a model that always says ' A' keeps only the pairs whose answer is A, and the
    circuit would explain that bias, not the task. A model that reads the colour keeps all four symbols."""
    _, tok = smollm
    pool = candidates("mcqa", tok, n=400)
    a = tok.encode(" A", add_special_tokens=False)[0]
    with pytest.raises(InputError, match=r"mcqa: the model names ' A' in 20 of the 20 pairs it answers right"):
        task_pairs(_Answers(len(tok), lambda row: a), tok, "mcqa", n=20)
    right = {tuple(c): ans[0] for c, ans in zip(pool.clean, pool.answers)}
    pairs = task_pairs(_Answers(len(tok), right.__getitem__), tok, "mcqa", n=20)
    assert len(pairs) == 20 and len({ans[0] for ans in pairs.answers}) == 4


def test_a_model_that_answers_none_right_cannot_do_the_task(smollm):
    _, tok = smollm
    never = tok.encode(" zebra", add_special_tokens=False)[0]
    with pytest.raises(InputError, match=r"mcqa: none of the \d+ candidate pairs is answered right by the model.*"
                                         r"cannot do this task"):
        task_pairs(_Answers(len(tok), lambda row: never), tok, "mcqa", n=20)
