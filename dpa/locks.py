"""A run's hold on its results folder: one run writes a folder at a time, and only the run the folder holds.

``dpa attribute --prompts ... --out DIR`` and ``dpa evaluate`` / ``sweep --out DIR`` resume what their folder holds,
so two runs writing one folder at once would overwrite each other's finished work (and one would delete the other's
half-written batch files as left by a killed run). ``start`` holds the folder for the run: an exclusive ``flock`` on
``DIR/.dpa.lock``, so a second run is refused at once, by name (``OutputError``). The kernel drops a flock when its
process ends, however it ends (an error, SIGKILL), so a crashed run never leaves the folder locked; the file is
removed when the run ends. The lock file is never followed: a link, FIFO, device or folder at ``DIR/.dpa.lock`` is
refused by name (remove it); a stale one we may not write (another user's killed run) is locked read-only. On a
filesystem without file locks (``ENOLCK``: NFS without lockd; ``EOPNOTSUPP``) the run goes on unlocked, with a
warning (refusing would leave no way to run there at all). Under torchrun the lock is the run's, not each process's:
rank 0 holds it for every rank, and a refusal stops every rank. Where the system has no flock (Windows) the folder
is not locked. Reading a folder (``dpa.read_results``) takes no lock: it reads what is there, also while a run
writes it.

``start`` also checks the folder's ``config.json`` (``files.check_run_config``): a run resumes only with the
settings, dtype and model it started with. The model counts by its weights, tokenizer and config: the same ones
under another name (a model folder moved or copied) resume the run, with a warning; a dtype that differs is named as
such (its weights' fingerprint differs too, but the folder's model was not overwritten).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
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
                          f"weights and tokenizer and the same config (their fingerprints match), so the run is "
                          f"resumed", stacklevel=4)
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
    ``identity`` (weights, tokenizer, config) recorded there and equal (a folder of a dpa that recorded one of them
    not cannot tell: not renamed)."""
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
    """Lock ``out/.dpa.lock`` (None where the system has no flock, or the filesystem no locks: a warning); a
    folder locked by another run raises ``OutputError`` naming the folder and the process that holds it, and so
    does a lock path that is not a regular file (a link, FIFO, device or folder: never followed, opened or
    truncated). A stale lock file we may not write (left by another user's killed run) is locked read-only."""
    path = Path(out) / LOCK
    if fcntl is None:
        return None
    while True:
        opened = _open_lock(path, out)
        if opened is None:
            continue  # the file went away between our looks: again
        fd, writable, created = opened
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if isinstance(err, BlockingIOError):
                raise OutputError(f"another run is writing the folder {out} (process {holder or '?'} holds {path}): "
                                  "wait for it to end, or use another --out folder") from None
            if err.errno in NO_LOCKS:
                if created:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                warnings.warn(f"the folder {out} cannot be locked ({path}: {_reason(err)}): its filesystem has no "
                              "file locks (NFS without lockd, some FUSE filesystems); the run goes on unlocked, so "
                              "make sure that no other run writes this folder at the same time", stacklevel=6)
                return None
            raise OutputError(f"cannot lock the folder {out} ({path}: {_reason(err)})") from None
        try:
            if os.fstat(fd).st_ino == os.lstat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the run that held it removed the file as we opened it: lock the one there now
    if writable:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # the pid is only a courtesy to a run refused
            pass
    return path, fd


NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # flock on a filesystem without locks
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link followed, nor a wait on a FIFO


def _open_lock(path: Path, out: Path) -> tuple[int, bool, bool] | None:
    """The lock file opened: ``(fd, writable, created)``; None if it vanished between two looks. Made if missing
    (never through a link: O_EXCL); one there that is not a regular file, or cannot be opened, raises."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o644), True, True
    except FileExistsError:
        pass
    except OSError as err:
        if not os.path.lexists(path):  # a folder we may not write
            raise OutputError(f"cannot lock the folder {out} ({path}: {_reason(err)})") from None
    fd, writable = None, True
    for mode in (os.O_RDWR, os.O_RDONLY):  # a stale lock of another user: flock works on a read-only one
        try:
            fd = os.open(path, mode | _OPEN)
            break
        except FileNotFoundError:
            return None
        except PermissionError as err:
            if mode == os.O_RDONLY:
                raise OutputError(f"cannot lock the folder {out} ({path}: {_reason(err)}): remove {path} (left by "
                                  "a run that was killed), or use another --out folder") from None
            writable = False
        except OSError as err:  # a link (ELOOP), a folder (EISDIR), ...
            if err.errno == errno.ELOOP or os.path.islink(path):
                raise _not_a_lock(out, path, "a symbolic link") from None
            if err.errno == errno.EISDIR:
                raise _not_a_lock(out, path, "a folder") from None
            raise OutputError(f"cannot lock the folder {out} ({path}: {_reason(err)})") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as err:
        os.close(fd)
        raise OutputError(f"cannot lock the folder {out} ({path}: {_reason(err)})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
                "not a regular file")
        raise _not_a_lock(out, path, kind)
    return fd, writable, False


def _not_a_lock(out: Path, path: Path, kind: str) -> OutputError:
    return OutputError(f"cannot lock the folder {out}: {path} is {kind}, not a lock file dpa made (it is never "
                       f"followed nor written); remove {path}, or use another --out folder")


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _reason(err: OSError) -> str:
    code = errno.errorcode.get(err.errno or 0)
    text = err.strerror or str(err)
    return f"{text} ({code})" if code else text


def _unlock(path: Path, fd: int) -> None:
    """Remove the lock file while it is held (a run that opened it meanwhile sees it gone and tries again), then
    release it."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)
