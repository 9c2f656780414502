"""Adverse files (issue 30, item 8): prompt files written by other tools, results folders after the model or a file
changed under them, and output paths that are not plain new files. Everything is read and written through
``dpa.files``; each case is either read as meant or refused by a dpa error naming the file, never silently wrong,
never a lost file."""

from __future__ import annotations

import copy
import errno
import gzip
import json
import os
import stat
import threading
from pathlib import Path

import pytest
import torch

import dpa
from dpa import batch, files
from dpa.cli import main
from dpa.evaluate import datasets
from dpa.evaluate.runner import Settings, Store, evaluate

from .test_cli import PROMPT


from .test_batch import folder, tiny  # noqa: E402,F401 (the saved tiny model and its loaded copy)


def prompts_of(path, **kw) -> tuple[list[str], dict[int, str]]:
    records, errors = batch.read_prompts(path, **kw)
    return [r.prompt for r in records], {e["line"]: e["error"] for e in errors}


# --- prompt files from other tools ------------------------------------------------------------------------------

SEPARATORS = ["\u2028", "\u2029", "\x85", "\x0c", "\x0b", "\x1c", "\x1d", "\x1e"]  # "\r" ends a line


def test_json_lines_written_with_ensure_ascii_false_keep_their_line_separators(tmp_path):
    """JSON Lines ends a line at \\n alone; str.splitlines also splits at U+2028, U+0085, form feed, ... which a
    JSON writer with ensure_ascii=False leaves raw inside strings."""
    want = [f"the city{s}of paris" for s in SEPARATORS]
    path = tmp_path / "p.jsonl"
    path.write_bytes("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in want).encode())
    assert prompts_of(path) == (want, {})


def test_text_prompts_keep_form_feed_and_separators_and_crlf_ends_a_line(tmp_path):
    want = [f"the city{s}of paris" for s in SEPARATORS]
    path = tmp_path / "p.txt"
    path.write_bytes("".join(p + "\r\n" for p in want).encode())  # a file written on Windows
    assert prompts_of(path) == (want, {})


def test_byte_order_marks_at_line_starts_are_dropped_inside_a_text_line_refused(tmp_path):
    """A BOM begins the file, and any line where two files were joined (cat a.txt b.txt): dropped. One inside a
    line of text is invisible and no tokenizer should see it: that line is an error, by number."""
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffthe city\n\ufeffof paris\nthe ri\ufeffver\nold london\n".encode())
    prompts, errors = prompts_of(path)
    assert prompts == ["the city", "of paris", "old london"]
    assert list(errors) == [3] and "U+FEFF" in errors[3]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes('\ufeff{"prompt": "a"}\n\ufeff{"prompt": "b\ufeff"}\n'.encode())
    assert prompts_of(jsonl) == (["a", "b\ufeff"], {})  # in JSON the string says what it holds


@pytest.mark.parametrize("comment", ["# written by export.py", "// generated"])
def test_a_commented_ndjson_is_json_lines(tmp_path, comment):
    """The first line used to decide: a comment made the whole file plain text, each JSON line a prompt."""
    path = tmp_path / "p.ndjson"
    path.write_text(f"{comment}\n" + json.dumps({"prompt": "the city", "target": "paris"}) + "\n")
    records, errors = batch.read_prompts(path)
    assert [(r.prompt, r.target, r.line) for r in records] == [("the city", "paris", 2)] and errors == []


def test_a_text_file_whose_first_prompt_starts_with_a_brace_is_text(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("{the city} of\nparis is\n")
    assert prompts_of(path) == (["{the city} of", "paris is"], {})


def test_no_extension_is_guessed_only_when_the_lines_agree(tmp_path):
    path = tmp_path / "prompts"
    path.write_text('{"prompt": "a"}\n# note\n{"prompt": "b"}\n')
    assert prompts_of(path) == (["a", "b"], {})
    path.write_text("the city\n# a heading is a prompt in text\n")
    assert prompts_of(path) == (["the city", "# a heading is a prompt in text"], {})
    path.write_text('{"prompt": "a"}\nthe city of\n')
    with pytest.raises(dpa.InputError, match=r"cannot tell .* line 2 .*--format"):
        batch.read_prompts(path)
    assert prompts_of(path, format="text") == (['{"prompt": "a"}', "the city of"], {})
    assert prompts_of(path, format="jsonl")[0] == ["a"]
    with pytest.raises(dpa.InputError, match="format"):
        batch.read_prompts(path, format="yaml")


def test_a_json_list_is_refused_as_a_whole(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('[\n {"prompt": "a"},\n {"prompt": "b"}\n]\n')
    with pytest.raises(dpa.InputError, match="one JSON list"):
        batch.read_prompts(path)


def test_cli_format_option_and_a_refusal_before_the_model_loads(capsys, folder, tmp_path, monkeypatch):
    path = tmp_path / "p.dat"
    path.write_text('{"prompt": "the city"}\nparis is\n')
    monkeypatch.setattr(dpa, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code = main(["attribute", "--prompts", str(path), "--out", str(tmp_path / "o"), "--model", str(folder)])
    assert code == 2 and "cannot tell" in capsys.readouterr().err
    monkeypatch.undo()
    code = main(["attribute", "--prompts", str(path), "--format", "text", "--out", str(tmp_path / "o"), "--model",
                 str(folder), "--quiet"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[1]["tokens"][1:] == ["paris", "is"] and "city" in rows[0]["tokens"]
    with pytest.raises(SystemExit):
        main(["attribute", PROMPT, "--format", "text", "--model", str(folder)])


def test_split_lines_ends_a_line_at_crlf_cr_or_lf_only():
    """Universal line ends. Before: a CR-only text with one final "\\n" was one line, a lone "\\r" in a CRLF text
    joined two lines, and "\\r\\r\\n" left a "\\r" in the line (a token to a tokenizer)."""
    assert files.split_lines("the city\rof paris\r") == ["the city", "of paris"]
    assert files.split_lines("the city\rof paris") == ["the city", "of paris"]
    assert files.split_lines("the city\r\rof paris\r") == ["the city", "", "of paris"]
    assert files.split_lines("the city\rof paris\n") == ["the city", "of paris"]
    assert files.split_lines("the city\rof\nparis\r\n") == ["the city", "of", "paris"]
    assert files.split_lines("the city\r\nof\rparis\r\n") == ["the city", "of", "paris"]
    assert files.split_lines("the city\r\r\nof paris\r\r\n") == ["the city", "", "of paris", ""]
    assert files.split_lines("a\n\r\nb\n\rc") == ["a", "", "b", "", "c"]
    assert files.split_lines("") == [] and files.split_lines("a") == ["a"] and files.split_lines("\n") == [""]
    for sep in SEPARATORS:  # characters of the line, as before
        assert files.split_lines(f"the city{sep}of paris\r\n") == [f"the city{sep}of paris"]


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
@pytest.mark.parametrize("ends", ["\r\r\r\n", "\r\r\n\n", "\r\r\n\r\n", "\r\n\r\r\n"])
def test_a_prompt_file_with_mixed_line_ends_has_one_prompt_a_line_and_no_carriage_return(tmp_path, fmt, ends):
    """A CR-only file ending in "\\n" (one prompt), a CRLF file with a lone "\\r" (two prompts joined), "\\r\\r\\n"
    (a "\\r" left at the end of a prompt, tokenized): every "\\r" ends a line; the blank lines are skipped."""
    lines = ["the city of", "paris is", "old london"]
    body = ends[0].join(json.dumps({"prompt": p}) if fmt == "jsonl" else p for p in lines[:2])
    path = tmp_path / f"p.{'txt' if fmt == 'text' else 'jsonl'}"
    path.write_bytes((body + ends[1:] + (json.dumps({"prompt": lines[2]}) if fmt == "jsonl" else lines[2])
                      + ends).encode())
    prompts, errors = prompts_of(path)
    assert (prompts, errors) == (lines, {}) and not any("\r" in p for p in prompts)


@pytest.mark.parametrize("name, fmt", [("p.txt", "text"), ("p.jsonl", "jsonl")])
def test_a_prompt_file_with_cr_only_line_ends_is_split_at_them(tmp_path, name, fmt):
    """Saved by an old Mac editor: was one prompt holding the whole file (text), or one JSON error (JSON lines)."""
    lines = ["the city of", "paris is"]
    path = tmp_path / name
    path.write_bytes("\r".join(json.dumps({"prompt": p}) if fmt == "jsonl" else p for p in lines).encode() + b"\r")
    assert prompts_of(path) == (lines, {})


NOT_TEXT = {  # bytes of a prompt file, what the message says
    "gzip": (gzip.compress, "is gzip-compressed; decompress it first"),
    "utf-16": (lambda b: b.decode().encode("utf-16"), r"is not UTF-8 \(UTF-16 byte-order mark\)"),
    "utf-16-no-bom": (lambda b: b.decode().encode("utf-16-le"), "holds NUL bytes: UTF-16 or UTF-32"),
    "empty": (lambda b: b"", "is empty"),
}


@pytest.mark.parametrize("kind", NOT_TEXT)
def test_decode_text_says_what_a_file_that_is_not_utf8_text_is(kind):
    """The one step every file dpa reads goes through (files.decode_text): was a raw UnicodeDecodeError, or a
    UTF-16 file without a byte-order mark read as text with a NUL after every character."""
    encode, message = NOT_TEXT[kind]
    with pytest.raises(dpa.InputError, match=f"'p.txt' {message}"):
        files.decode_text(encode(b"the city of\nparis is\n"), "p.txt")
    assert files.decode_text(b"\xef\xbb\xbfthe city\n", "p.txt") == "the city\n"  # a UTF-8 byte-order mark: dropped
    assert files.decode_text(b"BZh is text\n", "p.txt") == "BZh is text\n"  # a signature counts only in non-UTF-8


# A prompt file goes through the same reading step (batch.read_prompts):

@pytest.mark.parametrize("kind", NOT_TEXT)
def test_a_prompt_file_that_is_not_utf8_text_says_what_it_is(tmp_path, kind):
    encode, message = NOT_TEXT[kind]
    path = tmp_path / "p.txt"
    path.write_bytes(encode(b"the city of\nparis is\n"))
    with pytest.raises(dpa.InputError, match=message):
        batch.read_prompts(path)


@pytest.mark.parametrize("content", ["\n\n", "# a comment\n// another\n"])
def test_a_prompt_file_of_no_prompts_is_refused_by_name(tmp_path, content):
    """It 'succeeded' with nothing to do."""
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(dpa.InputError, match="p.jsonl.* no prompts|p.jsonl.* is empty"):
        batch.read_prompts(path)


def test_a_csv_prompt_file_is_refused_naming_the_formats(tmp_path):
    """A .csv file was guessed to be text: its header row attributed as a prompt, each row with its commas."""
    path = tmp_path / "p.csv"
    path.write_text("prompt,target\nthe city of, paris\n")
    with pytest.raises(dpa.InputError, match=r"p\.csv.*(jsonl|JSON lines).*text"):
        batch.read_prompts(path)


def test_a_prompt_record_with_a_key_twice_is_that_lines_error(tmp_path):
    """json.loads kept the last "prompt" of a record written with two: the other prompt was attributed silently."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "the city of"}\n{"prompt": "a", "target": " b", "prompt": "c"}\n')
    records, errors = batch.read_prompts(path)
    assert [r.line for r in records] == [1]
    assert errors == [{"line": 2, "error": "the line has the key 'prompt' twice in one object (which value is meant "
                                           "cannot be told); keep one"}]


def test_a_run_config_with_a_key_twice_or_compressed_is_refused_by_name(tmp_path):
    """json.loads kept the last of two values of a key: a config edited by hand resumed with one of them."""
    identity = {"model": "m", "target": None}
    config = tmp_path / "config.json"
    config.write_text('{"model": "m", "target": null, "model": "other"}')
    with pytest.raises(dpa.InputError, match=r"config\.json' has the key 'model' twice.*use a new --out folder"):
        files.check_run_config(tmp_path, identity)
    config.write_bytes(gzip.compress(json.dumps(identity).encode()))
    with pytest.raises(datasets.DataError, match=r"config\.json' is gzip-compressed"):  # the caller's error class
        files.check_run_config(tmp_path, identity, datasets.DataError)


def test_the_evaluation_store_reads_lines_as_json_lines(tmp_path):
    row = {"index": 0, "method": "dpa", "id": "a\u2028b\x85c"}
    (tmp_path / "samples.jsonl").write_bytes((json.dumps(row, ensure_ascii=False) + "\n").encode())
    assert Store(tmp_path).samples == {(0, "dpa"): row}


def test_the_evaluation_store_tells_of_lines_it_measures_again(tmp_path):
    good = {"index": 1, "method": "dpa"}
    (tmp_path / "samples.jsonl").write_text("garbage\n" + json.dumps(good) + "\n")
    with pytest.warns(UserWarning, match=r"samples.jsonl: line\(s\) 1 are not records"):
        assert Store(tmp_path).samples == {(1, "dpa"): good}


# --- results folders --------------------------------------------------------------------------------------------

def other_weights(model):
    """The model as if its folder had been overwritten by a fine-tune: same name, shapes and dtype."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.001)
    return changed


def test_the_weights_fingerprint(tiny):
    model, _ = tiny
    fp = files.weights_fingerprint(model)
    assert fp == files.weights_fingerprint(copy.deepcopy(model)) and len(fp) == 64
    assert files.weights_fingerprint(other_weights(model)) != fp
    assert files.weights_fingerprint(copy.deepcopy(model).float()) != fp
    one = copy.deepcopy(model)
    with torch.no_grad():
        one.lm_head.weight[0, 0] += 1  # the first value is always a sampled one
    assert files.weights_fingerprint(one) != fp


def test_a_prompt_folder_is_not_resumed_with_other_weights(tiny, tmp_path):
    model, tok = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("the city\nof paris\nthe river\n")
    dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False)
    (tmp_path / "out" / "scores" / "batch-000001.safetensors").unlink()
    with pytest.raises(dpa.InputError, match=r"the weights: '.*' with weights fingerprint [0-9a-f]{16} there, "
                                             r"'.*' with fingerprint [0-9a-f]{16} now"):
        dpa.attribute_file(other_weights(model), tok, prompts, tmp_path / "out", batch_size=1, progress=False)
    dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False)  # the same: resumed
    assert len(dpa.read_results(tmp_path / "out")) == 3


def test_a_folder_of_an_older_dpa_is_resumed_and_then_records_the_weights(tiny, tmp_path):
    model, tok = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("the city\nof paris\n")
    dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("weights_sha256", "prompts_format")}
    (tmp_path / "out" / "config.json").write_text(json.dumps(old))
    dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    with pytest.raises(dpa.InputError, match="prompts_format: 'text' there, 'jsonl' now"):
        dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False, format="jsonl")


def known_1000(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "known_1000.json").write_text(json.dumps(
        [{"known_id": i, "prompt": p, "attribute": "paris"} for i, p in enumerate(["the city of", "the river"])]))
    return folder


def test_an_evaluation_folder_is_not_resumed_with_other_weights(tiny, tmp_path):
    model, tok = tiny
    settings = Settings(dataset="known_1000", unit="input", methods=("random",), filter="length",
                        data_dir=str(known_1000(tmp_path / "data")))
    evaluate(model, tok, settings, tmp_path / "out", progress=False, figures=False)
    with pytest.raises(dpa.InputError, match="the weights: .* fingerprint"):
        evaluate(other_weights(model), tok, settings, tmp_path / "out", progress=False, figures=False)


def test_an_evaluation_part_of_another_run_is_refused(tiny, tmp_path):
    model, tok = tiny
    settings = Settings(dataset="known_1000", unit="input", methods=("random",), filter="length",
                        data_dir=str(known_1000(tmp_path / "data")))
    for out, seed in (("a", 0), ("b", 1)):
        evaluate(model, tok, Settings(**{**settings.__dict__, "seed": seed}), tmp_path / out, progress=False,
                 figures=False)
    (tmp_path / "a" / "samples.rank1.jsonl").write_bytes((tmp_path / "b" / "samples.jsonl").read_bytes())
    with pytest.raises(datasets.DataError, match=r"samples.rank1.jsonl, line 1: a row of another run"):
        evaluate(model, tok, settings, tmp_path / "a", progress=False, figures=False)


@pytest.fixture
def run(tiny, tmp_path):
    """A finished four-prompt run in batches of one, and a way to run it again."""
    model, tok = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("the city\nof paris\nthe river\nold london is\n")

    def again(**kw):
        return dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False, **kw)

    again()
    return tmp_path / "out", again


def shard(out: Path, b: int) -> Path:
    return out / "scores" / f"batch-{b:06d}.safetensors"


def test_a_cut_batch_file_is_refused_by_name_then_attributed_again(run):
    out, again = run
    before = dpa.read_results(out)
    path = shard(out, 2)
    path.write_bytes(path.read_bytes()[:-100])  # e.g. a copy that stopped, or a disk that lost its end
    for call in (again, lambda: dpa.read_results(out)):
        with pytest.raises(dpa.InputError, match=r"batch-000002.safetensors cannot be read .* delete it"):
            call()
    path.unlink()
    assert again()["attributed"] == 4
    for a, b in zip(before, dpa.read_results(out)):
        assert torch.equal(a.token_scores, b.token_scores)


def test_a_batch_file_of_another_run_is_refused(run, tiny, tmp_path):
    out, again = run
    model, tok = tiny
    other = tmp_path / "q.txt"
    other.write_text("a big river in\nnew york\nthe small city\n")
    dpa.attribute_file(model, tok, other, tmp_path / "other", batch_size=1, progress=False)
    shard(out, 1).write_bytes(shard(tmp_path / "other", 1).read_bytes())
    with pytest.raises(dpa.InputError, match="batch-000001.safetensors is a batch of another run"):
        again()
    with pytest.raises(dpa.InputError, match="batch-000001.safetensors is a batch of another run"):
        dpa.read_results(out)


def test_a_batch_file_of_no_batch_of_the_run_is_refused(run):
    out, again = run
    shard(out, 9).write_bytes(shard(out, 1).read_bytes())
    with pytest.raises(dpa.InputError, match="batch-000009.safetensors is batch 9, but this run has 4 batches"):
        again()
    with pytest.raises(dpa.InputError, match="both hold line"):
        dpa.read_results(out)


def test_a_batch_file_with_a_tensor_of_the_wrong_shape_is_refused(run):
    from safetensors import safe_open
    from safetensors.torch import save_file

    out, again = run
    path = shard(out, 0)
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    key = next(k for k in tensors if k.endswith("/head_scores"))
    tensors[key] = tensors[key][:, :3].contiguous()
    save_file(tensors, str(path), metadata=meta)
    for call in (again, lambda: dpa.read_results(out)):
        with pytest.raises(dpa.InputError, match=r"batch-000000.safetensors: the head_scores of line \d are of shape "
                                                 r"\[2, 3\], not \[2, 4\]"):
            call()


# --- output paths -----------------------------------------------------------------------------------------------

def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    files.write_text(tmp_path / "link.json", "new")
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "new"
    (tmp_path / "dangling.json").symlink_to("made.json")
    files.write_text(tmp_path / "dangling.json", "made")
    assert (tmp_path / "dangling.json").is_symlink() and (tmp_path / "made.json").read_text() == "made"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "made.json", "real.json"]


def test_a_fifo_is_written_straight_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    files.write_text(fifo, "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_an_open_descriptor_path_is_written_straight(tmp_path):
    """/dev/stdout is a link to /proc/self/fd/1: it must be written into, never renamed over. The same on a
    pipe of our own (renaming over the real /dev/stdout, were this to fail, would break the machine)."""
    r, w = os.pipe()
    os.set_blocking(r, False)  # nothing written (the link replaced instead) fails, not hangs
    try:
        (tmp_path / "out").symlink_to(f"/proc/self/fd/{w}")
        files.write_text(tmp_path / "out", "into the pipe")
        assert os.read(r, 100) == b"into the pipe" and (tmp_path / "out").is_symlink()
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device file needs root")
def test_a_character_device_is_written_straight_and_stays_a_device(tmp_path):
    dev = tmp_path / "null"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers, in a folder of our own
    files.write_text(dev, "gone")
    assert stat.S_ISCHR(os.stat(dev).st_mode) and [p.name for p in tmp_path.iterdir()] == ["null"]


def test_a_dash_is_stdout(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files.write_text("-", "to stdout\n")
    assert capsys.readouterr().out == "to stdout\n" and not (tmp_path / "-").exists()


def test_a_directory_or_a_missing_folder_is_refused_by_name(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "to-d").symlink_to("d")
    for path, reason in ((tmp_path / "d", "it is a directory"), (tmp_path / "to-d", "it is a directory"),
                         (tmp_path / "no" / "x.json", "no folder")):
        with pytest.raises(dpa.OutputError, match=reason) as info:
            files.write_text(path, "x")
        assert str(path) in str(info.value) and isinstance(info.value, dpa.InputError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "to-d"] and not any((tmp_path / "d").iterdir())


class HalfThenFull:
    """A file object whose write stores half of the data, then fails as a full disk does."""

    def __init__(self, fh):
        self.fh = fh

    def write(self, data):
        self.fh.write(data[:len(data) // 2])
        self.fh.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()


def full_disk(monkeypatch):
    real_fdopen, real_open = os.fdopen, open
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: HalfThenFull(real_fdopen(*a, **k)))
    monkeypatch.setattr("builtins.open", lambda f, mode="r", *a, **k: HalfThenFull(real_open(f, mode, *a, **k))
                        if "w" in mode or "a" in mode else real_open(f, mode, *a, **k))


@pytest.mark.parametrize("writer", ["circuit", "attribution", "text", "bytes"])
def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary_file(tiny, tmp_path, monkeypatch, writer):
    model, tok = tiny
    thing = (dpa.circuit(model, tok, PROMPT, nodes=4) if writer == "circuit"
             else dpa.attribute(model, tok, PROMPT) if writer == "attribution" else None)
    path = tmp_path / "graph.json"
    path.write_text('{"old": "graph"}')
    full_disk(monkeypatch)
    write = {"circuit": lambda: thing.save_json(path), "attribution": lambda: thing.to_json(str(path)),
             "text": lambda: files.write_text(path, "x" * 1000), "bytes": lambda: files.write_bytes(path, b"x" * 99)}
    with pytest.raises(dpa.OutputError, match=r"graph.json.*No space left on device \(ENOSPC\)") as info:
        write[writer]()
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert path.read_text() == '{"old": "graph"}' and [p.name for p in tmp_path.iterdir()] == ["graph.json"]


def test_circuit_save_json_errors_are_dpa_errors(tiny, tmp_path):
    model, tok = tiny
    circ = dpa.circuit(model, tok, PROMPT, nodes=4)
    with pytest.raises(dpa.OutputError, match="it is a directory"):
        circ.save_json(tmp_path)
    with pytest.raises(dpa.OutputError, match="no folder"):
        circ.save_json(tmp_path / "no" / "c.json")
    circ.save_json(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads(json.dumps(circ.to_json()))


def test_cli_json_through_a_symlink_keeps_the_link(capsys, folder, tmp_path):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    code = main(["circuit", PROMPT, "--model", str(folder), "--nodes", "4", "--json", str(tmp_path / "link.json")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "real.json").read_text())["nodes"]


def test_a_prompt_file_that_can_be_read_only_once_is_refused(tmp_path):
    """A FIFO, pipe or /dev/stdin can be read once; the CLI checks the file before the model loads, and a resume
    reads it again: refused by name instead of attributing an empty second read."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    with pytest.raises(dpa.InputError, match="not a regular file"):
        dpa.batch.read_prompts(fifo, format="text")


def test_an_out_folder_that_is_a_dangling_symlink_is_named_as_one(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "missing")
    with pytest.raises(dpa.InputError, match=r"is a symbolic link to .*missing.*which does not exist"):
        files.run_folder(tmp_path / "out")


def test_a_tokenizers_inert_keys_pass_and_zero_token_types_too(tiny):
    model, tok = tiny
    enc = tok("the city of", return_offsets_mapping=True, return_special_tokens_mask=True, return_length=True)
    plain = dpa.attribute(model, tok, "the city of", target=3)
    for extra in ({}, {"token_type_ids": [0] * len(enc["input_ids"])}):
        res = dpa.attribute(model, tok, {**enc.data, **extra}, target=3)
        assert torch.equal(res.token_scores, plain.token_scores)
