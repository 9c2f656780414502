"""The family table: every model family dpa supports, as data. This is the one place a contributor edits.

A ``Family`` is a handful of facts, not code (HF's ``modular_*`` files show how little differs): module paths
inside a decoder layer, relative to it, and a few flags. Next to each fact, ``Family``'s docstring says who reads it;
``tests/test_architecture.py`` checks those names against the code. Adding a family means adding a description
here (and its derivation in the book; the blocks a description names, experts and mixers, in blocks.py), not a
code path; the lists of families in README.md, pyproject.toml and
the package docstring are checked against ``FAMILIES`` (``tests/test_docs.py``).

How a model is checked against its description: ``families.py``; the checked model as dpa reads it (sizes,
modules by layer): ``spec.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .blocks import Experts, Mixer  # the table's blocks: a mixture of experts, a token mixer other than attention


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
class Family:
    """One ``model_type``: module paths (relative to the model, or to a decoder layer) and facts. Under each fact,
    ``read by`` names the modules that read it (``spec (LayerModules.x: ...)``: looked up by ``spec.layer_modules``
    and read as that field by the modules named); ``tests/test_architecture.py`` checks every name.

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
    #   read by: families (the table's key, in every refusal), spec (ModelSpec.family)
    config_class: str  # transformers class whose defaults the allow-list diffs against
    #   read by: families (the config allow-list), request (checks a config before loading), tiny
    layers: str = "model.layers"
    #   read by: spec (ModelSpec.layers), families, mib.forward
    embed: str = "model.embed_tokens"
    #   read by: spec (ModelSpec.embed: instrument, backward, circuit_graph, baselines.gradient),
    #            spec (ModelSpec.embeddings: circuit_graph, mib.forward)
    final_norm: str = "model.norm"
    #   read by: spec (ModelSpec.final_norm: instrument freezes it, lens), families
    unembed: str = "lm_head"
    #   read by: spec (ModelSpec.unembed: instrument, batch, backward's target direction, lens, baselines.depass),
    #            families
    attention: str = "self_attn"
    #   read by: spec (LayerModules.attention: instrument, explicit, circuit_graph, mib.forward, verify_circuit)
    mlp: str | None = "mlp"  # None: the layers have no MLP (Mamba-2's: one block each; no neurons, no t_mid)
    #   read by: spec (LayerModules.mlp: circuit_graph, verify_circuit), spec (LayerModules.mlp_write: circuit_graph,
    #            mib.forward), baselines.internals
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    #   read by: spec (LayerModules.norms: linearise freezes each), families, attribute, baselines.internals
    norm_kind: str = "rms"
    #   read by: linearise, instrument, explicit, lens, circuit_graph, mib.forward, baselines.depass,
    #            baselines.internals, families
    block_inputs: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # () without pre-norms (OLMo 2)
    #   read by: spec (LayerModules.block_inputs: linearise, circuit_graph, mib.forward, verify_circuit),
    #            baselines.internals
    head_norms: tuple[str, str] | None = None  # (query, key) RMSNorm over d_head before RoPE
    #   read by: spec (LayerModules.head_norms: linearise, explicit), families
    head_norms_over: str = "head"  # what the q/k norms normalise: each head ("head") or the whole projection
    #   read by: explicit, mib.forward
    branches: dict[str, str] = field(default_factory=lambda: {
        "query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj"})
    #   read by: spec (LayerModules.branches: linearise, instrument, explicit, mib.forward, baselines.internals),
    #            families
    activation: str | None = "mlp.act_fn"  # None on a dense MLP: its forward calls the activation as a function
    #   read by: spec (LayerModules.activation: linearise, baselines.internals),
    #            module_checks (checks it computes its kind)
    heads: str = "self_attn.o_proj"
    #   read by: spec (LayerModules.heads: linearise's head tap, explicit, circuit_graph, mib.forward),
    #            families
    neurons: str | None = "mlp.down_proj"
    #   read by: spec (LayerModules.neurons: linearise's neuron tap, backward, circuit_graph), families
    mid: str | None = "post_attention_layernorm"  # None where the layers have no MLP
    #   read by: spec (LayerModules.mid: instrument records t_mid), baselines.internals
    biased_branches: tuple[str, ...] = ()  # branches whose projection may carry a bias
    #   read by: families (checks each projection's bias)
    biases: bool = False  # every projection and norm may carry a bias (GPT-2, GPT-NeoX): each is in the bias share
    #   read by: families, baselines.internals
    slides_every_layer: bool = False  # a set ``sliding_window`` applies to all layers (Mistral)
    #   read by: families (ModelSpec.sliding_windows)
    activation_config: tuple[str | None, tuple[tuple[str | None, str], ...]] = ("hidden_act", (("silu", "silu"),))
    # ^ the config key naming the activation, and each value this description linearises -> its kind (key None: the
    #   modelling code calls one activation whatever the config says, LFM2's F.silu: ((None, kind),))
    #   read by: families (ModelSpec.activation)
    fixed: tuple[tuple[str, object, str], ...] = ()  # config settings the description needs at these values, and why
    #   read by: families (checks the config)
    rope_layers: str | None = None  # config key listing, per layer, 1 where RoPE is applied (SmolLM3's NoPE layers)
    #   read by: families (ModelSpec.rotary_layers)
    fused: tuple[tuple[str, str], ...] = ()  # (module path, layout): projections holding several branches
    #   read by: spec (ModelSpec.columns), families, baselines.internals
    gated: bool = True  # False: the MLP is act(W1 x) (GPT-2), one branch s; gate and up are the same path on it
    #   read by: linearise, attribute, baselines.internals
    positions: str | None = None  # learned position embeddings (GPT-2's wpe): their share is reported apart
    #   read by: spec (ModelSpec.positions: linearise's position tap, request, circuit, circuit_graph), families,
    #            baselines.internals
    softcap: tuple[str, str] | None = None  # config keys of the attention scores' and the final logits' soft-caps
    #   read by: families (ModelSpec.attn_softcap, final_softcap)
    parallel: str | None = None  # config key: attention and MLP both read the layer's input (GPT-NeoX)
    #   read by: families (ModelSpec.parallel), mib.graph
    rotary: str | None = "model.rotary_emb"
    #   read by: spec (ModelSpec.rotates), instrument, rotary
    partial_rotary: bool = False  # the model's attention rotates only part of each head (partial_rotary_factor)
    #   read by: families (checks the config)
    moe: Experts | None = None  # a mixture of experts in place of the MLP (then no gate/up branches, no neurons path)
    #   read by: experts, spec, weights, families
    sinks: str | None = None  # per-head attention sink logits (GPT-OSS): a column in the softmax that no key owns
    #   read by: spec (LayerModules.sinks: explicit, linearise)
    rope_pairs: bool = False  # the rotary module's cos/sin hold one value per rotated pair (GPT-OSS), not per feature
    #   read by: explicit
    output_gate: bool = False  # each head's output is gated by sigmoid of its own second half of the query projection,
    # [q | gate] per head (Qwen3-Next's gated attention): the gate is a control, frozen (book: gated-delta-rule)
    #   read by: spec (ModelSpec.columns: linearise freezes the gate's features, explicit, mib.forward), families
    mixers: tuple[Mixer, ...] = ()  # token mixers other than attention, on the layers the config's layer_types marks
    #   read by: mixers (ModelSpec.layer_kinds, the config's checks), registry (Family.mixer: spec, families, mixers)
    beside: Mixer | None = None  # a token mixer beside attention on every layer (Falcon-H1's Mamba-2 block): both read
    # the layer's one normalised input and the layer adds their outputs; its units follow the attention heads in the
    # layer's row of head scores (ModelSpec.n_beside), and its Mixer.layer_type is unused
    #   read by: spec (LayerModules.beside: linearise), spec (ModelSpec.n_beside: linearise, backward, explicit),
    #            registry (Family.mixer), families, mixers
    scales: tuple[tuple[str, str], ...] = ()  # (where, attribute path relative to a layer): scalars a layer's forward
    # puts on a block's input or output (Falcon-H1's µP multipliers): "attention_in" on attention's input,
    # "attention_out" and "beside_out" on the two mixers' outputs, "mlp_out" on the MLP's; dpa's own sums of writes
    # (circuit graphs) read them, from the modules, on every call
    #   read by: spec (LayerModules.scale: circuit_graph, mib.forward, lens)
    key_multiplier: str | None = None  # the attention module's attribute its forward multiplies the keys by
    # (Falcon-H1's µP key_multiplier): the scores' scale, as dpa's explicit path recomputes them
    #   read by: explicit (scaling)
    attention_types: tuple[str, ...] = ("full_attention", "sliding_attention")  # the layer_types of its attention
    #   read by: families (checks the config)
    multipliers: tuple[tuple[str, str], ...] = ()  # (which, config key): scalars the model's forward multiplies by
    # (Granite's): "embedding", the embeddings after the embedding module; "residual", each block's output before it
    # joins the residual stream; "logits", the logits' divisor (logits_scaling); "lm_head", the logits' multiplier
    # (Falcon-H1's); "ids_only", an embedding multiplier the forward applies to ids' embeddings but not to
    # inputs_embeds (Falcon-H1's: dpa applies it to embeddings it hands the model). dpa's own sums of writes and its
    # logits use them (ModelSpec.embedding_multiplier, residual_multiplier, logits_scaling, logits_multiplier,
    # ids_only_multiplier: instrument); autograd sees them anyway
    #   read by: multipliers, spec (ModelSpec.residual_multiplier: circuit_graph, mib.forward, backward, lens,
    #            baselines.internals), spec (ModelSpec.logits_scaling: backward), spec (ModelSpec.logits: instrument,
    #            backward, lens, baselines.depass), spec (ModelSpec.ids_only_multiplier: instrument)
    rope_switch: tuple[str, str] | None = None  # (config key, value): the model rotates q and k only where the key
    # has this value (Granite's position_embedding_type "rope"; otherwise no RoPE at all, NoPE)
    #   read by: rope_config (rope_switched: the description without rotary where the config switches RoPE off)
    heads_key: str = "num_attention_heads"  # the config key of the units per layer (Mamba-2's SSM heads: num_heads)
    #   read by: families (ModelSpec.n_heads)
    context_key: str | None = "max_position_embeddings"  # the config key of the longest prompt; None: the model
    # reads no position (a recurrent model), so no length is refused for being too long
    #   read by: families (ModelSpec.max_positions), request (sizes_of)
    mlp_layers: str | None = None  # the config's layer_types value of layers whose one block is the MLP (Nemotron-H's
    # "mlp"): every layer then holds ONE block after its one norm, a token mixer or an MLP, at the same path (the
    # description's attention and MLP paths both name it); ``on_layer`` keeps the block the layer has, and a layer
    # of this type has no token mixer (its kind is MLP_LAYER: no units in its row of head scores)
    #   read by: registry (Family.on_layer), mixers (ModelSpec.layer_kinds)
    variant: tuple[str, Family] | None = None  # (config key, description): the description of this model_type's
    # models whose config sets the key to a non-zero value (Granite 4.0-H's num_local_experts: experts and a
    # shared MLP beside them, where the dense models have the MLP alone)
    #   read by: families (check_family: the description of a config)

    def mixer(self, kind: str) -> Mixer | None:
        """The ``Mixer`` of a layer whose token mixer is ``kind`` (or of the mixer beside attention); None for
        attention."""
        return next((m for m in (*self.mixers, *filter(None, [self.beside])) if m.kind == kind), None)

    def on_layer(self, kind: str, sparse: bool = True) -> Family:
        """The description of a layer whose token mixer is ``kind``: this one for attention; for a ``Mixer``'s, its
        paths in the attention's places (the module, the query/key/value branches on its fused ``in_proj``, the
        unit tap), no head norms, sinks or rotary. In a family of one block per layer (``mlp_layers``), a layer of
        kind MLP_LAYER has the MLP alone (no token mixer, its one norm the MLP's input), the others no MLP. A layer
        of a mixture of experts that is not ``sparse`` (``Experts.layers``) has the dense MLP at ``Experts.dense``."""
        if not sparse and self.moe is not None:
            gate, up, act, down = self.moe.dense
            self = replace(self, moe=None, branches={**self.branches, "gate": gate, "up": up}, activation=act,
                           neurons=down)
        if self.mlp_layers is not None:
            mlp = {name: path for name, path in self.branches.items() if name in ("gate", "up")}
            if kind == MLP_LAYER:  # (dense, or the sparse block: Nemotron-H's "moe" layers)
                return replace(self, attention=None, heads=None, branches=mlp, head_norms=None, sinks=None,
                               block_inputs=("", *self.block_inputs), mid=self.block_inputs[0], mixers=(),
                               mlp_layers=None)
            self = replace(self, mlp=None, neurons=None, activation=None, mid=None, mlp_layers=None, moe=None,
                           branches={name: path for name, path in self.branches.items() if name not in mlp})
        mixer = self.mixer(kind)
        if mixer is None:
            return self
        branches = {**self.branches, **{name: mixer.in_proj for name in ("query", "key", "value")}}
        return replace(self, attention=mixer.module, heads=mixer.heads, branches=branches, head_norms=None,
                       sinks=None, fused=self.fused + ((mixer.in_proj, "blocks"),), biased_branches=(),
                       softcap=None)

    def with_(self, **changes) -> Family:
        return replace(self, **changes)


MLP_LAYER = "mlp"  # the kind of a layer with no token mixer, its one block an MLP (Family.mlp_layers: Nemotron-H's)
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
    fixed=(("use_bidirectional_attention", False, "bidirectional attention is not linearised"),))

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
    activation_config=("activation_function", _GELU),
    fixed=(("add_cross_attention", False, "cross-attention is not linearised"),))

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
_QWEN_DENSE = ("mlp.gate_proj", "mlp.up_proj", "mlp.act_fn", "mlp.down_proj")  # Qwen's dense layers (mlp_only_layers)
QWEN3_MOE = QWEN3.with_(model_type="qwen3_moe", config_class="Qwen3MoeConfig", branches=_MOE_BRANCHES,
                        activation="mlp.experts.act_fn", neurons=None,
                        moe=Experts(layers="sparse_step", dense=_QWEN_DENSE))
QWEN2_MOE = QWEN3_MOE.with_(model_type="qwen2_moe", config_class="Qwen2MoeConfig", head_norms=None,
                            biased_branches=("query", "key", "value"),
                            moe=Experts(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate",
                                        layers="sparse_step", dense=_QWEN_DENSE))
OLMOE = OLMO2.with_(  # pre-norms as Llama (not OLMo 2's post-norms), q/k norms over the projection, experts
    model_type="olmoe", config_class="OlmoeConfig", norms=LLAMA.norms, block_inputs=LLAMA.block_inputs,
    mid=LLAMA.mid, branches=_MOE_BRANCHES, activation="mlp.experts.act_fn", neurons=None, moe=Experts(),
    fixed=(("clip_qkv", None, "a clamp of q, k and v is not linearised"),))

GPT_OSS = Family(  # experts with biases and a clamped swish GLU, a router with a bias, attention sinks, q/k/v/o
    model_type="gpt_oss", config_class="GptOssConfig", branches=_MOE_BRANCHES, activation=None,  # biases, local
    neurons=None, biases=True, sinks="self_attn.sinks", rope_pairs=True,  # and global layers, YaRN RoPE
    moe=Experts(router="mlp.router", glu="clamped", biases=True, router_bias=True, transposed=True))

LFM2 = QWEN3.with_(  # diff with Qwen 3: gated short convolutions in place of attention on the layers marked "conv",
    model_type="lfm2", config_class="Lfm2Config", final_norm="model.embedding_norm",  # the MLP's SiLU a function
    norms=("operator_norm", "ffn_norm"), block_inputs=("operator_norm", "ffn_norm"), mid="ffn_norm",
    head_norms=("self_attn.q_layernorm", "self_attn.k_layernorm"), heads="self_attn.out_proj", mlp="feed_forward",
    branches={"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
              "gate": "feed_forward.w1", "up": "feed_forward.w3"}, activation=None, neurons="feed_forward.w2",
    activation_config=(None, ((None, "silu"),)), attention_types=("full_attention",),  # no sliding window
    mixers=(Mixer("conv", "conv", module="conv", in_proj="conv.in_proj", factors=("key", "query", "value"),
                  heads="conv.out_proj", biases=("conv_bias",)),))

BAMBA = LLAMA.with_(  # diff with Llama: Mamba-2 blocks in place of attention on the layers marked "linear_attention"
    model_type="bamba", config_class="BambaConfig", final_norm="model.final_layernorm",  # (book: state-space-duality),
    norms=("input_layernorm", "pre_ff_layernorm"), block_inputs=("input_layernorm", "pre_ff_layernorm"),  # partial
    mid="pre_ff_layernorm", mlp="feed_forward", partial_rotary=True, attention_types=("full_attention",),  # RoPE
    branches={"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
              "gate": "feed_forward.gate_proj", "up": "feed_forward.up_proj"}, activation="feed_forward.act_fn",
    neurons="feed_forward.down_proj",
    mixers=(Mixer("scan", "linear_attention", module="mamba", in_proj="mamba.in_proj",
                  factors=("value", "key", "query"), heads="mamba.out_proj", biases=("mamba_proj_bias",), letter="S",
                  rule="scan", book="state-space-duality"),))

GRANITEMOEHYBRID = BAMBA.with_(  # diff with Bamba: Granite's multipliers (the embeddings', each block's output's, the
    model_type="granitemoehybrid", config_class="GraniteMoeHybridConfig",  # logits' divisor; attention's scale is
    final_norm="model.norm", norms=LLAMA.norms, block_inputs=LLAMA.block_inputs, mid=LLAMA.mid,  # its module's),
    mlp="shared_mlp", activation="shared_mlp.activation", neurons="shared_mlp.output_linear",  # the MLP's gate and
    branches={**_MOE_BRANCHES, "gate": "shared_mlp.input_linear", "up": "shared_mlp.input_linear"},  # up fused,
    fused=(("shared_mlp.input_linear", "blocks"),), partial_rotary=False,  # no RoPE unless the config asks for it
    multipliers=(("embedding", "embedding_multiplier"), ("residual", "residual_multiplier"),
                 ("logits", "logits_scaling")),
    rope_switch=("position_embedding_type", "rope"))
GRANITEMOEHYBRID = GRANITEMOEHYBRID.with_(variant=("num_local_experts", GRANITEMOEHYBRID.with_(
    # with experts (Granite 4.0-H Tiny, Small): the sparse block, and the dense MLP beside it as an ungated shared
    # expert (its fused [gate | up] input_linear), whose output the layer adds to the block's
    mlp="block_sparse_moe", branches=_MOE_BRANCHES, activation="block_sparse_moe.experts.act_fn", neurons=None,
    fused=(), moe=Experts(router="block_sparse_moe.router", experts="block_sparse_moe.experts", shared="shared_mlp",
                          shared_parts=("input_linear", "input_linear", "output_linear", "activation"),
                          shared_beside=True))))

MAMBA2 = Family(  # every layer one Mamba-2 block (Bamba's, book: state-space-duality) and no MLP: a pre-norm, the
    model_type="mamba2", config_class="Mamba2Config", layers="backbone.layers",  # block, the residual add; the
    embed="backbone.embeddings", final_norm="backbone.norm_f", attention="mixer", mlp=None, mid=None,  # units are
    norms=("norm",), block_inputs=("norm",), branches={name: "mixer.in_proj" for name in ("query", "key", "value")},
    activation=None, heads="mixer.out_proj", neurons=None, rotary=None, attention_types=(),  # its SSM heads, and no
    heads_key="num_heads", context_key=None,  # position is read, so no prompt is too long
    mixers=(Mixer("scan", "linear_attention", module="mixer", in_proj="mixer.in_proj",
                  factors=("value", "key", "query"), heads="mixer.out_proj", biases=("use_bias",), letter="S",
                  rule="scan", book="state-space-duality"),))

MAMBA = Family(  # Mamba-2's layout with Mamba's block (book: selective-scan): a state-space model per channel, so
    model_type="mamba", config_class="MambaConfig", layers="backbone.layers",  # each channel is a unit (the
    embed="backbone.embeddings", final_norm="backbone.norm_f", attention="mixer", mlp=None, mid=None,  # config's
    norms=("norm",), block_inputs=("norm",), branches={name: "mixer.in_proj" for name in ("query", "key", "value")},
    activation=None, heads="mixer.out_proj", neurons=None, rotary=None, attention_types=(),  # intermediate_size)
    heads_key="intermediate_size", context_key=None,
    mixers=(Mixer("scan", "linear_attention", module="mixer", in_proj="mixer.in_proj",
                  factors=("value", "key", "query"), heads="mixer.out_proj", biases=("use_bias",), letter="S",
                  rule="scan", book="selective-scan", scan="selective"),))

FALCON_MAMBA = replace(MAMBA, model_type="falcon_mamba", config_class="FalconMambaConfig")  # its block RMS-normalises
# the step's input, B and C (without a gain): read by the block's own rule, the rest is Mamba's

JAMBA = BAMBA.with_(  # diff with Bamba: Mamba's block (book: selective-scan; its step's input, B and C RMS-normalised
    model_type="jamba", config_class="JambaConfig", partial_rotary=False,  # with gains) in the Mamba-2 block's
    rotary=None,  # place, attention without any position embedding; experts (a softmax router, its top k weights not
    branches=_MOE_BRANCHES, activation="feed_forward.experts.act_fn", neurons=None,  # renormalised) on the layers
    moe=Experts(router="feed_forward.router", experts="feed_forward.experts", layers="layers_num_experts",  # the
                dense=("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.act_fn",  # config gives more
                       "feed_forward.down_proj")),  # than one (every other layer in the released models), a dense
    mixers=(Mixer("scan", "linear_attention", module="mamba", in_proj="mamba.in_proj",  # MLP on the others
                  factors=("value", "key", "query"), heads="mamba.out_proj", biases=("mamba_proj_bias",), letter="S",
                  rule="scan", book="selective-scan", scan="selective"),))

QWEN3_NEXT = QWEN3.with_(  # diff with Qwen 3: Gated DeltaNets in place of attention on the layers marked
    model_type="qwen3_next", config_class="Qwen3NextConfig",  # "linear_attention" (book: gated-delta-rule), each
    norm_kind="rms_1p", partial_rotary=True, output_gate=True,  # head's attention output gated by a sigmoid of its
    attention_types=("full_attention",),  # second half of q_proj, (1 + gamma) norms; dense MLPs (num_experts 0)
    mixers=(Mixer("delta", "linear_attention", module="linear_attn", in_proj="linear_attn.in_proj_qkvz",
                  factors=("query", "key", "value"), heads="linear_attn.out_proj", letter="D", rule="scan",
                  book="gated-delta-rule", scan="delta"),))
QWEN3_NEXT = QWEN3_NEXT.with_(variant=("num_experts", QWEN3_NEXT.with_(  # with experts (the released models): a
    # sparse block with a shared expert behind a sigmoid gate (Qwen2-MoE's) on every layer
    branches=_MOE_BRANCHES, activation="mlp.experts.act_fn", neurons=None,
    moe=Experts(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate", layers="sparse_step",
                dense=_QWEN_DENSE))))

NEMOTRON_H = Family(  # one block per layer after one norm (Mamba-2's layout), by the config's layer_types: a Mamba-2
    model_type="nemotron_h", config_class="NemotronHConfig", embed="model.embeddings",  # block (Bamba's rule), an
    final_norm="model.norm_f", attention="mixer", mlp="mixer", norms=("norm",), block_inputs=("norm",),  # attention
    branches={"query": "mixer.q_proj", "key": "mixer.k_proj", "value": "mixer.v_proj", "gate": "mixer.up_proj",
              "up": "mixer.up_proj"}, activation="mixer.act_fn", heads="mixer.o_proj", neurons="mixer.down_proj",
    mid=None, rotary=None, gated=False, attention_types=("full_attention",), mlp_layers=MLP_LAYER,  # block without
    activation_config=("mlp_hidden_act", (("relu2", "relu2"),)),  # position embeddings, or an MLP relu(up x)^2
    fixed=(("num_nextn_predict_layers", 0, "the multi-token prediction layers are not attributed"),),  # (non-gated)
    mixers=(Mixer("scan", "linear_attention", module="mixer", in_proj="mixer.in_proj",
                  factors=("value", "key", "query"), heads="mixer.out_proj", biases=("use_bias",), letter="S",
                  rule="scan", book="state-space-duality"),))
NEMOTRON_H = NEMOTRON_H.with_(  # Nemotron 3's "moe" layers: the sparse block as the layer's one block (Experts.layers
    branches={k: v for k, v in NEMOTRON_H.branches.items() if k not in ("gate", "up")},  # "layer_type"): a sigmoid
    activation="mixer.experts.act_fn", neurons=None,  # router (its correction bias and groups choose, no gradient),
    moe=Experts(router="mixer.gate", experts="mixer.experts", shared="mixer.shared_experts",  # non-gated relu^2
                shared_parts=("up_proj", "up_proj", "down_proj", "act_fn"),
                layers="layer_type", layer_type="moe", latent=("mixer.fc1_latent_proj", "mixer.fc2_latent_proj"),
                dense=("mixer.up_proj", "mixer.up_proj", "mixer.act_fn", "mixer.down_proj")))  # experts in a latent
# space, a non-gated shared expert inside the block; "mlp" layers keep the dense MLP (Experts.dense)

FALCON_H1 = BAMBA.with_(  # diff with Bamba: attention AND a Mamba-2 block on every layer, side by side (book:
    model_type="falcon_h1", config_class="FalconH1Config", mixers=(),  # parallel-mixers), reading the one normalised
    partial_rotary=False, attention_types=("hybrid",), key_multiplier="key_multiplier",  # input; the units of a
    scales=(("attention_in", "attention_in_multiplier"), ("attention_out", "attn_out_multiplier"),
            ("beside_out", "ssm_out_multiplier"), ("mlp_out", "feed_forward.down_multiplier")),
    # layer: its attention heads, then
    multipliers=(("embedding", "embedding_multiplier"), ("ids_only", "embedding_multiplier"),  # its SSM heads. µP's
                 ("lm_head", "lm_head_multiplier")),
    beside=Mixer("scan", "hybrid", module="mamba", in_proj="mamba.in_proj", factors=("value", "key", "query"),  # other
                 heads="mamba.out_proj", biases=("mamba_proj_bias",), letter="S", rule="scan",  # scalars (in the
                 book="state-space-duality"))  # layer's and blocks' forwards: attention's input and output, the key,
# the SSM's input and output, in_proj's five groups of features (mup_vector), the MLP's gate (inside its activation)
# and down projection) are linear, seen by autograd; dpa's own sums of writes would need them, so circuit graphs, MIB's
# graph, the lens and the baselines that recompute layers refuse this family by name (``spec.ModelSpec.n_beside``)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, OLMO2, PHI3,
                                                          SMOLLM3, GPT2, GPT_NEOX, MIXTRAL, QWEN2_MOE,
                                                          QWEN3_MOE, OLMOE, GPT_OSS, LFM2, BAMBA,
                                                          GRANITEMOEHYBRID, MAMBA2, MAMBA, FALCON_MAMBA,
                                                          JAMBA, QWEN3_NEXT, NEMOTRON_H, FALCON_H1)}
# Each unit kind's letter in labels (L3.H2, L5.N812, L1.E3, a hybrid's convolution unit L0.C3), the mixers' from
# their descriptions.
_ALL_MIXERS = [m for f in FAMILIES.values() for m in (*f.mixers, *filter(None, [f.beside]))]
MIXER_KINDS: tuple[str, ...] = tuple(dict.fromkeys(m.kind for m in _ALL_MIXERS))
MIXER_RULES: dict[str, str] = {m.kind: m.rule for m in _ALL_MIXERS}  # kind -> Mixer.rule
UNIT_LETTERS: dict[str, str] = {"head": "H", "neuron": "N", "expert": "E", **{m.kind: m.letter for m in _ALL_MIXERS}}
