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
from .files import plain_settings
from .rules.norm import NORM_KINDS

BRANCHES = ("query", "key", "value", "gate", "up")
# How a fused projection lays out the branches it holds, along its output features:
# "blocks": one after the other ([q | k | v], Phi-3 and GPT-2; [gate | up], Phi-3);
# "per_head": per head, each head's [q | k | v] in turn (GPT-NeoX).
LAYOUTS = ("blocks", "per_head")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")  # tests/test_rope_scaling.py
# RoPE types whose frequencies transformers recomputes from the sequence length (``dynamic_rope_update``): from
# the longest prompt of a padded batch. LongRoPE picks its short or long factors by it (longer than
# ``original_max_position_embeddings``: long); dynamic NTK rescales its base beyond ``max_position_embeddings``.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Keys that carry no semantics for the forward pass, beyond those known by what they are (``_is_bookkeeping``:
# private keys, token ids and strings, a GGUF's quantization_config): names, flags of the output, training.
METADATA_KEYS = frozenset({
    "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "initializer_range",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_word_embeddings", "attention_dropout",
    "max_position_embeddings", "model_type", "tokenizer_class", "use_bfloat16", "rope_scaling", "rope_theta",
    "max_window_layers", "prefix", "task_specific_params", "finetuning_task",
    "head_dim",  # not metadata, but dpa reads each head's size from the projections' shapes (ModelSpec.d_head)
})


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block, relative to a decoder layer: the router (whose forward returns logits,
    top-k weights and top-k indices), the experts module (3-D weights, transformers' fused layout), and a
    shared expert with its sigmoid gate where the model has one (Qwen2-MoE)."""

    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    shared: str | None = None
    shared_gate: str | None = None
    glu: str = "act"  # act(gate) * up with the experts' act_fn; "clamped": GPT-OSS's (see experts.py)
    biases: bool = False  # the experts' projections carry biases (in the bias share)
    router_bias: bool = False  # the router's logits carry a bias (a control input: see experts.py)


@dataclass(frozen=True)
class Family:
    """One ``model_type``: module paths (relative to the model, or to a decoder layer) and facts.

    norms          every norm inside a layer; its scale is frozen
    norm_kind      their arithmetic (``rms``: weight * x / rms(x), HF's Llama RMSNorm; ``rms_1p``: (1 + weight) * x /
                   rms(x) in float32, Gemma's; ``layer``: LayerNorm, weight * (x - mean) / std + bias;
                   rules.norm.NORM_KINDS), also the final norm's and the head norms'
    activation_config  the config key that names the activation and the value this description linearises
    fixed          config settings that must keep these values (soft-capping off, causal attention)
    block_inputs   the norm whose output feeds the attention block and nothing else, and the MLP's: the
                   block's common mu is applied in that norm's backward, where it costs nothing
    branches       the module whose *output* is each branch: mu scales the gradient entering it
    activation     the activation module; its kind (``silu``: SiLU(s) -> s * sigmoid(s)) is read from the config
                   through ``activation_config``
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
    activation: str | None = "mlp.act_fn"
    heads: str = "self_attn.o_proj"
    neurons: str | None = "mlp.down_proj"
    mid: str = "post_attention_layernorm"
    biased_branches: tuple[str, ...] = ()  # branches whose projection may carry a bias
    biases: bool = False  # every projection and norm may carry a bias (GPT-2, GPT-NeoX): each is in the bias share
    slides_every_layer: bool = False  # a set ``sliding_window`` applies to all layers (Mistral)
    activation_config: tuple[str, tuple[tuple[str, str], ...]] = ("hidden_act", (("silu", "silu"),))
    # ^ the config key naming the activation, and each value this description linearises -> its kind
    fixed: tuple[tuple[str, object], ...] = ()  # config settings the description needs at these values
    rope_layers: str | None = None  # config key listing, per layer, 1 where RoPE is applied (SmolLM3's NoPE layers)
    fused: tuple[tuple[str, str], ...] = ()  # (module path, layout): projections holding several branches
    gated: bool = True  # False: the MLP is act(W1 x) (GPT-2), one branch s; gate and up are the same path on it
    positions: str | None = None  # learned position embeddings (GPT-2's wpe): their share is reported apart
    softcap: tuple[str, str] | None = None  # config keys of the attention scores' and the final logits' soft-caps
    parallel: str | None = None  # config key: attention and MLP both read the layer's input (GPT-NeoX)
    rotary: str | None = "model.rotary_emb"
    partial_rotary: bool = False  # the model's attention rotates only part of each head (partial_rotary_factor)
    moe: Experts | None = None  # a mixture of experts in place of the MLP (then no gate/up branches, no neurons path)
    sinks: str | None = None  # per-head attention sink logits (GPT-OSS): a column in the softmax that no key owns
    rope_pairs: bool = False  # the rotary module's cos/sin hold one value per rotated pair (GPT-OSS), not per feature

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
    head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    activation_config=("hidden_activation", (("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu"))),
    mid="pre_feedforward_layernorm", softcap=("attn_logit_softcapping", "final_logit_softcapping"),
    fixed=(("use_bidirectional_attention", False),))

GEMMA2 = GEMMA3.with_(model_type="gemma2", config_class="Gemma2Config",  # diff with Gemma 3: no q/k norms;
                      head_norms=None)  # its soft-caps are on by default (attention 50, final logits 30)

OLMO2 = LLAMA.with_(  # diff with Llama: norms after each block instead of before (the blocks read the residual
    model_type="olmo2", config_class="Olmo2Config",  # stream itself), and q/k norms over the whole projection
    norms=("post_attention_layernorm", "post_feedforward_layernorm"), block_inputs=(),
    head_norms=("self_attn.q_norm", "self_attn.k_norm"), head_norms_over="projection", mid="mlp")

SMOLLM3 = LLAMA.with_(model_type="smollm3", config_class="SmolLM3Config",
                      rope_layers="no_rope_layers")  # diff with Llama: some layers without RoPE (NoPE)

PHI3 = LLAMA.with_(  # diff with Llama: q/k/v in one projection and gate/up in another (sliced by the model)
    model_type="phi3", config_class="Phi3Config",
    branches={"query": "self_attn.qkv_proj", "key": "self_attn.qkv_proj", "value": "self_attn.qkv_proj",
              "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj"},
    fused=(("self_attn.qkv_proj", "blocks"), ("mlp.gate_up_proj", "blocks")), activation="mlp.activation_fn",
    partial_rotary=True)

_GELU = (("gelu", "gelu"), ("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"))

GPT2 = Family(  # LayerNorm with biases, learned positions, one fused q/k/v projection (Conv1D), a GELU MLP
    model_type="gpt2", config_class="GPT2Config", layers="transformer.h", embed="transformer.wte",
    final_norm="transformer.ln_f", rotary=None, attention="attn", norms=("ln_1", "ln_2"), norm_kind="layer",
    block_inputs=("ln_1", "ln_2"),
    branches={"query": "attn.c_attn", "key": "attn.c_attn", "value": "attn.c_attn", "gate": "mlp.c_fc",
              "up": "mlp.c_fc"},
    fused=(("attn.c_attn", "blocks"),), activation="mlp.act", heads="attn.c_proj", neurons="mlp.c_proj",
    mid="ln_2", biases=True, gated=False, positions="transformer.wpe",
    activation_config=("activation_function", _GELU), fixed=(("add_cross_attention", False),))

GPT_NEOX = Family(  # Pythia: LayerNorm with biases, q/k/v fused per head, partial RoPE, parallel residuals
    model_type="gpt_neox", config_class="GPTNeoXConfig", layers="gpt_neox.layers", embed="gpt_neox.embed_in",
    final_norm="gpt_neox.final_layer_norm", rotary="gpt_neox.rotary_emb",
    attention="attention", norm_kind="layer",
    branches={"query": "attention.query_key_value", "key": "attention.query_key_value",
              "value": "attention.query_key_value", "gate": "mlp.dense_h_to_4h", "up": "mlp.dense_h_to_4h"},
    fused=(("attention.query_key_value", "per_head"),), activation="mlp.act", heads="attention.dense",
    neurons="mlp.dense_4h_to_h", biases=True, gated=False, parallel="use_parallel_residual", partial_rotary=True,
    activation_config=("hidden_act", _GELU))

_MOE_BRANCHES = {"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj"}
MIXTRAL = MISTRAL.with_(  # diff with Mistral: a mixture of experts in place of the MLP
    model_type="mixtral", config_class="MixtralConfig", branches=_MOE_BRANCHES, activation="mlp.experts.act_fn",
    neurons=None, moe=Experts())
QWEN3_MOE = QWEN3.with_(model_type="qwen3_moe", config_class="Qwen3MoeConfig", branches=_MOE_BRANCHES,
                        activation="mlp.experts.act_fn", neurons=None, moe=Experts(),
                        fixed=(("mlp_only_layers", []), ("decoder_sparse_step", 1)))  # every layer sparse
QWEN2_MOE = QWEN3_MOE.with_(model_type="qwen2_moe", config_class="Qwen2MoeConfig", head_norms=None,
                            biased_branches=("query", "key", "value"),
                            moe=Experts(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate"))
OLMOE = OLMO2.with_(  # pre-norms as Llama (not OLMo 2's post-norms), q/k norms over the projection, experts
    model_type="olmoe", config_class="OlmoeConfig", norms=LLAMA.norms, block_inputs=LLAMA.block_inputs,
    mid=LLAMA.mid, branches=_MOE_BRANCHES, activation="mlp.experts.act_fn", neurons=None, moe=Experts(),
    fixed=(("clip_qkv", None),))

GPT_OSS = Family(  # experts with biases and a clamped swish GLU, a router with a bias, attention sinks, q/k/v/o
    model_type="gpt_oss", config_class="GptOssConfig", branches=_MOE_BRANCHES, activation=None,  # biases, local
    neurons=None, biases=True, sinks="self_attn.sinks", rope_pairs=True,  # and global layers, YaRN RoPE
    moe=Experts(router="mlp.router", glu="clamped", biases=True, router_bias=True))

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, OLMO2, PHI3,
                                                          SMOLLM3, GPT2, GPT_NEOX, MIXTRAL, QWEN2_MOE,
                                                          QWEN3_MOE, OLMOE, GPT_OSS)}


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
    activation: str = "silu"  # the kind of the MLP's activation (functions.ACTIVATION_RATIO)
    attn_softcap: float | None = None  # c in c * tanh(score / c) on the attention scores (Gemma 2)
    final_softcap: float | None = None  # c on the final logits: dpa attributes the pre-cap logit
    parallel: bool = False  # attention and MLP read the same residual stream (GPT-NeoX's parallel residual)
    n_experts: int = 0  # routed experts per layer (0: a dense MLP)
    d_expert: int = 0  # neurons per routed expert
    d_shared: int = 0  # neurons of the shared expert (Qwen2-MoE), 0 without one

    @property
    def expert_slots(self) -> int:
        """Expert scores per layer: the routed experts, then the shared expert where there is one."""
        return self.n_experts + (1 if self.d_shared else 0)

    def rotates(self, index: int) -> bool:
        return self.parts.rotary is not None and (not self.rotary_layers or self.rotary_layers[index])

    def columns(self, name: str) -> slice | torch.Tensor | None:
        """Which output features of its projection a branch is: None where the projection is the branch's
        alone, else a slice (``blocks``) or an index (``per_head``) into the fused projection's output."""
        path = self.parts.branches[name]
        layout = dict(self.parts.fused).get(path)
        if layout is None:
            return None
        if name in ("gate", "up"):
            return slice(0, self.d_mlp) if name == "gate" else slice(self.d_mlp, 2 * self.d_mlp)
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if layout == "blocks":
            return {"query": slice(0, q), "key": slice(q, q + kv), "value": slice(q + kv, q + 2 * kv)}[name]
        offset = ("query", "key", "value").index(name) * self.d_head  # per_head: [q k v] of head 0, head 1, ...
        return (torch.arange(self.n_heads)[:, None] * 3 * self.d_head + offset + torch.arange(self.d_head)).flatten()

    # Module access by the description's paths: the only place module names are read.
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return get(model, self.parts.layers)

    def embed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.embed)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.final_norm)

    def unembed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.unembed)

    def positions(self, model: nn.Module) -> nn.Module | None:
        """The learned position embeddings, where the model has them (GPT-2)."""
        return get(model, self.parts.positions) if self.parts.positions else None

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
    activation_kind(config, family)
    for key, want in family.fixed:
        if (getattr(config, key, want) or None) != (want or None):  # False, None and 0 all mean "off"
            raise _config_error(key, getattr(config, key), f"the {model_type} description needs {want!r} "
                                "(bidirectional attention and cross-attention are not linearised)")
    if getattr(config, "mlp_bias", False):
        raise _config_error("mlp_bias", True, "MLP biases are inputs no token owns")
    if getattr(config, "pretraining_tp", 1) != 1:
        raise _config_error("pretraining_tp", config.pretraining_tp, "sliced projections are not supported")
    for rope in rope_settings(config):
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise _config_error("rope_type", rope_type, f"dpa attributes {model_type} with RoPE of the types "
                                f"{', '.join(ROPE_TYPES)} (each tested against autograd)")
        factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0) and not family.partial_rotary:
            raise _config_error("partial_rotary_factor", factor, f"the {model_type} description rotates whole "
                                "heads (partial rotary embeddings are known for phi3 and gpt_neox)")
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            raise _config_error(f"layer_types[{i}]", kind, "only full and sliding attention are supported")
    return family


def rope_settings(config) -> list[dict]:
    """The RoPE parameters of each layer type: one dict for most models, one per layer type for Gemma 3
    (``rope_parameters`` keyed by ``full_attention`` / ``sliding_attention``)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    return [dict(r) for r in rope.values()] if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]


def rope_depends_on_length(config) -> bool:
    """Whether the model's rotary frequencies depend on the sequence length (``LENGTH_DEPENDENT_ROPE``):
    transformers then takes them from the longest prompt of a padded batch, so dpa computes each prompt's
    rotary as for that prompt alone (``rotary.each_prompt_alone``)."""
    return any(r.get("rope_type", "default") in LENGTH_DEPENDENT_ROPE for r in rope_settings(config))


def context_length(config, max_position_embeddings: int | None = None) -> int:
    """The longest prompt dpa attributes: ``max_position_embeddings``, or, where every layer's RoPE is
    dynamic NTK scaling, ``factor`` times it: transformers rescales the rotary base for a sequence longer than
    ``max_position_embeddings`` (the scaling's purpose), up to the ``factor``-fold context it is configured for."""
    n = config.max_position_embeddings if max_position_embeddings is None else max_position_embeddings
    ropes = rope_settings(config)
    if all(r.get("rope_type", "default") == "dynamic" for r in ropes):
        return int(n * min(float(r.get("factor", 1.0)) for r in ropes))
    return n


def activation_kind(config, family: Family) -> str:
    """The kind of the MLP's activation (``silu``, ``gelu``, ``gelu_tanh``) named by the config, or
    ``UnsupportedModelError``: the gate rule depends on it."""
    key, known = family.activation_config
    value = getattr(config, key, None)
    kinds = dict(known)
    if value not in kinds:
        raise _config_error(key, value, f"the {family.model_type} description linearises "
                            f"{', '.join(kinds)} (the gate rule depends on the activation)")
    return kinds[value]


def _computes(module: nn.Module, kind: str) -> bool:
    """Whether an activation module computes the activation ``kind`` (s * ratio(s), functions.ACTIVATION_RATIO):
    its own forward on a probe over [-8, 8] in float64, against the formula."""
    from .functions import ACTIVATION_RATIO

    s = torch.linspace(-8, 8, 161, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = module.forward(s)
    except Exception:  # noqa: BLE001 -- a module that cannot run on the probe computes no kind dpa knows
        return False
    want = s * ACTIVATION_RATIO[kind](s)
    return isinstance(out, torch.Tensor) and out.shape == s.shape and torch.allclose(
        out.to(torch.float64), want, rtol=1e-6, atol=1e-9)


def check_activations(model: nn.Module, family: Family, kind: str) -> None:
    """Every activation module dpa linearises must compute the kind the config names (``activation_kind``):
    the gate rule's frozen factor is that kind's, while the value is the module's own. A module computing
    another function (``mlp.act_fn = nn.GELU()`` in a SiLU model) is refused by name, never linearised wrongly."""
    from .functions import ACTIVATION_RATIO

    paths = [p for p in (family.activation, family.moe and family.moe.shared and family.moe.shared + ".act_fn") if p]
    key, _ = family.activation_config
    for i, layer in enumerate(get(model, family.layers)):
        for path in paths:
            module = get(layer, path)
            if not _computes(module, kind):
                other = [k for k in ACTIVATION_RATIO if k != kind and _computes(module, k)]
                found = f"it computes {other[0]}" if other else "it computes none of " + ", ".join(ACTIVATION_RATIO)
                raise UnsupportedModelError(
                    f"unsupported module: layers[{i}].{path} is a {type(module).__name__} that does not compute "
                    f"{kind}, the activation the config names ({key}={getattr(model.config, key, None)!r}); {found}. "
                    "dpa linearises the activation the config names, so it refuses rather than attribute with "
                    "another activation's gate rule")


def check_norms(model: nn.Module, family: Family) -> None:
    """Every norm dpa freezes must compute its kind's arithmetic (``rules.norm.NORM_KINDS``) with its own weight
    (and bias) and epsilon: the frozen backward is built from them, the value is the module's own. A norm computing
    something else (a subclass with another forward, an adapter) is refused by name. Checked on a probe [4, width]
    in the norm's dtype and device against the arithmetic in float64, to the dtype's rounding."""
    arithmetic = NORM_KINDS[family.norm_kind]
    layers = get(model, family.layers)
    where = [(f"layers[{i}].{path}", get(layer, path)) for i, layer in enumerate(layers)
             for path in (*family.norms, *(family.head_norms or ()))] + [(family.final_norm, get(model, family.final_norm))]
    probes: dict = {}
    for name, norm in where:
        w = getattr(norm, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise UnsupportedModelError(f"unsupported module: {name} is a {type(norm).__name__} without a 1-D weight "
                                        f"(the {family.norm_kind} norm of the {family.model_type} description has one)")
        key = (w.shape[0], w.dtype, w.device)
        if key not in probes:
            g = torch.Generator().manual_seed(0)
            probes[key] = (3 * torch.randn(4, w.shape[0], generator=g, dtype=torch.float64)).to(w.device, w.dtype)
        x = probes[key]
        beta = getattr(norm, "bias", None)
        with torch.no_grad():
            try:
                own = norm.forward(x)
            except Exception as err:  # noqa: BLE001
                raise UnsupportedModelError(f"unsupported module: {name} ({type(norm).__name__}) does not run as a "
                                            f"norm over its weight's width ({err})") from None
            extra = () if beta is None else (beta.detach().double(),)
            want = arithmetic(x.double(), w.detach().double(), norm_eps(norm), *extra)[0]
        miss = (own.double() - want).norm() / want.norm() if isinstance(own, torch.Tensor) and own.shape == x.shape \
            else float("inf")
        if not miss <= 1e-5 + 16 * torch.finfo(w.dtype).eps:
            raise UnsupportedModelError(
                f"unsupported module: {name} is a {type(norm).__name__} that does not compute the "
                f"{family.norm_kind} norm of its weight (relative difference {float(miss):.2g} on a probe); dpa "
                "freezes a norm from its weight and epsilon, so it refuses a norm that computes something else")


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


def _projection_classes() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def is_projection(module: nn.Module) -> bool:
    """nn.Linear, or GPT-2's Conv1D (the same map with its weight stored [in, out]), or a subclass of either
    that keeps its forward (a parametrization, a marker class): a module that computes exactly what its
    ``weight`` and ``bias`` say, which dpa may read instead of running it. A subclass with a forward of its
    own (a LoRA written as a Linear) computes something else: not a projection (``why_not_projection``)."""
    return any(isinstance(module, base) and type(module).forward is base.forward for base in _projection_classes())


def why_not_projection(module: nn.Module) -> str:
    """What a module that is not a projection is, for the refusal that names it."""
    name = type(module).__name__
    if isinstance(module, _projection_classes()):
        return (f"a {name}, a subclass of {type(module).__mro__[1].__name__} with a forward of its own (an "
                "adapter such as LoRA?), so its weight is not what it computes")
    return f"a {name}, not a Linear (an adapter wrapping one, such as LoRA?)"


def weight_rows(module: nn.Module) -> torch.Tensor:
    """A projection's weight as [out, in] (nn.Linear's layout) whatever its class: what ``is_projection``
    vouches the module computes."""
    if not is_projection(module):
        raise UnsupportedModelError(f"unsupported module: {why_not_projection(module)}; dpa reads its weight")
    return module.weight if isinstance(module, nn.Linear) else module.weight.T


def in_features(module: nn.Module) -> int:
    return weight_rows(module).shape[1]




def check_experts(layer: nn.Module, family: Family, i: int) -> None:
    """The experts dpa attributes must be exactly the ones it reads: transformers' fused layout (3-D
    ``gate_up_proj`` and ``down_proj``, the flags ``use_experts_implementation`` sets), nothing else. A
    layout or a parameter dpa does not read is refused by name: never a partial attribution."""
    moe = family.moe
    try:
        experts, router = get(layer, moe.experts), get(layer, moe.router)
    except AttributeError as err:
        raise UnsupportedModelError(f"layers[{i}] has no mixture-of-experts block where the {family.model_type} "
                                    f"description expects one ({err}; mlp_only_layers?)") from None
    names = {n for n, _ in experts.named_parameters()}
    layout = {"has_gate": True, "has_bias": moe.biases, "has_post_expert_norm": False}  # what dpa's experts read
    for flag, want in layout.items():
        if getattr(experts, flag, None) != want:
            raise UnsupportedModelError(f"unsupported experts in layers[{i}]: {type(experts).__name__}.{flag} is "
                                        f"{getattr(experts, flag, None)!r} (dpa reads experts with {flag}={want})")
    read = {"gate_up_proj", "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if moe.biases else set())
    if names != read or experts.gate_up_proj.dim() != 3:
        raise UnsupportedModelError(f"unsupported experts in layers[{i}]: parameters {sorted(names)}; dpa reads "
                                    f"exactly {', '.join(sorted(read))}, so it would miss the others")
    if moe.glu == "clamped" and not all(isinstance(getattr(experts, a, None), (int, float)) for a in ("alpha", "limit")):
        raise UnsupportedModelError(f"unsupported experts in layers[{i}]: the clamped GLU needs numbers alpha, limit")
    router_params = {n for n, _ in router.named_parameters()}
    if router_params != ({"weight", "bias"} if moe.router_bias else {"weight"}):
        raise UnsupportedModelError(f"unsupported router in layers[{i}]: parameters {sorted(router_params)} (the "
                                    f"{family.model_type} description knows {'weight, bias' if moe.router_bias else 'weight'})")


def own_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class has a forward of its own (a subclass's), not transformers'."""
    return not getattr(type(module).forward, "__module__", "").startswith("transformers")


def _check_modules(model: nn.Module, family: Family) -> None:
    forward = type(model).forward
    if own_forward(model):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s forward is its own ({forward.__qualname__}, not transformers'): dpa runs the "
            f"decoder stack and computes the logits from {family.unembed} itself, so what that forward changes (a "
            "logit bias or scale, a mask, another head) would be missed, a silently different model: attribute the "
            "model's own class (AutoModelForCausalLM)")
    try:
        layers = get(model, family.layers)
        get(model, family.embed), get(model, family.final_norm)
        unembed = get(model, family.unembed)
        if family.positions:
            get(model, family.positions)
    except AttributeError as err:
        raise UnsupportedModelError(f"{type(model).__name__} does not have the modules of a {family.model_type} "
                                    f"*ForCausalLM model ({err})") from None
    if not is_projection(unembed):
        raise UnsupportedModelError(f"unsupported module: {family.unembed} is {why_not_projection(unembed)}; dpa "
                                    "reads the unembedding's weight for the target direction")
    if getattr(unembed, "bias", None) is not None:
        raise UnsupportedModelError(f"unsupported module: {family.unembed} has a bias")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise UnsupportedModelError(f"unsupported module: {name} is quantized ({p.dtype}); load the model in a "
                                        "float dtype")
    try:
        _check_layers(layers, family)
    except AttributeError as err:  # a block wrapped or replaced by a module without the family's parts
        raise UnsupportedModelError(f"unsupported module: a decoder layer does not have the modules of a "
                                    f"{family.model_type} layer ({err}); dpa reads and linearises them by name") from None
    where: dict[int, str] = {}
    for i, layer in enumerate(layers):  # dpa's rules and taps are per module object: one object, one place
        for name, m in layer.named_modules(remove_duplicate=False):
            here = f"layers[{i}]" + (f".{name}" if name else "")
            first = where.setdefault(id(m), here)
            if first != here:
                raise UnsupportedModelError(f"unsupported model: {here} is the same module object as {first}; dpa "
                                            "scores each place of the model apart, so a module used twice would get "
                                            "one place's scores for both: give each place its own copy "
                                            "(copy.deepcopy) before attributing")


def _check_layers(layers, family: Family) -> None:
    layer_norm = family.norm_kind == "layer"
    for i, layer in enumerate(layers):
        for branch, path in family.branches.items():
            proj = get(layer, path)
            if not is_projection(proj):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is {why_not_projection(proj)}")
            if proj.bias is not None and not family.biases and branch not in family.biased_branches:
                what = "attention_bias=True" if branch in ("query", "key", "value") else "an MLP bias"
                raise UnsupportedModelError(f"unsupported config setting {what} (layers[{i}].{path} has a bias)")
        if family.moe is not None:
            check_experts(layer, family, i)
        shared = (family.moe.shared + ".down_proj",) if family.moe is not None and family.moe.shared else ()
        for path in (family.heads, family.neurons, *shared):
            if path is None:  # a mixture of experts: check_experts
                continue
            if not is_projection(get(layer, path)):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is "
                                            f"{why_not_projection(get(layer, path))}; dpa reads its weight")
            if getattr(get(layer, path), "bias", None) is not None and not family.biases:
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} has a bias (attention_bias?)")
        for path in family.norms:
            norm = get(layer, path)
            if layer_norm != isinstance(norm, nn.LayerNorm) or (layer_norm and norm.weight is None):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is a {type(norm).__name__}, "
                                            f"not the {family.norm_kind} norm of the {family.model_type} description")


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def spec_for(model: nn.Module) -> ModelSpec:
    """Check ``model`` and return its ``ModelSpec``; raises ``UnsupportedModelError``.

    The checks run again whenever the model is not the one last checked: its config's settings and its modules
    (``module_state``) are compared on every call, so a model edited since (a layer, a projection or a norm
    replaced, an adapter injected) is checked, and its modules looked up (``layer_modules``), as a fresh one."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (no .config)")
    fingerprint = (repr(sorted(config.__dict__.items(), key=lambda kv: kv[0])), module_state(model))
    cached = _SPECS.get(model)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    spec = _spec_for(model, config)
    _SPECS[model] = (fingerprint, spec)
    return spec


def module_state(model: nn.Module) -> list:
    """What the checks and the modules dpa looks up depend on, besides the config, walked from ``model``: each
    module's class, its parameters (name, identity, dtype, shape), its plain settings and its children (name and the object itself,
    kept alive by the list, so that no other module can take its place unseen; a parameter's identity matters
    only where dpa keeps the object, which then stays alive too: GPT-OSS's sinks). Equal lists: the same modules
    at the same places, the same parameters. About 1 ms per call on a 135M-parameter model."""
    state: list = []
    add = state.append
    seen, stack = {id(model)}, [model]
    while stack:
        m = stack.pop()
        add(type(m))
        params, children = m._parameters, m._modules
        add(len(params))
        for name, p in params.items():
            add(name)
            if p is None:
                add(None)
            else:
                add(id(p)), add(p.dtype), add(p.shape)
        for k, v in plain_settings(m):  # an attention's head_dim, soft-cap or scaling
            add(k), add(v)
        add(len(children))
        for name, child in children.items():
            add(name), add(child)
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return state


def _spec_for(model: nn.Module, config) -> ModelSpec:
    from .guard import checking

    family = check_config(config)
    with checking(model):  # the probes run each module's own forward: not while another call's rules are on it
        return _checked_spec(model, config, family)


def _checked_spec(model: nn.Module, config, family: Family) -> ModelSpec:
    _check_modules(model, family)
    n = len(get(model, family.layers))
    if n != config.num_hidden_layers:  # Llama-like models run the config's first n, GPT-2 runs them all
        raise UnsupportedModelError(f"unsupported module: {family.layers} holds {n} layers, while the config's "
                                    f"num_hidden_layers is {config.num_hidden_layers}; dpa attributes the layers the "
                                    "model runs, so the two must agree (set num_hidden_layers when removing layers)")
    check_activations(model, family, activation_kind(config, family))
    check_norms(model, family)
    first = get(model, family.layers)[0]
    n_heads = config.num_attention_heads
    d_head = in_features(get(first, family.heads)) // n_heads  # the output projection reads every head
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    n_experts = d_expert = d_shared = 0
    if family.moe is not None:
        experts = get(first, family.moe.experts)
        down = experts.down_proj  # [expert d_model d_expert], or [expert d_expert d_model] transposed
        n_experts, d_expert = down.shape[0], down.shape[1 if getattr(experts, "is_transposed", False) else 2]
        if family.moe.shared:
            d_shared = in_features(get(first, family.moe.shared + ".down_proj"))
        d_mlp = n_experts * d_expert + d_shared
    else:
        d_mlp = in_features(get(first, family.neurons))
    spec = ModelSpec(
        family=family.model_type, parts=family,
        n_layers=config.num_hidden_layers, d_model=config.hidden_size, d_mlp=d_mlp,
        n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, rms_eps=norm_eps(get(model, family.final_norm)),
        vocab_size=config.vocab_size, max_positions=context_length(config),
        qkv_bias=get(first, family.branches["query"]).bias is not None, qk_norm=family.head_norms is not None,
        sliding_windows=_sliding_windows(config, family),
        rotary_layers=_rotary_layers(config, family), activation=activation_kind(config, family),
        attn_softcap=getattr(config, family.softcap[0], None) if family.softcap else None,
        final_softcap=getattr(config, family.softcap[1], None) if family.softcap else None,
        parallel=bool(getattr(config, family.parallel, False)) if family.parallel else False,
        n_experts=n_experts, d_expert=d_expert, d_shared=d_shared,
    )
    _check_attention(get(model, family.layers), family, spec)
    for path, layout in family.fused:  # the fused projection holds exactly its branches' features
        names = [n for n, p in family.branches.items() if p == path]
        want = sum(spec.n_heads * d_head if n == "query" else spec.n_kv_heads * d_head if n in ("key", "value")
                   else d_mlp for n in names)
        if weight_rows(get(first, path)).shape[0] != want or layout not in LAYOUTS:
            raise UnsupportedModelError(f"unsupported module: {path} has {weight_rows(get(first, path)).shape[0]} "
                                        f"outputs, not the {want} of {', '.join(names)} ({layout})")
    return spec


# The attention modules' own copies of the head layout and soft-cap (what their forward runs with), by attribute name.
_ATTENTION_SETTINGS = {"head_dim": lambda s: s.d_head, "head_size": lambda s: s.d_head, "num_heads": lambda s: s.n_heads,
                       "num_attention_heads": lambda s: s.n_heads, "num_key_value_heads": lambda s: s.n_kv_heads,
                       "num_key_value_groups": lambda s: s.n_heads // s.n_kv_heads}


def _check_attention(layers, family: Family, spec: ModelSpec) -> None:
    """Each attention module runs the layout dpa reads from the config: its own head_dim, head counts and soft-cap
    (where it keeps them), and its query, key and value projections' sizes. A config edited after loading
    (num_attention_heads, attn_logit_softcapping) or a module edited alone would otherwise have dpa split and cap
    the heads one way while the model runs them another: refused by name."""
    settings = dict(_ATTENTION_SETTINGS)
    if family.softcap:
        settings[family.softcap[0]] = lambda s: s.attn_softcap
    fused = {path for path, _ in family.fused}
    rows = {"query": spec.n_heads * spec.d_head, "key": spec.n_kv_heads * spec.d_head,
            "value": spec.n_kv_heads * spec.d_head}
    for i, layer in enumerate(layers):
        attn = get(layer, family.attention)
        for name, value in settings.items():
            have = getattr(attn, name, _ABSENT)
            if have is _ABSENT or isinstance(have, (nn.Module, torch.Tensor)):
                continue
            if have != value(spec):
                raise UnsupportedModelError(
                    f"unsupported model: layers[{i}].{family.attention}.{name} is {have!r}, while the config gives "
                    f"{value(spec)!r}; dpa splits and scores the heads as the config says and the module runs them "
                    "its own way (a config or module edited after loading?): make the two agree, or load the model "
                    "again")
        for branch, n in rows.items():
            path = family.branches[branch]
            if path not in fused and weight_rows(get(layer, path)).shape[0] != n:
                raise UnsupportedModelError(
                    f"unsupported model: layers[{i}].{path} has {weight_rows(get(layer, path)).shape[0]} outputs, "
                    f"not the {n} the config's head counts give ({spec.n_heads} query, {spec.n_kv_heads} key/value "
                    f"heads of {spec.d_head}); a config edited after loading?")


_ABSENT = object()


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
    activation: nn.Module | None  # None where the experts' GLU is written inline (GPT-OSS)
    heads: nn.Module
    neurons: nn.Module | None  # None for a mixture of experts (its neurons are inside ``experts``)
    mid: nn.Module
    mlp: nn.Module | None = None  # the MLP (or sparse) block, called on its normalised input by the circuit graphs
    post_norms: tuple[nn.Module | None, nn.Module | None] = (None, None)  # after the attention's and the MLP's
    # output projections (Gemma, OLMo 2): a unit's write passes them, frozen
    columns: dict[str, slice | torch.Tensor | None] = field(default_factory=dict)  # ModelSpec.columns
    router: nn.Module | None = None
    experts: nn.Module | None = None
    shared: nn.Module | None = None  # the shared expert (a GLU MLP) and its gate
    shared_gate: nn.Module | None = None
    sinks: torch.Tensor | None = None  # attention sink logits [head] (GPT-OSS)

    def output(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Branch ``name``'s part of its projection's output ``out`` (all of it unless fused)."""
        cols = self.columns.get(name)
        if cols is None:
            return out
        return out[..., cols] if isinstance(cols, slice) else out.index_select(-1, cols.to(out.device))

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Branch ``name`` of the input ``x``: its projection's own forward, sliced where fused."""
        return self.output(name, self.branches[name](x))

    def weight(self, name: str) -> torch.Tensor:
        """Branch ``name``'s weight [out, in] (its rows of a fused projection)."""
        w = weight_rows(self.branches[name])
        cols = self.columns.get(name)
        return w if cols is None else w[cols] if isinstance(cols, slice) else w.index_select(0, cols.to(w.device))

    def bias(self, name: str) -> torch.Tensor | None:
        b = getattr(self.branches[name], "bias", None)
        cols = self.columns.get(name)
        return b if b is None or cols is None else b[cols] if isinstance(cols, slice) else b[cols.to(b.device)]


def neuron_direction(mods: LayerModules, spec: ModelSpec, neuron: int) -> torch.Tensor:
    """What one MLP neuron writes per unit of activation [d_model]: its down-projection column. On a mixture of
    experts neuron e * d_expert + j is neuron j of routed expert e, then the shared expert's follow."""
    if mods.experts is None:
        return weight_rows(mods.neurons)[:, neuron]
    expert, j = divmod(neuron, spec.d_expert)
    if expert < spec.n_experts:
        down = mods.experts.down_proj[expert]  # [d_model d_expert], or [d_expert d_model] transposed
        return down[j] if getattr(mods.experts, "is_transposed", False) else down[:, j]
    return weight_rows(mods.shared.down_proj)[:, neuron - spec.n_experts * spec.d_expert]


def post_norms(layer: nn.Module, family: Family) -> tuple[nn.Module | None, nn.Module | None]:
    """The norms after each block's output projection, (attention's, MLP's): the norms that feed no block
    (Gemma's post-attention and post-feedforward norms, OLMo 2's), in the order the layer runs them."""
    after = [n for n in family.norms if n not in family.block_inputs]
    if not after:
        return (None, None)
    if len(after) != 2:
        raise UnsupportedModelError(f"{family.model_type}: expected a norm after each block, found {after}")
    return (get(layer, after[0]), get(layer, after[1]))


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
        activation=get(layer, p.activation) if p.activation else None, heads=get(layer, p.heads),
        neurons=get(layer, p.neurons) if p.neurons else None, mid=get(layer, p.mid), mlp=get(layer, p.mlp),
        post_norms=post_norms(layer, p),
        columns={name: spec.columns(name) for name in p.branches},
        sinks=get(layer, p.sinks.rsplit(".", 1)[0]).get_parameter(p.sinks.rsplit(".", 1)[1]) if p.sinks else None,
        **({} if p.moe is None else dict(
            router=get(layer, p.moe.router), experts=get(layer, p.moe.experts),
            shared=get(layer, p.moe.shared) if p.moe.shared else None,
            shared_gate=get(layer, p.moe.shared_gate) if p.moe.shared_gate else None)))
        for layer in spec.layers(model)]
    _MODULES[model] = (spec, out)
    return out
