"""A checked model as dpa reads it: its sizes (``ModelSpec``) and each layer's modules (``LayerModules``), looked up
by the family table's paths (``registry.py``); how to read a projection's weight, a norm's epsilon
(``module_access.py``, re-exported here). The checks that make a model a ``ModelSpec`` are in ``families.py``
(``spec_for``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import UnsupportedModelError
from .module_access import (get, in_features, is_projection, norm_eps,  # noqa: F401 (re-exported)
                            own_forward, weight_rows, why_not_projection)
from .registry import MLP_LAYER, Family
from .ssd_shape import factor_columns


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
    sparse_layers: tuple[bool, ...] = ()  # per layer, whether its MLP is the sparse block (Experts.layers); empty:
    # every layer's MLP is the family's (sparse in a mixture of experts)
    d_dense: int = 0  # where some layers are dense and some sparse: the dense MLPs' neurons, the first columns of
    # their layer's row of neuron scores (as wide as the experts', d_mlp)
    layer_kinds: tuple[str, ...] = ()  # per layer: "attention", or the kind of its Mixer (LFM2's "conv"); empty: all
    # attention. A mixer layer's units are scored in the heads' place: n_heads groups of its output projection's input
    unit_widths: tuple[int, ...] = ()  # per layer, the channels of one unit at its tap (empty: d_head on every layer)
    embedding_multiplier: float = 1.0  # the model's forward multiplies the embeddings by it (Granite's multipliers,
    residual_multiplier: float = 1.0  # Family.multipliers), each block's output before the residual add by it, and
    logits_scaling: float = 1.0  # divides the logits by it: what dpa computes itself (sums of writes, logits) does too
    logits_multiplier: float = 1.0  # multiplies the logits by it (Falcon-H1's lm_head_multiplier)
    ids_only_multiplier: float = 1.0  # the part of embedding_multiplier the model's forward applies to the embeddings
    # it looks up from ids only, not to inputs_embeds given to it (Falcon-H1's): dpa multiplies embeddings it hands
    # the model by it (the session's forward), so that both ways in are the same model
    n_beside: int = 0  # units of the token mixer beside attention on every layer (Family.beside, Falcon-H1's SSM
    # heads): columns n_heads .. n_heads + n_beside - 1 of each layer's row of head scores
    beside_width: int = 0  # channels of one of those units at its tap (the beside block's out_proj input)

    @property
    def row_width(self) -> int:
        """The columns of a layer's row of head scores: the attention heads (or a mixer's units), then the units of
        the mixer beside attention where there is one (Falcon-H1's)."""
        return self.n_heads + self.n_beside

    def beside_unit(self, column: int) -> int | None:
        """Column ``column`` of a layer's row of head scores as the index of a unit of the mixer beside attention
        (Falcon-H1's SSM head ``column - n_heads``); None where it is an attention head (or there is no such mixer)."""
        return column - self.n_heads if self.n_beside and column >= self.n_heads else None

    @property
    def beside_kind(self) -> str | None:
        """The unit kind of the mixer beside attention (``Family.beside``), None without one."""
        return self.parts.beside.kind if self.n_beside else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the model scales its logits (or a direction read from the unembedding): divided by
        ``logits_scaling`` (Granite), times ``logits_multiplier`` (Falcon-H1); ``x`` itself where neither."""
        x = x if self.logits_scaling == 1 else x / self.logits_scaling
        return x if self.logits_multiplier == 1 else x * self.logits_multiplier

    def unit_width(self, index: int) -> int:
        """Layer ``index``'s channels per unit at its tap (the output projection's input): d_head on attention, the
        mixer block's inner width / n_heads on a Mamba-2 block's."""
        return self.unit_widths[index] if self.unit_widths else self.d_head

    def kind(self, index: int) -> str:
        """Layer ``index``'s token mixer: "attention" or a ``Mixer``'s kind."""
        return self.layer_kinds[index] if self.layer_kinds else "attention"

    def scans(self, index: int) -> bool:
        """Whether layer ``index``'s token mixer is a block dpa's Function linearises whole (``Mixer.rule`` "scan",
        Mamba-2): its edge scores are its scan's terms (``ssd.scan_edges``); MIB's graph reads its in_proj's features
        per reader (``factor_columns``)."""
        mixer = self.parts.mixer(self.kind(index))
        return mixer is not None and mixer.rule == "scan"

    def mixes(self, index: int) -> bool:
        """Whether layer ``index`` has a token mixer (attention or a ``Mixer``): not where its one block is an MLP
        (``Family.mlp_layers``, Nemotron-H's), whose row of head scores holds no unit."""
        return self.kind(index) != MLP_LAYER

    def on_layer(self, index: int) -> Family:
        """Layer ``index``'s description: its token mixer's paths and its MLP's (``Family.on_layer``)."""
        return self.parts.on_layer(self.kind(index), not self.sparse_layers or self.sparse_layers[index])

    def has_mlp(self, index: int) -> bool:
        """Whether layer ``index`` has an MLP (or experts): not Mamba-2's layers, nor Nemotron-H's mixer layers."""
        return self.on_layer(index).mlp is not None

    def has_experts(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is the sparse block: every layer's in a mixture of experts, but the dense
        layers' of a model that mixes both (``sparse_layers``: Jamba's, Qwen's mlp_only_layers)."""
        return self.n_experts > 0 and self.has_mlp(index) and (not self.sparse_layers or self.sparse_layers[index])

    def neuron_width(self, index: int) -> int:
        """Layer ``index``'s neurons: the first columns of its row of neuron scores (``d_dense`` on a dense layer
        of a model that mixes both layouts, none on a layer without an MLP)."""
        return 0 if not self.has_mlp(index) else self.d_dense if self.d_dense and not self.has_experts(index) \
            else self.d_mlp  # (the experts' row is never narrower than a dense layer's: families._mlp_widths)

    @property
    def neurons_that_exist(self) -> torch.Tensor:
        """[layer d_mlp] bool: the columns of each layer's row of neuron scores that are neurons (``neuron_width``:
        none on a layer without an MLP, a dense layer's first columns in a mixed layout)."""
        return torch.arange(self.d_mlp)[None, :] < torch.tensor([self.neuron_width(i) for i in range(self.n_layers)],
                                                                 dtype=torch.long)[:, None]

    def mlp_units(self, index: int) -> tuple[str, int]:
        """The kind and count of layer ``index``'s units in its MLP block, as circuit graphs read them: its experts
        (the routed ones, then the shared one) on a sparse layer, its neurons on a dense one."""
        return ("expert", self.expert_slots) if self.has_experts(index) else ("neuron", self.neuron_width(index))

    @property
    def dense_layers(self) -> list[int] | None:
        """The layers of a mixture of experts whose MLP is dense (``Attribution.dense_layers``); None where every
        layer's MLP is the sparse block, or there are no experts."""
        return [i for i in self.neuron_layers if not self.has_experts(i)] if self.n_experts and self.d_dense else None

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the sparse block (``has_experts``)."""
        return tuple(i for i in range(self.n_layers) if self.has_experts(i))

    def lacks(self, kind: str, layer: int, unit: int | None = None) -> str | None:
        """Why layer ``layer`` has no unit of ``kind`` ("head": a token mixer's unit; "neuron"; "expert"), or not
        ``unit`` (a dense layer's neurons beyond its width), for the refusal of a selection of one (a verification,
        a neuron's logit effect), the unit named where given; None where it has it."""
        if (kind == "head" and not self.mixes(layer) or kind in ("neuron", "expert") and self.d_mlp
                and not self.has_mlp(layer) or kind == "expert" and self.n_experts and not self.has_experts(layer)):
            return lacking(kind, layer, dense=self.has_mlp(layer)) + ("" if unit is None else f" {unit}")
        if kind == "neuron" and unit is not None and self.d_mlp and unit >= self.neuron_width(layer):
            return narrower(layer, self.neuron_width(layer), unit)
        return None

    @property
    def neuron_layers(self) -> tuple[int, ...]:
        """The layers with MLP neurons (``has_mlp``): none where no layer has an MLP (Mamba-2's), Nemotron-H's MLP
        layers alone."""
        return tuple(i for i in range(self.n_layers) if self.d_mlp and self.has_mlp(i))

    @property
    def mixing_layers(self) -> tuple[int, ...]:
        """The layers with a token mixer (``mixes``): every layer but Nemotron-H's MLP layers."""
        return tuple(i for i in range(self.n_layers) if self.mixes(i))

    @property
    def scan_layers(self) -> tuple[int, ...]:
        """The layers whose token mixer dpa's Function linearises whole (``scans``)."""
        return tuple(i for i in range(self.n_layers) if self.scans(i))

    @property
    def unit_kinds(self) -> list[str] | None:
        """Per layer, the kind of unit its row of head scores holds ("head", or a mixer's kind); None where every
        layer is attention (``Attribution.layer_kinds``)."""
        return ["head" if k == "attention" else k for k in self.layer_kinds] if self.mixed else None

    @property
    def mixed(self) -> bool:
        """Whether some layer's token mixer is not attention (a hybrid model)."""
        return any(k != "attention" for k in self.layer_kinds)

    @property
    def non_attention(self) -> str:
        """The layers that are not attention, for refusals: "scan layers", "conv layers", and "layers whose one
        block is an MLP" (Nemotron-H's)."""
        kinds = sorted(set(self.layer_kinds) - {"attention", MLP_LAYER})
        parts = ([f"{', '.join(kinds)} layers"] if kinds else []) + (
            ["layers whose one block is an MLP"] if MLP_LAYER in self.layer_kinds else [])
        return " and ".join(parts)

    @property
    def expert_slots(self) -> int:
        """Expert scores per layer: the routed experts, then the shared expert where there is one."""
        return self.n_experts + (1 if self.d_shared else 0)

    def rotates(self, index: int) -> bool:
        return self.parts.rotary is not None and (not self.rotary_layers or self.rotary_layers[index])

    def columns(self, name: str, kind: str = "attention") -> slice | torch.Tensor | None:
        """Which output features of its projection a branch is, on a layer whose token mixer is ``kind``: None where
        the projection is the branch's alone, else a slice (``blocks``) or an index (``per_head``) into the fused
        projection's output. A mixer's factors are blocks of d_model features in its ``factors``' order."""
        if kind != "attention" and name in ("query", "key", "value"):
            k = self.parts.mixer(kind).factors.index(name)
            return slice(k * self.d_model, (k + 1) * self.d_model)
        if self.parts.output_gate and name in ("query", "output_gate"):  # [q | gate] of head 0, head 1, ...
            return self._per_head(("query", "output_gate"), name)
        path = self.parts.branches.get(name)  # (None: a dense layer's own MLP in a mixture of experts, Experts.dense)
        layout = dict(self.parts.fused).get(path)
        if layout is None:
            return None
        if name in ("gate", "up"):
            width = self.d_dense or self.d_mlp  # (a fused dense MLP on the dense layers of a mixed layout)
            return slice(0, width) if name == "gate" else slice(width, 2 * width)
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        if layout == "blocks":
            return {"query": slice(0, q), "key": slice(q, q + kv), "value": slice(q + kv, q + 2 * kv)}[name]
        return self._per_head(("query", "key", "value"), name)  # per_head: [q k v] of head 0, head 1, ...

    def _per_head(self, parts: tuple[str, ...], name: str) -> torch.Tensor:
        """The output features of part ``name`` of a projection laid out per head, each head's ``parts`` in turn."""
        offset = parts.index(name) * self.d_head
        return (torch.arange(self.n_heads)[:, None] * len(parts) * self.d_head + offset
                + torch.arange(self.d_head)).flatten()

    # Module access by the description's paths: the only place module names are read.
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return get(model, self.parts.layers)

    def embed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.embed)

    def final_norm(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.final_norm)

    def unembed(self, model: nn.Module) -> nn.Module:
        return get(model, self.parts.unembed)

    def embeddings(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings as the model's forward uses them: the embedding module's output, times the model's
        embedding multiplier where it has one (Granite's)."""
        x = self.embed(model)(ids)
        return x if self.embedding_multiplier == 1 else x * self.embedding_multiplier

    def positions(self, model: nn.Module) -> nn.Module | None:
        """The learned position embeddings, where the model has them (GPT-2)."""
        return get(model, self.parts.positions) if self.parts.positions else None

    def base(self, model: nn.Module) -> nn.Module:
        """The decoder stack (``model.model``): called with ids or embeddings, returns hidden states."""
        return get(model, self.parts.layers.rsplit(".", 1)[0])

    def device(self, model: nn.Module) -> torch.device:
        return self.embed(model).weight.device


def one_mixer_per_layer(spec: ModelSpec, what: str) -> None:
    """Refuse by name what reads one token mixer per layer (``what``: "activation patching", "ablating heads", ...)
    on a model with a mixer beside attention (``Family.beside``, Falcon-H1's), whose head ablations would miss that
    block's units. dpa.attribute, dpa.circuit, MIB's graph, the lens, the evaluation's input ablations and the
    gradient baselines read these models."""
    if spec.n_beside:
        raise UnsupportedModelError(
            f"{what} not yet supported on {spec.family}: its layers hold attention and a {spec.beside_kind} block "
            "side by side (book: parallel-mixers), and these read one token mixer per layer; dpa.attribute (its "
            "scores, edges and top components), dpa.circuit and its verification, MIB's graph, the lens, the "
            "evaluation's input ablations and the gradient baselines do")


def lacking(kind: str, layer: int, dense: bool = False) -> str:
    """The words of a refusal of a unit a layer lacks (``ModelSpec.lacks``; the widget's static page, from the layer's
    kind alone)."""
    return (f"layer {layer} has no token mixer (its one block is an MLP), so no head or unit" if kind == "head" else
            f"layer {layer}'s MLP is dense (the experts are on other layers), so no expert" if dense else
            f"layer {layer} has no MLP (its one block is a token mixer), so no {kind}")


def narrower(layer: int, width: int, neuron: int) -> str:
    """The words of a refusal of a neuron past a dense layer's width in a mixed layout (``ModelSpec.lacks``; the
    widget's static page, from the result's ``dense_layers`` and ``d_dense``)."""
    return f"layer {layer}'s MLP is dense, with {width} neurons (fewer than the experts' layers), so no neuron {neuron}"


def unread_parameters(layer: nn.Module, family: Family) -> list[str]:
    """A decoder layer's parameters under none of the modules its description names (its token mixer, its MLP or
    experts, its norms): what dpa would neither linearise nor score. transformers' layer forwards run such modules
    on flags of their own (Granite's ``block_sparse_moe`` whenever its layer's ``has_experts``), whatever the
    config says now, so a layer holding one is refused by name (families)."""
    moe = family.moe
    paths = {family.attention or "", family.mlp or "", family.heads or "", *family.norms, *family.branches.values(),
             family.beside.module if family.beside else "",
             *(family.head_norms or ()), *([family.neurons] if family.neurons else []),
             *([moe.router, moe.experts, moe.shared or "", moe.shared_gate or ""] if moe else [])} - {""}
    return [name for name, _ in layer.named_parameters()
            if not any(name == p or name.startswith(p + ".") for p in paths)]


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer's modules, looked up once from the description's paths."""

    layer: nn.Module
    attention: nn.Module | None  # None where the layer has no token mixer (Nemotron-H's MLP layers)
    norms: tuple[nn.Module, ...]
    block_inputs: tuple[nn.Module | None, ...]  # (attention's, MLP's); None for a block the layer lacks
    head_norms: tuple[nn.Module, ...]
    branches: dict[str, nn.Module]
    activation: nn.Module | None  # None where the experts' GLU is written inline (GPT-OSS)
    heads: nn.Module | None  # None where the layer has no token mixer
    neurons: nn.Module | None  # None for a mixture of experts (its neurons are inside ``experts``)
    mid: nn.Module | None  # None where the layer has no MLP (Mamba-2's)
    mlp: nn.Module | None = None  # the MLP (or sparse) block, called on its normalised input by the circuit graphs
    post_norms: tuple[nn.Module | None, nn.Module | None] = (None, None)  # after the attention's and the MLP's
    # output projections (Gemma, OLMo 2): a unit's write passes them, frozen
    columns: dict[str, slice | torch.Tensor | None] = field(default_factory=dict)  # ModelSpec.columns
    router: nn.Module | None = None
    experts: nn.Module | None = None
    shared: nn.Module | None = None  # the shared expert (a GLU MLP) and its gate
    shared_gate: nn.Module | None = None
    shared_beside: bool = False  # the layer adds the shared expert's output to the block's (Experts.shared_beside)
    sinks: torch.Tensor | None = None  # attention sink logits [head] (GPT-OSS)
    parts_of_shared: tuple[str, str, str, str] = ()  # Experts.shared_parts, relative to ``shared``
    kind: str = "attention"  # the layer's token mixer: "attention", or a Mixer's kind (then ``attention`` is that
    # block, its query/key/value branches its factors' columns of one projection, ``heads`` its output projection)
    gated: bool = True  # the MLP, the experts and the shared expert are GLUs (False: act(up x), Nemotron-H's)
    latent_out: nn.Module | None = None  # the projection out of the experts' latent space (Experts.latent), None
    # where the experts write the residual stream's space themselves
    beside: LayerModules | None = None  # the token mixer beside attention (Family.beside, Falcon-H1's Mamba-2 block),
    # as a layer of its kind would hold it: its block, its factors' columns of in_proj, its output projection
    scales: tuple[tuple[str, str], ...] = ()  # Family.scales

    def scale(self, where: str) -> float:
        """The scalar the layer's forward puts at ``where`` (``Family.scales``: "attention_in", "attention_out",
        "beside_out", "mlp_out"), read from its module now (an edit after loading is the model's); 1 where none."""
        path = dict(self.scales).get(where)
        if path is None:
            return 1.0
        owner, _, name = path.rpartition(".")
        value = getattr(get(self.layer, owner) if owner else self.layer, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModelError(f"unsupported module: the layer's {path} is {value!r}, not a number; dpa "
                                        "reads the scalars a layer's forward multiplies by as numbers")
        return float(value)

    def shared_glu(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared expert's gate and up pre-activations on ``x``, from its own projections (``shared_parts``): two
        projections, or one fused one whose output is [gate | up] (Granite's input_linear)."""
        parts = self.parts_of_shared
        if not self.gated:  # one projection s = up x, act(s) (Nemotron-H's): no up factor
            return get(self.shared, parts[1])(x), None
        if parts[0] == parts[1]:
            return get(self.shared, parts[0])(x).chunk(2, dim=-1)
        return get(self.shared, parts[0])(x), get(self.shared, parts[1])(x)

    def shared_down(self, a: torch.Tensor) -> torch.Tensor:
        return get(self.shared, self.parts_of_shared[2])(a)

    def shared_act(self) -> nn.Module:
        return get(self.shared, self.parts_of_shared[3])

    def mlp_write(self, h: torch.Tensor) -> torch.Tensor:
        """What the layer's MLP adds on its normalised input ``h`` (before a post-norm and the residual multiplier):
        the block's output, plus the shared expert's where the layer adds it beside the block (Granite's)."""
        y = self.mlp(h)
        y = y[0] if isinstance(y, tuple) else y
        return y + self.shared(h) if self.shared_beside else y

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
        column = down[j] if getattr(mods.experts, "is_transposed", False) else down[:, j]
        return column if mods.latent_out is None else weight_rows(mods.latent_out) @ column  # (out of the latent
        # space the experts work in: Nemotron 3's)
    return weight_rows(get(mods.shared, mods.parts_of_shared[2]))[:, neuron - spec.n_experts * spec.d_expert]


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
    out = [_layer_modules(layer, spec, i) for i, layer in enumerate(spec.layers(model))]
    _MODULES[model] = (spec, out)
    return out


def _layer_modules(layer: nn.Module, spec: ModelSpec, index: int, kind: str | None = None) -> LayerModules:
    """Layer ``index``'s modules; with ``kind``, those of its mixer of that kind beside attention (``Family.beside``)
    as a layer of that kind would hold them."""
    beside = kind is None and spec.n_beside and spec.kind(index) == "attention"
    kind = kind or spec.kind(index)
    p = spec.parts.on_layer(kind) if kind != spec.kind(index) else spec.on_layer(index)
    columns = {name: spec.columns(name, kind) for name in p.branches}
    if p.output_gate and kind == "attention":  # the query projection's gate features (Qwen3-Next's gated attention)
        columns["output_gate"] = spec.columns("output_gate")
    mixer = spec.parts.mixer(kind)
    if mixer is not None and mixer.scan == "ssd" and mixer.rule == "scan":
        # a Mamba-2 block: in_proj's [z | xBC | dt]
        columns.update(factor_columns(get(layer, p.attention)))  # as the readers of MIB's graph see it
    return LayerModules(
        layer=layer, attention=get(layer, p.attention) if p.attention else None,
        norms=tuple(get(layer, n) for n in p.norms),
        block_inputs=tuple(get(layer, n) if n else None for n in p.block_inputs),  # "": the layer has no such block
        head_norms=tuple(get(layer, n) for n in (p.head_norms or ())),
        branches={name: get(layer, path) for name, path in p.branches.items()},
        activation=get(layer, p.activation) if p.activation else None, heads=get(layer, p.heads) if p.heads else None,
        neurons=get(layer, p.neurons) if p.neurons else None, mid=get(layer, p.mid) if p.mid else None,
        mlp=get(layer, p.mlp) if p.mlp else None,
        post_norms=post_norms(layer, p),
        columns=columns,
        sinks=get(layer, p.sinks.rsplit(".", 1)[0]).get_parameter(p.sinks.rsplit(".", 1)[1]) if p.sinks else None,
        kind=kind, gated=p.gated,
        beside=_layer_modules(layer, spec, index, spec.beside_kind) if beside else None, scales=p.scales,
        **({} if p.moe is None else dict(
            latent_out=_latent_out(get(layer, p.moe.latent[1])) if p.moe.latent else None,
            router=get(layer, p.moe.router), experts=get(layer, p.moe.experts),
            shared=get(layer, p.moe.shared) if p.moe.shared else None,
            shared_gate=get(layer, p.moe.shared_gate) if p.moe.shared_gate else None,
            shared_beside=p.moe.shared_beside, parts_of_shared=p.moe.shared_parts)))


def _latent_out(module: nn.Module) -> nn.Module | None:
    """The projection out of the experts' latent space, None where it is the identity (no latent size set)."""
    return None if isinstance(module, nn.Identity) else module
