"""What the help texts say matches the code: every option of a public function is in its ``help()``, and the
built-in models are named where a user chooses a model (``--help``, the error for a model that is not there)."""

from __future__ import annotations

import inspect

import pytest

import dpa
from dpa.cli import main
from dpa.models import CHUNKED, DEFAULT_MODEL, ModelLoadError, load_model


@pytest.mark.parametrize("fn", [dpa.attribute, dpa.attribute_file, dpa.circuit, dpa.load_model, dpa.read_results],
                         ids=lambda f: f.__name__)
def test_every_option_is_in_help(fn):
    doc = inspect.getdoc(fn) or ""
    missing = [name for name in inspect.signature(fn).parameters if name not in doc]
    assert not missing, f"help(dpa.{fn.__name__}) does not describe {missing}"


def test_the_package_load_model_has_the_full_signature():
    assert list(inspect.signature(dpa.load_model).parameters) == list(inspect.signature(load_model).parameters)


@pytest.mark.parametrize("command", ["attribute", "circuit", "evaluate"])
def test_help_names_the_built_in_models(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert DEFAULT_MODEL in text and all(name in text for name in CHUNKED)


@pytest.mark.parametrize("name", ["gemma-3-270M-typo", "./no/such/folder"])
def test_a_model_that_is_not_there_names_the_built_in_ones(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        load_model(name)
    assert all(n in str(info.value) for n in CHUNKED) and DEFAULT_MODEL in str(info.value)


DISPLAY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma 2",
           "gemma3_text": "Gemma 3", "olmo2": "OLMo 2", "phi3": "Phi-3", "smollm3": "SmolLM3", "gpt2": "GPT-2",
           "gpt_neox": "GPT-NeoX", "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE",
           "olmoe": "OLMoE", "gpt_oss": "GPT-OSS", "lfm2": "LFM2", "bamba": "Bamba",
           "granitemoehybrid": "Granite 4.0-H", "mamba2": "Mamba-2", "mamba": "Mamba", "falcon_mamba": "Falcon-Mamba",
           "jamba": "Jamba", "qwen3_next": "Qwen3-Next",
           "nemotron_h": "Nemotron-H", "falcon_h1": "Falcon-H1"}


def test_every_family_list_is_the_codes():
    """The README's family table has one row per supported model_type, and every place that counts or lists the
    families (README, the book's introduction, the package metadata and docstring) says how many there are."""
    import re
    import tomllib
    from pathlib import Path

    from dpa.families import FAMILIES

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    rows = [r for r in re.findall(r"^\| [^|]*\(`([a-z0-9_]+)`\) \|", readme, flags=re.M) if r != "model_type"]
    assert sorted(rows) == sorted(FAMILIES) and set(DISPLAY) == set(FAMILIES)
    n = f"{len(FAMILIES)} families"
    intro = (root / "book" / "introduction.md").read_text(encoding="utf-8")
    head = readme.split("\n\n")[1]  # the opening paragraph
    for text in (" ".join(head.split()), " ".join(intro.split())):
        assert n in text and all(DISPLAY[f] in text for f in FAMILIES)
    meta = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["description"]
    assert n in meta and f"({len(FAMILIES)})" in dpa.__doc__
