"""The ``dpa`` command and its reports, on a tiny random Llama saved with a word-level tokenizer (no network)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import dpa
from dpa import report
from dpa.cli import main

WORDS = "the capital of france is paris london a city in river big small old new".split()
PROMPT = "the capital of france is"


def save_tiny_model(folder: Path, **config) -> Path:
    """A 2-layer Llama (GQA) with random weights and a 128-word tokenizer that prepends <s>."""
    vocab = ["[UNK]", "<s>"] + WORDS
    vocab += [f"w{i}" for i in range(128 - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.save_pretrained(folder)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=None, **config)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return dpa.load_model(str(tiny_dir), device="cpu")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the fixtures printed
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_scores(out: str) -> list[float]:
    """The score column of the plain token table."""
    return [float(m.group(1)) for m in re.finditer(r"^\s+\d+\s+([+-]\d+\.\d+)\s+'", out, re.M)]


def _must_not_run(*_a, **_k):
    raise AssertionError("a loader ran before the arguments were checked")


class TestAttribute:
    def test_prints_prediction_scores_and_components(self, capsys, tiny_dir, tiny):
        code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--color", "never", "--top", "3")
        assert code == 0
        res = dpa.attribute(*tiny, PROMPT)
        predicted, p = res.top_predictions[0]
        assert re.search(rf"predicted +{re.escape(repr(predicted))} p={p:.3f}", out)
        torch.testing.assert_close(torch.tensor(table_scores(out)), res.token_scores, atol=1e-4, rtol=0)
        assert f"gap {res.completeness_gap:+.3g}" in out
        comps = res.top_components(3)
        for c in comps["positive"] + comps["negative"]:
            assert f"{report.component_label(c):<18}{c.score:>+9.4f}" in out
        assert "\x1b[" not in out

    def test_json_round_trip_with_target_contrast_and_weights(self, capsys, tiny_dir, tiny, tmp_path):
        path = tmp_path / "res.json"
        code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--target", "paris",
                           "--contrast", "london", "--weights", "0,0,1,0.3,0.7", "--json", str(path),
                           "--json-neurons", "all")
        assert code == 0 and f"wrote {path}" in out
        back = dpa.Attribution.from_dict(json.loads(path.read_text()))
        weights = dpa.PathWeights(0, 0, 1, 0.3, 0.7)
        want = dpa.attribute(*tiny, PROMPT, "paris", contrast="london", weights=weights)
        assert back.weights == weights
        assert (back.target.kind, back.target.token, back.target.contrast) == ("contrast", "paris", "london")
        assert back.tokens == want.tokens == ["<s>", "the", "capital", "of", "france", "is"]
        for name in ("token_scores", "head_scores", "neuron_scores"):
            torch.testing.assert_close(getattr(back, name), getattr(want, name).float(), atol=1e-6, rtol=1e-5)
        assert abs(back.completeness_gap) < 1e-4  # conservative weights, bias-free model

    def test_preset_logprob_and_position(self, capsys, tiny_dir, tiny, tmp_path):
        path = tmp_path / "res.json"
        code, _, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--preset", "attention", "--p",
                         "0.8", "--logprob", "--position", "-2", "--json", str(path))
        assert code == 0
        back = dpa.Attribution.from_dict(json.loads(path.read_text()))
        assert back.weights == dpa.PathWeights.attention(0.8)
        assert (back.target.kind, back.target.position) == ("logprob", 4)
        want = dpa.attribute(*tiny, PROMPT, kind="logprob", position=-2, weights=dpa.PathWeights.attention(0.8))
        torch.testing.assert_close(back.token_scores, want.token_scores.float(), atol=1e-6, rtol=1e-5)

    def test_color_output(self, capsys, tiny_dir, tiny):
        code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--color", "always")
        assert code == 0
        res = dpa.attribute(*tiny, PROMPT)
        scale = report.color_scale(res)
        token_line = next(line for line in out.splitlines() if "capital" in line)
        colors = re.findall(r"\x1b\[48;2;(\d+);(\d+);(\d+)m", token_line)
        assert len(colors) == len(res.tokens)
        for rgb, s in zip(colors, res.token_scores.tolist()):
            assert tuple(map(int, rgb)) == report.diverging_rgb(s, scale)
        assert f"scale {-scale:+.4f}" in out and f"{scale:+.4f} (special tokens clipped)" in out

    def test_html_report_is_standalone(self, capsys, tiny_dir, tiny, tmp_path):
        path = tmp_path / "res.html"
        code, _, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--html", str(path), "--top", "4")
        assert code == 0
        page = path.read_text(encoding="utf-8")
        res = dpa.attribute(*tiny, PROMPT)
        parsed = PageParser()
        parsed.feed(page)
        assert parsed.tags.get("script", 0) == 0 and parsed.tags.get("link", 0) == 0
        assert parsed.tags.get("img", 0) == 0 and "http://" not in page and "https://" not in page
        assert parsed.token_texts == res.tokens
        scale = report.color_scale(res)
        want_bg = [report.hex_rgb(report.diverging_rgb(s, scale)) for s in res.token_scores.tolist()]
        assert parsed.token_backgrounds == want_bg
        comps = res.top_components(4)
        for c in comps["positive"] + comps["negative"]:
            assert f"<td>{report.component_label(c)}</td><td class='num'>{c.score:+.4f}</td>" in page
        assert f"{-scale:+.4f}" in page and "linear-gradient" in page

    def test_multi_token_target_is_a_one_line_error(self, capsys, tiny_dir):
        code, out, err = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--target", "paris london")
        assert code == 2 and out == ""
        assert err.startswith("error: target 'paris london' is not a single token: it splits into 2 tokens")
        assert err.count("\n") == 1

    def test_multi_token_sum(self, capsys, tiny_dir, tiny, tmp_path):
        """--multi-token sum: the sum of the target's tokens under teacher forcing, as dpa.attribute gives it;
        a file of prompts takes it too; dpa circuit refuses it by name."""
        code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--target", "paris london",
                           "--multi-token", "sum", "--json", str(tmp_path / "r.json"))
        assert code == 0 and "sum of the logits of 'paris london', 2 tokens" in out
        assert "'paris'  (target, teacher-forced)" in out
        want = dpa.attribute(*tiny, PROMPT, "paris london", multi_token="sum")
        back = dpa.Attribution.from_json(tmp_path / "r.json")
        assert back.target.terms == want.target.terms and back.target_logit == pytest.approx(want.target_logit)
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": PROMPT, "target": "paris london"}) + "\n")
        code, _, _ = run(capsys, "attribute", "--prompts", str(prompts), "--model", str(tiny_dir), "--out",
                         str(tmp_path / "runs"), "--multi-token", "sum", "--quiet")
        (res,) = dpa.batch.read_results(tmp_path / "runs")
        assert code == 0 and res.target.terms == want.target.terms
        torch.testing.assert_close(res.token_scores, want.token_scores.float(), rtol=1e-6, atol=1e-6)
        with pytest.raises(SystemExit):  # a circuit attributes one token: argparse offers 'first' only
            main(["circuit", PROMPT, "--model", str(tiny_dir), "--target", "paris london", "--multi-token", "sum"])
        assert "invalid choice: 'sum' (choose from 'first')" in capsys.readouterr().err

    def test_empty_prompt(self, capsys, tiny_dir):
        code, _, err = run(capsys, "attribute", "  ", "--model", str(tiny_dir))
        assert (code, err) == (2, "error: the prompt is empty\n")

    def test_unsupported_model_fails_at_load(self, capsys, tmp_path):
        folder = save_tiny_model(tmp_path / "gelu", hidden_act="gelu")
        code, _, err = run(capsys, "attribute", PROMPT, "--model", str(folder))
        assert code == 2 and err.startswith("error: unsupported config setting hidden_act='gelu'")

    @pytest.mark.parametrize("name, message", [
        ("/no/such/model", "no such folder: '/no/such/model'"),
        ("./my-local-model", "no such folder: './my-local-model'"),
        ("no-such-org/no-such-model", "neither a local folder nor in the Hugging Face cache, and the Hub"),
        ("FOLDER", "holds no config.json"),
    ])
    def test_a_wrong_model_name_fails_before_anything_loads(self, capsys, tmp_path, monkeypatch, name, message):
        """Named, in one line, without reaching transformers' loaders (which retry the network for a minute)."""
        monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # unreachable, whatever this machine's network
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _must_not_run)
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _must_not_run)
        code, out, err = run(capsys, "attribute", PROMPT, "--model", str(tmp_path) if name == "FOLDER" else name)
        assert code == 2 and out == "" and message in err and err.count("\n") == 1, err

    @pytest.mark.parametrize("args, message", [
        (["--target", "paris london"], "not a single token"),
        (["--target", "zebra"], "not in the tokenizer's vocabulary"),
        (["--contrast", "paris paris"], "not a single token"),
        (["--position", "9"], "outside the prompt of 6 tokens"),
    ])
    def test_a_bad_target_or_position_fails_before_the_weights_load(self, capsys, tiny_dir, monkeypatch, args,
                                                                    message):
        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _must_not_run)
        code, _, err = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), *args)
        assert code == 2 and message in err, err

    def test_json_is_float32_by_default_and_full_on_request(self, capsys, tiny_dir, tmp_path):
        short, full = tmp_path / "short.json", tmp_path / "full.json"
        every = ("--json-neurons", "all")
        assert run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", str(short), *every)[0] == 0
        assert run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", str(full), "--json-full",
                   *every)[0] == 0
        a, b = dpa.Attribution.from_json(str(short)), dpa.Attribution.from_json(str(full))
        assert json.loads(short.read_text())["score_dtype"] == "float32" and a.neuron_scores.dtype == torch.float32
        assert torch.equal(a.neuron_scores, b.neuron_scores.float())  # rounded, every digit float32 carries kept
        assert len(short.read_text()) < len(full.read_text()) or b.neuron_scores.dtype == torch.float32
        assert "\n" not in short.read_text()  # one line, no indentation


def test_json_keeps_the_top_neurons_by_default(capsys, tiny_dir, tiny, tmp_path):
    """--json writes the 16 most positive and most negative neurons of each layer (with each layer's total), and
    the file's report is the CLI's: the top components are exact up to 16; --json-neurons sets the count."""
    path, every = tmp_path / "top.json", tmp_path / "all.json"
    code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", str(path), "--color", "never")
    assert code == 0
    assert run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", str(every), "--json-neurons",
               "all")[0] == 0
    saved = json.loads(path.read_text())
    assert saved["neuron_scores"] is None and saved["top_neurons"]["k"] == 16
    assert len(path.read_text()) < len(every.read_text())
    back, want = dpa.Attribution.from_json(path), dpa.attribute(*tiny, PROMPT)
    saved_report = back.summary().split("\n", 1)[1]  # the model line says the top 16 were saved
    assert saved_report in out, "the saved result's report is the one printed"
    torch.testing.assert_close(torch.tensor(back.neuron_top.total), want.neuron_scores.sum(1).float(), atol=1e-5, rtol=1e-5)
    k3 = tmp_path / "k3.json"
    assert run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", str(k3), "--json-neurons", "3")[0] == 0
    assert json.loads(k3.read_text())["top_neurons"]["k"] == 3
    with pytest.raises(dpa.InputError, match=r"top 4 neurons overall are not known: ask for k <= 3"):
        dpa.Attribution.from_json(k3).top_components(4)


@pytest.mark.parametrize("argv, message", [
    (["--json-neurons", "0"], "at least 1 neuron"), (["--json-neurons", "many"], "whole number of neurons or 'all'"),
    (["--json-neurons", "5"], "error: --json-neurons goes with --json FILE"),
    (["--json-full"], "error: --json-full goes with --json FILE"),
    (["--json-full", "--json-neurons", "all"], "error: --json-full and --json-neurons go with --json FILE"),
])
def test_json_options_refused(capsys, tiny_dir, monkeypatch, argv, message):
    monkeypatch.setattr(dpa, "load_model", _must_not_run)
    with pytest.raises(SystemExit) as info:
        main(["attribute", PROMPT, "--model", str(tiny_dir), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_json_to_stdout_and_one_file_for_two_outputs(capsys, tiny_dir, tmp_path):
    code, out, _ = run(capsys, "attribute", PROMPT, "--model", str(tiny_dir), "--json", "-")
    assert code == 0 and dpa.Attribution.from_json(out).tokens[1:] == ["the", "capital", "of", "france", "is"]
    assert not Path("-").exists()
    same = tmp_path / "r.out"
    with pytest.raises(SystemExit):
        main(["attribute", PROMPT, "--model", str(tiny_dir), "--json", str(same), "--html", str(same)])
    assert "both write" in capsys.readouterr().err and not same.exists()


def test_a_prompt_file_with_nothing_attributed_exits_with_1(capsys, tiny_dir, tmp_path):
    """Every line an error: the run said '0 of 2 prompts attributed' and exited with 0, as if all went well."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"prompt": "   "}\n')
    code, out, err = run(capsys, "attribute", "--prompts", str(bad), "--model", str(tiny_dir), "--out",
                         str(tmp_path / "bad"), "--quiet")
    assert code == 1 and "0 of 2 prompts attributed" in out
    assert "error: no prompt was attributed: every one of the 2 is an error (the first: line 1: " in err
    some = tmp_path / "some.jsonl"
    some.write_text(f'not json\n{{"prompt": "{PROMPT}"}}\n')
    code, out, err = run(capsys, "attribute", "--prompts", str(some), "--model", str(tiny_dir), "--out",
                         str(tmp_path / "some"), "--quiet")
    assert code == 0 and "1 of 2 prompts attributed" in out and "error" not in err


class TestUsage:  # (these two sat after a function's raise, so pytest never collected them)
    @pytest.mark.parametrize("args, message", [
        (["--weights", "1,2"], "expected five comma-separated weights"),
        (["--p", "0.5"], "--p needs --preset"),
        (["--preset", "mlp", "--p", "2"], "p must be in [0.0, 1.0]"),
        (["--preset", "mlp", "--weights", "0,0,1,.5,.5"], "not allowed with argument"),
        (["--logprob", "--contrast", "london"], "--logprob takes no --contrast"),
        (["--json", "/no/such/folder/x.json"], "no folder /no/such/folder"),
    ])
    def test_usage_errors(self, capsys, tiny_dir, args, message):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["attribute", PROMPT, "--model", str(tiny_dir), *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err

    def test_python_dash_m(self, tiny_dir, tmp_path):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "DPA_CACHE": str(tmp_path / "cache")}
        proc = subprocess.run([sys.executable, "-m", "dpa", "attribute", PROMPT, "--model", str(tiny_dir),
                               "--color", "auto"], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "predicted " in proc.stdout and "top 10 components" in proc.stdout
        assert "\x1b[" not in proc.stdout and len(table_scores(proc.stdout)) == 6
        assert not (tmp_path / "cache").exists()  # --model never touches the default model's cache


def test_evaluate_commands_are_registered(capsys):
    pytest.importorskip("dpa.evaluate.cli")
    for command in ("evaluate", "sweep"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: dpa {command}" in capsys.readouterr().out


class TestColors:
    def test_white_at_zero_and_symmetric(self):
        assert report.diverging_rgb(0.0, 3.0) == (255, 255, 255)
        assert report.diverging_rgb(3.0, 3.0) == (0xb2, 0x18, 0x2b)
        assert report.diverging_rgb(-3.0, 3.0) == (0x21, 0x66, 0xac)
        assert report.diverging_rgb(99.0, 3.0) == report.diverging_rgb(3.0, 3.0)  # clipped
        for x in (0.3, 1.1, 2.9):
            hi, lo = report.diverging_rgb(x, 3.0), report.diverging_rgb(-x, 3.0)
            assert hi[0] > hi[2] and lo[2] > lo[0]  # red above zero, blue below

    def test_scale_ignores_special_tokens(self, tiny):
        res = dpa.attribute(*tiny, PROMPT)
        res.token_scores = torch.tensor([50.0, 1.0, -2.0, 0.5, 0.0, 1.5])
        assert res.special == [True] + [False] * 5
        assert report.color_scale(res) == 2.0

    def test_wants_color(self, monkeypatch):
        class Tty:
            def isatty(self):
                return True

        monkeypatch.delenv("NO_COLOR", raising=False)
        monkeypatch.setenv("TERM", "xterm-256color")
        assert report.wants_color(Tty())
        monkeypatch.setenv("NO_COLOR", "1")
        assert not report.wants_color(Tty())

    def test_special_characters_are_visible(self):
        assert report.show_token("\n") == "\\n" and report.show_token(" a") == " a" and report.show_token("") == "∅"


class PageParser(HTMLParser):
    """Counts tags and collects the token spans' text and background colour."""

    def __init__(self):
        super().__init__()
        self.tags: dict[str, int] = {}
        self.token_texts: list[str] = []
        self.token_backgrounds: list[str] = []
        self._in_token = False

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attrs = dict(attrs)
        if tag == "span" and "tok" in (attrs.get("class") or "").split():
            self._in_token = True
            self.token_texts.append("")
            self.token_backgrounds.append(re.search(r"background:(#[0-9a-f]{6})", attrs["style"]).group(1))

    def handle_endtag(self, tag):
        if tag == "span":
            self._in_token = False

    def handle_data(self, data):
        if self._in_token:
            self.token_texts[-1] += data


@pytest.mark.parametrize("family", ["gemma2", "phi3", "gpt2", "gpt_neox", "qwen2_moe", "gpt_oss"])
def test_cli_attributes_every_kind_of_family(family, tmp_path, capsys):
    """`dpa attribute --model FOLDER` on a saved tiny model of each new kind of family: what the family adds
    (soft-capped logit, learned positions, expert scores) reaches the JSON, and the gap is the API's."""
    from .conftest import tiny_config

    folder = save_tiny_model(tmp_path / family)  # the tokenizer; the model is replaced below
    config = tiny_config(family, 2, vocab_size=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    for name in ("model.safetensors", "config.json"):
        (folder / name).unlink()
    model.save_pretrained(folder)
    assert main(["attribute", PROMPT, "--target", " paris", "--model", str(folder), "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = dpa.spec_for(model)
    assert abs(out["completeness_gap"] - dpa.attribute(model, None, out["token_ids"], target=out["target"]["token_id"]
                                                        ).completeness_gap) < 1e-4
    assert (out["target"]["capped_logit"] is not None) == (spec.final_softcap is not None)
    assert (out["position_scores"] is not None) == (family == "gpt2")
    assert (out["expert_scores"] is not None) == (spec.n_experts > 0)


class TestGenerate:
    def test_generate_prints_each_step_and_writes_json(self, capsys, tiny_dir, tiny, tmp_path):
        code, out, _ = run(capsys, "generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "3",
                           "--json", str(tmp_path / "g.json"))
        want = dpa.attribute_generation(*tiny, PROMPT, max_new_tokens=3)
        assert code == 0 and f"({len(want.steps)} tokens, greedy)" in out
        back = dpa.Generation.from_json(tmp_path / "g.json")
        assert back.token_ids == want.token_ids
        torch.testing.assert_close(back.scores, want.scores.float(), rtol=1e-6, atol=1e-6)
        for j, step in enumerate(want.steps):
            assert f"{j:>4}  {want.generated[j]!r:<14}{step.target_logit:>9.3f}" in out

    def test_continuation_and_refusals(self, capsys, tiny_dir, tiny):
        code, out, _ = run(capsys, "generate", PROMPT, "--model", str(tiny_dir), "--continuation", "paris london")
        assert code == 0 and "generated  'paris london' (2 tokens, given)" in out
        code, _, err = run(capsys, "generate", "  ", "--model", str(tiny_dir))
        assert (code, err) == (2, "error: the prompt is empty\n")
        with pytest.raises(SystemExit):
            main(["generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "0"])
        with pytest.raises(SystemExit):
            main(["generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "3", "--continuation", "paris"])
        with pytest.raises(SystemExit):  # a folder for --json: refused before the generation, not after it
            main(["generate", PROMPT, "--model", str(tiny_dir), "--json", str(tiny_dir)])
        assert f"cannot write {tiny_dir}: it is a folder" in capsys.readouterr().err
        code, out, _ = run(capsys, "generate", PROMPT, "--model", str(tiny_dir), "--max-new-tokens", "2",
                           "--json", "-")
        assert code == 0 and dpa.Generation.from_json(out).token_ids == dpa.attribute_generation(
            *tiny, PROMPT, max_new_tokens=2).token_ids  # the JSON alone on stdout
