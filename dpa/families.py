"""Model families as data: which module is which norm, branch and tap, and which config keys dpa knows.

A ``Family`` is a handful of facts, not code (HF's ``modular_*`` files show how little differs):
module paths inside a decoder layer, relative to it. ``instrument.py`` reads them to linearise the
model (frozen norms, linearised activation, mu-scaled branches) and to place its score taps; the
explicit attention path (``explicit.py``) reads them to recompute alpha. Adding a family means adding
a description (and its derivation in the book), not a code path.

Anything a description does not cover -- another ``model_type``, an unknown config key, another
activation, a bias where none is expected, unknown RoPE -- raises ``UnsupportedModelError`` naming
it: a silently wrong attribution is worse than an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import functools
import weakref

import torch
from torch import nn

from .errors import UnsupportedModelError

BRANCHES = ("query", "key", "value", "gate", "up")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# Keys that carry no semantics for the forward pass, beyond those known by what they are (``_is_bookkeeping``:
# private keys, token ids and strings, a GGUF's quantization_config): names, flags of the output, training.
METADATA_KEYS = frozenset({
    "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "initializer_range",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings", "attention_dropout",
    "max_position_embeddings", "model_type", "tokenizer_class", "use_bfloat16", "rope_scaling", "rope_theta",
    "max_window_layers", "prefix", "task_specific_params", "finetuning_task",
})


@dataclass(frozen=True)
class Family:
    """One ``model_type``: module paths (relative to the model, or to a decoder layer) and facts.

    norms          every norm inside a layer; its scale is frozen
    norm_kind      their arithmetic (``rms``: weight * x / rms(x), HF's Llama RMSNorm; ``rms_1p``: (1 + weight) * x /
                   rms(x) in float32, Gemma's; linearise.NORM_KINDS), also the final norm's and the head norms'
    activation_config  the config key that names the activation and the value this description linearises
    fixed          config settings that must keep these values (soft-capping off, causal attention)
    block_inputs   the norm whose output feeds the attention block and nothing else, and the MLP's: the
                   block's common mu is applied in that norm's backward, where it costs nothing
    branches       the module whose *output* is each branch: mu scales the gradient entering it
    activation     the gated activation module and its kind (``silu``: SiLU(s) -> s * sigmoid(s))
    heads          tap: the input of this module (o_proj), split per head, dotted with its gradient
    neurons        the down projection, whose input a = act(s) * u is what a neuron writes; its score
                   a . grad_a is read on the up branch as u . grad_u (equal: grad_u = grad_a * act(s)),
                   where u is already kept for the backward, so the tap costs no memory
    mid            a module whose input is the residual stream after attention (t_mid): the norm before the
                   MLP, or the MLP itself where there is none
    """

    model_type: str
    config_class: str  # transformers class whose defaults the allow-list diffs against
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    unembed: str = "lm_head"
    rotary: str = "model.rotary_emb"
    attention: str = "self_attn"
    mlp: str = "mlp"
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    norm_kind: str = "rms"
    block_inputs: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # () without pre-norms (OLMo 2)
    head_norms: tuple[str, str] | None = None  # (query, key) RMSNorm over d_head before RoPE
    head_norms_over: str = "head"  # what the q/k norms normalise: each head ("head") or the whole projection
    branches: dict[str, str] = field(default_factory=lambda: {
        "query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj"})
    activation: tuple[str, str] = ("mlp.act_fn", "silu")
    heads: str = "self_attn.o_proj"
    neurons: str = "mlp.down_proj"
    mid: str = "post_attention_layernorm"
    biased_branches: tuple[str, ...] = ()  # branches whose projection may carry a bias
    slides_every_layer: bool = False  # a set ``sliding_window`` applies to all layers (Mistral)
    activation_config: tuple[str, str] = ("hidden_act", "silu")  # the config key naming the activation, its value
    fixed: tuple[tuple[str, object], ...] = ()  # config settings the description needs at these values
    rope_layers: str | None = None  # config key listing, per layer, 1 where RoPE is applied (SmolLM3's NoPE layers)

    def with_(self, **changes) -> Family:
        return replace(self, **changes)


LLAMA = Family("llama", "LlamaConfig")
MISTRAL = LLAMA.with_(model_type="mistral", config_class="MistralConfig",
                      slides_every_layer=True)  # diff with Llama: a sliding window on every layer
QWEN2 = LLAMA.with_(model_type="qwen2", config_class="Qwen2Config",
                    biased_branches=("query", "key", "value"))  # diff with Llama: q/k/v biases
QWEN3 = LLAMA.with_(model_type="qwen3", config_class="Qwen3Config",
                    head_norms=("self_attn.q_norm", "self_attn.k_norm"))  # diff with Llama: q/k RMSNorm

GEMMA3 = LLAMA.with_(  # diff with Llama: GeGLU (tanh GELU), (1 + gamma) norms, a norm before and after each
    model_type="gemma3_text", config_class="Gemma3TextConfig",  # block, q/k norms, scaled embeddings, local
    norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",  # and global layers
           "post_feedforward_layernorm"),
    norm_kind="rms_1p", block_inputs=("input_layernorm", "pre_feedforward_layernorm"),
    head_norms=("self_attn.q_norm", "self_attn.k_norm"), activation=("mlp.act_fn", "gelu_tanh"),
    activation_config=("hidden_activation", "gelu_pytorch_tanh"), mid="pre_feedforward_layernorm",
    fixed=(("attn_logit_softcapping", None), ("final_logit_softcapping", None),
           ("use_bidirectional_attention", False)))

OLMO2 = LLAMA.with_(  # diff with Llama: norms after each block instead of before (the blocks read the residual
    model_type="olmo2", config_class="Olmo2Config",  # stream itself), and q/k norms over the whole projection
    norms=("post_attention_layernorm", "post_feedforward_layernorm"), block_inputs=(),
    head_norms=("self_attn.q_norm", "self_attn.k_norm"), head_norms_over="projection", mid="mlp")

SMOLLM3 = LLAMA.with_(model_type="smollm3", config_class="SmolLM3Config",
                      rope_layers="no_rope_layers")  # diff with Llama: some layers without RoPE (NoPE)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, SMOLLM3, OLMO2)}


@dataclass(frozen=True)
class ModelSpec:
    """A checked model's family description and sizes, read once from the config and modules."""

    family: str
    parts: Family
    n_layers: int
    d_model: int
    d_mlp: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    rms_eps: float
    vocab_size: int
    max_positions: int
    qkv_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per layer
    rotary_layers: tuple[bool, ...] = ()  # per layer: whether the layer rotates q and k (empty: every layer)

    def rotates(self, index: int) -> bool:
        return not self.rotary_layers or self.rotary_layers[index]

    # Module access by the description's paths: the only place module names are read.
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return get(model, self.parts.layers)

    def embed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.embed)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.final_norm)

    def unembed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.unembed)

    def rotary(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.rotary)

    def base(self, model: nn.Module) -> nn.Module:
        """The decoder stack (``model.model``): called with ids or embeddings, returns hidden states."""
        return get(model, self.parts.layers.rsplit(".", 1)[0])

    def device(self, model: nn.Module) -> torch.device:
        return self.embed(model).weight.device


def get(root: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path (``"self_attn.q_proj"``)."""
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _config_error(setting: str, value: object, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported config setting {setting}={value!r}: {why}")


def check_family(config) -> Family:
    """The family description of ``config``'s ``model_type``, or ``UnsupportedModelError`` naming it."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r}; dpa supports {', '.join(FAMILIES)}")
    return family


def check_config(config) -> Family:
    """The family of ``config``, or ``UnsupportedModelError`` for any setting dpa would attribute wrongly."""
    family = check_family(config)
    model_type = config.model_type
    settings = config.to_dict()
    unknown = sorted(k for k in set(settings) - _default_keys(family.config_class) - METADATA_KEYS
                     if not _is_bookkeeping(k, settings[k]))
    if unknown:
        raise UnsupportedModelError(
            f"unsupported config setting(s) {', '.join(unknown)} for model_type={model_type!r}: dpa does not know "
            "what they change, so it refuses to attribute rather than risk a wrong answer")
    key, want = family.activation_config
    if getattr(config, key, None) != want:
        raise _config_error(key, getattr(config, key, None), f"the {model_type} description linearises {want} "
                            "(the gate rule depends on the activation)")
    for key, want in family.fixed:
        if getattr(config, key, want) != want:
            raise _config_error(key, getattr(config, key), f"the {model_type} description needs {want!r} "
                                "(soft-capping and bidirectional attention are not linearised)")
    if getattr(config, "mlp_bias", False):
        raise _config_error("mlp_bias", True, "MLP biases are inputs no token owns")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise _config_error("pretraining_tp", config.pretraining_tp, "sliced projections are not supported")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    per_type = rope if rope and all(isinstance(v, dict) for v in rope.values()) else {"": rope}  # Gemma: by layer type
    for rope in per_type.values():
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise _config_error("rope_type", rope_type, f"known RoPE types are {', '.join(ROPE_TYPES)}")
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            raise _config_error("partial_rotary_factor", factor, "partial rotary embeddings are not supported")
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            raise _config_error(f"layer_types[{i}]", kind, "only full and sliding attention are supported")
    return family


def _is_bookkeeping(key: str, value) -> bool:
    """A config key that says where the model came from rather than what its forward pass computes, known by
    what it is: transformers' private keys (``_name_or_path``, ``_model_name_or_path`` of a GGUF, ...), token
    ids and token strings, and the ``quantization_config`` of a GGUF file, whose weights transformers
    dequantises on loading (``_check_modules`` then checks that every weight is a float tensor)."""
    if key.startswith("_") or key.endswith(("_token_id", "_token_ids", "_token")):
        return True
    if key == "quantization_config":
        method = value.get("quant_method") if isinstance(value, dict) else getattr(value, "quant_method", None)
        return str(getattr(method, "value", method)).lower() == "gguf"
    return False


@functools.lru_cache(maxsize=None)
def _default_keys(config_class: str) -> frozenset[str]:
    import transformers

    return frozenset(getattr(transformers, config_class)().to_dict())


def _rotary_layers(config, family: Family) -> tuple[bool, ...]:
    if family.rope_layers is None:
        return ()
    flags = list(getattr(config, family.rope_layers))
    if len(flags) != config.num_hidden_layers or any(f not in (0, 1, True, False) for f in flags):
        raise _config_error(family.rope_layers, flags, f"expected {config.num_hidden_layers} flags of 0 or 1")
    return tuple(bool(f) for f in flags)


def _sliding_windows(config, family: Family) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2, SmolLM3: the layer types alone do not slide
        return (None,) * n
    if family.slides_every_layer:
        return (window,) * n
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return tuple(window if t == "sliding_attention" else None for t in types)


def _check_modules(model: nn.Module, family: Family) -> None:
    try:
        layers = get(model, family.layers)
        get(model, family.embed), get(model, family.final_norm)
        unembed = get(model, family.unembed)
    except AttributeError as err:
        raise UnsupportedModelError(f"{type(model).__name__} does not have the modules of a {family.model_type} "
                                    f"*ForCausalLM model ({err})") from None
    if getattr(unembed, "bias", None) is not None:
        raise UnsupportedModelError("unsupported module: lm_head has a bias")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise UnsupportedModelError(f"unsupported module: {name} is quantized ({p.dtype}); load the model in a "
                                        "float dtype")
    for i, layer in enumerate(layers):
        for branch, path in family.branches.items():
            proj = get(layer, path)
            if not isinstance(proj, nn.Linear):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is not a plain Linear (MoE?)")
            if not proj.weight.is_floating_point():
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is quantized; load in float")
            if proj.bias is not None and branch not in family.biased_branches:
                what = "attention_bias=True" if branch in ("query", "key", "value") else "an MLP bias"
                raise UnsupportedModelError(f"unsupported config setting {what} (layers[{i}].{path} has a bias)")
        for path in (family.heads, family.neurons):
            if getattr(get(layer, path), "bias", None) is not None:
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} has a bias (attention_bias?)")


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def spec_for(model: nn.Module) -> ModelSpec:
    """Check ``model`` and return its ``ModelSpec``; raises ``UnsupportedModelError``.

    The checks run again whenever the config changes (its settings are compared on every call)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (no .config)")
    fingerprint = repr(sorted(config.__dict__.items(), key=lambda kv: kv[0]))
    cached = _SPECS.get(model)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    spec = _spec_for(model, config)
    _SPECS[model] = (fingerprint, spec)
    return spec


def _spec_for(model: nn.Module, config) -> ModelSpec:
    family = check_config(config)
    _check_modules(model, family)
    query = get(get(model, family.layers)[0], family.branches["query"])
    n_heads = config.num_attention_heads
    return ModelSpec(
        family=family.model_type, parts=family,
        n_layers=config.num_hidden_layers, d_model=config.hidden_size, d_mlp=config.intermediate_size,
        n_heads=n_heads, n_kv_heads=config.num_key_value_heads or n_heads,
        d_head=query.out_features // n_heads, rms_eps=config.rms_norm_eps,
        vocab_size=config.vocab_size, max_positions=config.max_position_embeddings,
        qkv_bias=query.bias is not None, qk_norm=family.head_norms is not None,
        sliding_windows=_sliding_windows(config, family),
        rotary_layers=_rotary_layers(config, family),
    )


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` in Llama-like code, ``eps`` elsewhere)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise UnsupportedModelError(f"unsupported norm module {type(norm).__name__}: no epsilon attribute")
    return float(eps)


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer's modules, looked up once from the description's paths."""

    layer: nn.Module
    attention: nn.Module
    norms: tuple[nn.Module, ...]
    block_inputs: tuple[nn.Module, ...]
    head_norms: tuple[nn.Module, ...]
    branches: dict[str, nn.Module]
    activation: nn.Module
    heads: nn.Module
    neurons: nn.Module
    mid: nn.Module


_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layer_modules(model: nn.Module, spec: ModelSpec) -> list[LayerModules]:
    """Every layer's ``LayerModules`` (cached per model and spec)."""
    cached = _MODULES.get(model)
    if cached is not None and cached[0] is spec:
        return cached[1]
    p = spec.parts
    out = [LayerModules(
        layer=layer, attention=get(layer, p.attention), norms=tuple(get(layer, n) for n in p.norms),
        block_inputs=tuple(get(layer, n) for n in p.block_inputs),
        head_norms=tuple(get(layer, n) for n in (p.head_norms or ())),
        branches={name: get(layer, path) for name, path in p.branches.items()},
        activation=get(layer, p.activation[0]), heads=get(layer, p.heads), neurons=get(layer, p.neurons),
        mid=get(layer, p.mid)) for layer in spec.layers(model)]
    _MODULES[model] = (spec, out)
    return out
