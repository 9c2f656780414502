"""The hand-derived backward rules of the book, written out as the proof the library is tested against.

The library computes DPA as one autograd backward through the linearised model (``dpa.instrument``).
These are the rules the book derives block by block -- frozen RMSNorm, GLU content/control, the
softmax delta, the RoPE transpose, GQA grouping, q/k norms -- and a top-down sweep that chains them
(book: end-to-end). ``test_glu.py``, ``test_attention.py``, ``test_norm.py`` and ``test_rope.py``
check each against torch.autograd on random tensors, and ``test_attribute.py`` proves the sweep
equal to ``dpa.attribute`` path by path on every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..families import ModelSpec
from .attention import attention_mask
from .attention import heads as _heads
from .attention import merge as _merge
from .norm import apply_norm, rms_scale  # noqa: F401  (re-exported for the rule tests)
from .rope import apply_rope, rotate_half


# --- RMSNorm (book: rmsnorm) ---

def pull_back_norm(target: Tensor, gamma: Tensor, scale: Tensor) -> Tensor:
    """Transpose of the frozen norm gamma * r * x: the same diagonal map, gamma * r * t."""
    return target * (gamma * scale)


# --- RoPE (book: rope) ---

def apply_rope_transpose(a: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """R^T a: pull a target on the rotated vector back to the unrotated one."""
    return a * cos - rotate_half(a * sin)


def glu_forward(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute the block: returns (s, u, out) for x [batch pos d_model]."""
    s = x @ w_gate.T  # [batch pos d_mlp]
    u = x @ w_up.T
    out = (F.silu(s) * u) @ w_down.T
    return s, u, out


def propagate_glu(target: Tensor, s: Tensor, u: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  gamma: Tensor, scale: Tensor, *, up: float = 0.5, gate: float = 0.5) -> tuple[Tensor, Tensor]:
    """g_GLU(t) = (mu_up c_up W_U + mu_gate c_gate W_G) * gamma * r.

    Returns (g, lam): the target on the block's residual input and t W_D per neuron.
    """
    lam = target @ w_down  # [batch pos d_mlp]
    coef = 0.0
    if up:
        coef = (up * lam * F.silu(s)) @ w_up
    if gate:
        coef = coef + (gate * lam * torch.sigmoid(s) * u) @ w_gate
    if not isinstance(coef, Tensor):
        coef = torch.zeros_like(target)
    return coef * (gamma * scale), lam


def neuron_position_scores(s: Tensor, u: Tensor, neuron_target: Tensor) -> Tensor:
    """S_{n,i} = a_{n,i} (w_D^n . t_i): [batch pos d_mlp]."""
    return F.silu(s) * u * neuron_target

# --- attention (book: softmax-taylor) ---

@dataclass(frozen=True)
class AttentionWeights:
    """One layer's projections, HF layout. Biases only for Qwen2; q/k norms only for Qwen3."""

    q: Tensor  # [head*d_head, d_model]
    k: Tensor  # [kv_head*d_head, d_model]
    v: Tensor  # [kv_head*d_head, d_model]
    o: Tensor  # [d_model, head*d_head]
    n_heads: int
    n_kv_heads: int
    scaling: float
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    q_norm: Tensor | None = None  # [d_head] gamma of Qwen3's per-head RMSNorm
    k_norm: Tensor | None = None
    qk_norm_eps: float = 1e-6

    @property
    def d_head(self) -> int:
        return self.q.shape[0] // self.n_heads

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


@dataclass(frozen=True)
class AttentionInternals:
    """What the propagation rules need from one layer's forward pass."""

    q: Tensor  # [batch head pos d_head], post-norm, post-RoPE
    k: Tensor  # [batch kv_head pos d_head], post-norm, post-RoPE
    v: Tensor  # [batch kv_head pos d_head]
    probs: Tensor | None  # [batch head query_pos key_pos], zero where masked; None = form per query block
    q_pull: Tensor | None  # gamma_q * r_q [batch head pos d_head] (Qwen3) else None
    k_pull: Tensor | None  # gamma_k * r_k [batch kv_head pos d_head]
    mask: Tensor | None = None  # [batch 1|head query_pos key_pos]

    def probs_rows(self, w: AttentionWeights, rows: slice) -> Tensor:
        """Probabilities of the query positions ``rows`` [batch head rows key_pos]."""
        if self.probs is not None:
            return self.probs[:, :, rows]
        return attention_probs(self.q[:, :, rows], self.k, w, self.mask[:, :, rows])


def _project(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return x @ w.T if b is None else torch.addmm(b, x.flatten(0, 1), w.T).view(*x.shape[:-1], -1)


def _head_norm(x: Tensor, gamma: Tensor | None, eps: float) -> tuple[Tensor, Tensor | None]:
    """Qwen3's RMSNorm over d_head; returns (normalised x, gamma * r) or (x, None)."""
    if gamma is None:
        return x, None
    pull = gamma * rms_scale(x, eps)
    return (x * pull).to(x.dtype), pull.to(x.dtype)


def attention_internals(q: Tensor, k: Tensor, v: Tensor, w: AttentionWeights, cos: Tensor, sin: Tensor,
                        mask: Tensor, *, probs: bool = True) -> AttentionInternals:
    """Queries, keys and probabilities from the q/k/v projection outputs [batch pos heads*d_head].

    cos/sin [batch pos d_head] come from the model's own rotary module; mask is a
    boolean [batch 1|head query_pos key_pos] (True = may attend). With ``probs=False``
    the [head, pos, pos] map is not formed here: ``propagate_attention`` then builds it
    block by block over query positions (the memory-lean mode).
    """
    q, q_pull = _head_norm(_heads(q, w.n_heads), w.q_norm, w.qk_norm_eps)
    k, k_pull = _head_norm(_heads(k, w.n_kv_heads), w.k_norm, w.qk_norm_eps)
    cos, sin = cos[:, None], sin[:, None]  # head axis: [batch 1 pos d_head]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return AttentionInternals(q=q, k=k, v=_heads(v, w.n_kv_heads), probs=attention_probs(q, k, w, mask) if probs
                              else None, q_pull=q_pull, k_pull=k_pull, mask=mask)


def attention_probs(q: Tensor, k: Tensor, w: AttentionWeights, mask: Tensor) -> Tensor:
    """softmax(q k^T * scale) over keys for q [batch head query d_head], k [batch kv_head key d_head]."""
    b, h, tq, dh = q.shape
    qg = q.reshape(b, w.n_kv_heads, w.group, tq, dh)  # [batch kv_head group query d_head]
    scores = torch.einsum("bkgid,bkjd->bkgij", qg, k).reshape(b, h, tq, k.shape[2]) * w.scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows (padding) -> 0


def attention_output(c: AttentionInternals, w: AttentionWeights) -> Tensor:
    """The block output sum_j alpha_ij v_j W_O^T  [batch pos d_model]."""
    b, h, t, dh = c.q.shape
    probs = c.probs_rows(w, slice(None))
    z = torch.einsum("bkgij,bkjd->bkgid", probs.view(b, w.n_kv_heads, w.group, t, t), c.v)
    return _merge(z.reshape(b, h, t, dh)) @ w.o.T


def attention_forward(x: Tensor, w: AttentionWeights, cos: Tensor, sin: Tensor,
                      mask: Tensor) -> tuple[AttentionInternals, Tensor]:
    """Recompute one attention block from its normalised input x [batch pos d_model]."""
    c = attention_internals(_project(x, w.q, w.q_bias), _project(x, w.k, w.k_bias), _project(x, w.v, w.v_bias),
                            w, cos, sin, mask)
    return c, attention_output(c, w)


@dataclass(frozen=True)
class AttentionPropagation:
    target: Tensor  # g_MHSA on the normalised input (before gamma * r)  [batch pos d_model]
    head_scores: Tensor  # sum_i lam_{h,i} . z_{h,i}               [batch head]
    edge_scores: Tensor | None  # alpha * (lam . v)                  [batch head query_pos key_pos]
    value_bias_share: Tensor  # sum_{h,i} lam_{h,i} . (sum_j alpha) b_v  [batch]


def propagate_attention(target: Tensor, c: AttentionInternals, w: AttentionWeights, cos: Tensor, sin: Tensor,
                        *, query: float = 0.25, key: float = 0.25, value: float = 0.5,
                        edges: bool = False, block: int | None = None) -> AttentionPropagation:
    """mu_v g_V + mu_q g_Q + mu_k g_K for ``target`` [batch pos d_model] on the block output.

    The result is the target on the normalised input; multiply by gamma * r (norm.py)
    to get g_MHSA on the residual stream. ``block`` processes that many query positions
    at a time, so only a [head, block, pos] slice of the attention map is ever live.
    """
    b, h, t, dh = c.q.shape
    kv, g = w.n_kv_heads, w.group
    lam_all = _heads(target @ w.o, h)  # W_O^h^T t_i  [batch head query d_head]
    g_v = torch.zeros_like(c.v)  # [batch kv_head key d_head]
    g_k = torch.zeros_like(c.v)
    g_q = torch.zeros_like(c.q)  # [batch head query d_head]
    head_scores = target.new_zeros(b, h)
    share = target.new_zeros(b)
    edge_rows = []
    step = block or t
    for i0 in range(0, t, step):
        rows = slice(i0, min(i0 + step, t))
        n = rows.stop - rows.start
        lam = lam_all[:, :, rows].reshape(b, kv, g, n, dh)  # [batch kv group query d_head]
        probs = c.probs_rows(w, rows).reshape(b, kv, g, n, t)
        lam_v = torch.einsum("bkgid,bkjd->bkgij", lam, c.v)  # lam_{h,i} . v_{h,j}
        contrib = probs * lam_v  # edge scores alpha * (lam . v)
        lam_z = contrib.sum(-1)  # lam_{h,i} . z_{h,i}   [batch kv group query]
        head_scores += lam_z.sum(-1).reshape(b, h)
        if edges:
            edge_rows.append(contrib.reshape(b, h, n, t))
        if value:
            g_v += torch.einsum("bkgij,bkgid->bkjd", probs, lam)  # sum over group and queries
        if query or key:
            delta = probs * (lam_v - lam_z[..., None]) * w.scaling  # softmax sensitivity, score scale folded in
            if query:
                g_q[:, :, rows] = torch.einsum("bkgij,bkjd->bkgid", delta, c.k).reshape(b, h, n, dh)
            if key:
                g_k += torch.einsum("bkgij,bkgid->bkjd", delta, c.q[:, :, rows].reshape(b, kv, g, n, dh))
        if w.v_bias is not None:
            share += (probs.sum(-1, keepdim=True) * lam * w.v_bias.view(1, kv, 1, 1, dh)).sum((1, 2, 3, 4))
    out = value * (_merge(g_v) @ w.v) if value else torch.zeros_like(target)
    cos, sin = cos[:, None], sin[:, None]
    if query:
        g_q = apply_rope_transpose(g_q, cos, sin)
        out = out + query * (_merge(g_q if c.q_pull is None else g_q * c.q_pull) @ w.q)
    if key:
        g_k = apply_rope_transpose(g_k, cos, sin)
        out = out + key * (_merge(g_k if c.k_pull is None else g_k * c.k_pull) @ w.k)
    return AttentionPropagation(target=out, head_scores=head_scores,
                                edge_scores=torch.cat(edge_rows, dim=2) if edges else None, value_bias_share=share)


# --- one layer's weights and the capture of a forward pass ---

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


# --- the top-down sweep (book: end-to-end), chaining the rules above ---

@dataclass
class HandScores:
    token_scores: Tensor  # [pos]
    head_scores: Tensor  # [layer head]
    neuron_scores: Tensor  # [layer d_mlp]
    edge_scores: Tensor  # [layer head query key]
    neuron_position_scores: Tensor  # [layer pos d_mlp]
    effective_targets: Tensor  # [layer+1 pos d_model]
    value_bias_share: float  # Qwen2's value biases: sum lam . (sum_j alpha) b_v
    target_logit: float


def capture(model: nn.Module, ids: Tensor) -> dict:
    """Residual streams at every module boundary of one forward pass (ordinary hooks, batch of one)."""
    store: dict = {}
    handles = []

    def pre(key):
        def hook(_m, args):
            store[key] = args[0].detach()
        return hook

    for i, layer in enumerate(model.model.layers):
        handles.append(layer.input_layernorm.register_forward_pre_hook(pre(("pre", i))))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(pre(("mid", i))))
    handles.append(model.model.norm.register_forward_pre_hook(pre(("final", None))))
    try:
        with torch.no_grad():
            model.model(input_ids=ids[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return store


@torch.no_grad()
def hand_attribute(model: nn.Module, spec: ModelSpec, ids: Tensor, target: int, position: int = -1,
                   mu=(0.25, 0.25, 0.5, 0.5, 0.5), neuron_target: str = "output") -> HandScores:
    """DPA by the hand rules: fold the target through the final norm, then walk the layers top-down."""
    q_mu, k_mu, v_mu, gate_mu, up_mu = mu
    dtype = torch.float64
    t = len(ids)
    pos = position % t
    cap = capture(model, ids)
    final_x = cap[("final", None)].to(dtype)  # [1 pos d_model]
    r_f = rms_scale(final_x[0, pos], spec.rms_eps)
    folded = model.lm_head.weight[target].to(dtype) * model.model.norm.weight.to(dtype) * r_f
    target_t = torch.zeros_like(final_x)
    target_t[0, pos] = folded
    logit = float((folded * final_x[0, pos]).sum())
    cos, sin = model.model.rotary_emb(final_x, torch.arange(t)[None])
    cos, sin = cos.to(dtype), sin.to(dtype)
    mask = torch.ones(1, t, dtype=torch.bool)
    heads, neurons, edges, npos, targets = [], [], [], [], [target_t[0]]
    share = 0.0
    for i in reversed(range(spec.n_layers)):
        w = layer_weights(model, spec, i, dtype)
        x_mid = cap[("mid", i)].to(dtype)
        xm = apply_norm(x_mid, w.mlp_norm, rms_scale(x_mid, spec.rms_eps))
        s, u, _ = glu_forward(xm, w.mlp.gate, w.mlp.up, w.mlp.down)
        g, lam = propagate_glu(target_t, s, u, w.mlp.gate, w.mlp.up, w.mlp.down, w.mlp_norm,
                               rms_scale(x_mid, spec.rms_eps), up=up_mu, gate=gate_mu)
        t_mid = target_t + g
        if neuron_target == "mid":
            lam = t_mid @ w.mlp.down
        n = neuron_position_scores(s, u, lam)[0]
        npos.append(n)
        neurons.append(n.sum(0))
        x_in = cap[("pre", i)].to(dtype)
        r_in = rms_scale(x_in, spec.rms_eps)
        c, _ = attention_forward(apply_norm(x_in, w.attn_norm, r_in), w.attn, cos, sin,
                                 attention_mask(mask, spec.sliding_windows[i]))
        prop = propagate_attention(t_mid, c, w.attn, cos, sin, query=q_mu, key=k_mu, value=v_mu, edges=True)
        target_t = t_mid + prop.target * (w.attn_norm * r_in)
        heads.append(prop.head_scores[0])
        edges.append(prop.edge_scores[0])
        share += float(prop.value_bias_share[0])
        targets.append(target_t[0])
    emb = cap[("pre", 0)].to(dtype)[0]
    flip = lambda xs: torch.stack(xs[::-1])  # noqa: E731
    return HandScores(token_scores=(emb * target_t[0]).sum(-1), head_scores=flip(heads), neuron_scores=flip(neurons),
                      edge_scores=flip(edges), neuron_position_scores=flip(npos), effective_targets=flip(targets),
                      value_bias_share=share, target_logit=logit)
