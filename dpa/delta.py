"""Qwen3-Next's Gated DeltaNet, linearised: the rule of book: gated-delta-rule, as dpa runs it.

The block (transformers' ``Qwen3NextGatedDeltaNet``) computes, from its normalised input h, with H_k key heads of
D_k and H_v = G H_k value heads of D_v (value head j reads key head j // G):

    [q | k | v | z] = in_proj_qkvz(h),  [b | a] = in_proj_ba(h)   (both grouped per key head),
    [q | k | v] = SiLU(conv([q | k | v])),  q^ = q / |q| / sqrt(D_k),  k^ = k / |k|,
    alpha = exp(-exp(A_log) softplus(a + b_dt)),  beta = sigmoid(b),
    S_t = alpha_t (I - beta_t k^_t k^_t^T) S_{t-1} + beta_t k^_t v_t^T,  o_t = S_t^T q^_t   (per value head),
    n = gamma * r * o * SiLU(z)   (the gated norm, per value head),  out = out_proj(n).

With the controls frozen at their forward values -- alpha, beta, the L2 scales of q and k, the gated norm's scale r,
the SiLUs' sigmoids, and the key where it erases (inside the transitions) -- o is linear in q, in the written key and
in v: q is the query (mu_query), the written key the key (mu_key), v the content (mu_value); z is the gate (mu_gate)
and o the content (mu_up). mu_query + mu_key + mu_value = 1 and mu_gate + mu_up = 1 conserve the target (Euler's
identity; the erasing key gets no path of its own, so the key is not counted twice).

As for the scan blocks (ssd.py, selective.py), the block runs its own forward (its chunked float32 rule, or fla's
kernel) for the value, and ``ssd.LinearisedScan`` runs the rule in its backward on ``scan_block``, dpa's copy of the
block; ``check_block`` checks that the block is the one described and computes the copy's value on a probe. Each
value head is a unit (its slice of out_proj's input), grouped n_heads to a layer as the other scan blocks' units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .errors import UnsupportedModelError
from .mixers import check_projections, own_block
from .registry import Mixer
from .spec import weight_rows
from .ssd import ScanRule, check_computes, check_conv, conv_silu, scaler, wide


@dataclass(frozen=True)
class DeltaShape:
    """A Gated DeltaNet block's sizes, as its forward reads them (its own attributes)."""

    k_heads: int  # H_k
    v_heads: int  # H_v, a multiple of H_k
    k_dim: int  # D_k
    v_dim: int  # D_v
    kernel: int  # K, the convolution's taps

    @property
    def heads(self) -> int:  # the units: the value heads
        return self.v_heads

    @property
    def inner(self) -> int:  # out_proj's input: H_v D_v
        return self.v_heads * self.v_dim

    @property
    def group(self) -> int:  # G: value heads per key head
        return self.v_heads // self.k_heads

    @property
    def conv(self) -> int:  # the convolution's channels [q | k | v]
        return 2 * self.k_heads * self.k_dim + self.inner

    @property
    def rows(self) -> int:  # in_proj_qkvz's outputs
        return 2 * self.k_heads * self.k_dim + 2 * self.inner


_ATTRIBUTES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size")
CHUNK = 64  # the positions of one chunk of transformers' torch_chunk_gated_delta_rule (its default, which the module
# does not change), and of dpa's copy
L2_EPS = 1e-6  # transformers' l2norm of q and k (its own, fixed in the code; not the config's rms_norm_eps)


def shape_of(block: nn.Module) -> DeltaShape:
    """The block's sizes from its own attributes; refused by name where one is missing."""
    values = {name: getattr(block, name, None) for name in _ATTRIBUTES}
    if not all(isinstance(v, int) and v > 0 for v in values.values()) or values["num_v_heads"] % values["num_k_heads"]:
        raise UnsupportedModelError(f"unsupported module: {type(block).__name__} lacks the sizes of a Gated DeltaNet "
                                    f"block ({', '.join(_ATTRIBUTES)}, value heads a multiple of key heads): {values}")
    return DeltaShape(values["num_k_heads"], values["num_v_heads"], values["head_k_dim"], values["head_v_dim"],
                      values["conv_kernel_size"])


def _weights(block: nn.Module, s: DeltaShape, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """in_proj_qkvz's and in_proj_ba's rows of q, k, v, z, b and a, each [features d_model]: both projections group
    their features per key head (book: gated-delta-rule, eq-gdr-layout), v and z value head by value head."""
    qkvz = weight_rows(block.in_proj_qkvz).detach().to(dtype)
    d = qkvz.shape[-1]
    per = qkvz.view(s.k_heads, -1, d).split([s.k_dim, s.k_dim, s.group * s.v_dim, s.group * s.v_dim], dim=1)
    ba = weight_rows(block.in_proj_ba).detach().to(dtype).view(s.k_heads, 2 * s.group, d).split([s.group, s.group], 1)
    return tuple(w.reshape(-1, d) for w in (*per, *ba))


def _factors(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, bias: Tensor | None,
             frozen: bool = True) -> tuple:
    """The block from its input to the delta rule's factors: (q, k, v after the convolution's SiLU, its sigmoid
    frozen [b t *], z [b t H_v D_v], g = log alpha and beta [b t H_v] frozen). As the module's forward: padded positions
    zeroed before the projections; A_log and a rounded to float32. ``h``: the input, or one per reader of MIB's graph
    ("query": q and z, read at the output's position; "key": k, alpha and beta, written with the input's position;
    "value": v, the content). ``frozen`` off: nothing detached (the block's own function)."""
    s = shape_of(block)
    inputs = h if isinstance(h, dict) else {"query": h, "key": h, "value": h}
    freeze = (lambda t: t.detach()) if frozen else (lambda t: t)
    dtype = wide(inputs["query"].dtype)
    m = None if mask is None else mask.to(inputs["query"].device, dtype)[..., None]
    x = {name: x.to(dtype) if m is None else x.to(dtype) * m for name, x in inputs.items()}  # (padding zeroed)
    w_q, w_k, w_v, w_z, w_b, w_a = _weights(block, s, dtype)
    mixed = torch.cat([x["query"] @ w_q.T, x["key"] @ w_k.T, x["value"] @ w_v.T], dim=-1)
    q, k, v = conv_silu(block.conv1d, mixed, bias, None, frozen).split([s.k_heads * s.k_dim] * 2 + [s.inner], -1)
    z = x["query"] @ w_z.T
    beta = freeze(torch.sigmoid(x["key"] @ w_b.T))
    return s, q, k, v, z, freeze(_decay(block, x["key"] @ w_a.T)), beta


def _decay(block: nn.Module, a: Tensor) -> Tensor:
    """g = -exp(A_log) softplus(a + b_dt), the log of the decay alpha [b t H_v], A_log and a rounded to float32 as
    the module's forward does."""
    a = a.float().to(a.dtype)
    return -torch.exp(block.A_log.detach().float()).to(a.dtype) * nn.functional.softplus(
        a + block.dt_bias.detach().to(a.dtype))


def _log_decay(block: nn.Module, h: Tensor, mask: Tensor | None) -> Tensor:
    """g on the input ``h`` (padded positions zeroed first, as the module's forward does)."""
    s = shape_of(block)
    dtype = wide(h.dtype)
    x = h.to(dtype) if mask is None else h.to(dtype) * mask.to(h.device, dtype)[..., None]
    return _decay(block, x @ _weights(block, s, dtype)[5].T)


def _heads(x: Tensor, n: int, s: DeltaShape) -> Tensor:
    """[b t n*D] -> [b t H_v D]: value head j reads head j // (H_v / n) (transformers' repeat_interleave)."""
    x = x.view(*x.shape[:2], n, -1)
    return x if n == s.v_heads else x.repeat_interleave(s.v_heads // n, dim=2)


def _normed(q: Tensor, k: Tensor, s: DeltaShape, freeze) -> tuple[Tensor, Tensor]:
    """q^ = q rho_q / sqrt(D_k) and k^ = k rho_k per value head, the L2 scales rho frozen (``freeze``)."""
    return _unit(q, s, freeze) / s.k_dim ** 0.5, _unit(k, s, freeze)


def _unit(x: Tensor, s: DeltaShape, freeze) -> Tensor:
    """x [b t H_k*D_k] L2-normalised per value head [b t H_v D_k], its scale rho frozen (``freeze``)."""
    x = _heads(x, s.k_heads, s)
    return x * freeze(torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS))


def _rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, erase: Tensor) -> Tensor:
    """o_t = S_t^T q_t with S_t = alpha_t (S_{t-1} - beta_t e_t (e_t^T S_{t-1})) + beta_t k_t v_t^T per value head
    [b t H_v D_v], alpha = exp(g), the erasing key ``erase`` apart from the written ``k`` (frozen under the rule); by
    chunks of ``CHUNK`` positions, as transformers' chunked rule, so that time and memory grow linearly with the length
    and the positions of a chunk run at once. Within a chunk, with gamma_t the decay since its start and S_0 the state
    entering it, the erased parts r_t = alpha_t S_{t-1}^T e_t solve the lower-triangular system
    r_t + sum_{i<t} (gamma_t / gamma_i) beta_i (e_t . e_i) r_i = gamma_t S_0^T e_t + sum_{i<t} (gamma_t / gamma_i)
    beta_i (e_t . k_i) v_i, and then o_t = gamma_t S_0^T q_t + sum_{i<=t} (gamma_t / gamma_i) beta_i ((q_t . k_i) v_i
    - (q_t . e_i) r_i): the recurrence unrolled within the chunk (book: gated-delta-rule, eq-gdr-unrolled)."""
    b, t, heads, _ = q.shape
    c = CHUNK
    n = -(-t // c)

    def chunks(x: Tensor) -> Tensor:  # [b t H ...] -> [b H n c ...], zeros after the last position (no write, no decay)
        if n * c > t:
            x = torch.cat([x, x.new_zeros(b, n * c - t, *x.shape[2:])], dim=1)
        return x.view(b, n, c, *x.shape[2:]).movedim(3, 1)

    q, k, v, e, g, beta = (chunks(x) for x in (q, k, v, erase, g, beta))
    cum = g.cumsum(-1)  # [b H n c]: log gamma_t within each chunk
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp(torch.where(causal, cum[..., :, None] - cum[..., None, :], float("-inf")))  # gamma_t / gamma_i
    weight = decay * beta[..., None, :]  # [b H n c c]: (t, i) -> (gamma_t / gamma_i) beta_i for i <= t
    strict = weight * torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)  # i < t
    system = torch.eye(c, dtype=q.dtype, device=q.device) + strict * (e @ e.transpose(-1, -2))
    from_values = (strict * (e @ k.transpose(-1, -2))) @ v  # [b H n c D_v]
    reads_k, reads_e = weight * (q @ k.transpose(-1, -2)), weight * (q @ e.transpose(-1, -2))
    gamma = torch.exp(cum)[..., None]  # [b H n c 1]
    state, outs = q.new_zeros(b, heads, q.shape[-1], v.shape[-1]), []
    for j in range(n):
        erased = torch.linalg.solve_triangular(system[:, :, j], gamma[:, :, j] * (e[:, :, j] @ state)
                                               + from_values[:, :, j], upper=False, unitriangular=True)
        outs.append(gamma[:, :, j] * (q[:, :, j] @ state) + reads_k[:, :, j] @ v[:, :, j]
                    - reads_e[:, :, j] @ erased)
        last = (torch.exp(cum[:, :, j, -1:] - cum[:, :, j]) * beta[:, :, j])[..., None]  # (gamma_C / gamma_i) beta_i
        state = (torch.exp(cum[:, :, j, -1])[..., None, None] * state + (k[:, :, j] * last).transpose(-1, -2)
                 @ v[:, :, j] - (e[:, :, j] * last).transpose(-1, -2) @ erased)
    return torch.stack(outs, dim=2).movedim(1, 3).reshape(b, n * c, heads, -1)[:, :t]


def _gated_norm(block: nn.Module, o: Tensor, z: Tensor, freeze) -> tuple[Tensor, Tensor]:
    """The gated norm's scale r = 1/rms(o) per value head and SiLU(z)'s sigmoid, both at their forward values."""
    r = freeze(torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + float(block.norm.variance_epsilon)))
    return r, freeze(torch.sigmoid(z))


def scan_block(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, mu=None,
               bias: Tensor | None = None, frozen: bool = True) -> tuple[Tensor, Tensor]:
    """The block's output and out_proj's input n, written from the book: ``selective.scan_block``'s contract (``h``
    one input or one per reader, ``bias`` a leaf per prompt, ``frozen`` off for the block's own function)."""
    freeze = (lambda t: t.detach()) if frozen else (lambda t: t)
    s, q, k, v, z, g, beta = _factors(block, h, mask, bias, frozen)
    scaled = scaler(mu)
    q_hat, k_hat = _normed(scaled(q, "query"), scaled(k, "key"), s, freeze)
    erase = freeze(_unit(k, s, freeze))  # the key inside the transitions: a control, frozen
    o = _rule(q_hat, k_hat, _heads(scaled(v, "value"), s.v_heads, s), g, beta, erase)
    z = z.view(*z.shape[:2], s.v_heads, s.v_dim)
    r, sig = _gated_norm(block, o.detach() if frozen else o, z, freeze)
    y = block.norm.weight.detach().to(o.dtype) * (scaled(o, "up") * r) * scaled(z * sig, "gate")
    n = y.flatten(2)
    return n @ weight_rows(block.out_proj).detach().to(n.dtype).T, n


def scan_edges(block: nn.Module, h: Tensor, mask: Tensor | None, lam: Tensor, units: int) -> Tensor:
    """A Gated DeltaNet block's edge scores [batch unit query key], the terms its units' scores sum (book:
    gated-delta-rule, eq-gdr-heads): E_{t,s} = beta_s (q^_t^T P_{t,s} k^_s) lambda_t . v_s per value head, with
    P_{t,s} = A_t ... A_{s+1} the transitions between s and t (A_r = alpha_r (I - beta_r k^_r k^_r^T)) and lambda the
    target on the rule's output o (``lam``, the gradient at out_proj's input n, times gamma, the frozen r and SiLU(z)).
    The key s is the rule's: the convolution before it has already mixed each position with the K - 1 before it. The
    queries' reads back through the transitions, P_{t,s}^T q^_t for every t at once, are carried from the last key to
    the first: memory [b t H_v D_k]."""
    with torch.no_grad():
        s, q, k, v, z, g, beta = _factors(block, h, mask, None)
        alpha = torch.exp(g)
        q_hat, k_hat = _normed(q, k, s, lambda t: t)
        v = _heads(v, s.v_heads, s)
        o = _rule(q_hat, k_hat, v, g, beta, k_hat)
        z = z.view(*z.shape[:2], s.v_heads, s.v_dim)
        r, sig = _gated_norm(block, o, z, lambda t: t)
        b, t, heads, d_v = v.shape
        lam = lam.to(v.dtype).view(b, t, heads, d_v) * block.norm.weight.detach().to(v.dtype) * r * z * sig
        width = s.inner // units  # a unit's channels: whole value heads, or equal parts of one
        part = min(width, d_v)
        if width % part or d_v % part:
            raise UnsupportedModelError(f"a unit of {width} channels and value heads of {d_v} do not divide each "
                                        "other: dpa cannot split the delta rule's edge scores between the units")
        parts = d_v // part
        lv = torch.einsum("bthpc,bshpc->btshp", lam.view(b, t, heads, parts, part),
                          v.view(b, t, heads, parts, part))  # lambda_t . v_s per part of a value head
        reads = q_hat.new_zeros(q_hat.shape)  # P_{t,s}^T q^_t for t >= s, [b t H D_k]
        scores = q_hat.new_zeros(b, t, t, heads)
        later = torch.arange(t, device=v.device)
        for key in reversed(range(t)):
            if key + 1 < t:  # one more transition, A_{key+1} (symmetric), on every later query's read
                e, a_, be = k_hat[:, key + 1], alpha[:, key + 1], beta[:, key + 1]
                along = torch.einsum("bhk,bthk->bth", e, reads)
                reads = a_[:, None, :, None] * (reads - be[:, None, :, None] * along[..., None] * e[:, None])
            reads[:, key] = q_hat[:, key]
            on = later >= key
            scores[:, on, key] = beta[:, key, None] * torch.einsum("bthk,bhk->bth", reads[:, on], k_hat[:, key])
        edges = scores[..., None] * lv  # [b t s H parts]
        return edges.reshape(b, t, t, units, -1).sum(-1).permute(0, 3, 1, 2)


def check_block(layer: nn.Module, mixer: Mixer, d_model: int, i: int) -> DeltaShape:
    """Layer ``i``'s Gated DeltaNet is the one the rule describes: transformers' forward; in_proj_qkvz, in_proj_ba
    and out_proj without biases, a depthwise convolution over [q | k | v] (a bias allowed: the bias share), dt_bias
    and A_log per value head, the gated norm's weight per channel of a value head, nothing else; a SiLU after the
    convolution; and it computes ``scan_block``'s value on a probe."""
    block, where = own_block(layer, mixer, i)
    s = shape_of(block)
    if getattr(block, "activation", None) != "silu" or not isinstance(
            getattr(getattr(block, "norm", None), "variance_epsilon", None), (int, float)):
        raise UnsupportedModelError(f"unsupported module: {where} has activation "
                                    f"{getattr(block, 'activation', None)!r} and a norm "
                                    f"{type(getattr(block, 'norm', None)).__name__}; the rule reads a SiLU after the "
                                    "convolution and transformers' gated RMS norm (its variance_epsilon)")
    check_projections(layer, mixer, {mixer.in_proj: (s.rows, d_model), mixer.heads: (d_model, s.inner),
                                     f"{mixer.module}.in_proj_ba": (2 * s.v_heads, d_model)}, i)
    conv = check_conv(block, where, mixer.kind, s.conv, s.kernel)
    want = {"in_proj_qkvz.weight": (s.rows, d_model), "in_proj_ba.weight": (2 * s.v_heads, d_model),
            "out_proj.weight": (d_model, s.inner), "conv1d.weight": (s.conv, 1, s.kernel), "dt_bias": (s.v_heads,),
            "A_log": (s.v_heads,), "norm.weight": (s.v_dim,)}
    if conv.bias is not None:
        want["conv1d.bias"] = (s.conv,)
    check_computes(block, want, d_model, where, mixer.kind, RULE)
    return s


def rounding(block: nn.Module, h: Tensor, mask: Tensor | None) -> Tensor:
    """How far the module's own output may stray from the copy's on ``h``, per prompt and channel of out_proj's input
    [b 1 H_v*D_v] (relative to each position's largest output: ``ssd.agree``). The module's chunked rule takes the
    cumulative sums of the log-decays g within each chunk in float32: a decay gamma_t / gamma_i = exp(G_t - G_i)
    computed from them carries a relative error of float32's epsilon times |G_t| + |G_i|, and it weighs by the decay
    itself; and a head that forgets slowly sums many terms in float32 (the module's and, on a float32 model, the
    copy's, in other orders). So each value head's bound is eps32 x the larger of the largest (|G_t| + |G_i|)
    exp(G_t - G_i) over its chunks' pairs i < t (G = 0 before a chunk's first position, for the state carried into it)
    and the largest sum of the decays its state holds, sum_{i <= t} gamma_t / gamma_i: a head that forgets fast gets
    no slack from its vanishing decays, and the other heads none from it. Measured on random blocks (heads of every
    speed, inputs from 0.3 to 30 times the unit scale, up to 1024 positions): the difference stays within RATIO times
    that; the bound is ten times it. Memory: a chunk's pairs at a time."""
    with torch.no_grad():
        g = _log_decay(block, h, mask).double()
        b, t, heads = g.shape
        n = -(-t // CHUNK)
        g = torch.cat([g, g.new_zeros(b, n * CHUNK - t, heads)], 1).view(b, n, CHUNK, heads)
        cum = torch.cat([g.new_zeros(b, n, 1, heads), g.cumsum(2)], 2)  # [b n 1+C H], G = 0 before the chunk
        later = torch.ones(CHUNK + 1, CHUNK + 1, dtype=torch.bool, device=g.device).tril(-1)[None, :, :, None]
        written = torch.ones(CHUNK + 1, CHUNK + 1, dtype=torch.bool, device=g.device).tril()[None, :, :, None]
        written[:, :, 0] = False  # i <= t, i a position (not the state entering the chunk)
        worst, carried = g.new_zeros(b, heads), g.new_zeros(b, heads)
        for j in range(n):  # a chunk at a time: [b 1+C 1+C H] (G_t - G_i), not the whole input's pairs at once
            G = cum[:, j, :1 + min(CHUNK, t - j * CHUNK)]  # (the zeros padding the last chunk read no decay)
            m = G.shape[1]
            size = G.abs()[:, :, None] + G.abs()[:, None, :]
            decay = torch.exp((G[:, :, None] - G[:, None, :]).clamp(max=0))
            worst = torch.maximum(worst, torch.where(later[:, :m, :m], size * decay, 0).amax((1, 2)))
            # the terms a head's state holds, weighed by their decays: sum_{i <= t} gamma_t / gamma_i, the chunk's
            # own and those carried into it
            held = torch.exp(G[:, 1:]) * carried[:, None] + torch.where(written[:, :m, :m], decay, 0).sum(2)[:, 1:]
            worst, carried = torch.maximum(worst, held.amax(1)), held[:, -1]
        width = shape_of(block).v_dim
        bound = 10 * RATIO * torch.finfo(torch.float32).eps * worst
        return bound.repeat_interleave(width, dim=-1)[:, None, :]


RATIO = 2.5  # above the measured worst difference over eps32 x the bound (2.1: ``rounding``)


RULE = ScanRule("Gated DeltaNet", "gated-delta-rule", scan_block, scan_edges, check_block, apart=False,
                rounding=rounding)
