import pytest
import torch
import transformers

import dpa
from dpa.errors import UnsupportedModelError
from dpa.families import check_config

from .conftest import tiny_config, tiny_model


class TestSpec:
    @pytest.mark.parametrize("family,kv", [("llama", 4), ("mistral", 2), ("qwen2", 1), ("qwen3", 2)])
    def test_family_facts(self, family, kv):
        spec = dpa.spec_for(tiny_model(family, kv))
        assert spec.family == family and spec.n_kv_heads == kv and spec.n_heads == 4
        assert spec.qkv_bias == (family == "qwen2")
        assert spec.qk_norm == (family == "qwen3")
        assert spec.sliding_windows == ((5,) * 3 if family == "mistral" else (None,) * 3)

    def test_qwen_sliding_layers(self):
        cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(cfg)
        assert dpa.spec_for(model).sliding_windows == (None, 4, 4)


def unsupported(family="llama", **overrides):
    return pytest.raises(UnsupportedModelError, match=next(iter(overrides)) if overrides else ".")


class TestRejects:
    def test_other_architecture(self):
        cfg = transformers.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32)
        with pytest.raises(UnsupportedModelError, match="model_type='bloom'"):
            dpa.spec_for(transformers.BloomForCausalLM(cfg))

    def test_moe_families_not_described(self):  # (dense layers among sparse ones: tests/test_mixed_layouts.py)
        with pytest.raises(UnsupportedModelError, match="model_type='deepseek_v3'"):  # no description (MLA)
            check_config(transformers.DeepseekV3Config(num_hidden_layers=1, hidden_size=16, vocab_size=32))

    @pytest.mark.parametrize("setting,value", [("hidden_act", "gelu"), ("mlp_bias", True), ("pretraining_tp", 2)])
    def test_settings(self, setting, value):
        with pytest.raises(UnsupportedModelError, match=setting):
            check_config(tiny_config("llama", **{setting: value}))

    def test_attention_bias(self):
        model = transformers.LlamaForCausalLM(tiny_config("llama", attention_bias=True))
        with pytest.raises(UnsupportedModelError, match="bias"):
            dpa.spec_for(model)

    def test_unknown_rope_type(self):
        cfg = tiny_config("llama")
        cfg.rope_parameters = {"rope_type": "spiral", "rope_theta": 1e4}
        with pytest.raises(UnsupportedModelError, match="rope_type='spiral'"):
            check_config(cfg)

    def test_partial_rotary(self):
        cfg = tiny_config("llama")
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
        with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
            check_config(cfg)

    def test_unknown_config_key(self):
        cfg = tiny_config("llama")
        cfg.final_logit_softcapping = 30.0
        with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
            check_config(cfg)

    def test_unknown_layer_type(self):
        cfg = tiny_config("qwen3")
        cfg.layer_types = ["chunked_attention"] * 3
        with pytest.raises(UnsupportedModelError, match="layer_types"):
            check_config(cfg)

    def test_attribute_refuses_too(self):
        model = tiny_model("llama")
        model.config.hidden_act = "relu"
        with pytest.raises(UnsupportedModelError, match="hidden_act='relu'"):
            dpa.attribute(model, None, torch.tensor([1, 2, 3]), target=1)
