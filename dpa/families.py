"""Checking a model against its family's description (``registry.py``, the family table): the config's settings,
every module dpa reads or linearises, and the sizes, into one ``ModelSpec`` (``spec_for``).

``instrument.py`` reads the description to linearise the model (frozen norms, linearised activation, mu-scaled
branches) and to place its score taps; the explicit attention path (``explicit.py``) reads it to recompute alpha.
Anything a description does not cover -- another ``model_type``, an unknown config key, another activation, a bias
where none is expected, unknown RoPE -- raises ``UnsupportedModelError`` naming it: a silently wrong attribution is
worse than an error.

The table's and ``spec.py``'s names are importable from here too (``from dpa.families import FAMILIES, ModelSpec``).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from .errors import UnsupportedModelError
from .expert_checks import check_experts, expert_sizes
from .guard import checking
from .mixers import (check_mixer, check_mixer_config, every_layer_kind as _kinds, layer_descriptions, layer_kinds,
                     mixer_layer_types, sparse_layers)
from .module_checks import check_activations, check_norms
from .multipliers import check_copies, multipliers
from .registry import (BRANCHES, FAMILIES, LAYOUTS, LENGTH_DEPENDENT_ROPE, METADATA_KEYS, ROPE_TYPES, Experts,
                       Family)
from .rope_config import UNBOUNDED, context_length, rope_depends_on_length, rope_settings, rope_switched
from .spec import (LayerModules, ModelSpec, get, in_features, is_projection, layer_modules, neuron_direction, norm_eps,
                   own_forward, post_norms, unread_parameters, weight_rows, why_not_projection)
from .scan_rules import RULES
from .state_checks import check_not_compiled, module_state

__all__ = ["BRANCHES", "FAMILIES", "LAYOUTS", "LENGTH_DEPENDENT_ROPE", "METADATA_KEYS", "ROPE_TYPES", "Experts",
           "Family", "LayerModules", "ModelSpec", "activation_kind", "check_activations", "check_config",
           "check_experts", "check_family", "check_norms", "context_length", "get", "in_features", "is_projection",
           "layer_modules", "module_state", "neuron_direction", "norm_eps", "own_forward", "post_norms",
           "rope_depends_on_length", "rope_settings", "spec_for", "weight_rows", "why_not_projection"]


def _config_error(setting: str, value: object, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"unsupported config setting {setting}={value!r}: {why}")


def check_family(config) -> Family:
    """The family description of ``config``'s ``model_type``, or ``UnsupportedModelError`` naming it."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r}; dpa supports {', '.join(FAMILIES)}")
    if family.variant is not None and getattr(config, family.variant[0], None):  # (Granite's experts)
        return family.variant[1]
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
    for key, want, why in family.fixed:
        if (getattr(config, key, want) or None) != (want or None):  # False, None and 0 all mean "off"
            raise _config_error(key, getattr(config, key), f"the {model_type} description needs {want!r} ({why})")
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
    known = (*family.attention_types, *mixer_layer_types(family))
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in known:
            raise _config_error(f"layer_types[{i}]", kind, f"the {model_type} description knows the layer types "
                                f"{', '.join(known)}")
    check_mixer_config(config, family)
    multipliers(config, family)
    return family


def activation_kind(config, family: Family) -> str:
    """The kind of the MLP's activation (``silu``, ``gelu``, ``gelu_tanh``) named by the config, or
    ``UnsupportedModelError``: the gate rule depends on it."""
    key, known = family.activation_config
    value = getattr(config, key, None) if key is not None else None  # None: the modelling code names it
    kinds = dict(known)
    if value not in kinds:
        raise _config_error(key, value, f"the {family.model_type} description linearises "
                            f"{', '.join(kinds)} (the gate rule depends on the activation)")
    return kinds[value]


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
    check_not_compiled("", model)
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
    n = len(layers)  # Llama-like models run the config's first n, GPT-2 runs them all; checked before the per-layer
    if n != model.config.num_hidden_layers:  # checks, which read each layer's kind from the config
        raise UnsupportedModelError(f"unsupported module: {family.layers} holds {n} layers, while the config's "
                                    f"num_hidden_layers is {model.config.num_hidden_layers}; dpa attributes the layers "
                                    "the model runs, so the two must agree (set num_hidden_layers when removing layers)")
    if getattr(get(model, family.embed), "max_norm", None) is not None:
        raise UnsupportedModelError(
            f"unsupported module: {family.embed} has max_norm={get(model, family.embed).max_norm}: an embedding with "
            "a max_norm rescales its weight's rows in place on every forward, so attributing would change the model")
    if not is_projection(unembed):
        raise UnsupportedModelError(f"unsupported module: {family.unembed} is {why_not_projection(unembed)}; dpa "
                                    "reads the unembedding's weight for the target direction")
    if getattr(unembed, "bias", None) is not None:
        raise UnsupportedModelError(f"unsupported module: {family.unembed} has a bias")
    vocab, rows = getattr(model.config, "vocab_size", None), weight_rows(unembed).shape[0]
    embed = getattr(get(model, family.embed), "weight", None)
    if rows != vocab or not isinstance(embed, torch.Tensor) or embed.shape[0] != vocab:
        raise UnsupportedModelError(
            f"unsupported model: {family.unembed} has {rows} outputs and {family.embed} "
            f"{embed.shape[0] if isinstance(embed, torch.Tensor) else 'no'} rows, while the config's vocab_size is "
            f"{vocab}; dpa checks token ids and targets against the config, so the three must agree (a module "
            "replaced or a config edited after loading? model.resize_token_embeddings keeps them together)")
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise UnsupportedModelError(f"unsupported module: {name} is quantized ({p.dtype}); load the model in a "
                                        "float dtype")
    kinds = _kinds(model.config, family, len(layers))
    sparse = sparse_layers(model.config, family, len(layers))
    at: list[int] = []  # the layer being checked
    try:
        _check_layers(layers, family, layer_descriptions(model.config, family, len(layers)), kinds, at)
    except AttributeError as err:  # a block wrapped or replaced by a module without the family's parts
        i = at[-1] if at else 0
        kind = (f"; the config's layer_types makes it {'an' if kinds[i][0] in 'aeiou' else 'a'} {kinds[i]} layer"
                if family.mixers else "") + (
            f"; the config gives it a {'sparse' if sparse[i] else 'dense'} MLP ({family.moe.layers})" if sparse else "")
        raise UnsupportedModelError(f"unsupported module: layers[{i}] does not have the modules of a "
                                    f"{family.model_type} layer ({err}{kind}); dpa reads and linearises them by "
                                    "name") from None
    _check_own_forwards(model, family, layers)
    _check_dispatch(model.config, family, layers, kinds)
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


def _check_dispatch(config, family: Family, layers, kinds: tuple[str, ...]) -> None:
    """A hybrid's decoder layer runs the block its own record names (transformers' ``block_type``, the config's
    layer type when it was built; LFM2's ``is_attention_layer``), while dpa reads each layer's kind from the config:
    an attribute edited since (or a config edited since) would have the layer run one block and dpa linearise
    another. Refused by name."""
    types = list(getattr(config, "layer_types", None) or [])
    for i, layer in enumerate(layers):
        own = layer.__dict__.get("block_type")
        if isinstance(own, str) and i < len(types) and own != types[i]:
            raise UnsupportedModelError(
                f"unsupported model: layers[{i}].block_type is {own!r}, while the config's layer_types[{i}] is "
                f"{types[i]!r}; the layer runs the block its block_type names and dpa reads the config's (a layer or "
                "a config edited after loading?): make the two agree, or load the model again")
        flag = layer.__dict__.get("is_attention_layer")
        if isinstance(flag, bool) and flag != (kinds[i] == "attention"):
            raise UnsupportedModelError(
                f"unsupported model: layers[{i}].is_attention_layer is {flag}, while the config makes it a {kinds[i]} "
                "layer; the layer runs the block its flag names and dpa reads the config's: make the two agree")


def _check_own_forwards(model: nn.Module, family: Family, layers) -> None:
    """The decoder stack, each layer, each attention module and each MLP run their own forwards in dpa's calls, with
    dpa's rules on the modules inside them: a class replacing one of those forwards (a subclass with a forward of its
    own) may compute something the rules do not describe (a nonlinearity on a block's output, another scale), which
    autograd would then carry through unlinearised. Refused by name. (A mixer block's: ``mixers.own_block``.)"""
    kinds = _kinds(model.config, family, len(layers))
    described = layer_descriptions(model.config, family, len(layers))
    parts = [("the decoder stack", get(model, family.layers.rsplit(".", 1)[0]))]
    for i, layer in enumerate(layers):
        on = described[i]
        parts.append((f"layers[{i}]", layer))
        if kinds[i] == "attention":
            parts.append((f"layers[{i}]'s attention", get(layer, family.attention)))
        if on.mlp is not None:
            parts.append((f"layers[{i}]'s MLP", get(layer, on.mlp)))
        if on.moe is not None:  # dpa runs the experts (and the shared expert) from their weights: a forward of
            parts += [(f"layers[{i}]'s experts", get(layer, on.moe.experts))] + (  # their own would be ignored
                [(f"layers[{i}]'s shared expert", get(layer, on.moe.shared))] if on.moe.shared else [])
    for name, module in parts:
        if own_forward(module):
            forward = type(module).forward
            raise UnsupportedModelError(
                f"unsupported module: {name} is a {type(module).__name__} whose forward is its own "
                f"({getattr(forward, '__qualname__', forward)}, not transformers'): dpa linearises the modules inside "
                "it and lets that forward run, so what it changes would be attributed with rules derived for "
                "another computation; use the model's own class")


def _check_layers(layers, model_family: Family, described: tuple[Family, ...], kinds: tuple[str, ...],
                  at: list[int]) -> None:
    layer_norm = model_family.norm_kind == "layer"
    for i, layer in enumerate(layers):
        at.append(i)
        family = described[i]  # a mixer layer: its block's paths in the attention's places; a dense or sparse MLP
        for branch, path in family.branches.items():
            proj = get(layer, path)
            if not is_projection(proj):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is {why_not_projection(proj)}")
            if proj.bias is not None and not family.biases and branch not in family.biased_branches:
                mixer = model_family.mixer(kinds[i])
                what = ("an MLP bias" if branch not in ("query", "key", "value") else "attention_bias=True"
                        if mixer is None else f"a bias inside the {mixer.kind} block ({', '.join(mixer.biases)}?)")
                raise UnsupportedModelError(f"unsupported config setting {what} (layers[{i}].{path} has a bias)")
        if family.moe is not None:
            check_experts(layer, family, i)
        shared = tuple(dict.fromkeys(f"{family.moe.shared}.{p}" for p in family.moe.shared_parts[:3])) \
            if family.moe is not None and family.moe.shared else ()
        for path in (family.heads, family.neurons, *shared):
            if path is None:  # a mixture of experts: check_experts
                continue
            if not is_projection(get(layer, path)):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is "
                                            f"{why_not_projection(get(layer, path))}; dpa reads its weight")
            if getattr(get(layer, path), "bias", None) is not None and not family.biases:
                mixer = model_family.mixer(kinds[i])
                what = "attention_bias?" if mixer is None or path != family.heads else f"inside the {mixer.kind} block"
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} has a bias ({what})")
        for path in family.norms:
            norm = get(layer, path)
            if layer_norm != isinstance(norm, nn.LayerNorm) or (layer_norm and norm.weight is None):
                raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is a {type(norm).__name__}, "
                                            f"not the {family.norm_kind} norm of the {family.model_type} description")
    for i, layer in enumerate(layers):  # last: a layer without the family's modules, or compiled, says so first
        at.append(i)
        check_not_compiled(f"{model_family.layers}.{i}", layer)
        unread = unread_parameters(layer, described[i])
        if unread:
            raise UnsupportedModelError(
                f"unsupported module: layers[{i}] holds parameters outside the modules the {model_family.model_type} "
                f"description reads ({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}; experts a config "
                "edit switched off, an adapter?); dpa would neither linearise nor score what they compute")


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


def _spec_for(model: nn.Module, config) -> ModelSpec:
    family = check_config(config)
    with checking(model):  # the probes run each module's own forward: not while another call's rules are on it
        return _checked_spec(model, config, family)


def _checked_spec(model: nn.Module, config, family: Family) -> ModelSpec:
    family = rope_switched(model, config, family)
    _check_modules(model, family)
    check_activations(model, family, activation_kind(config, family))
    check_norms(model, family)
    layers = get(model, family.layers)
    kinds = _kinds(config, family, len(layers))
    attention = next((layer for layer, kind in zip(layers, kinds) if kind == "attention"), None)  # the first
    # attention layer: its head sizes and biases; else the first with a token mixer
    first, kind = (attention, "attention") if attention is not None else next(
        ((layer, kind) for layer, kind in zip(layers, kinds) if family.on_layer(kind).heads), (layers[0], kinds[0]))
    n_heads = getattr(config, family.heads_key)
    # the output projection reads every head; with no attention layer, the mixers' units are n_heads groups of
    # their output projection's input channels (Mamba-2's SSM heads, Mamba's channels)
    heads = family.on_layer(kind).heads
    d_head = in_features(get(first, heads)) // n_heads if heads else 0
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    widths = _mlp_widths(layers, layer_descriptions(config, family, len(layers)), family)
    spec = ModelSpec(
        family=family.model_type, parts=family, n_layers=config.num_hidden_layers, d_model=config.hidden_size,
        n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, rms_eps=norm_eps(get(model, family.final_norm)),
        vocab_size=config.vocab_size, max_positions=context_length(config) if family.context_key else UNBOUNDED,
        qkv_bias=attention is not None and get(attention, family.branches["query"]).bias is not None, qk_norm=family.head_norms is not None,
        sliding_windows=_sliding_windows(config, family),
        rotary_layers=_rotary_layers(config, family), activation=activation_kind(config, family),
        attn_softcap=getattr(config, family.softcap[0], None) if family.softcap else None,
        final_softcap=getattr(config, family.softcap[1], None) if family.softcap else None,
        parallel=bool(getattr(config, family.parallel, False)) if family.parallel else False,
        **widths, sparse_layers=sparse_layers(config, family, len(layers)), layer_kinds=layer_kinds(config, family),
        unit_widths=tuple(in_features(get(layer, family.on_layer(kind).heads)) // n_heads
                          if family.on_layer(kind).heads else d_head  # (an MLP layer: no units)
                          for layer, kind in zip(layers, kinds)) if family.mixers else (),
        **multipliers(config, family), **_beside_sizes(layers, family, config.hidden_size),
    )
    check_copies(model, family, spec)
    _check_attention(get(model, family.layers), family, spec)
    for path, layout in family.fused:  # the fused projection holds exactly its branches' features
        names = [n for n, p in family.branches.items() if p == path]
        want = sum(spec.n_heads * d_head if n == "query" else spec.n_kv_heads * d_head if n in ("key", "value")
                   else spec.d_dense or spec.d_mlp for n in names)
        if weight_rows(get(first, path)).shape[0] != want or layout not in LAYOUTS:
            raise UnsupportedModelError(f"unsupported module: {path} has {weight_rows(get(first, path)).shape[0]} "
                                        f"outputs, not the {want} of {', '.join(names)} ({layout})")
    return spec


def _beside_sizes(layers, family: Family, d_model: int) -> dict[str, int]:
    """The units of the mixer beside attention (``Family.beside``: Falcon-H1's Mamba-2 blocks, their SSM heads) and
    their channels (``ModelSpec.n_beside``, ``beside_width``), each layer's block checked as its rule describes it
    (``ScanRule.check_block``); every layer's alike (one row of head scores per layer)."""
    mixer = family.beside
    if mixer is None:
        return {}
    shapes = [RULES[mixer.scan].check_block(layer, mixer, d_model, i) for i, layer in enumerate(layers)]
    for i, s in enumerate(shapes):
        if (s.heads, s.head_dim) != (shapes[0].heads, shapes[0].head_dim):
            raise UnsupportedModelError(
                f"unsupported model: layers[{i}].{mixer.module} has {s.heads} heads of {s.head_dim} channels, while "
                f"layers[0]'s has {shapes[0].heads} of {shapes[0].head_dim}; dpa scores every layer's units in one "
                "row of the same width")
    return dict(n_beside=shapes[0].heads, beside_width=shapes[0].head_dim) if shapes else {}


def _mlp_widths(layers, described: tuple[Family, ...], family: Family) -> dict[str, int]:
    """The widths of the rows of neuron and expert scores (``ModelSpec``'s d_mlp, n_experts, d_expert, d_shared,
    d_dense): the sparse layers' experts alike (``expert_sizes``), every dense MLP as wide; where both kinds of
    layer are there (Jamba's, Qwen's mlp_only_layers), a row as wide as the experts', a dense layer's neurons in
    its first columns."""
    sparse = [(i, layer) for i, (layer, on) in enumerate(zip(layers, described)) if on.moe is not None]
    dense = [(i, layer, on.neurons) for i, (layer, on) in enumerate(zip(layers, described))
             if on.mlp is not None and on.moe is None]
    n_experts, d_expert, d_shared = expert_sizes(sparse, family) if sparse else (0, 0, 0)
    d_dense = in_features(get(dense[0][1], dense[0][2])) if dense else 0  # (Mamba-2: no MLP)
    for i, layer, path in dense:  # one row of neuron scores per layer: every dense MLP as wide
        if in_features(get(layer, path)) != d_dense:
            raise UnsupportedModelError(
                f"unsupported model: layers[{i}].{path} reads {in_features(get(layer, path))} neurons, while "
                f"layers[{dense[0][0]}]'s reads {d_dense}; dpa scores every layer's neurons in one row of the same "
                "width, so MLPs of different widths (a model pruned layer by layer?) are not supported")
    d_sparse = n_experts * d_expert + d_shared
    if sparse and dense and d_dense > d_sparse:
        raise UnsupportedModelError(
            f"unsupported model: the dense layers' MLPs ({', '.join(str(i) for i, _, _ in dense)}) have {d_dense} "
            f"neurons, more than the {d_sparse} of the experts' layers; dpa writes a dense layer's neurons in the "
            "first columns of a row as wide as the experts' (every released model's dense MLPs are narrower), so a "
            "result could not say which columns are a routed expert's and which the shared expert's")
    return dict(n_experts=n_experts, d_expert=d_expert, d_shared=d_shared, d_mlp=d_sparse or d_dense,
                d_dense=d_dense if sparse and dense else 0)


# The attention modules' own copies of the head layout and soft-cap (what their forward runs with), by attribute name.
_ATTENTION_SETTINGS = {"is_causal": lambda s: True,  # (False: transformers' sdpa and flash kernels attend both ways)
                       "head_dim": lambda s: s.d_head, "head_size": lambda s: s.d_head,
                       "num_heads": lambda s: s.n_heads,
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
    rows = {"query": spec.n_heads * spec.d_head * (2 if family.output_gate else 1),  # (with a gate per head: twice)
            "key": spec.n_kv_heads * spec.d_head, "value": spec.n_kv_heads * spec.d_head}
    for i, layer in enumerate(layers):
        if not spec.mixes(i):  # an MLP layer (Nemotron-H's): no token mixer
            continue
        if spec.kind(i) != "attention":  # a mixer block (LFM2's convolution): its own checks
            mixer = family.mixer(spec.kind(i))
            if mixer.rule == "scan":  # a Mamba-2 or Mamba block: its units are n_heads groups of out_proj's input
                shape = RULES[mixer.scan].check_block(layer, mixer, spec.d_model, i)
                key = family.heads_key
                if shape.inner % spec.n_heads:
                    raise UnsupportedModelError(
                        f"unsupported model: layers[{i}].{mixer.heads} reads {shape.inner} channels, not a multiple of "
                        f"{key}={spec.n_heads}; dpa scores a {mixer.kind} layer's channels in the heads' place, "
                        "n_heads groups of them")
                if key != "num_attention_heads" and shape.heads != spec.n_heads:  # the units are the SSM heads
                    raise UnsupportedModelError(
                        f"unsupported model: layers[{i}].{mixer.module} has {shape.heads} state-space units (a Mamba-2 "
                        f"block's heads, a Mamba block's channels), while the config's {key} is {spec.n_heads}; dpa "
                        "scores each of them as a unit, so the two must agree (a config edited after loading?)")
                continue
            check_mixer(layer, mixer, spec.d_model, i)
            if spec.d_model != spec.n_heads * spec.d_head:
                raise UnsupportedModelError(
                    f"unsupported model: hidden_size={spec.d_model} is not num_attention_heads x head_dim = "
                    f"{spec.n_heads} x {spec.d_head}; dpa scores a {mixer.kind} layer's channels in the heads' place, "
                    "n_heads groups of head_dim channels, so the two must agree (they do in the released LFM2 models)")
            continue
        attn = get(layer, family.attention)
        for name, value in settings.items():
            have = getattr(attn, name, _ABSENT)
            if have is _ABSENT or isinstance(have, (nn.Module, torch.Tensor)):
                continue
            if name == "is_causal" and have is not True:
                raise UnsupportedModelError(
                    f"unsupported model: layers[{i}].{family.attention}.is_causal is {have!r}: transformers' attention "
                    "kernels read it, and the module would attend to later positions too, while dpa's rules, edges and "
                    "ablations are those of causal attention (a module edited after loading?)")
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
