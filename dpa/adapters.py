"""Model adapter: the few facts that differ between families, and a config allow-list.

One declarative ``ModelSpec`` serves every family; the differences are (HF ``modular_*``):

* llama   - the base case
* mistral - a sliding attention window (only the mask changes)
* qwen2   - biases on q, k and v projections (and optional sliding layers)
* qwen3   - an RMSNorm over d_head on q and k before RoPE (and optional sliding layers)

Anything else in a config (another activation, o/MLP biases, soft-capping, MoE,
post-norms, unknown RoPE types, unknown keys) raises ``UnsupportedModelError``
naming the setting: a silently wrong attribution is worse than an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .attention import AttentionWeights


class UnsupportedModelError(ValueError):
    """The model or one of its config settings is not handled by dpa."""


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Keys that carry no semantics for the forward pass.
METADATA_KEYS = {
    "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "initializer_range", "chunk_size_feed_forward", "is_encoder_decoder",
    "tie_word_embeddings", "attention_dropout", "max_position_embeddings", "model_type", "tokenizer_class",
    "_attn_implementation_autoset", "use_bfloat16", "rope_scaling", "rope_theta", "max_window_layers",
    "bos_token", "eos_token", "pad_token", "unk_token_id", "prefix", "task_specific_params", "finetuning_task",
}


@dataclass(frozen=True)
class ModelSpec:
    """Family facts dpa needs, read once from the config and modules."""

    family: str
    n_layers: int
    d_model: int
    d_mlp: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    rms_eps: float
    vocab_size: int
    max_positions: int
    qkv_bias: bool  # diff with Llama: Qwen2
    qk_norm: bool  # diff with Llama: Qwen3
    sliding_windows: tuple[int | None, ...]  # per layer; diff with Llama: Mistral, Qwen sliding layers


def _config_error(setting: str, value: object, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported config setting {setting}={value!r}: {why}")


def check_config(config) -> None:
    """Raise ``UnsupportedModelError`` for any setting dpa would attribute wrongly."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={family!r}; dpa supports {', '.join(FAMILIES)} (SwiGLU decoders)")
    import transformers

    default = getattr(transformers, {"llama": "LlamaConfig", "mistral": "MistralConfig",
                                     "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family])()
    given = config.to_dict()
    unknown = sorted(set(given) - set(default.to_dict()) - METADATA_KEYS)
    if unknown:
        raise UnsupportedModelError(
            f"unsupported config setting(s) {', '.join(unknown)} for model_type={family!r}: dpa does not know what "
            "they change, so it refuses to attribute rather than risk a wrong answer")
    if config.hidden_act != "silu":
        raise _config_error("hidden_act", config.hidden_act, "DPA's gate rule assumes SiLU (SwiGLU)")
    if getattr(config, "mlp_bias", False):
        raise _config_error("mlp_bias", True, "MLP biases are inputs no token owns")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise _config_error("pretraining_tp", config.pretraining_tp, "sliced projections are not supported")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise _config_error("rope_type", rope_type, f"known RoPE types are {', '.join(ROPE_TYPES)}")
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise _config_error("partial_rotary_factor", factor, "partial rotary embeddings are not supported")
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            raise _config_error(f"layer_types[{i}]", kind, "only full and sliding attention are supported")


def _sliding_windows(config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":  # every layer slides when a window is set
        return (window,) * n
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return tuple(window if t == "sliding_attention" else None for t in types)


def _check_modules(model: nn.Module, family: str) -> None:
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a *ForCausalLM model with .model.layers and .lm_head")
    if getattr(model.lm_head, "bias", None) is not None:
        raise UnsupportedModelError("unsupported module: lm_head has a bias")
    for i, layer in enumerate(base.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn.o_proj, "bias", None) is not None:
            raise UnsupportedModelError(f"unsupported module: layers[{i}].self_attn.o_proj has a bias (attention_bias)")
        if family != "qwen2" and getattr(attn.q_proj, "bias", None) is not None:
            raise UnsupportedModelError(f"unsupported config setting attention_bias=True (layers[{i}] q/k/v/o biases)")
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(mlp, name, None)
            if not isinstance(proj, nn.Linear):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].mlp.{name} is not a plain Linear (MoE?)")
            if proj.bias is not None:
                raise UnsupportedModelError(f"unsupported module: layers[{i}].mlp.{name} has a bias")
            if not proj.weight.is_floating_point():
                raise UnsupportedModelError(f"unsupported module: layers[{i}].mlp.{name} is quantized; load in float")


def spec_for(model: nn.Module) -> ModelSpec:
    """Check ``model`` and return its ``ModelSpec``; raises ``UnsupportedModelError``."""
    config = model.config
    check_config(config)
    family = config.model_type
    _check_modules(model, family)
    attn = model.model.layers[0].self_attn
    n_heads = config.num_attention_heads
    d_head = attn.q_proj.out_features // n_heads
    return ModelSpec(
        family=family,
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        d_mlp=config.intermediate_size,
        n_heads=n_heads,
        n_kv_heads=config.num_key_value_heads or n_heads,
        d_head=d_head,
        rms_eps=config.rms_norm_eps,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        qkv_bias=attn.q_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm"),
        sliding_windows=_sliding_windows(config),
    )


@dataclass(frozen=True)
class GLUWeights:
    gate: Tensor  # [d_mlp d_model]
    up: Tensor  # [d_mlp d_model]
    down: Tensor  # [d_model d_mlp]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters, cast to the propagation dtype and device."""

    attn_norm: Tensor  # gamma of input_layernorm [d_model]
    attn: AttentionWeights
    mlp_norm: Tensor  # gamma of post_attention_layernorm [d_model]
    mlp: GLUWeights


def _cast(t: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    return None if t is None else t.detach().to(device=device, dtype=dtype)


def layer_weights(model: nn.Module, spec: ModelSpec, index: int, dtype: torch.dtype,
                  device: torch.device | None = None) -> LayerWeights:
    """Read layer ``index``'s weights (no copy when dtype and device already match)."""
    layer = model.model.layers[index]
    a, m = layer.self_attn, layer.mlp
    device = device or a.q_proj.weight.device
    c = lambda t: _cast(t, dtype, device)  # noqa: E731
    attn = AttentionWeights(
        q=c(a.q_proj.weight), k=c(a.k_proj.weight), v=c(a.v_proj.weight), o=c(a.o_proj.weight),
        n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, scaling=float(getattr(a, "scaling", spec.d_head ** -0.5)),
        q_bias=c(a.q_proj.bias), k_bias=c(a.k_proj.bias), v_bias=c(a.v_proj.bias),
        q_norm=c(a.q_norm.weight) if spec.qk_norm else None, k_norm=c(a.k_norm.weight) if spec.qk_norm else None,
        qk_norm_eps=a.q_norm.variance_epsilon if spec.qk_norm else spec.rms_eps,
    )
    mlp = GLUWeights(gate=c(m.gate_proj.weight), up=c(m.up_proj.weight), down=c(m.down_proj.weight))
    return LayerWeights(attn_norm=c(layer.input_layernorm.weight), attn=attn,
                        mlp_norm=c(layer.post_attention_layernorm.weight), mlp=mlp)
