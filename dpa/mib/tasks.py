"""MIB's circuit-track tasks rebuilt offline as clean/counterfactual prompt pairs for a given tokenizer.

MIB (Mueller et al., arXiv 2504.13151; code: hannamw/MIB-circuit-track) reads its tasks from a model hub that
these machines cannot reach. Here they are rebuilt from MIB's published templates and rules (``RULES`` says, task
by task, exactly how and where the rebuild differs from the hub data):

- ``ioi``: the IOI sentences of ``ioi.json`` (the DPA paper's data folder), MIB's default counterfactual for IOI
  (``s2_io_flip``: the second mention of the subject becomes the indirect object);
- ``mcqa``: copy-colours multiple choice, four choices labelled A-D, MIB's ``symbol_counterfactual``;
- ``arithmetic-add`` / ``arithmetic-sub``: "Q: How much is 3 plus 4? A: " and paraphrases, MIB's
  ``random_counterfactual`` (other operands), one-token answers;
- ``greater-than``: "The war lasted from the year 1732 to the year 17", the "01" start year as counterfactual,
  probability difference of the years after YY minus those up to YY.

``candidates`` builds the pairs before any model is run (deterministic for a seed); ``task_pairs`` keeps the
first ``n`` that a model answers right.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from pathlib import Path

import torch

from ..errors import InputError
from .pairs import Pairs

TASKS = ("ioi", "mcqa", "arithmetic-add", "arithmetic-sub", "greater-than")

_FILTERS = ("Pairs whose clean and counterfactual prompts tokenise to different lengths, or whose answers are not "
            "one token each right after the prompt (tokenizer(prompt + answer) = tokenizer(prompt) + one token), "
            "are dropped. task_pairs then keeps the pairs whose clean prompt's top next token is {what}; MIB's "
            "circuit track itself has no per-model filter (dataset.py keeps every pair that passes its tokenizer "
            "checks), and the counterfactual prompt's prediction is not checked (MIB does not require it).")

RULES: dict[str, str] = {
    "ioi": (
        "Clean prompts: the records of ioi.json (the DPA paper's data folder; read, never copied), shuffled with "
        "random.Random(seed). Every record fits one of MIB's IOI sentence frames (the ABBA/BABA templates of the "
        "mib-bench/ioi set, MIB-causal-variable-track/tasks/IOI_task/templates.json) but uses the file's own 100 "
        "names, not MIB's. The indirect object IO is the record's answer; the subject S is the other name of the "
        "'X and Y' pair, the one said twice (records where that is not clear-cut are dropped). Counterfactual: "
        "MIB's circuit-track default for IOI, s2_io_flip_counterfactual (MIB_circuit_track/dataset.py, "
        "HFEAPDataset.__getitem__): the second mention of S is replaced by IO, which makes S the right answer. "
        "Metric: logit difference, logit(' IO') - logit(' S') (MIB: correct_idx = IO, incorrect_idx = subject). "
        "MIB's own length filter also asks the ABC counterfactual's third name to match; that name is not used "
        "here. " + _FILTERS.format(what="' IO'")),
    "mcqa": (
        "MIB's copy-colours format (the prompt of MIB's causal-variable track, CausalAbstraction "
        "tasks/simple_MCQA/simple_MCQA.py input_dumper): 'Question: The {object} is {color}. What color is the "
        "{object}?' then one line '{symbol}. {choice}' per choice and a last line 'Answer:'; the answer is "
        "' {symbol}'. Four choices (MIB's 4_answer_choices config) labelled A, B, C, D: the object's colour and "
        "three other distinct colours in random order. Our own 64 object/colour pairs over 11 colours (the hub "
        "set mib-bench/copycolors_mcqa, 110/50/50 rows from Wiegreffe et al.'s Colors data, is not reproduced row "
        "by row). Counterfactual: MIB's circuit-track default for mcqa, symbol_counterfactual (dataset.py): the "
        "same question and colours in the same order with the four symbols permuted by a random derangement, so "
        "that the right colour's symbol changes; the counterfactual answer is that new symbol. The hub column's "
        "exact symbol rule could not be read offline: a permutation of A-D is our reading of it (MIB's "
        "randomLetter counterfactuals, which draw other letters, are separate columns). Metric: logit difference "
        "of the two symbols. " + _FILTERS.format(what="the right symbol")
        + " Since only the clean prompt is checked, a model that always names one symbol keeps exactly the pairs "
        "whose answer is that symbol; task_pairs refuses such a model by name (one symbol in more than two thirds "
        "of at least 20 kept pairs, where the right symbols are spread evenly over A-D)."),
    "arithmetic-add": (
        "MIB's arithmetic prompt 'Q: How much is {a} plus {b}? A: ' (trailing space; MIB-causal-variable-track "
        "tasks/two_digit_addition_task/arithmetic.py) and five paraphrases of ours: the hub set "
        "mib-bench/arithmetic_addition has a template column (its 49,200 rows = 6 x 8,200 operand pairs suggests "
        "six templates) whose wording could not be read offline. Operands both one-digit (0-9) or both two-digit "
        "(10-99), like MIB's num_digit. Counterfactual: MIB's random_counterfactual (the one dataset.py uses): "
        "the same template with other operands of the same digit count, drawn at random, whose sum differs. "
        "MIB's filter (dataset.py filter_dataset) asks the label and the counterfactual label to be one token "
        "each: with digit-by-digit tokenizers (SmolLM2, Gemma) only sums 0-9 pass (one-digit operands, 55 pairs "
        "per template, 330 candidates at most), as MIB's own filter would leave (MIB ran arithmetic on Llama-3 "
        "only). The answer is the token right after 'A: '. Metric: logit difference of the two results. "
        + _FILTERS.format(what="the result")),
    "arithmetic-sub": (
        "As arithmetic-add with 'minus' ('Q: How much is {a} minus {b}? A: ' and five paraphrases of ours; hub "
        "set mib-bench/arithmetic_subtraction, operator '-'), a >= b so that results are not negative. "
        "Counterfactual: other operands of the same digit count whose difference differs (random_counterfactual). "
        "With digit-by-digit tokenizers only differences 0-9 are one token: one-digit pairs and two-digit pairs "
        "at most 9 apart. " + _FILTERS.format(what="the result")),
    "greater-than": (
        "Hanna et al.'s greater-than as in EAP-IG's greater_than_data.csv (the format MIB's dataset.py reads for "
        "'greater-than'): 'The {noun} lasted from the year {XX}{YY} to the year {XX}', XX 11-17, YY 02-98, our own "
        "30 nouns, shuffled with random.Random(seed). Counterfactual: the start year's YY replaced by '01'. "
        "Metric prob_diff: p(years after YY) - p(years up to YY). With a tokenizer that writes each two-digit YY "
        "as one token after the century (GPT-2), the answers are the tokens of YY+1..99 and the wrong ones "
        "00..YY, MIB's gpt2 branch exactly. With digit-by-digit tokenizers (SmolLM2, Gemma) MIB's metric is a "
        "two-position product (decade digit, then year digit; metrics.py logit_diff_greater_than), which a "
        "last-position metric cannot express: there the prompt ends with the start year's decade digit ('... to "
        "the year 173') and the sets are the digits above / up to YY's last digit, i.e. MIB's year-digit factor "
        "without its decade term; YY ending in 9 is dropped (no later year in that decade). "
        + _FILTERS.format(what="one of the answer years")),
}


def candidates(task: str, tokenizer, *, n: int = 400, seed: int = 0, data: str | os.PathLike | None = None) -> Pairs:
    """Up to ``n`` rebuilt pairs of ``task`` for ``tokenizer``, before any model filter (``RULES[task]``).

    Deterministic for a seed. ``data``: for ``ioi`` the ioi.json file or the folder holding it (default:
    ``$DPA_DATA``, else ``../shared/data`` next to the repository); the other tasks need no data. Fewer than
    ``n`` come back where the task has fewer (e.g. one-token sums on a digit-by-digit tokenizer)."""
    _check_task(task)
    _check_count("n", n)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InputError(f"seed must be an integer, got {seed!r}")
    build = {"ioi": _ioi, "mcqa": _mcqa, "arithmetic-add": _arithmetic, "arithmetic-sub": _arithmetic,
             "greater-than": _greater_than}[task]
    rows = build(_Tok(tokenizer), n, seed, data, task)
    if not rows:
        raise InputError(f"no {task} pair survives the tokenizer checks (equal lengths, one-token answers) for "
                         f"this tokenizer")
    clean, counter, answers, wrong, names = (list(x) for x in zip(*rows))
    return Pairs(clean, counter, answers, wrong, "prob_diff" if task == "greater-than" else "logit_diff", names)


def task_pairs(model, tokenizer, task: str, *, n: int = 100, seed: int = 0, data: str | os.PathLike | None = None,
               batch_size: int = 16, fewer: bool = False) -> Pairs:
    """The first ``n`` pairs of ``candidates(task, ..., n=max(400, 5 * n))`` that ``model`` answers right: its
    top next token on the clean prompt is the clean answer (logit_diff) or one of the answer tokens (prob_diff).
    Raises ``InputError`` when fewer than ``n`` survive, saying how many did (``fewer``: returns them, if any)."""
    _check_task(task)
    _check_count("n", n)
    _check_count("batch_size", batch_size)
    pool = candidates(task, tokenizer, n=max(400, 5 * n), seed=seed, data=data)
    from ..request import check_model

    if getattr(model, "config", None) is not None:  # a transformers model (the tests' stand-ins answer by rule)
        pool.check(check_model(model))  # a tokenizer of another model: ids past its vocabulary, said before any run
    device = next(model.parameters()).device
    kept: list[int] = []
    checked = 0
    step = 4 * batch_size
    for start in range(0, len(pool), step):
        rows = list(range(start, min(start + step, len(pool))))
        tops = _top_tokens(model, [pool.clean[i] for i in rows], device, batch_size)
        for i, top in zip(rows, tops):
            if top in pool.answers[i]:
                kept.append(i)
        checked = rows[-1] + 1
        if len(kept) >= n:
            break
    if len(kept) < n and not (fewer and kept):
        right = "the clean answer" if pool.metric == "logit_diff" else "one of the answer tokens"
        if not kept:
            raise InputError(f"{task}: none of the {checked} candidate pairs is answered right by the model (top next "
                             f"token on the clean prompt = {right}): it cannot do this task (RULES[{task!r}] says "
                             "how the candidates are built)")
        raise InputError(f"{task}: only {len(kept)} of {checked} candidate pairs are answered right by the model "
                         f"(top next token on the clean prompt = {right}); asked for n={n}. Ask for n <= "
                         f"{len(kept)} (RULES[{task!r}] says how the candidates are built)")
    kept = kept[:n]
    if task == "mcqa" and len(kept) >= 20:  # four symbols in random order: a model that reads the colour spreads
        # its answers over them (the first 20 of the pool: 12 of one symbol at most); two thirds of one is a bias
        symbol, most = Counter(pool.answers[i][0] for i in kept).most_common(1)[0]
        if 3 * most > 2 * len(kept):
            name = tokenizer.decode([symbol])
            raise InputError(f"mcqa: the model names {name!r} in {most} of the {len(kept)} pairs it answers right "
                             f"(of {checked} checked; the right symbol is each of A-D equally often): it picks one "
                             "symbol whatever the colour, so MIB's circuit would explain that bias rather than the "
                             "task (RULES['mcqa'])")
    return pool.subset(kept)


# --- shared -----------------------------------------------------------------------------------------------------

def _check_task(task) -> None:
    if task not in TASKS:
        raise InputError(f"unknown MIB task {task!r}; choose one of {', '.join(TASKS)}")


def _check_count(what: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{what} must be a positive integer, got {value!r}")


class _Tok:
    """``tokenizer(text).input_ids`` with a cache, and the one token a completion adds after a prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = [int(i) for i in self.tokenizer(text).input_ids]
            self.cache[text] = ids
        return ids

    def next_token(self, prompt: str, completion: str) -> int | None:
        """The token the model would predict for ``completion`` right after ``prompt``; None if it takes more
        than one token there (or re-tokenises the prompt's end)."""
        head, full = self(prompt), self(prompt + completion)
        if len(full) != len(head) + 1 or full[:len(head)] != head:
            return None
        return full[-1]


def _top_tokens(model, rows: list[list[int]], device, batch_size: int) -> list[int]:
    """The top next token of each prompt: rows of equal length run together (no padding), in batches of at most
    ``batch_size``; only the last position's logits are asked for where the model takes ``logits_to_keep``."""
    out: dict[int, int] = {}
    by_length: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_length.setdefault(len(row), []).append(i)
    with torch.no_grad():
        for members in by_length.values():
            for start in range(0, len(members), batch_size):
                batch = members[start:start + batch_size]
                ids = torch.tensor([rows[i] for i in batch], device=device)
                try:
                    logits = model(ids, logits_to_keep=1).logits
                except TypeError:  # a model without logits_to_keep: all positions
                    logits = model(ids).logits
                out.update(zip(batch, logits[:, -1].argmax(-1).tolist()))
    return [out[i] for i in range(len(rows))]


# --- IOI -------------------------------------------------------------------------------------------------------

def _ioi_file(data) -> Path:
    """``data`` (the file or its folder), else ioi.json in the benchmark data folder every dpa benchmark reads
    (``dpa.evaluate.find_data_dir``: $DPA_DATA, else ../shared/data next to the repository)."""
    from ..evaluate.datasets import DataError, find_data_dir

    if data is not None:
        path = Path(data).expanduser()
        return path / "ioi.json" if path.is_dir() else path
    if os.environ.get("DPA_DATA"):
        return Path(os.environ["DPA_DATA"]).expanduser() / "ioi.json"
    try:
        return find_data_dir() / "ioi.json"
    except DataError:
        return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "ioi.json"


def _load_ioi(data) -> list[dict]:
    path = _ioi_file(data)
    if not path.is_file():
        raise InputError(f"IOI data file {path} does not exist: pass data= the ioi.json file or its folder, or set "
                         "DPA_DATA to the folder holding ioi.json (default: ../shared/data next to the repository)")
    try:
        with open(path, encoding="utf-8-sig") as fh:
            records = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"cannot read the IOI data file {path}: {err}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str)
                                                and isinstance(r.get("answer"), str) for r in records):
        raise InputError(f"{path} is not a list of records with 'prompt' and 'answer' strings")
    return records


def _ioi_subject(prompt: str, io: str) -> str | None:
    """The subject: the name other than ``io`` in the 'X and Y' pair, said twice; None when not clear-cut."""
    counts = Counter(re.findall(r"\b[A-Z][a-z]+\b", prompt))
    if counts[io] != 1:
        return None
    found = [w for w, c in counts.items() if c == 2 and w != io
             and (f"{io} and {w}" in prompt or f"{w} and {io}" in prompt)]
    return found[0] if len(found) == 1 else None


def _ioi(tok: _Tok, n: int, seed: int, data, task: str) -> list[tuple]:
    records = _load_ioi(data)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    rows = []
    for i in order:
        record = records[i]
        prompt, io = record["prompt"], record["answer"].strip()
        s = _ioi_subject(prompt, io)
        if s is None:
            continue
        second = list(re.finditer(rf"\b{re.escape(s)}\b", prompt))[-1]
        counter = prompt[:second.start()] + io + prompt[second.end():]
        clean_ids, counter_ids = tok(prompt), tok(counter)
        good, bad = tok.next_token(prompt, " " + io), tok.next_token(prompt, " " + s)
        if len(clean_ids) != len(counter_ids) or good is None or bad is None or good == bad:
            continue
        rows.append((clean_ids, counter_ids, [good], [bad], f"ioi case {record.get('case_id', i)}"))
        if len(rows) == n:
            break
    return rows


# --- MCQA (copy colours) ---------------------------------------------------------------------------------------

_OBJECT_COLORS = {
    "red": ("tomato", "strawberry", "cherry", "ladybug", "ruby", "fire truck", "stop sign"),
    "yellow": ("banana", "lemon", "sunflower", "canary", "school bus", "egg yolk"),
    "green": ("leaf", "frog", "cucumber", "lime", "pea", "emerald", "lettuce"),
    "blue": ("sky", "ocean", "sapphire", "blueberry", "bluebird", "swimming pool"),
    "orange": ("carrot", "pumpkin", "tangerine", "goldfish", "basketball"),
    "purple": ("eggplant", "grape", "plum", "lavender", "amethyst"),
    "pink": ("flamingo", "pig", "bubblegum", "cherry blossom", "shrimp"),
    "brown": ("chocolate bar", "acorn", "walnut", "coffee bean", "tree trunk", "potato"),
    "black": ("crow", "coal", "raven", "panther", "tire", "night sky"),
    "white": ("snowflake", "swan", "cloud", "polar bear", "sugar cube", "milk"),
    "gray": ("elephant", "koala", "pigeon", "rhino", "pebble"),
}
_COLORS = tuple(_OBJECT_COLORS)
_SYMBOLS = ("A", "B", "C", "D")


def _mcqa_prompt(obj: str, color: str, symbols, choices) -> str:
    lines = "".join(f"\n{s}. {c}" for s, c in zip(symbols, choices))
    return f"Question: The {obj} is {color}. What color is the {obj}?{lines}\nAnswer:"


def _mcqa(tok: _Tok, n: int, seed: int, data, task: str) -> list[tuple]:
    rng = random.Random(seed)
    pairs = [(obj, color) for color, objs in _OBJECT_COLORS.items() for obj in objs]
    seen: set[str] = set()
    rows = []
    for _ in range(50 * n):
        obj, color = rng.choice(pairs)
        choices = [color] + rng.sample([c for c in _COLORS if c != color], 3)
        rng.shuffle(choices)
        while True:  # a derangement: every symbol moves, so the right colour's symbol changes
            moved = rng.sample(_SYMBOLS, len(_SYMBOLS))
            if all(a != b for a, b in zip(moved, _SYMBOLS)):
                break
        prompt = _mcqa_prompt(obj, color, _SYMBOLS, choices)
        if prompt in seen:
            continue
        seen.add(prompt)
        counter = _mcqa_prompt(obj, color, moved, choices)
        at = choices.index(color)
        clean_ids, counter_ids = tok(prompt), tok(counter)
        good, bad = tok.next_token(prompt, " " + _SYMBOLS[at]), tok.next_token(counter, " " + moved[at])
        if len(clean_ids) != len(counter_ids) or good is None or bad is None:
            continue
        rows.append((clean_ids, counter_ids, [good], [bad],
                     f"mcqa {obj}/{color}: {_SYMBOLS[at]} vs {moved[at]}"))
        if len(rows) == n:
            break
    return rows


# --- arithmetic ------------------------------------------------------------------------------------------------

_ARITHMETIC_TEMPLATES = {
    "+": ("Q: How much is {a} plus {b}? A: ",  # MIB's own (causal-variable track)
          "Q: What is {a} plus {b}? A: ",
          "Q: What is the sum of {a} and {b}? A: ",
          "Q: What do you get when you add {a} and {b}? A: ",
          "Q: Add {a} and {b}. What is the result? A: ",
          "Q: If you have {a} and get {b} more, how many do you have? A: "),
    "-": ("Q: How much is {a} minus {b}? A: ",
          "Q: What is {a} minus {b}? A: ",
          "Q: What is the difference between {a} and {b}? A: ",
          "Q: What do you get when you subtract {b} from {a}? A: ",
          "Q: Take {b} away from {a}. What is the result? A: ",
          "Q: If you have {a} and give away {b}, how many are left? A: "),
}


def _arithmetic(tok: _Tok, n: int, seed: int, data, task: str) -> list[tuple]:
    op = "+" if task == "arithmetic-add" else "-"
    templates = _ARITHMETIC_TEMPLATES[op]
    one_token: dict[tuple[int, int], bool] = {}  # (template, result): one token after 'A: '?

    def fits(t: int, a: int, b: int, result: int) -> bool:
        if (t, result) not in one_token:
            one_token[t, result] = tok.next_token(templates[t].format(a=a, b=b), str(result)) is not None
        return one_token[t, result]

    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for t in range(len(templates)):
        for digits, numbers in ((1, range(10)), (2, range(10, 100))):
            for a in numbers:
                for b in numbers:
                    result = a + b if op == "+" else a - b
                    if result >= 0 and fits(t, a, b, result):
                        groups.setdefault((t, digits), []).append((a, b, result))
    pool = [(key, item) for key, items in groups.items() for item in items]
    rng = random.Random(seed)
    rng.shuffle(pool)
    rows = []
    for (t, digits), (a, b, result) in pool:
        others = [x for x in groups[t, digits] if x[2] != result]
        if not others:
            continue
        a2, b2, result2 = rng.choice(others)
        prompt, counter = templates[t].format(a=a, b=b), templates[t].format(a=a2, b=b2)
        clean_ids, counter_ids = tok(prompt), tok(counter)
        good, bad = tok.next_token(prompt, str(result)), tok.next_token(counter, str(result2))
        if len(clean_ids) != len(counter_ids) or good is None or bad is None or good == bad:
            continue
        rows.append((clean_ids, counter_ids, [good], [bad],
                     f"{task} template {t}: {a}{op}{b}={result} vs {a2}{op}{b2}={result2}"))
        if len(rows) == n:
            break
    return rows


# --- greater-than ----------------------------------------------------------------------------------------------

_NOUNS = ("war", "drought", "voyage", "treaty", "siege", "reign", "famine", "expedition", "alliance", "dynasty",
          "rebellion", "truce", "partnership", "festival", "tradition", "occupation", "friendship", "feud",
          "pilgrimage", "boom", "monopoly", "blockade", "crusade", "exile", "apprenticeship", "embargo",
          "construction", "excavation", "plague", "journey")


def _greater_than(tok: _Tok, n: int, seed: int, data, task: str) -> list[tuple]:
    probe = "The war lasted from the year 1732 to the year 17"
    if all(tok.next_token(probe, f"{y:02d}") is not None for y in range(100)):
        mode = "pair"  # GPT-2 style: the two last digits are one token
    elif all(tok.next_token(probe + "3", str(d)) is not None for d in range(10)):
        mode = "digit"  # digit by digit: the prompt ends with the decade digit, the answer is the year digit
    else:
        raise InputError("greater-than: this tokenizer writes neither each two-digit year ending nor each digit as "
                         "one token after the century, so the year sets cannot be single tokens")
    items = [(noun, century, yy) for noun in _NOUNS for century in range(11, 18) for yy in range(2, 99)]
    random.Random(seed).shuffle(items)
    sets: dict[str, list[int] | None] = {}  # the continuation tokens after a prompt ending, by ending

    def continuation(prompt: str, ending: str, labels: list[str]) -> list[int] | None:
        if ending not in sets:
            ids = [tok.next_token(prompt, label) for label in labels]
            sets[ending] = None if None in ids or len(set(ids)) != len(ids) else ids
        return sets[ending]

    rows = []
    for noun, century, yy in items:
        if mode == "digit" and yy % 10 == 9:
            continue
        start = f"The {noun} lasted from the year {century}"
        tail = f" to the year {century}" + ("" if mode == "pair" else str(yy // 10))
        prompt, counter = f"{start}{yy:02d}{tail}", f"{start}01{tail}"
        clean_ids, counter_ids = tok(prompt), tok(counter)
        if len(clean_ids) != len(counter_ids):
            continue
        if mode == "pair":
            ids = continuation(prompt, tail, [f"{y:02d}" for y in range(100)])
            cut = yy
        else:
            ids = continuation(prompt, tail, [str(d) for d in range(10)])
            cut = yy % 10
        if ids is None:
            continue
        rows.append((clean_ids, counter_ids, ids[cut + 1:], ids[:cut + 1],
                     f"greater-than: {noun} {century}{yy:02d}"))
        if len(rows) == n:
            break
    return rows
