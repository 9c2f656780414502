"""The blocks a family description (``registry.Family``) may name besides attention and a dense MLP: a mixture of
experts (``Experts``) and a token mixer other than attention (``Mixer``). Part of the family table: each fact says
who reads it, as ``Family``'s do (``tests/test_architecture.py`` checks the experts' names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block, relative to a decoder layer: the router (whose forward returns logits,
    top-k weights and top-k indices), the experts module (3-D weights, transformers' fused layout), and a
    shared expert with its sigmoid gate where the model has one (Qwen2-MoE), or without a gate beside the block
    (Granite 4.0-H's ``shared_mlp``, whose output the layer adds to the block's)."""

    router: str = "mlp.gate"
    #   read by: spec (LayerModules.router), experts
    experts: str = "mlp.experts"
    #   read by: spec (LayerModules.experts), experts
    shared: str | None = None
    #   read by: spec (LayerModules.shared), experts, families (checks its activation)
    shared_gate: str | None = None
    #   read by: spec (LayerModules.shared_gate), experts
    shared_parts: tuple[str, str, str, str] = ("gate_proj", "up_proj", "down_proj", "act_fn")  # the shared expert's
    # gate and up projections (one fused projection, [gate | up], where both name it), down projection, activation
    #   read by: spec (LayerModules.shared_glu: experts), families (checks them), expert_checks (shared_width)
    shared_beside: bool = False  # the shared expert is not inside the block: the layer adds its output to the
    # block's (Granite 4.0-H), so the MLP's write is the two outputs' sum (LayerModules.mlp_write)
    #   read by: spec (LayerModules.shared_beside: verify_circuit)
    glu: str = "act"  # act(gate) * up with the experts' act_fn; "clamped": GPT-OSS's (see experts.py)
    #   read by: experts, expert_checks
    biases: bool = False  # the experts' projections carry biases (in the bias share)
    #   read by: expert_checks (the experts' layout)
    router_bias: bool = False  # the router's logits carry a bias (a control input: see experts.py)
    #   read by: expert_checks (the router)
    transposed: bool = False  # the experts' weights are stored [in, out] with gate and up interleaved (GPT-OSS's):
    # the flags the experts module must carry (is_transposed, not is_concatenated), as its own forward reads them
    #   read by: expert_checks (the experts' layout)
    layers: str = "every"  # which layers hold the sparse block, from the config: "every" layer; "sparse_step", Qwen's
    # (not in mlp_only_layers, and (i + 1) % decoder_sparse_step == 0); "layers_num_experts", Jamba's (the config's
    # per-layer count above 1); "layer_type", those whose layer_types value is ``layer_type`` (Nemotron-H's "moe",
    # a layer of one block: the sparse block). The others hold a dense MLP at ``dense``'s paths
    #   read by: mixers (ModelSpec.sparse_layers)
    layer_type: str | None = None  # with layers "layer_type": the config's layer_types value of the sparse layers
    #   read by: mixers (ModelSpec.layer_kinds, ModelSpec.sparse_layers)
    latent: tuple[str, str] | None = None  # projections into and out of the space the experts work in (Nemotron 3's
    # fc1_latent_proj / fc2_latent_proj, linear: content; nn.Identity where the config sets no latent size)
    #   read by: spec (LayerModules.latent_out: spec, verify_circuit), expert_checks
    dense: tuple[str, str, str, str] | None = None  # a dense layer's gate and up projections, activation and down
    # projection, where ``layers`` leaves some layers dense (their neurons the first columns of the layer's row)
    #   read by: registry (Family.on_layer)


@dataclass(frozen=True)
class Mixer:
    """A token mixer in place of attention, on the layers the config's ``layer_types`` marks ``layer_type`` (LFM2's
    gated short convolution, book: gated-short-convolution). Its paths, relative to a decoder layer, take the
    attention's places in the layer's description (``Family.on_layer``): ``module`` the block, ``in_proj`` the fused
    projection of its factors (one block of ``d_model`` features per factor, in order), ``heads`` the output
    projection whose input the unit tap reads. Each factor carries the path weight of the attention branch whose
    part it plays (``factors``, in ``in_proj``'s order): in y = C * conv(B * x), as in a state-space model read as
    attention, C reads the mixed state like a query, B writes into it like a key and x is the content, like the
    value; so mu_query + mu_key + mu_value = 1 conserves the target on these blocks too (book: Euler's identity)."""

    kind: str  # the unit's kind in results and views ("conv")
    #   read by: spec (ModelSpec.layer_kinds: result, report, circuit_graph)
    layer_type: str  # the config's layer_types value of its layers
    #   read by: families (ModelSpec.layer_kinds)
    module: str
    #   read by: registry (Family.on_layer), families (checks)
    in_proj: str
    #   read by: registry (Family.on_layer), families (checks its size)
    factors: tuple[str, ...]
    #   read by: spec (LayerModules.columns: linearise), families (checks)
    heads: str
    #   read by: registry (Family.on_layer), families (checks)
    biases: tuple[str, ...] = ()  # config keys that must be off: a bias inside the product is not multilinear
    #   read by: families (checks the config)
    letter: str = "C"  # the unit's letter in labels (L0.C3, beside attention's L1.H2)
    #   read by: report, circuit_graph
    rule: str = "product"  # how dpa linearises the block: "product", mu on in_proj's blocks of columns (a gated
    # convolution: the block is multilinear in them, so its own autograd graph is the rule); "scan", dpa's Function
    # over the whole block (Mamba-2: the step, the SiLUs and the gated norm's scale frozen inside it, ssd.py)
    #   read by: spec (ModelSpec.scans: linearise, mib.forward), families (checks)
    book: str = "gated-short-convolution"  # the book's chapter that derives its rule, named in refusals
    #   read by: mixers (checks the config)
    scan: str = "ssd"  # with rule "scan", which block: "ssd" Mamba-2's (ssd.py), "selective" Mamba's (selective.py),
    # "delta" Qwen3-Next's Gated DeltaNet (delta.py)
    #   read by: scan_rules (linearise, families, explicit), spec (MIB's readers: Mamba-2's only), mib.forward
