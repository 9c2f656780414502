"""Attributing a file of prompts: every result equals dpa.attribute's, bad records reported by line, resumable
after SIGKILL at any moment, and the same output from 2 gloo processes under torchrun as from one."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dpa
from dpa import batch

from .test_cli import WORDS, save_tiny_model

RECORDS = [
    {"prompt": "the capital of france is", "target": "paris"},
    {"prompt": "the city", "id": "c"},
    "not json",
    {"prompt": "   "},
    {"prompt": "a big river in", "target": "paris london"},
    {"prompt": "the old city of", "contrast": "london"},
    {"prompt": "a small city", "position": 1},
    {"prompt": "in the", "position": 9},
    {"text": "no prompt field"},
    ["a", "list"],
    {"prompt": "new york", "target": 2.5},
    {"prompt": "the river", "target": 7, "contrast": "city"},
]
BAD_LINES = {3: "not valid JSON", 4: "the prompt is empty", 5: "not a single token", 8: "outside the prompt",
             9: "unknown field", 10: "JSON object", 11: "target must be"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("batch-model"))


@pytest.fixture(scope="module")
def tiny(folder):
    return dpa.load_model(str(folder), device="cpu", dtype=torch.float64)


def write_records(path: Path, records) -> Path:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in records))
    return path


def many(path: Path, n: int, seed: int = 0, length: tuple[int, int] = (2, 14)) -> Path:
    rng = random.Random(seed)
    return write_records(path, [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*length)))}
                                for _ in range(n)])


def close(x: float | None, y: float | None, tol: float) -> bool:
    return x == y if x is None or y is None else abs(x - y) <= tol * max(1.0, abs(y))


def same(a: dpa.Attribution, b: dpa.Attribution, tol: float = 0.0) -> None:
    """Equal to ``tol`` (relative): a prompt run inside a padded batch multiplies matrices of other shapes than
    alone, whose kernels may round differently on another CPU, so only ``tol=0`` asks for bit-for-bit."""
    assert a.tokens == b.tokens and a.weights == b.weights
    floats = ("probability", "logprob", "capped_logit")
    assert dataclasses.replace(a.target, **dict.fromkeys(floats)) == dataclasses.replace(b.target, **dict.fromkeys(floats))
    for name in floats:
        assert close(getattr(a.target, name), getattr(b.target, name), tol), name
    for name in ("token_scores", "head_scores", "neuron_scores"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=tol, atol=tol, msg=name)
    assert abs(a.target_logit - b.target_logit) <= tol * max(1.0, abs(b.target_logit))


class TestFile:
    def test_every_result_is_dpa_attribute_and_bad_records_are_reported(self, tiny, tmp_path):
        model, tok = tiny
        summary = dpa.attribute_file(model, tok, write_records(tmp_path / "p.jsonl", RECORDS), tmp_path / "out",
                                     batch_size=2, progress=False)
        assert (summary["prompts"], summary["attributed"], summary["errors"]) == (12, 5, 7)
        errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
        assert {e["line"]: e["error"] for e in errors}.keys() == BAD_LINES.keys()
        for e in errors:
            assert BAD_LINES[e["line"]] in e["error"], e
        results = dpa.read_results(tmp_path / "out")
        good = [r for n, r in enumerate(RECORDS, start=1) if n not in BAD_LINES]
        assert len(results) == len(good)
        for rec, res in zip(good, results):  # input order, each equal to its own call (float64: exactly)
            want = dpa.attribute(model, tok, rec["prompt"], rec.get("target"), contrast=rec.get("contrast"),
                                 position=rec.get("position"))
            same(res, want, tol=1e-12)
        rows = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
        assert [r["line"] for r in rows] == [1, 2, 6, 7, 12] and rows[1]["id"] == "c"
        top = results[0].top_components(10)
        assert rows[0]["top_components"]["positive"][0] == top["positive"][0]._asdict()
        assert rows[0]["completeness_gap"] == results[0].completeness_gap and "token_scores" not in rows[0]

    def test_plain_text_one_prompt_a_line(self, tiny, tmp_path):
        model, tok = tiny
        (tmp_path / "p.txt").write_text("the capital of france is\n\nthe old city\n")
        dpa.attribute_file(model, tok, tmp_path / "p.txt", tmp_path / "out", target="paris", progress=False)
        res = dpa.read_results(tmp_path / "out")
        assert [r.tokens[1:] for r in res] == [["the", "capital", "of", "france", "is"], ["the", "old", "city"]]
        assert {r.target.token for r in res} == {"paris"}

    def test_resume_skips_what_is_done_and_refuses_other_settings(self, tiny, tmp_path, monkeypatch):
        model, tok = tiny
        prompts = many(tmp_path / "p.jsonl", 12)
        dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=3, progress=False)
        before = dpa.read_results(tmp_path / "out")
        (tmp_path / "out" / "scores" / "batch-000002.safetensors").unlink()
        calls = []
        real = batch.attribute
        monkeypatch.setattr(batch, "attribute", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
        dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=3, progress=False)
        assert calls == [3]  # only the missing batch
        for a, b in zip(before, dpa.read_results(tmp_path / "out")):
            same(a, b)
        with pytest.raises(dpa.InputError, match="batch_size: 3 there, 4 now"):
            dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=4, progress=False)
        with pytest.raises(dpa.InputError, match="prompts_sha256"):
            dpa.attribute_file(model, tok, many(tmp_path / "q.jsonl", 5, seed=1), tmp_path / "out", batch_size=3,
                               progress=False)
        with pytest.raises(dpa.InputError, match="asks for float32, but .* holds a run in float64"):  # another dtype
            dpa.attribute_file(copy.deepcopy(model).float(), tok, prompts, tmp_path / "out", batch_size=3,
                               progress=False)

    @pytest.mark.parametrize("content, message", [
        (None, "no prompt file"), ("FOLDER", "is a folder"), (b"\xff\xfe bad", "not UTF-8"),
        ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n', "line 1 and line 2 have the same id '1'"),
    ])
    def test_unreadable_prompt_files(self, tiny, tmp_path, content, message):
        model, tok = tiny
        path = tmp_path / "p.jsonl"
        if content == "FOLDER":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(dpa.InputError, match=message):
            dpa.attribute_file(model, tok, path, tmp_path / "out", progress=False)

    @pytest.mark.parametrize("name", ["p.json", "p.jsonl"])
    @pytest.mark.parametrize("text, lines", [
        ('{\n  "prompt": "the capital of france is",\n  "target": "paris"\n}\n', 4),
        ('\ufeff{"prompt": "a",\r\n "id": "x"}\r\n{\n"prompt": "b"}\n', 2),  # two records, CRLF, a BOM
    ])
    def test_a_pretty_printed_json_object_is_refused_saying_json_lines(self, tmp_path, name, text, lines):
        """It gave one 'not valid JSON' error a line (Extra data, Expecting value...) and nothing attributed."""
        path = tmp_path / name
        path.write_text(text, newline="")
        with pytest.raises(dpa.InputError, match=rf"holds a JSON object spread over several lines \(pretty-printed: "
                                                 rf"its first record takes {lines} lines\); a prompt file holds one "
                                                 r"JSON object a line \(JSON lines\): write each record on one line "
                                                 r"\(e\.g\. jq -c"):
            batch.read_prompts(path)
        path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')  # JSON lines, and one record on one line, are read
        assert [r.prompt for r in batch.read_prompts(path)[0]] == ["a", "b"]
        path.write_text('{"prompt": "a"}')
        assert [r.prompt for r in batch.read_prompts(path)[0]] == ["a"]

    def test_arguments_are_checked(self, tiny, tmp_path):
        model, tok = tiny
        prompts = many(tmp_path / "p.jsonl", 2)
        for kwargs, error in [({"batch_size": 0}, dpa.InputError), ({"batch_size": 2.5}, dpa.InputTypeError),
                              ({"kind": "prob"}, dpa.InputError), ({"top": -1}, dpa.InputError),
                              ({"weights": (0, 0, 1, 0, 1)}, dpa.InputTypeError)]:
            with pytest.raises(error, match=next(iter(kwargs))):
                dpa.attribute_file(model, tok, prompts, tmp_path / "out", progress=False, **kwargs)
        (tmp_path / "file").write_text("x")
        with pytest.raises(dpa.InputError, match="is a file"):
            dpa.attribute_file(model, tok, prompts, tmp_path / "file", progress=False)
        with pytest.raises(dpa.InputError, match="no dpa batch results"):
            dpa.read_results(tmp_path)


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dpa", "attribute", *args, "--quiet"],
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


N_KILLED = 240  # prompts, one a batch: five kills land at random batches and within one


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(folder, tmp_path):
    """Kill the CLI with SIGKILL at random moments (seeded) within an uninterrupted run's time, read what is
    there after each kill (never unreadable, never less than before), resume; the end result equals the
    uninterrupted run's, prompt by prompt and file by file."""
    prompts = many(tmp_path / "p.jsonl", N_KILLED, length=(20, 60))
    args = ["--prompts", str(prompts), "--model", str(folder), "--batch-size", "1"]
    start = time.monotonic()
    ref = cli(*args, "--out", str(tmp_path / "ref"))
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    whole = time.monotonic() - start
    want = {tuple(w.tokens): w for w in dpa.read_results(tmp_path / "ref")}
    rng = random.Random(0)
    out, seen = tmp_path / "killed", [0]
    shards = lambda: len(list((out / "scores").glob("batch-*.safetensors"))) if (out / "scores").is_dir() else 0  # noqa: E731
    for _ in range(5):
        proc = cli(*args, "--out", str(out))
        # wait until a random number of new batches is written, then a random part of one batch's time more
        goal = shards() + rng.randint(1, max(1, (N_KILLED - shards()) // 3))
        while shards() < goal and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = dpa.read_results(out) if (out / "scores").is_dir() else []
        assert len(got) >= seen[-1], "a kill lost finished batches"
        seen.append(len(got))
        for res in got:
            same(res, want[tuple(res.tokens)])
    proc = cli(*args, "--out", str(out))
    assert proc.wait(timeout=600) == 0, proc.stderr.read()
    assert len(seen) - 1 >= 3 and all(0 < n < N_KILLED for n in seen[1:]), f"results after each kill: {seen[1:]}"
    got = dpa.read_results(out)
    assert len(got) == len(want) == N_KILLED
    for res in got:
        same(res, want[tuple(res.tokens)])
    assert (out / "results.jsonl").read_text() == (tmp_path / "ref" / "results.jsonl").read_text()
    print(f"uninterrupted {whole:.1f} s; results readable after each of {len(seen) - 1} kills: {seen[1:]}")


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(29500 + os.getpid() % 1000), "-m", "dpa", *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)


def test_two_gloo_processes_give_one_process_output(folder, tmp_path):
    prompts = many(tmp_path / "p.jsonl", 30)
    args = ["--prompts", str(prompts), "--model", str(folder), "--batch-size", "4", "--quiet"]
    single = subprocess.run([sys.executable, "-m", "dpa", "attribute", *args, "--out", str(tmp_path / "one")],
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    proc = torchrun("attribute", *args, "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("prompts attributed") == 1  # rank 0 alone reports
    a, b = dpa.read_results(tmp_path / "one"), dpa.read_results(tmp_path / "two")
    assert len(a) == len(b) == 30
    for x, y in zip(a, b):
        same(x, y, tol=1e-6)
    assert (tmp_path / "one" / "results.jsonl").read_text() == (tmp_path / "two" / "results.jsonl").read_text()
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["attributed"] == 30
    assert not (tmp_path / "two" / ".dpa.lock").exists()  # rank 0 held the folder for the run, and let it go
