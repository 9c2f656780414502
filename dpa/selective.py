"""Mamba's mixer (the selective scan), linearised: the rule of book: selective-scan, as dpa runs it.

The block (transformers' ``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``) computes, from its normalised
input h,

    [xi | z] = in_proj(h),  x = SiLU(conv(xi) + b),  [d | B | C] = x_proj(x),  Delta = softplus(dt_proj(d)),
    s_t = exp(Delta_t A) o s_{t-1} + (Delta_t x_t) B_t^T,  y_t = s_t C_t + D o x_t   (per channel: a state of N),
    n = y * SiLU(z),  out = out_proj(n)

(Falcon-Mamba's and Jamba's blocks normalise d, B and C first: an RMS norm each, Falcon-Mamba's without a gain).
Every channel is a state-space model of its own (its own step, its own decay row of A), so every channel of
out_proj's input is a unit (its column of out_proj: the unit's "head"). With the controls frozen at their forward
values -- the step Delta (and with it the decay), the SiLUs' sigmoids, the norms' scales -- y is trilinear in x, B
and C, where B and C are themselves linear in x: x is the content (mu_value), B the key (mu_key) and C the query
(mu_query); z is the gate (mu_gate) and y the content (mu_up); the skip D x passes with weight one. Euler's identity
again: mu_query + mu_key + mu_value = 1 and mu_gate + mu_up = 1 conserve the target.

Like Mamba-2's (ssd.py), the block runs its own forward for the value, and ``ssd.LinearisedScan`` runs the rule in
its backward on ``scan_block``, dpa's copy of the block written from the book; ``check_block`` checks that the block
is the one described and computes the copy's value on a probe.
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
class SelectiveShape:
    """A Mamba block's sizes, as its forward reads them (its own attributes)."""

    inner: int  # I: x, z, y and n, one state-space model per channel
    state: int  # N
    rank: int  # R: the step's low-rank input d
    kernel: int  # K, the convolution's taps
    norms: bool  # d, B and C RMS-normalised (Falcon-Mamba, Jamba)

    @property
    def heads(self) -> int:  # the units: one per channel
        return self.inner


_ATTRIBUTES = ("intermediate_size", "ssm_state_size", "time_step_rank", "conv_kernel_size")
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def shape_of(block: nn.Module) -> SelectiveShape:
    """The block's sizes from its own attributes; refused by name where one is missing."""
    values = {name: getattr(block, name, None) for name in _ATTRIBUTES}
    norms = [getattr(block, name, None) for name in _NORMS]
    if not all(isinstance(v, int) and v > 0 for v in values.values()) or len({n is None for n in norms}) > 1:
        raise UnsupportedModelError(f"unsupported module: {type(block).__name__} lacks the sizes of a Mamba block "
                                    f"({', '.join(_ATTRIBUTES)}), or holds some of {', '.join(_NORMS)} only")
    return SelectiveShape(values["intermediate_size"], values["ssm_state_size"], values["time_step_rank"],
                          values["conv_kernel_size"], norms[0] is not None)


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


def _normed(norm: nn.Module, v: Tensor, freeze) -> Tensor:
    """An RMS norm of the block's with its scale frozen (``freeze``): gain * v / rms(v). Falcon-Mamba's has no gain
    (its weight a buffer its forward does not read); Jamba's has one."""
    r = freeze(torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + _eps(norm)))
    gain = norm.weight if isinstance(getattr(norm, "weight", None), nn.Parameter) else None
    return v * r if gain is None else gain.detach().to(v.dtype) * (v * r)


def _factors(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, bias: Tensor | None,
             frozen: bool = True) -> tuple:
    """The block from its input to the scan's factors: (z, x, B, C, the step Delta [b t I] frozen, the decay
    A [I N]), the convolution's SiLU with its sigmoid frozen. As the module's forward: padded positions zeroed before
    in_proj and after the convolution; A, D and the step's bias rounded to float32. ``h``: the input, or one per
    reader of MIB's graph ("query": z and C, read at the output's position; "key": B and the step, written with
    the input's position; "value": x, the content). ``frozen`` off: nothing detached (the block's own function)."""
    s = shape_of(block)
    inputs = h if isinstance(h, dict) else {"query": h, "key": h, "value": h}
    freeze = (lambda t: t.detach()) if frozen else (lambda t: t)
    dtype = wide(inputs["query"].dtype)
    m = None if mask is None else mask.to(inputs["query"].device, dtype)[..., None]
    w_in, w_x = (weight_rows(p).detach().to(dtype) for p in (block.in_proj, block.x_proj))
    conv = {}
    for name in ("query", "key", "value"):  # the content stream after the convolution, per reader
        x = inputs[name].to(dtype) if m is None else inputs[name].to(dtype) * m
        if name != "query" and inputs[name] is inputs["query"]:
            conv[name] = conv["query"]
            continue
        xi = x @ w_in[:s.inner].T
        conv[name] = conv_silu(block.conv1d, xi, bias, m, frozen)  # [b t I]
        if name == "query":
            z = x @ w_in[s.inner:].T
    d, B = (conv["key"] @ w_x[:s.rank + s.state].T).split([s.rank, s.state], dim=-1)
    C = conv["query"] @ w_x[s.rank + s.state:].T
    if s.norms:
        d, B, C = (_normed(getattr(block, name), v, freeze) for name, v in zip(_NORMS, (d, B, C)))
    dt = block.dt_proj
    step = freeze(nn.functional.softplus(freeze(d) @ dt.weight.detach().to(dtype).T
                                         + dt.bias.detach().float().to(dtype)))  # [b t I]
    a = -torch.exp(block.A_log.detach().float()).to(dtype)  # [I N], the decay as the module's forward makes it
    return s, z, conv["value"], B, C, step, a


def _skip(block: nn.Module, x: Tensor) -> Tensor:
    return block.D.detach().float().to(x.dtype) * x  # D x, per channel (D rounded to float32, as the forward does)


def _scan(x: Tensor, B: Tensor, C: Tensor, step: Tensor, a: Tensor) -> Tensor:
    """The scan without its skip, y_t = sum_n C_tn s_tn with s_t = exp(Delta_t A) o s_{t-1} + Delta_t x_t B_t^T
    per channel [b t I]: the recurrence over positions, as the module's torch path runs it."""
    b, t, inner = x.shape
    decay = torch.exp(step[..., None] * a)  # [b t I N], frozen (the step is)
    written = (step * x)[..., None] * B[:, :, None, :]  # Delta_t x_t B_t^T [b t I N]
    state, ys = x.new_zeros(b, inner, a.shape[-1]), []
    for i in range(t):
        state = decay[:, i] * state + written[:, i]
        ys.append((state * C[:, i, None, :]).sum(-1))
    return torch.stack(ys, dim=1)


def scan_block(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, mu=None,
               bias: Tensor | None = None, frozen: bool = True) -> tuple[Tensor, Tensor]:
    """The block's output and out_proj's input n, written from the book (``ssd.scan_block``'s contract): its value,
    and with ``mu`` the linearised graph whose gradient is the rule. ``h``: the input, or one per reader of MIB's
    graph (``_factors``). ``bias`` [batch channel]: the convolution's bias as a leaf per prompt (its gradient gives
    the bias share), else the block's own. ``frozen`` off: nothing detached, the block's own function (MIB's graph
    under the model's own backward)."""
    _, z, x, B, C, step, a = _factors(block, h, mask, bias, frozen)
    scaled = scaler(mu)
    y = _scan(scaled(x, "value"), scaled(B, "key"), scaled(C, "query"), step, a) + _skip(block, x)
    sig = torch.sigmoid(z)
    n = scaled(y, "up") * scaled(z * (sig.detach() if frozen else sig), "gate")  # SiLU(z), sigmoid frozen
    return n @ weight_rows(block.out_proj).detach().to(n.dtype).T, n


def scan_edges(block: nn.Module, h: Tensor, mask: Tensor | None, lam: Tensor, units: int) -> Tensor:
    """A Mamba block's edge scores [batch unit query key], the terms its units' scores sum (book: selective-scan):
    E_ts = sum_channels lambda_t o (sum_n C_tn B_sn exp(A_n sum_{s<r<=t} Delta_r)) Delta_s x_s, plus D lambda_t o x_t
    at s = t, with lambda the target on y (``lam``, the gradient at out_proj's input n, times the frozen SiLU(z)).
    One query position at a time: memory [b t I N]."""
    with torch.no_grad():
        _, z, x, B, C, step, a = _factors(block, h, mask, None)
        b, t, inner = x.shape
        if inner % units:
            raise UnsupportedModelError(f"{inner} channels do not split into {units} units")
        lam = lam.to(x.dtype) * z * torch.sigmoid(z)
        cum = torch.cumsum(step, dim=1)  # [b t I]
        written = step * x  # Delta_s x_s
        out = x.new_zeros(b, units, t, t)
        for q in range(t):
            decay = torch.exp((cum[:, q, None] - cum[:, :q + 1])[..., None] * a)  # [b s I N]
            mixing = torch.einsum("bn,bsn,bsin->bsi", C[:, q], B[:, :q + 1], decay)  # [b s I]
            terms = lam[:, q, None] * mixing * written[:, :q + 1]  # [b s I]
            terms[:, q] += _skip(block, lam[:, q] * x[:, q])
            out[:, :, q, :q + 1] = terms.view(b, q + 1, units, -1).sum(-1).transpose(1, 2)
        return out


def check_block(layer: nn.Module, mixer: Mixer, d_model: int, i: int) -> SelectiveShape:
    """Layer ``i``'s Mamba block is the one the rule describes: transformers' forward; in_proj [xi | z], x_proj
    [d | B | C] and out_proj without biases, dt_proj with its bias, a depthwise convolution over xi (a bias allowed:
    the bias share), A_log [I N] and D [I] (and the norms' gains where they have some), nothing else; a SiLU after
    the convolution; and it computes ``scan_block``'s value on a probe."""
    block, where = own_block(layer, mixer, i)
    s = shape_of(block)
    if getattr(block, "activation", None) != "silu":
        raise UnsupportedModelError(f"unsupported module: {where} has activation "
                                    f"{getattr(block, 'activation', None)!r}; the rule reads a SiLU after the "
                                    "convolution")
    proj = mixer.module + "."
    check_projections(layer, mixer, {mixer.in_proj: (2 * s.inner, d_model), mixer.heads: (d_model, s.inner),
                                     proj + "x_proj": (s.rank + 2 * s.state, s.inner)}, i)
    conv = check_conv(block, where, mixer.kind, s.inner, s.kernel)
    want = {"in_proj.weight": (2 * s.inner, d_model), "out_proj.weight": (d_model, s.inner),
            "x_proj.weight": (s.rank + 2 * s.state, s.inner), "dt_proj.weight": (s.inner, s.rank),
            "dt_proj.bias": (s.inner,), "conv1d.weight": (s.inner, 1, s.kernel), "A_log": (s.inner, s.state),
            "D": (s.inner,)}
    if conv.bias is not None:
        want["conv1d.bias"] = (s.inner,)
    if s.norms:
        for name, size in zip(_NORMS, (s.rank, s.state, s.state)):
            norm = getattr(block, name)
            if not isinstance(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)), (int, float)):
                raise UnsupportedModelError(f"unsupported module: {where}.{name} is {type(norm).__name__}; the rule "
                                            "reads one of transformers' RMS norms there (its eps, its gain if any)")
            if isinstance(getattr(norm, "weight", None), nn.Parameter):
                want[f"{name}.weight"] = (size,)
    check_computes(block, want, d_model, where, mixer.kind, RULE)
    return s


RULE = ScanRule("Mamba", "selective-scan", scan_block, scan_edges, check_block, apart=False)
