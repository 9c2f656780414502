"""One recorded forward pass with each layer's internals, for the decomposition baselines.

DePass, IFR, norm-only, MLP-only and the attention maps read residual streams, the branch outputs
(q/k/v, gate/up pre-activations) and the attention probabilities. The forward pass is the model's
own (fused attention), recorded by ``dpa.instrument``; alpha is then recomputed from the recorded
queries and keys by ``dpa.explicit`` (pure tensor arithmetic), where it is needed.

The methods that recompute a layer from its weights (``decompose=True``) read where its norms sit
from the family description (``Layout``): a norm before a block (Llama's, Gemma's pre-norms), after
it (Gemma's and OLMo 2's post-norms), both or neither. Every norm is a frozen-scale diagonal map,
``gain(gamma) * r`` per position with r = 1/rms of the norm's input in the clean forward and gain the
family's (``rules.norm.GAIN``: gamma, or Gemma's 1 + gamma); the gated activation is the model's own
module. So a layer is, with everything nonlinear frozen,

    resid_mid  = resid_pre + post_attn * attention(pre_attn * resid_pre)
    resid_post = resid_mid + post_mlp * mlp(pre_mlp * resid_mid)

(an absent norm is the identity). ``forward_internals`` checks this against the recorded streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from ..explicit import probs_from_recording
from ..families import Family, get, layer_modules, norm_eps, weight_rows
from ..instrument import instrument, logits_at
from ..request import Request
from ..rules.attention import attention_output, heads
from ..rules.norm import GAIN, rms_scale


@dataclass(frozen=True)
class Layout:
    """Where a decoder layer's norms sit (paths relative to the layer; None: no norm there)."""

    pre_attn: str | None
    pre_mlp: str | None
    post_attn: str | None
    post_mlp: str | None


# Norm kinds that are a gain times r times x (no mean-centring, no bias): what a frozen norm diagonal covers.
DIAGONAL_NORMS = ("rms", "rms_1p")


def layout_problem(spec) -> str | None:
    """Why the methods that recompute a layer cannot read ``spec``'s layers from its family description (None:
    they can). They read separate q/k/v and gate/up projections, a gated MLP after attention, and norms that
    are a gain times r, before and/or after each block."""
    parts: Family = spec.parts
    if spec.mixed:
        return f"layers other than attention ({spec.non_attention})"
    if spec.n_beside:
        return f"a {spec.beside_kind} block beside attention on every layer"
    if getattr(parts, "moe", None) is not None:
        return "a mixture of experts in place of the MLP"
    if parts.activation is None:
        return "an MLP calling its activation as a function (no activation module to read)"
    if parts.norm_kind not in DIAGONAL_NORMS:
        return f"{parts.norm_kind} norms (the decomposition freezes norms of the kinds {', '.join(DIAGONAL_NORMS)})"
    if parts.fused:
        return f"fused projections ({', '.join(path for path, _ in parts.fused)})"
    if not parts.gated:
        return "a non-gated MLP"
    if parts.biases:
        return "biases on every projection and norm"
    if parts.positions:
        return "learned position embeddings"
    if spec.parallel:
        return "attention and MLP in parallel"
    if spec.residual_multiplier != 1 or spec.embedding_multiplier != 1:
        return "multipliers on the embeddings or the blocks' outputs (Granite's)"
    pre = tuple(parts.block_inputs)
    post = tuple(n for n in parts.norms if n not in pre)
    if len(pre) not in (0, 2):
        return f"{len(pre)} block input norm(s) (expected one per block or none)"
    if len(post) not in (0, 2):
        return f"{len(post)} norm(s) after the blocks (expected one per block or none)"
    if parts.mid != (pre[1] if pre else parts.mlp):  # the residual after attention feeds the MLP's norm, or the MLP
        return f"the residual after attention enters {parts.mid!r}, not the MLP's input norm"
    return None


def layout(parts: Family) -> Layout:
    """A family's ``Layout``: the block inputs are the pre-norms (attention's, then the MLP's); the other norms
    of ``Family.norms``, listed in the order the layer applies them, are the post-norms (attention's first)."""
    pre = tuple(parts.block_inputs) or (None, None)
    post = tuple(n for n in parts.norms if n not in parts.block_inputs) or (None, None)
    return Layout(pre_attn=pre[0], pre_mlp=pre[1], post_attn=post[0], post_mlp=post[1])


def recomputes(spec) -> bool:
    """Whether the methods that recompute a layer from its weights handle ``spec``'s family."""
    return layout_problem(spec) is None


def require_layout(spec, method: str) -> Layout:
    """The family's ``Layout``, or ``UnsupportedModelError`` naming the family and what the method cannot read."""
    problem = layout_problem(spec)
    if problem is not None:
        raise UnsupportedModelError(f"{method} recomputes each layer from its weights and does not handle the "
                                    f"layers of {spec.family}: {problem}")
    return layout(spec.parts)


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights (HF layout [out, in]) in the model's dtype."""

    v: Tensor  # [kv_head*d_head d_model]
    o: Tensor  # [d_model head*d_head]
    gate: Tensor  # [d_mlp d_model]
    up: Tensor
    down: Tensor  # [d_model d_mlp]
    n_heads: int
    n_kv_heads: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def d_head(self) -> int:
        return self.o.shape[1] // self.n_heads


@dataclass
class Layer:
    """One layer of the clean forward pass (batch of one). Every field after ``resid_mid`` is filled by
    ``forward_internals(..., decompose=True)`` only; a norm the layer does not have is None (the identity)."""

    probs: Tensor  # [1 head query key]
    resid_pre: Tensor  # [1 pos d_model]
    resid_mid: Tensor
    weights: LayerWeights | None = None
    v: Tensor | None = None  # [1 kv_head key d_head] value projection output
    gate: Tensor | None = None  # s [1 pos d_mlp]
    up: Tensor | None = None  # u
    act: Tensor | None = None  # act(s) [1 pos d_mlp], the model's own gated activation
    pre_attn: Tensor | None = None  # frozen norm diagonals gain * r [pos d_model], in float32 or wider
    pre_mlp: Tensor | None = None
    post_attn: Tensor | None = None
    post_mlp: Tensor | None = None
    attn_out: Tensor | None = None  # the blocks' outputs before any post-norm [pos d_model]
    mlp_out: Tensor | None = None

    @property
    def attn_write(self) -> Tensor:
        """What attention adds to the residual stream [pos d_model]."""
        return frozen(self.attn_out, self.post_attn)

    @property
    def mlp_write(self) -> Tensor:
        """What the MLP adds to the residual stream [pos d_model]."""
        return frozen(self.mlp_out, self.post_mlp)


@dataclass
class Internals:
    layers: list[Layer]
    embeddings: Tensor  # [1 pos d_model]
    resid_final: Tensor  # input of the final norm [1 pos d_model]


def frozen(x: Tensor, diagonal: Tensor | None) -> Tensor:
    """A frozen norm applied to x [pos ... d_model] (diagonal [pos d_model]; None: no norm), in x's dtype."""
    if diagonal is None:
        return x
    return x * diagonal.view(diagonal.shape[0], *(1,) * (x.dim() - 2), diagonal.shape[1]).to(x.dtype)


def norm_diagonal(norm: nn.Module, kind: str, x: Tensor) -> Tensor:
    """gain(gamma) * r for the norm's input x [pos d_model]: the norm with its scale frozen, [pos d_model]."""
    return GAIN[kind](norm.weight) * rms_scale(x, norm_eps(norm))


# A recomputed block may miss the recorded update by this share of it, plus a few roundings of the residual
# stream (bfloat16 rounds the streams themselves): a wrong layout misses by the order of the update itself.
_TOLERANCE, _ROUNDINGS = 0.02, 4


@torch.no_grad()
def forward_internals(model: nn.Module, req: Request, decompose: bool = False) -> Internals:
    """Record every layer of one clean forward pass (and keep the clean logits in ``req``): alpha and the
    residual streams, for every family.

    decompose: also the weights, branch outputs, frozen norms, activation and block outputs (``Layer``), for a
    family the recomputing methods handle, checked against the recorded residual streams
    (``UnsupportedModelError`` if the family's layout does not reproduce them)."""
    spec = req.spec
    where = require_layout(spec, "this method") if decompose else None
    mods = layer_modules(model, spec)
    with instrument(model, req, record={"resid", "mid", "branches", "rope"}) as session:
        hidden = session.forward()
        req.clean_logits = logits_at(model, req, hidden)
        rec = session.recording
        for (name, i), out in list(rec.branches.items()):  # a fused projection's whole output -> the branch's features
            if mods[i].columns.get(name) is not None and out.shape[-1] == weight_rows(mods[i].branches[name]).shape[0]:
                rec.branches[(name, i)] = mods[i].output(name, out)
        probs = [probs_from_recording(spec, model, req, rec, i) for i in range(spec.n_layers)]
    layers = [Layer(probs=probs[i], resid_pre=rec.resid[i], resid_mid=rec.mid.get(i, rec.resid[i + 1]))  # (a layer
              for i in range(spec.n_layers)]  # without an MLP: the residual after its attention is its output)
    cap = Internals(layers=layers, embeddings=rec.resid[0], resid_final=rec.resid[spec.n_layers])
    if decompose:
        _decompose(spec, cap, mods, rec.branches, where)
    return cap


def _decompose(spec, cap: Internals, mods: list, branches: dict, where: Layout) -> None:
    kind = spec.parts.norm_kind
    for i, (layer, m) in enumerate(zip(cap.layers, mods)):
        diagonal = lambda path, x: None if path is None else norm_diagonal(get(m.layer, path), kind, x)  # noqa: E731
        w = layer.weights = LayerWeights(v=m.branches["value"].weight, o=m.heads.weight, gate=m.branches["gate"].weight,
                                         up=m.branches["up"].weight, down=m.neurons.weight, n_heads=spec.n_heads,
                                         n_kv_heads=spec.n_kv_heads)
        layer.v = heads(branches[("value", i)], spec.n_kv_heads)
        layer.gate, layer.up = branches[("gate", i)], branches[("up", i)]
        layer.act = m.activation(layer.gate)
        layer.attn_out = attention_output(layer.probs.to(layer.v.dtype), layer.v)[0] @ w.o.T
        layer.mlp_out = (layer.act * layer.up)[0] @ w.down.T
        layer.pre_attn, layer.pre_mlp = diagonal(where.pre_attn, layer.resid_pre[0]), diagonal(where.pre_mlp,
                                                                                             layer.resid_mid[0])
        layer.post_attn, layer.post_mlp = diagonal(where.post_attn, layer.attn_out), diagonal(where.post_mlp,
                                                                                            layer.mlp_out)
    outputs = [layer.resid_pre[0] for layer in cap.layers[1:]] + [cap.resid_final[0]]
    for i, (layer, out) in enumerate(zip(cap.layers, outputs)):
        for before, write, after, block in ((layer.resid_pre[0], layer.attn_write, layer.resid_mid[0], "attention"),
                                            (layer.resid_mid[0], layer.mlp_write, out, "MLP")):
            update = (after - before).double()
            miss = (update - write.double()).norm()
            rounding = _ROUNDINGS * torch.finfo(after.dtype).eps * after.double().norm()
            if not miss <= _TOLERANCE * update.norm() + rounding:
                raise UnsupportedModelError(
                    f"recomputing layer {i}'s {block} block of {spec.family} from its weights misses the recorded "
                    f"residual stream by {float(miss / update.norm().clamp_min(1e-30)):.2g} of its update: the "
                    "family's layer layout is not what the decomposition baselines assume")


def probabilities(layers: list[Layer]) -> Tensor:
    """Attention probabilities of every layer [layer head query key] (batch of one)."""
    return torch.stack([layer.probs[0] for layer in layers])


def head_values(layer: Layer) -> Tensor:
    """v_{h,j} W_O^h: what head h writes (before any post-norm) when it attends fully to key j  [head key d_model]."""
    w = layer.weights
    v = layer.v[0].repeat_interleave(w.group, dim=0)  # [head key d_head]: query head h reads kv head h // group
    o = w.o.view(w.o.shape[0], w.n_heads, w.d_head)  # [d_model head d_head]
    return torch.einsum("hjd,mhd->hjm", v, o)
