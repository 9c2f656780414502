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
