"""Files in and out, in one place: lines as JSON Lines defines them, every output written by one helper, and a
run folder's identity (its settings and the model's weights).

Lines (``split_lines``): universal line ends, a line ends at ``"\\r\\n"``, ``"\\r"`` or ``"\\n"``, nothing else:
U+2028, U+2029, U+0085, form feed, vertical tab and the \\x1c-\\x1e separators are characters of the line, as in a
JSON string written with ``ensure_ascii=False`` or a plain-text prompt (``str.splitlines`` splits at all of them).
A JSON Lines record never holds a raw ``"\\r"`` (JSON escapes it inside a string), so this splits one the same.

Inputs (``read_text``, ``decode_text``, ``read_json``, ``load_json``; every file dpa reads in this module and in
``result`` goes through them): UTF-8 text (a UTF-8 byte-order mark at its start dropped), not empty; a
compressed file, one in UTF-16 or UTF-32, or one of other bytes is refused by name, saying which it looks like.
JSON is strict about keys: an object that has a key twice is refused by name (Python's parser keeps the last
value, JavaScript's too, others the first: which one was meant cannot be told).

Outputs (``write_text`` / ``write_bytes``; every file dpa writes goes through them):

* ``-``: standard output.
* a new path or a regular file: written atomically, a temporary file beside it renamed over it, so a crash or a
  full disk never leaves a truncated file and never destroys what was there; the file keeps its mode.
* a symbolic link: its target, resolved, written atomically (the link stays a link).
* a character device or a FIFO (``/dev/stdout``, ``/dev/null``, a named pipe), or a path through an open file
  descriptor (``/dev/fd/N``, ``/proc/self/fd/N``): written straight, never replaced (renaming a file over
  ``/dev/stdout`` as root would replace the device).
* a directory, a block device or a socket: refused by name.

A failure raises ``OutputError`` naming the path and the reason the system gave (e.g. ``No space left on device
(ENOSPC)``).
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from .errors import InputError, InputTypeError, OutputError

WEIGHTS_KEY = "weights_sha256"
TOKENIZER_KEY = "tokenizer_sha256"
CONFIG_KEY = "model_config_sha256"
STATE_KEY = "model_state_sha256"
FINGERPRINTS = (WEIGHTS_KEY, TOKENIZER_KEY, CONFIG_KEY, STATE_KEY)  # what an older config lacks is taken as the current one
UNNAMED = (CONFIG_KEY, STATE_KEY)  # recorded since a run's name was first stamped on its files: not in run_id
# What a model's config holds that does not change what it computes (besides every "_" key: _name_or_path,
# _attn_implementation, _commit_hash): who wrote it, its class names, its dtype (recorded apart), flags of what a
# forward pass returns, classification labels, and the initialisation of weights that are loaded.
COSMETIC = frozenset({"transformers_version", "architectures", "dtype", "torch_dtype", "output_attentions",
                      "output_hidden_states", "return_dict", "use_cache", "id2label", "label2id", "problem_type",
                      "initializer_range", "torchscript"})


def split_lines(text: str) -> list[str]:
    """``text``'s lines: a line ends at ``"\\r\\n"``, ``"\\r"`` or ``"\\n"`` (Windows, old Mac and Unix line
    ends, in any mix: a lone ``"\\r"`` in a CRLF file ends its line too, and ``"\\r\\r\\n"`` ends two, the
    second empty), at nothing else (``str.splitlines`` also splits at U+2028, U+0085, form feed, ...); no empty
    last line for a text that ends in a line end."""
    lines = _LINE_END.split(text)
    if lines[-1] == "":
        lines.pop()
    return lines


_LINE_END = re.compile("\r\n|\r|\n")


# --- inputs ------------------------------------------------------------------------------------------------------

# What the first bytes of a file that is not UTF-8 text say it is (looked at only once UTF-8 decoding has failed,
# so a text that happens to begin with "BZh" or "PK" is read as text).
SIGNATURES = ((b"\x1f\x8b", "is gzip-compressed; decompress it first (gunzip)"),
              (b"BZh", "is bzip2-compressed; decompress it first (bunzip2)"),
              (b"\xfd7zXZ\x00", "is xz-compressed; decompress it first (unxz)"),
              (b"\x28\xb5\x2f\xfd", "is zstd-compressed; decompress it first (unzstd)"),
              (b"PK\x03\x04", "is a zip archive (or a spreadsheet); extract the file, or save it as text"),
              *((bom, f"is not UTF-8 ({code} byte-order mark); convert it (iconv -f {code} -t UTF-8)")
                for bom, code in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),  # UTF-32 LE's
                                  (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))))  # first
NUL = "holds NUL bytes: UTF-16 or UTF-32 text without a byte-order mark, or no text at all; save it as UTF-8"


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def decode_text(data: bytes, name: str, error: type[Exception] = InputError) -> str:
    """``data``, the bytes of the file ``name``, as text: UTF-8, a UTF-8 byte-order mark at the start dropped.
    Anything else raises ``error`` naming the file and saying what it looks like: compressed, UTF-16 or UTF-32
    (by its byte-order mark, or by the NUL bytes of one without: those decode as UTF-8, every other character a
    NUL), other bytes (where the first is), or empty (nothing but blank space: nothing to read)."""
    why = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        text, why = "", f"is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
    if why or "\0" in text:
        why = next((what for magic, what in SIGNATURES if data.startswith(magic)), NUL if b"\0" in data else why)
        raise error(f"{name!r} {why}")
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise error(f"{name!r} is empty" + (" (blank space only)" if text else ""))
    return text


def read_text(path: str | os.PathLike, what: str = "file", error: type[Exception] = InputError) -> str:
    """The text of the file ``path`` (``decode_text``); a missing file, a folder or a file that cannot be read
    raises ``error`` naming it (``what``: what the file is, in the message)."""
    name = os.fsdecode(path)
    try:
        data = Path(name).read_bytes()
    except FileNotFoundError:
        raise error(f"no {what} {name!r}") from None
    except IsADirectoryError:
        raise error(f"{name!r} is a folder; give a {what}") from None
    except OSError as err:
        raise error(f"cannot read the {what} {name!r}: {_reason(err)}") from None
    return decode_text(data, name, error)


def load_json(text: str, name: str, error: type[Exception] = InputError) -> Any:
    """``text`` parsed as JSON; ``name`` says in messages what it is (a quoted file name, "the JSON text"). Text
    that is not JSON, nested too deeply for the parser, or an object with a key twice raises ``error``."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise error(f"{name} has the key {err.key!r} twice in one object (which value is meant cannot be "
                    f"told); keep one") from None
    except json.JSONDecodeError as err:
        raise error(f"{name} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    except RecursionError:
        raise error(f"{name} cannot be read: lists or objects nested too deeply") from None
    except ValueError as err:  # an integer of over 4300 digits
        raise error(f"{name} cannot be read as JSON ({err})") from None


def read_json(path: str | os.PathLike, what: str = "file", error: type[Exception] = InputError) -> Any:
    """The JSON value the file ``path`` holds (``read_text``, then ``load_json``)."""
    return load_json(read_text(path, what, error), repr(os.fsdecode(path)), error)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# --- outputs ---------------------------------------------------------------------------------------------------

def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` by the rules of this module's docstring."""
    if not isinstance(text, str):
        raise TypeError(f"write_text writes a str, got {type(text).__name__}")
    _write(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` by the rules of this module's docstring."""
    _write(path, bytes(data))


def _reason(err: OSError) -> str:
    code = errno.errorcode.get(err.errno or 0)
    text = err.strerror or str(err)
    return f"{text} ({code})" if code else text


def _fail(path: str, reason: str, code: int | None = None, hint: str = "") -> OutputError:
    error = OutputError(f"cannot write {path!r}: {reason}{hint}")
    error.errno = code
    return error


def _follow(path: str) -> tuple[str, bool]:
    """The file ``path`` names once its symbolic links are followed, and whether one of them went through an
    open file descriptor (``/dev/fd``, ``/proc/*/fd``: a link that names no path to write beside)."""
    seen = 0
    through_fd = path.startswith(("/dev/fd/", "/proc/")) or path in ("/dev/stdout", "/dev/stderr")
    while not through_fd and os.path.islink(path) and seen < 40:
        target = os.readlink(path)
        through_fd = target.startswith(("/dev/fd/", "/proc/"))
        path = os.path.join(os.path.dirname(path), target)
        seen += 1
    return path, through_fd


def _write(path: str | os.PathLike, data: bytes) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"an output path must be a str or a path, got {type(path).__name__}")
    name = os.fspath(path)
    if name == "-":
        return _straight(name, None, data)
    if not name:
        raise _fail(name, "an empty file name", errno.ENOENT)
    try:
        target, through_fd = _follow(name)
        st = os.stat(name if through_fd else target)  # a descriptor's link names no path: the kernel follows it
    except FileNotFoundError:
        st = None
    except OSError as err:  # a link loop, a name too long, a folder we may not enter
        raise _fail(name, _reason(err), err.errno) from None
    link = f" (a link to {target})" if target != name and not through_fd else ""
    if st is None:
        _atomic(name, target, data, link)
    elif stat.S_ISDIR(st.st_mode):
        raise _fail(name, f"it is a directory{link}; give a file name", errno.EISDIR)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or through_fd:
        _straight(name, target, data)
    elif stat.S_ISREG(st.st_mode):
        _atomic(name, target, data, link, mode=st.st_mode & 0o7777)
    else:
        kind = "a block device" if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else \
            "not a regular file"
        raise _fail(name, f"it is {kind}{link}; give a regular file", errno.EINVAL)


def _straight(name: str, target: str | None, data: bytes) -> None:
    """Standard output (``-``), a device, a FIFO or an open descriptor: written in place (appended to, for a
    descriptor that is a file, so what was printed before stays), never renamed over."""
    for stream in (sys.stdout, sys.stderr):  # what Python printed before comes first
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        if target is None:
            sys.stdout.buffer.write(data) if hasattr(sys.stdout, "buffer") else sys.stdout.write(data.decode())
            sys.stdout.flush()
            return
        with open(name, "ab") as fh:
            fh.write(data)
    except OSError as err:
        raise _fail(name if target is not None else "-", _reason(err), err.errno) from None


def _atomic(name: str, target: str, data: bytes, link: str, mode: int | None = None) -> None:
    """A temporary file beside ``target``, flushed to disk, given the mode of the file it replaces (or the
    umask's for a new one; temporary files are private), then renamed over ``target``."""
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        raise _fail(name, f"no folder {folder}{link}", errno.ENOENT)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)[:100]}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        tmp = None
    except OSError as err:
        raise _fail(name, _reason(err) + link, err.errno) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


# --- run folders -------------------------------------------------------------------------------------------------

def run_folder(out: str | os.PathLike, error: type[Exception] = InputError, marker: str = "config.json") -> Path:
    """The output folder of a run (``dpa evaluate``, ``dpa attribute --prompts``, ``dpa mib``), made if missing; a
    file of that name, a folder that cannot be made, or a folder holding files of something else (not a run's: no
    ``marker``, the file a run writes first) raises ``error``: a run never writes among a user's files."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise error(f"--out {out} is a file; the results go into a folder (give a new folder name)")
    if out.is_dir() and not (out / marker).exists():
        other = sorted(e.name for e in out.iterdir() if not e.name.startswith(".")
                       and not (e.is_dir() and not any(e.iterdir())))  # dpa's lock, or a run stopped at its start
        if other:
            raise error(f"--out {out} holds files that are not a dpa run's ({', '.join(other[:3])}"
                        f"{', ...' if len(other) > 3 else ''}; a run's folder has its {marker}): give a new or "
                        "empty folder")
    if out.is_symlink() and not out.exists():
        raise error(f"--out {out} is a symbolic link to {os.readlink(out)!r}, which does not exist; make that folder "
                    "first, or give another folder name")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise error(f"cannot create the output folder {out}: {err.strerror or err}") from None
    return out


def weights_fingerprint(model, samples: int = 256) -> str:
    """A fingerprint of the model's loaded weights, in milliseconds: sha256 over every parameter's name, shape
    and dtype and the exact bits of ``samples`` of its values at evenly spaced positions (all of them for a
    small tensor). The same weights give the same fingerprint on any device; another checkpoint (retrained,
    fine-tuned, another seed: values that differ nearly everywhere), another architecture, a renamed, reshaped or
    recast parameter give another one. It does not see an edit confined to values between the sampled positions.
    A parameter offloaded to the ``meta`` device counts by its name, shape and dtype alone."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}\0{tuple(p.shape)}\0{p.dtype}\0".encode())
        h.update(sampled_bits(p, samples))
    return h.hexdigest()


def sampled_bits(p, samples: int) -> bytes:
    """The exact bits of ``samples`` values of tensor ``p`` at evenly spaced positions (all of them for a small
    tensor), read without copying the whole tensor; empty for an empty or ``meta`` tensor. What a model's
    identity reads of each weight (``weights_fingerprint``, ``circuit.ModelIdentity``)."""
    import torch

    n = p.numel()
    if n == 0 or p.device.type == "meta":
        return b""
    k = min(samples, n)
    with torch.no_grad():
        idx = torch.arange(k, dtype=torch.int64, device=p.device) * (n - 1) // max(k - 1, 1)
        t = p.detach()
        values = (t.view(-1)[idx] if t.is_contiguous() else t[torch.unravel_index(idx, t.shape)] if t.dim()
                  else t.reshape(1)).cpu()
    try:
        return values.view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):  # a dtype numpy or view cannot take: its values as text
        return repr(values.tolist()).encode()


_SETTING_TYPES = (bool, int, float, str, type(None))


def _plain(value) -> bool:
    return isinstance(value, _SETTING_TYPES) or (isinstance(value, (tuple, list)) and all(_plain(v) for v in value))


def _frozen(value):
    """A setting as a value that a later in-place edit of the module's own cannot change (a list as a tuple)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (tuple, list)) else value


def plain_settings(module):
    """One module's plain settings: its public attributes that are a bool, number, string or None, or a tuple or
    list of them (a norm's eps, an attention's scaling or soft-cap, a head count, a Mamba-2 block's time_step_limit,
    a convolution's padding), what its forward reads besides its tensors; not ``training``. Lists come as tuples."""
    return ((k, _frozen(v)) for k, v in module.__dict__.items()
            if k[0] != "_" and k != "training" and _plain(v))


def module_settings(model) -> list[tuple[str, Any]]:
    """Every module's plain settings (``plain_settings``), by dotted name."""
    return [(f"{name}.{k}" if name else k, v) for name, m in model.named_modules() for k, v in plain_settings(m)]


def state_fingerprint(model, samples: int = 256) -> str:
    """sha256 of what a model computes with besides its parameters and config: every buffer (a rotary module's
    inv_freq; name, shape, dtype and ``samples`` of its values, as ``weights_fingerprint`` reads a parameter) and
    every module's plain settings (``module_settings``). A model edited in memory (inv_freq rescaled, an attention's
    scaling or a norm's eps set) gives another one."""
    h = hashlib.sha256()
    for name, b in model.named_buffers():
        h.update(f"{name}\0{tuple(b.shape)}\0{b.dtype}\0".encode())
        h.update(sampled_bits(b, samples))
    h.update(repr(module_settings(model)).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what turns text into ids: a fast tokenizer's whole definition (vocabulary, merges, normaliser,
    pre-tokeniser), else its vocabulary and special tokens, with its class."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    h.update(repr(getattr(tokenizer, "add_bos_token", None)).encode())
    return h.hexdigest()


def config_fingerprint(config) -> str | None:
    """sha256 of what a model's config says about what it computes: its ``to_dict()`` (sub-configs too) without
    the cosmetic fields (``COSMETIC`` and every key that starts with ``_``). The same weights with another config
    (``rope_theta``, ``rms_norm_eps``, a sliding window) are another model. None for a config without
    ``to_dict``."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None

    def computing(value):
        if isinstance(value, dict):
            return {str(k): computing(v) for k, v in value.items()
                    if not (str(k).startswith("_") or k in COSMETIC)}
        if isinstance(value, (list, tuple)):
            return [computing(v) for v in value]
        return value

    text = json.dumps(computing(to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def model_identity(model, dtype, tokenizer=None) -> dict:
    """The model part of a run's identity: its name, its dtype where that is not float32 (the dtype of every run
    before dtypes were recorded), so that a run in bfloat16 is never resumed in float32, nor the reverse; and the
    fingerprint of its weights (``weights_fingerprint``), so that a folder is never resumed with other weights
    under the same name (a model folder overwritten since), of its tokenizer and of its config
    (``config_fingerprint``: the same weights with another ``rope_theta`` compute something else), and of its
    buffers and module settings (``state_fingerprint``: an in-memory edit between an interrupted run and its resume)."""
    import torch

    out = {"model": getattr(model.config, "_name_or_path", "")}
    if dtype != torch.float32:
        out["dtype"] = str(dtype).removeprefix("torch.")
    out[WEIGHTS_KEY] = weights_fingerprint(model)
    if tokenizer is not None:  # the same weights with another tokenizer see other ids
        out[TOKENIZER_KEY] = tokenizer_fingerprint(tokenizer)
    config = config_fingerprint(getattr(model, "config", None))
    if config is not None:
        out[CONFIG_KEY] = config
    out[STATE_KEY] = state_fingerprint(model)
    return out


def run_id(identity: dict) -> str:
    """A short name of a run's identity, stamped on what it writes, so that a file of another run is known. The
    config's fingerprint is left out: a folder written before it was recorded keeps its run name when resumed (its
    batch files were stamped without it); the folder's config.json refuses another config."""
    named = {k: v for k, v in identity.items() if k not in UNNAMED}
    return hashlib.sha256(json.dumps(named, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_run_config(out: Path, identity: dict, error: type[Exception] = InputError,
                     legacy: dict | None = None) -> None:
    """A run's settings in ``out/config.json``: written by the first run; a later run with other settings is
    refused (``InputError`` naming what differs; other weights name both models and fingerprints), an unreadable
    config raises ``error``. ``legacy``: values to assume for keys a config of an older dpa lacks; the weights'
    fingerprint, which no older config holds, is taken as the current one (that folder's weights are unknown)
    and recorded from then on."""
    path = out / "config.json"
    if not path.exists():
        write_text(path, json.dumps(identity, indent=1) + "\n")
        return
    try:
        old = read_json(path, "run config", error)
    except error as err:
        raise error(f"{err}; use a new --out folder") from None
    if not isinstance(old, dict):
        raise error(f"{path} is not a run's config; use a new --out folder")
    assumed = {k: v for k, v in {**{k: identity[k] for k in FINGERPRINTS if k in identity},
                                  **(legacy or {})}.items() if k not in old}
    full = {**old, **assumed}
    diff = {k: (full.get(k), identity.get(k)) for k in sorted(identity.keys() | full.keys())  # a key on one side
            if full.get(k) != identity.get(k)}  # only differs too: settings recorded only off their default
    if diff:
        changes = "; ".join(_change(k, a, b, old, identity) for k, (a, b) in diff.items())
        raise InputError(f"{out} holds a run with other settings ({changes}); use a new --out folder")
    if assumed:  # a folder of an older dpa: what it did not record is recorded now
        write_text(path, json.dumps(identity, indent=1) + "\n")


def _change(key: str, a, b, old: dict, new: dict) -> str:
    if key == STATE_KEY:
        return (f"the model's buffers or module settings: fingerprint {str(a)[:16]} there, {str(b)[:16]} now (the "
                f"model was edited in memory since that run: a rotary inv_freq, an attention's scaling, a norm's eps)")
    if key == CONFIG_KEY:
        return (f"the model's config: {old.get('model')!r} with config fingerprint {str(a)[:16]} there, "
                f"{new.get('model')!r} with {str(b)[:16]} now (the same weights with another config.json: a setting "
                f"such as rope_theta changed, or another transformers version reads it otherwise)")
    if key != WEIGHTS_KEY:
        return f"{key}: {a!r} there, {b!r} now"
    return (f"the weights: {old.get('model')!r} with weights fingerprint {str(a)[:16]} there, {new.get('model')!r} "
            f"with fingerprint {str(b)[:16]} now (the model folder was overwritten since that run, or another "
            f"model has its name)")
