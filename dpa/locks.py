"""A run's hold on its results folder: one run writes a folder at a time, and only the run the folder holds.

``dpa attribute --prompts ... --out DIR`` and ``dpa evaluate`` / ``sweep --out DIR`` resume what their folder
holds, so two runs writing one folder at once would overwrite each other's finished work (and one would delete
the other's half-written batch files as left by a killed run). ``start`` holds the folder for the run: an
exclusive ``flock`` on ``DIR/.dpa.lock``, so a second run is refused at once, by name (``OutputError``). The
kernel drops a flock when its process ends, however it ends (an error, SIGKILL), so a crashed run never leaves
the folder locked; the file is removed when the run ends. Under torchrun the lock is the run's, not each
process's: rank 0 holds it for every rank, and a refusal stops every rank. Where the system has no flock
(Windows) the folder is not locked. Reading a folder (``dpa.read_results``) takes no lock: it reads what is
there, also while a run writes it.

``start`` also checks the folder's ``config.json`` (``files.check_run_config``): a run resumes only with the
settings, dtype and model it started with. The model counts by its weights and tokenizer: the same ones under
another name (a model folder moved or copied) resume the run, with a warning; a dtype that differs is named as
such (its weights' fingerprint differs too, but the folder's model was not overwritten).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator

from . import distributed
from .errors import InputError, OutputError
from .files import FINGERPRINTS, WEIGHTS_KEY, check_run_config

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

LOCK = ".dpa.lock"


@contextlib.contextmanager
def start(out: Path, identity: dict, group: distributed.Group = distributed.SINGLE, error: type[Exception] = InputError,
          legacy: dict | None = None) -> Iterator[dict]:
    """Hold ``out`` for this run and check its config (``check_run_config(out, identity, error, legacy)``); yields
    the run's identity: ``identity``, or the folder's when that names the same weights and tokenizer under
    another model name. Every rank calls it; rank 0 locks and checks, and a refusal raises on every rank."""
    old, asked = folder_config(out), identity
    if old is not None and _same_model_renamed(old, identity):
        identity = {**identity, "model": old["model"]}  # the run's identity (and run name) is the folder's
    with hold(out, group, then=lambda: _check_config(out, identity, error, legacy)):
        if identity is not asked and group.main:
            warnings.warn(f"{out} was started with the model {old['model']!r}; {asked['model']!r} has the same "
                          f"weights and tokenizer (their fingerprints match), so the run is resumed", stacklevel=4)
        yield identity


@contextlib.contextmanager
def hold(out: Path, group: distributed.Group = distributed.SINGLE,
         then: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold ``out`` for this run: rank 0 locks it for every rank and then runs ``then`` (a check of the folder),
    and a failure of either raises on every rank (none waits for ever). A second hold on ``out`` is refused
    however it is asked for: from another process, another thread, or from inside this run."""
    held, failed = None, None
    if group.main:
        try:
            held = _lock(out)
            if then is not None:
                then()
        except BaseException as err:  # noqa: BLE001  told to the other ranks below
            failed = err
    try:
        group.stop_together(failed)
        yield
    finally:
        if held is not None:
            _unlock(*held)


def folder_config(out: Path) -> dict | None:
    """The folder's config.json, if it has one that reads as a JSON object (else None: the run's own check says
    what is wrong with it)."""
    try:
        config = json.loads((Path(out) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _same_model_renamed(old: dict, identity: dict) -> bool:
    """Whether the folder's run had the model of ``identity`` under another name: every fingerprint of
    ``identity`` recorded there and equal (a folder of a dpa that recorded none cannot tell: not renamed)."""
    keys = [k for k in FINGERPRINTS if k in identity]
    return (isinstance(old.get("model"), str) and old["model"] != identity.get("model") and WEIGHTS_KEY in keys
            and all(old.get(k) == identity[k] for k in keys))


def _check_config(out: Path, identity: dict, error: type[Exception], legacy: dict | None) -> None:
    """``check_run_config``, with another dtype named as the setting that differs (float32 is recorded by its
    absence); the fingerprint, which differs with it, would blame the folder's weights."""
    old = folder_config(out)
    if old is not None:
        there, now = old.get("dtype", "float32"), identity.get("dtype", "float32")
        if there != now:
            raise InputError(f"this run asks for {now}, but {out} holds a run in {there} (the model's dtype): a run "
                             f"resumes in the dtype it started in; load the model in {there} to resume it, or use "
                             f"a new --out folder")
    check_run_config(out, identity, error, legacy)


def _lock(out: Path) -> tuple[Path, int] | None:
    """Lock ``out/.dpa.lock`` (None where the system has no flock); a folder locked by another run raises
    ``OutputError`` naming the folder and the process that holds it."""
    path = Path(out) / LOCK
    if fcntl is None:
        return None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise OutputError(f"cannot lock the folder {out} ({path}: {err.strerror or err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if isinstance(err, BlockingIOError):
                raise OutputError(f"another run is writing the folder {out} (process {holder or '?'} holds {path}): "
                                  "wait for it to end, or use another --out folder") from None
            raise OutputError(f"cannot lock the folder {out} ({path}: {err.strerror or err})") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed the file as we opened it: lock the one there now
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return path, fd


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file while it is held (a run that opened it meanwhile sees it gone and tries again), then
    release it."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)
