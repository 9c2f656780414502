"""Results folders from a hostile review (``dpa attribute --prompts FILE --out DIR`` read back with
``dpa.read_results``; ``dpa evaluate`` / ``sweep --out DIR``): each result says which prompt it is, one run writes
a folder at a time (a second is refused by name, a killed one frees it), a batch file whose records were edited is
refused by file and line where it is read (on resume too), and the refusals name the setting that differs."""

from __future__ import annotations

import copy
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dpa
from dpa import batch, files, locks
from dpa.cli import main
from dpa.evaluate.runner import Settings, evaluate, sweep

from .test_batch import folder, tiny  # noqa: F401 (the saved tiny model and its loaded copy)
from .test_batch import cli, many, torchrun, write_records
from .test_evaluate import tiny_dataset, word_tokenizer
from .test_files import other_weights
from .conftest import tiny_model


def shard(out: Path, b: int) -> Path:
    return out / "scores" / f"batch-{b:06d}.safetensors"


def shard_of_line(out: Path, line: int) -> Path:
    for path in sorted((out / "scores").glob("batch-*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if any(r["line"] == line for r in json.loads(handle.metadata()["records"])):
                return path
    raise AssertionError(f"no batch file holds line {line}")


@pytest.fixture
def run(tiny, tmp_path):
    """A finished four-prompt run in batches of one, and a way to run it again."""
    model, tok = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("the city\nof paris\nthe river\nold london is\n")

    def again(model=model, **kw):
        return dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False, **kw)

    again()
    return tmp_path / "out", again


# --- 1. each result says which prompt it is -----------------------------------------------------------------------

def test_each_result_of_a_partial_run_with_an_error_line_says_its_line_and_id(tiny, tmp_path):
    model, tok = tiny
    records = [{"prompt": "the city", "id": "a"}, {"prompt": "   "}, {"prompt": "of paris"},
               {"prompt": "the river", "id": 7}, {"prompt": "old london is", "id": "z"}]
    out = tmp_path / "out"
    dpa.attribute_file(model, tok, write_records(tmp_path / "p.jsonl", records), out, batch_size=1, progress=False)
    shard_of_line(out, 4).unlink()  # a partial run: the batch of line 4 not written yet; line 2 is an error
    got = dpa.read_results(out)
    assert [(res.line, res.id) for res in got] == [(1, "a"), (3, "3"), (5, "z")]
    for res in got:
        assert res.tokens[1:] == records[res.line - 1]["prompt"].split()  # the prompt of that line, not the n-th


# --- 2. one run writes a folder at a time --------------------------------------------------------------------------

def test_a_second_run_on_a_folder_being_written_is_refused_and_a_killed_run_frees_it(folder, tmp_path):
    prompts = many(tmp_path / "p.jsonl", 300, length=(20, 60))
    out = tmp_path / "out"
    model, tok = dpa.load_model(str(folder), device="cpu", dtype=torch.float32)  # the command's model
    proc = cli("--prompts", str(prompts), "--model", str(folder), "--batch-size", "1", "--out", str(out))
    try:
        while not shard(out, 0).exists() and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read()
        with pytest.raises(dpa.OutputError, match=rf"another run is writing the folder {out} \(process {proc.pid} "):
            dpa.attribute_file(model, tok, prompts, out, batch_size=1, progress=False)
        assert proc.poll() is None, "the run ended before the second one was refused: nothing was tested"
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: the kernel drops its lock
        proc.wait()
    summary = dpa.attribute_file(model, tok, prompts, out, batch_size=1, progress=False)
    assert summary["attributed"] == 300 and not (out / ".dpa.lock").exists()
    for res in dpa.read_results(out):  # what the killed run wrote was kept
        assert res.id == str(res.line)


def locked_elsewhere(out: Path) -> subprocess.Popen:
    """Another process holding the folder's lock, as a run does."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                             "fcntl.flock(fd, fcntl.LOCK_EX)\nos.write(fd, str(os.getpid()).encode())\n"
                             "print('locked', flush=True)\ntime.sleep(600)", str(out / ".dpa.lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_an_evaluation_sweep_or_command_on_a_folder_another_run_holds_is_refused(folder, tmp_path, capsys):
    llama, tok = tiny_model("llama", kv_heads=2), word_tokenizer()
    tiny_dataset(llama, tmp_path / "data", n=2)
    settings = Settings(dataset="known_1000", unit="input", methods=("random",), min_probability=0.0,
                        data_dir=str(tmp_path / "data"))
    out = tmp_path / "run"
    holder = locked_elsewhere(out)
    try:
        for call in (lambda: evaluate(llama, tok, settings, out, progress=False, figures=False),
                     lambda: sweep(llama, tok, settings, out, families=["attention"], ps=[0.5], progress=False,
                                   figures=False)):
            with pytest.raises(dpa.OutputError, match=rf"another run is writing the folder {out} \(process "
                                                      rf"{holder.pid} "):
                call()
        assert sorted(p.name for p in out.iterdir()) == [".dpa.lock"]  # nothing written
        (tmp_path / "p.txt").write_text("the city\n")
        code = main(["attribute", "--prompts", str(tmp_path / "p.txt"), "--out", str(out), "--model", str(folder),
                     "--quiet"])
        assert code == 2 and f"error: another run is writing the folder {out}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert evaluate(llama, tok, settings, out, progress=False, figures=False)["n_evaluated"] == 2
    assert not (out / ".dpa.lock").exists()


def test_a_torchrun_on_a_folder_another_run_holds_is_refused_on_every_rank(folder, tmp_path):
    """The lock is the run's: rank 0 takes it for both ranks, and its refusal stops rank 1 too (no wait)."""
    out = tmp_path / "out"
    holder = locked_elsewhere(out)
    try:
        proc = torchrun("attribute", "--prompts", str(many(tmp_path / "p.jsonl", 4)), "--model", str(folder),
                        "--out", str(out), "--quiet")
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0 and f"error: another run is writing the folder {out}" in proc.stderr, proc.stderr
    assert "error: another rank of this torchrun failed; see its message" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [".dpa.lock"]


def test_a_run_holds_its_folder_in_this_process_too_and_frees_it_after_an_error(run, tiny, monkeypatch):
    """Two runs of one process (threads, or a second call from inside the first) are two runs."""
    import threading

    out, again = run
    shard(out, 3).unlink()
    seen = []

    def second_run(*args, **kw):
        thread = threading.Thread(target=lambda: seen.append(_refusal(again)))
        thread.start()
        thread.join()
        raise dpa.InputError("the first run fails")

    monkeypatch.setattr(batch, "_attribute_batch", second_run)
    with pytest.raises(dpa.InputError, match="the first run fails"):
        again()
    assert seen and "another run is writing the folder" in seen[0]
    monkeypatch.undo()
    assert again()["attributed"] == 4  # the failed run let go of the folder


def _refusal(call) -> str:
    try:
        call()
    except dpa.OutputError as err:
        return str(err)
    return "not refused"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


@pytest.mark.parametrize("kind, named", [("link to a file", "a symbolic link"), ("dangling link", "a symbolic link"),
                                         ("fifo", "a FIFO"), ("folder", "a folder"), ("device", "a device")])
def test_a_lock_path_that_is_not_a_regular_file_is_refused_never_followed_nor_truncated(tmp_path, kind, named):
    """A link at DIR/.dpa.lock truncated the file it points to; a FIFO gave a raw OSError and kept a descriptor."""
    out, precious = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    precious.write_text("IMPORTANT NOTES\n")
    lock = out / locks.LOCK
    if kind == "link to a file":
        os.symlink(precious, lock)
    elif kind == "dangling link":
        os.symlink(tmp_path / "nowhere" / "x", lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        try:
            os.mknod(lock, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except OSError:
            pytest.skip("cannot make a device node here")
    fds = _fds()
    with pytest.raises(dpa.OutputError, match=rf"{lock} is {named}, not a lock file dpa made .*remove {lock}"):
        with locks.hold(out):
            pass
    assert _fds() == fds  # no descriptor left open
    assert precious.read_text() == "IMPORTANT NOTES\n" and os.path.lexists(lock)


def test_a_stale_lock_we_may_not_write_is_locked_read_only(tmp_path, monkeypatch):
    """A lock left by another user's killed run (0644, theirs): flock works on a read-only descriptor."""
    out = tmp_path / "out"
    out.mkdir()
    (out / locks.LOCK).write_text("12345\n")
    real = os.open

    def not_ours(path, flags, *args):  # as for a file of another user (root may write anything)
        if Path(path).name == locks.LOCK and flags & (os.O_WRONLY | os.O_RDWR) and not flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *args)

    monkeypatch.setattr(locks.os, "open", not_ours)
    fds = _fds()
    with locks.hold(out):
        assert (out / locks.LOCK).read_text() == "12345\n"  # not written to
        assert "another run is writing the folder" in _refusal(lambda: locks.hold(out).__enter__())
    assert _fds() == fds and not (out / locks.LOCK).exists()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_runs_unlocked_with_a_warning_and_leaves_no_lock_file(tmp_path, monkeypatch, code):
    out = tmp_path / "out"
    out.mkdir()

    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(locks.fcntl, "flock", no_locks)
    fds = _fds()
    with pytest.warns(UserWarning, match=rf"{out} cannot be locked .*\({errno.errorcode[code]}\).* goes on unlocked"):
        with locks.hold(out):
            assert not os.path.lexists(out / locks.LOCK)
    assert _fds() == fds and not os.path.lexists(out / locks.LOCK)


# --- 3. an edited batch file is refused where it is read, by file and line -----------------------------------------

def edit_records(path: Path, edit) -> None:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    records = json.loads(meta["records"])
    edit(records[0])
    save_file(tensors, str(path), metadata={**meta, "records": json.dumps(records)})


@pytest.mark.parametrize("edit, names", [
    (lambda r: r.pop("target"), "target"),
    (lambda r: r.update(weights="heavy"), "weights"),
    (lambda r: r.update(token_ids=r["token_ids"][:-1]), "token_ids"),
    (lambda r: r["target"].update(position=99), "position"),
    (lambda r: r.update(score_dtype="int8"), "score_dtype"),
])
def test_an_edited_batch_record_is_refused_by_file_and_line_on_resume_and_on_reading(run, edit, names):
    """What from_dict would refuse later, without the file's name (reading) or not at all (a resume merged it
    into results.jsonl), is refused where the file is read, naming the file, the line and the field."""
    out, again = run
    merged = (out / "results.jsonl").read_text()
    edit_records(shard_of_line(out, 3), edit)
    name = shard_of_line(out, 3).name
    for call in (again, lambda: dpa.read_results(out)):
        with pytest.raises(dpa.InputError, match=rf"{name}: the record of line 3 is damaged \(.*{names}.*\); delete "
                                                 rf"it"):
            call()
    assert (out / "results.jsonl").read_text() == merged  # nothing of the edited record merged


def test_a_batch_record_without_its_id_is_refused_by_file(run):
    out, again = run
    edit_records(shard_of_line(out, 3), lambda r: r.update(id=None))
    for call in (again, lambda: dpa.read_results(out)):
        with pytest.raises(dpa.InputError, match=rf"{shard_of_line(out, 3).name}: its records are damaged"):
            call()


# --- 4. the refusals name what differs -------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": "1"}\n', "line 1 and line 2 have the same id '1'"),
    ('{"prompt": "a"}\n{"prompt": "b", "id": 1}\n',
     "line 1 \\(no \"id\": named by its line number\\) and line 2 have the same id '1'"),
])
def test_an_id_clash_names_both_lines_and_a_line_number_taken_as_id(tmp_path, text, message):
    (tmp_path / "p.jsonl").write_text(text)
    with pytest.raises(dpa.InputError, match=message):
        batch.read_prompts(tmp_path / "p.jsonl")


def test_another_dtype_is_named_as_the_setting_not_as_other_weights(run, tiny):
    out, again = run
    with pytest.raises(dpa.InputError) as info:
        again(copy.deepcopy(tiny[0]).float())
    assert f"this run asks for float32, but {out} holds a run in float64" in str(info.value)
    assert "fingerprint" not in str(info.value) and "overwritten" not in str(info.value)


def test_the_same_weights_under_another_name_resume_the_run_other_weights_do_not(run, tiny, monkeypatch):
    out, again = run
    config = json.loads((out / "config.json").read_text())
    shard(out, 1).unlink()
    moved = copy.deepcopy(tiny[0])
    moved.config._name_or_path = "/elsewhere/the-same-model"  # a model folder moved or copied
    calls = []
    real = batch.attribute
    monkeypatch.setattr(batch, "attribute", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    with pytest.warns(UserWarning, match=r"'/elsewhere/the-same-model' has the same weights and tokenizer"):
        assert again(moved)["attributed"] == 4
    assert calls == [1]  # the batches there are this run's: only the missing one is attributed
    assert json.loads((out / "config.json").read_text()) == config  # the folder keeps the name it started with
    moved = other_weights(moved)
    with pytest.raises(dpa.InputError, match="the weights: .* with fingerprint [0-9a-f]{16} now"):
        again(moved)


def test_the_same_weights_with_another_config_are_another_model_under_any_name(run, tiny):
    """A copy of the model folder with rope_theta changed (its weights and tokenizer the same files) resumed the
    run, mixing the results of two models: under the same name silently, under another with a warning."""
    out, again = run
    config = json.loads((out / "config.json").read_text())
    assert len(config["model_config_sha256"]) == 64
    shard(out, 1).unlink()
    variant = copy.deepcopy(tiny[0])
    variant.config.rms_norm_eps = variant.config.rms_norm_eps * 10  # as rope_theta: another model, same weights
    with pytest.raises(dpa.InputError, match=r"the model's config: '.*' with config fingerprint [0-9a-f]{16} there"):
        again(variant)
    variant.config._name_or_path = "/elsewhere/long-context-variant"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "same weights" warning: refused
        with pytest.raises(dpa.InputError, match=r"the model's config: .* with [0-9a-f]{16} now"):
            again(variant)
    assert json.loads((out / "config.json").read_text()) == config and not shard(out, 1).exists()
    cosmetic = copy.deepcopy(tiny[0])
    cosmetic.config.use_cache, cosmetic.config.transformers_version = False, "4.0.0"  # the same model
    model, tok = tiny
    assert files.model_identity(cosmetic, torch.float64, tok) == files.model_identity(model, torch.float64, tok)


@pytest.mark.parametrize("edit", ["inv_freq", "scaling", "eps"])
def test_a_model_edited_in_memory_does_not_resume_the_run(run, tiny, edit):
    """Weights, tokenizer and config the same, but a buffer or a module setting edited in memory between an
    interrupted run and its resume: another model, refused by name (it would mix two models' results)."""
    out, again = run
    config = json.loads((out / "config.json").read_text())
    assert len(config["model_state_sha256"]) == 64
    shard(out, 1).unlink()
    edited = copy.deepcopy(tiny[0])
    if edit == "inv_freq":
        edited.model.rotary_emb.inv_freq.mul_(1.5)
    elif edit == "scaling":
        edited.model.layers[0].self_attn.scaling *= 1.1
    else:
        edited.model.layers[1].input_layernorm.variance_epsilon *= 10
    with pytest.raises(dpa.InputError, match=r"the model's buffers or module settings: fingerprint [0-9a-f]{16} there"):
        again(edited)
    assert json.loads((out / "config.json").read_text()) == config and not shard(out, 1).exists()
    assert again()["attributed"] == 4  # the model as it was resumes it


def test_a_folder_written_before_the_config_was_recorded_resumes_and_then_records_it(tiny, tmp_path, monkeypatch):
    """Its config.json lacks the config's fingerprint and its batch files were stamped with the run name of then."""
    model, tok = tiny
    prompts = tmp_path / "p.txt"
    prompts.write_text("the city\nof paris\nthe river\nold london is\n")
    again = lambda: dpa.attribute_file(model, tok, prompts, tmp_path / "out", batch_size=1, progress=False)
    with monkeypatch.context() as before:
        before.setattr(files, "config_fingerprint", lambda config: None)  # a dpa that did not record it
        again()
    out = tmp_path / "out"
    assert "model_config_sha256" not in json.loads((out / "config.json").read_text())
    shard(out, 2).unlink()
    calls = []
    real = batch.attribute
    monkeypatch.setattr(batch, "attribute", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    assert again()["attributed"] == 4
    assert calls == [1]  # its batch files are this run's (their run name is the one they were stamped with)
    assert json.loads((out / "config.json").read_text())["model_config_sha256"] == files.config_fingerprint(
        model.config)  # recorded from then on
    assert len(dpa.read_results(out)) == 4


def test_an_evaluation_resumes_with_the_same_weights_under_another_name(tmp_path):
    llama, tok = tiny_model("llama", kv_heads=2), word_tokenizer()
    tiny_dataset(llama, tmp_path / "data", n=2)
    settings = Settings(dataset="known_1000", unit="input", methods=("random",), min_probability=0.0,
                        data_dir=str(tmp_path / "data"))
    first = evaluate(llama, tok, settings, tmp_path / "run", progress=False, figures=False)
    moved = copy.deepcopy(llama)
    moved.config._name_or_path = "/elsewhere/llama"
    with pytest.warns(UserWarning, match="same weights and tokenizer"):
        again = evaluate(moved, tok, settings, tmp_path / "run", progress=False, figures=False)
    assert again["methods"] == first["methods"]
    with pytest.raises(dpa.InputError, match="the weights"):
        evaluate(other_weights(moved), tok, settings, tmp_path / "run", progress=False, figures=False)
