"""Mamba-2's mixer (the state-space duality), linearised: the rule of book: state-space-duality, as dpa runs it.

The block (transformers' ``BambaMixer``, ``Mamba2Mixer``' layout) computes, from its normalised input h,

    [z | xi | delta] = in_proj(h),  [x | B | C] = SiLU(conv(xi) + b),  Delta = clamp(softplus(delta + b_dt)),
    y = L o (C B^T) (Delta x) + D x   (per head: a masked attention without a softmax, the skip D x),
    n = gamma * r * (y * SiLU(z))     (the gated norm, per group of channels),  out = out_proj(n).

With the controls frozen at their forward values -- the step Delta (and with it the mask L), the SiLUs' sigmoids and
the norm's scale r -- the block is a GLU around a trilinear scan: z is the gate (mu_gate), y the content (mu_up); in
the scan x is the content (mu_value), B the key (mu_key) and C the query (mu_query), the skip D x passes with weight
one. mu_query + mu_key + mu_value = 1 and mu_gate + mu_up = 1 conserve the target (Euler's identity); the
convolution's bias is an input no token owns (the bias share).

The scan and its SiLUs are functions inside the block's forward, so the rule cannot ride on modules the way
attention's does. ``LinearisedScan`` is one autograd Function over the whole block: its value is the block's own
output (its forward, its kernels, its float32 scan), and its backward is the rule, run on ``scan_block``, dpa's copy of
the block written from the book, with the controls frozen and each factor's gradient times its mu. The unit
tap reads out_proj's input n: the scores of its ``n_heads`` groups of channels (an SSM head each where the counts
agree). ``check_block`` checks that the block is the one described, and that it computes ``scan_block``'s value on a
probe, so a patched forward, function or kernel is refused by name; and on every call, the copy's value on the call's
own input must be the block's output (``LinearisedScan``), which no probe of a short input can vouch for.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .errors import NonFiniteError, UnsupportedModelError, non_finite_parameter
from .functions import Branch
from .guard import owned
from .mixers import check_projections, disagreement, own_block
from .registry import Mixer
from .spec import weight_rows
from .ssd_shape import ScanShape, factor_columns, shape_of


@dataclass(frozen=True)
class ScanRule:
    """A block dpa linearises whole with ``LinearisedScan`` (``Mixer.rule`` "scan"), one per ``Mixer.scan``: Mamba-2's
    (here), Mamba's (selective.py). ``scan_block(block, h, mask, mu=None, bias=None)`` -> (output, out_proj's input
    n), dpa's copy of the block; ``scan_edges(block, h, mask, lam, units)`` -> [batch unit query key];
    ``check_block(layer, mixer, d_model, i)`` -> its shape (``inner`` channels, ``heads``)."""

    name: str  # in refusals: "Mamba-2"
    book: str  # the chapter that derives the rule
    scan_block: Callable
    scan_edges: Callable
    check_block: Callable
    apart: bool = True  # MIB's graph can feed the block's readers apart through in_proj's columns (Mamba-2); else
    # (Mamba: B and C are read from x) the block's value there is its copy's, fed per reader (``readers_value``)
    rounding: Callable | None = None  # (block, h, mask) -> how far the block's own float32 arithmetic may stray from
    # the copy on this input (relative to each position's largest output, broadcast against out_proj's input: per
    # prompt and channel), where that grows with the input (the delta rule's cumulative decays); None: ``AGREE``


# While MIB's graph runs a Mamba-2 block with a separate input per reader (``mib.forward``), the block's key and value
# inputs: its in_proj's features are computed from them (a hook), and dpa's copy of the block reads them too.
READERS: contextvars.ContextVar[dict] = contextvars.ContextVar("dpa_scan_readers", default={})


def scan_block(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, mu=None,
               bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The block's output and out_proj's input n, written from the book, in float64 for a float64 model and float32
    otherwise (``wide``): the value of the block and, with ``mu`` (path weights), the linearised graph whose gradient
    is the rule. The frozen controls are detached: the step Delta, the sigmoids of the two SiLUs and the norm's
    scale r. ``bias`` [batch channel]: the convolution's bias as a leaf per prompt (its gradient gives the bias
    share), else the block's own."""
    s, z, x, B, C, step, a = _factors(block, h, mask, bias)
    dtype = x.dtype
    scaled = scaler(mu)
    y = _scan(scaled(x, "value"), scaled(B, "key"), scaled(C, "query"), step, a, s) + _skip(block, x, s)
    gate = z * torch.sigmoid(z).detach()  # SiLU(z), sigmoid frozen
    y = scaled(y, "up")
    n = _gated(block, s, y, scaled(gate, "gate"), y.detach())
    return n @ weight_rows(block.out_proj).detach().to(dtype).T, n


def _gated(block: nn.Module, s: ScanShape, y: Tensor, gate: Tensor, frozen_y: Tensor) -> Tensor:
    """out_proj's input n from the scan's y and the gate SiLU(z) (``ScanShape.gating``), the norm's scale r frozen at
    its forward value (read from ``frozen_y`` and the gate): gamma * r(y * gate) * y * gate (the gated norm),
    gamma * r(y) * y * gate (the norm before the gate), or y * gate (no norm)."""
    yz = y * gate
    if s.gating == "none":
        return yz
    weight = block.norm.weight.detach().to(y.dtype)
    r = _scale(block, (frozen_y * gate.detach()) if s.gating == "after" else frozen_y, s)
    return weight * yz * r


def _factors(block: nn.Module, h: Tensor | dict[str, Tensor], mask: Tensor | None, bias: Tensor | None) -> tuple:
    """The block from its input to the scan's factors: (shape, z, x, B, C, the step Delta [b t H] frozen, the decay a
    [H]), the convolution's SiLU with its sigmoid frozen. ``h``: the input, or one per reader of MIB's graph
    (``factor_columns``: "query", "key", "value")."""
    s = shape_of(block)
    inputs = h if isinstance(h, dict) else {"query": h}  # MIB's graph: each reader's input feeds its own features
    h = inputs["query"]
    dtype = wide(h.dtype)  # the copy's dtype
    m = None if mask is None else mask.to(h.device, dtype)[..., None]
    w = weight_rows(block.in_proj).detach().to(dtype)
    into, features = input_scales(block)  # (Falcon-H1's µP scalars: linear)
    if into != 1:
        w = w * into
    if features is not None:
        w = w * features.detach().to(w.device, dtype).reshape(-1)[:, None]
    columns = factor_columns(block) if len(inputs) > 1 else None
    p = 0
    for name, x in inputs.items():
        x = x.to(dtype) if m is None else x.to(dtype) * m  # transformers zeroes padded positions before in_proj
        if columns is None:
            p = x @ w.T
        else:
            cols = columns[name].to(x.device)
            p = p + x.new_zeros(*x.shape[:-1], w.shape[0]).index_add(-1, cols, x @ w[cols].T)
    h = h.to(dtype)
    z, xi, delta = p.split([s.inner, s.conv, s.heads], dim=-1)
    v = conv_silu(block.conv1d, xi, bias, m)
    x, B, C = v.split([s.inner, s.groups * s.state, s.groups * s.state], dim=-1)
    step = nn.functional.softplus(delta + block.dt_bias.detach().to(dtype)).clamp(*s.limit).detach()  # [b t H]
    a = -torch.exp(block.A_log.detach().float()).to(dtype)  # the decay as the module's forward makes it
    return s, z, x, B, C, step, a


def input_scales(block: nn.Module) -> tuple[float, Tensor | None]:
    """What the block's forward multiplies its input and in_proj's output features by (Falcon-H1's
    ``ssm_in_multiplier`` and ``mup_vector``, µP's scalars for [z | x | B | C | dt]): linear maps, folded into
    in_proj's weight in dpa's copy; (1, None) for a block without them. Refused by name where one is not a number or
    not one per feature."""
    into = getattr(block, "ssm_in_multiplier", 1.0)
    features = getattr(block, "mup_vector", None)
    rows = weight_rows(block.in_proj).shape[0]
    if isinstance(into, bool) or not isinstance(into, (int, float)) or not (
            features is None or isinstance(features, Tensor) and features.numel() == rows
            and features.is_floating_point()):
        raise UnsupportedModelError(
            f"unsupported module: {type(block).__name__}.ssm_in_multiplier is {into!r} and its mup_vector "
            f"{'a tensor of ' + str(features.numel()) + ' values' if isinstance(features, Tensor) else repr(features)}"
            f"; dpa reads a number and one float per in_proj output ({rows})")
    return float(into), features


def conv_silu(conv: nn.Conv1d, xi: Tensor, bias: Tensor | None, m: Tensor | None, frozen: bool = True) -> Tensor:
    """The block's depthwise causal convolution over ``xi`` [b t channels] and its SiLU, the sigmoid frozen: with
    ``bias`` [b channels] (a leaf per prompt, for the bias share) in the convolution's bias's place where given;
    padded positions (``m`` [b t 1] zero) zeroed after it, as the module's forward does."""
    t = xi.shape[1]
    u = nn.functional.conv1d(xi.transpose(1, 2), conv.weight.detach().to(xi.dtype), padding=conv.weight.shape[-1] - 1,
                             groups=xi.shape[-1])[..., :t].transpose(1, 2)
    if bias is not None:
        u = u + bias[:, None, :]
    elif conv.bias is not None:
        u = u + conv.bias.detach().to(xi.dtype)
    sig = torch.sigmoid(u)
    v = u * (sig.detach() if frozen else sig)  # SiLU(u) = u sigmoid(u), sigmoid frozen (unless ``frozen`` is off)
    return v if m is None else v * m


def _skip(block: nn.Module, x: Tensor, s: ScanShape) -> Tensor:
    """D x, per head."""
    return (block.D.detach().to(x.dtype)[:, None] * x.view(*x.shape[:2], s.heads, s.head_dim)).flatten(2)


def _scale(block: nn.Module, yz: Tensor, s: ScanShape) -> Tensor:
    """The gated norm's scale r = 1/rms per group of channels, at its forward value, per channel [b t I]."""
    grouped = yz.view(*yz.shape[:2], -1, s.norm_group)
    r = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + float(block.norm.variance_epsilon))
    return r.expand_as(grouped).flatten(2)


def scan_edges(block: nn.Module, h: Tensor, mask: Tensor | None, lam: Tensor, units: int) -> Tensor:
    """A Mamba-2 block's edge scores [batch unit query key], the terms its units' scores sum (book:
    state-space-duality, eq-ssd-heads): E_{t,s} = lambda_t . (L_ts (C_t . B_s) Delta_s x_s) + [s = t] D lambda_t . x_t
    over the unit's channels, with lambda the target on the scan's output y (``lam``, the gradient at out_proj's input
    n, times the gated norm's gamma, frozen r and SiLU(z)). The key s is the scan's: the convolution before it has
    already mixed each position with the K - 1 before it."""
    with torch.no_grad():
        s, z, x, B, C, step, a = _factors(block, h, mask, None)
        b, t, inner = x.shape
        y = _scan(x, B, C, step, a, s) + _skip(block, x, s)
        gate = z * torch.sigmoid(z)
        lam = _gated(block, s, lam.to(x.dtype), gate, y)  # (n is linear in y with the scale frozen: its transpose)
        width = inner // units  # a unit's channels: whole heads, or equal parts of one
        part = min(width, s.head_dim)
        if width % part or s.head_dim % part:
            raise UnsupportedModelError(f"a unit of {width} channels and SSM heads of {s.head_dim} do not divide each "
                                        "other: dpa cannot split the scan's edge scores between the units")
        per = s.heads // s.groups
        Bh = B.view(b, t, s.groups, s.state).repeat_interleave(per, dim=2)
        Ch = C.view(b, t, s.groups, s.state).repeat_interleave(per, dim=2)
        cum = torch.cumsum(step * a, dim=1)  # [b t H]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        decay = torch.exp(torch.where(causal, cum[:, :, None] - cum[:, None], float("-inf")))  # [b t s H]
        mixing = torch.einsum("bthn,bshn->btsh", Ch, Bh) * decay * step[:, None]  # L o (C B^T) Delta_s
        parts = s.head_dim // part
        lx = torch.einsum("bthjq,bshjq->btshj", lam.view(b, t, s.heads, parts, part),
                          x.view(b, t, s.heads, parts, part))  # lambda_t . x_s per part of a head
        edges = mixing[..., None] * lx
        diagonal = torch.arange(t, device=x.device)
        edges[:, diagonal, diagonal] += block.D.detach().to(x.dtype)[:, None] * lx[:, diagonal, diagonal]
        return edges.reshape(b, t, t, units, -1).sum(-1).permute(0, 3, 1, 2)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of dpa's copy of the block: float64 for a float64 model, float32 for the others (a gradient's own
    precision, wider than bfloat16 or half)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def weighted(tensor: Tensor, mu: float) -> Tensor:
    return tensor if mu == 1 else Branch.apply(tensor, float(mu), None, None)


def scaler(mu) -> Callable[[Tensor, str], Tensor]:
    """(tensor, name) -> the tensor, its gradient times the path weight ``mu.name`` (the identity without ``mu``: the
    copy's value alone)."""
    return (lambda tensor, name: tensor) if mu is None else (lambda tensor, name: weighted(tensor, getattr(mu, name)))


def _scan(x: Tensor, B: Tensor, C: Tensor, step: Tensor, a: Tensor, s: ScanShape) -> Tensor:
    """The scan without its skip, y_t = sum_{s <= t} L_ts (C_t . B_s) Delta_s x_s per head with
    L_ts = exp(a sum_{s < r <= t} Delta_r) [b t (H P)], by chunks of ``s.chunk`` positions (book:
    state-space-duality): within a chunk its attention form, between chunks the state carried forward, so memory
    and time grow linearly with the length. Positions padded after the last have a step of zero: they decay nothing
    and write nothing."""
    b, t, _ = x.shape
    q = s.chunk
    n = -(-t // q)
    pad = n * q - t
    per = s.heads // s.groups

    def chunks(v: Tensor, *shape) -> Tensor:  # [b t ...] -> [b n q ...], zeros after the last position
        v = v.reshape(b, t, *shape)
        if pad:
            v = torch.cat([v, v.new_zeros(b, pad, *shape)], dim=1)
        return v.view(b, n, q, *shape)

    Bh = chunks(B, s.groups, s.state).repeat_interleave(per, dim=3)  # [b n q H N]
    Ch = chunks(C, s.groups, s.state).repeat_interleave(per, dim=3)
    values = chunks(x, s.heads, s.head_dim) * chunks(step, s.heads)[..., None]  # Delta_s x_s [b n q H P]
    cum = torch.cumsum(chunks(step, s.heads) * a, dim=2)  # [b n q H], within each chunk
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[:, :, None]
    decay = torch.exp(torch.where(causal, cum[:, :, :, None] - cum[:, :, None], float("-inf")))  # [b n l s H]
    scores = torch.einsum("bnlhk,bnshk->bnlsh", Ch, Bh) * decay  # M = L o (C B^T) within each chunk
    y = torch.einsum("bnlsh,bnshp->bnlhp", scores, values)
    last = cum[:, :, -1:]  # [b n 1 H]: each chunk's whole decay
    written = torch.einsum("bnshk,bnshp->bnhpk", Bh * torch.exp(last - cum)[..., None], values)  # [b n H P N]
    state, carried = written.new_zeros(b, s.heads, s.head_dim, s.state), []
    for c in range(n):  # the state entering each chunk
        carried.append(state)
        state = state * torch.exp(last[:, c, 0])[..., None, None] + written[:, c]
    entering = torch.stack(carried, dim=1)  # [b n H P N]
    y = y + torch.einsum("bnlhk,bnhpk->bnlhp", Ch * torch.exp(cum)[..., None], entering)
    return y.reshape(b, n * q, s.heads * s.head_dim)[:, :t]


class LinearisedScan(torch.autograd.Function):
    """Value: the block's own output projection input ``n`` (seen as its forward called out_proj). Backward: the
    rule from the target on n back to the block's input h, on ``scan_block``'s graph from the saved input, each
    factor's gradient times its mu; the bias share of the convolution's bias to ``bias_sink``. out_proj then runs on
    it as on an attention block's heads (``linearise``'s unit tap reads its input).

    The copy's value on this very input must be the block's own (``agree``): the probe of ``check_block`` vouches
    for the block on a short input, but a scan patched to differ only across a chunk boundary, a forward changed
    behind an accelerate hook or a remapped activation would otherwise be attributed with a rule for another
    computation. Refused by name where they differ."""

    @staticmethod
    def forward(ctx, anchor, n, block, mask, mu, bias_sink, where, rule, *inputs):
        ctx.save_for_backward(n, *inputs)  # the block's input, or one per reader of MIB's graph (query, key, value)
        ctx.block, ctx.mask, ctx.mu, ctx.bias_sink, ctx.where, ctx.rule = block, mask, mu, bias_sink, where, rule
        return n.view_as(n)

    @staticmethod
    def backward(ctx, g):
        own, *inputs = ctx.saved_tensors
        h = inputs[0]
        block = ctx.block
        conv_bias = block.conv1d.bias
        with torch.enable_grad():
            leaves = [x.detach().to(wide(h.dtype)).requires_grad_(True) for x in inputs]
            leaf = leaves[0] if len(leaves) == 1 else dict(zip(("query", "key", "value"), leaves))
            bias = (None if conv_bias is None else  # one leaf per row: its gradient gives each one's share
                    conv_bias.detach().to(leaves[0]).expand(h.shape[0], -1).clone().requires_grad_(True))
            _, n = ctx.rule.scan_block(block, leaf, ctx.mask, ctx.mu, bias)
            check_copy(block, own, n.detach(), ctx.rule, ctx.where, h, ctx.mask)
            grads = torch.autograd.grad(n, leaves + ([] if bias is None else [bias]), g.to(n.dtype), allow_unused=True)
        if bias is not None and ctx.bias_sink is not None and grads[-1] is not None:
            ctx.bias_sink((grads[-1] * bias.detach()).sum(-1))
        out = [torch.zeros_like(x) if gx is None else gx.to(x.dtype) for x, gx in zip(inputs, grads)]
        return (None, None, None, None, None, None, None, None, *out)


def check_copy(block: nn.Module, own: Tensor, copy: Tensor, rule: ScanRule, where: str, h: Tensor,
               mask: Tensor | None) -> None:
    """The block's own output (out_proj's input) on a call's input ``h`` is its copy's (``agree``, to the rule's
    ``rounding`` on that input where it has one), else refused."""
    if not agree(own, copy, rule.name, block, where, tolerance(rule, block, h, mask)):
        raise UnsupportedModelError(
            f"unsupported module: {where} ({type(block).__name__}) computed another output on this input than the "
            f"{rule.name} block dpa linearises (relative difference {_difference(own, copy):.2g}; its forward, a "
            "function it calls or a kernel patched, also behind a hook?): dpa refuses rather than attribute another "
            f"computation with this rule (book: {rule.book})")


def readers_value(block: nn.Module, rule: ScanRule, where: str) -> Callable:
    """A forward hook for MIB's graph on a block whose readers in_proj cannot feed apart (``ScanRule.apart`` off):
    the block ran on the query reader's input; its output is replaced by the copy's fed per reader (``READERS``),
    nothing frozen, so that a gradient through it is the block's own (the model's backward: EAP, AtP). The block's
    own output is first checked against the copy's on that same input. Where dpa's linearised forward already fed
    the readers (``linearised_forward``), its output stands."""
    def hook(_module, args, kwargs, output):
        readers = READERS.get()[block]
        if readers.pop("done", False):
            return output
        h = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("attention_mask")
        with torch.no_grad():
            check_copy(block, output, rule.scan_block(block, h, mask)[0], rule, where, h, mask)
        n = rule.scan_block(block, dict(readers, query=h), mask, frozen=False)[1]
        return block.out_proj(n.to(output.dtype))  # (out_proj's input is where MIB's graph reads the units)
    return hook


AGREE = 3e-5  # float32 and float64 models: ten times the worst difference measured (per position, relative to the
# position's largest output) between transformers' torch scans and dpa's copies, on random blocks up to 1024 tokens
AGREE_HALF = 5e-2  # bfloat16 and half models


def tolerance(rule: ScanRule, block: nn.Module, h: Tensor, mask: Tensor | None) -> Tensor | None:
    """How far the block's own output may stray from its copy's on the input ``h`` (``ScanRule.rounding``)."""
    return None if rule.rounding is None else rule.rounding(block, h, mask)


def agree(own: Tensor, copy: Tensor, name: str = "scan", block: nn.Module | None = None, where: str = "",
          slack: Tensor | None = None) -> bool:
    """Whether the block's own output and dpa's copy's agree at every position, to the rounding of the module's
    float32 scan (or of a bfloat16 / half model): per position, to ``AGREE`` of that position's largest output (a
    thousandth of the largest anywhere at least), or to ``slack`` where that is larger (the rule's ``rounding`` on
    this input, broadcast against the output). A value that is not finite is no disagreement:
    ``NonFiniteError``, naming the block's parameter that is NaN or inf where one is (``block``, at ``where``)."""
    if not (bool(torch.isfinite(own).all()) and bool(torch.isfinite(copy).all())):
        weight = None if block is None else non_finite_parameter(block)
        half = own.dtype in (torch.bfloat16, torch.float16)
        raise NonFiniteError(f"non-finite activations (NaN or inf) in the {name} block {where}".rstrip() + (
            f": its parameter {weight} is NaN or inf" if weight else
            ": the model's dtype overflows on this input (try float32)" if half else
            " (a weight or an activation is NaN or inf)"))
    bound = AGREE if own.dtype in (torch.float64, torch.float32) else AGREE_HALF
    if own.shape != copy.shape:
        return False
    if slack is None:
        return _difference(own, copy) <= bound
    return bool((_relative(own, copy) <= slack.to(own.device, torch.float64).clamp_min(bound)).all())


def _difference(own: Tensor, copy: Tensor) -> float:
    """The largest difference, relative to the largest output at its position (``agree``)."""
    return float(_relative(own, copy).max())


def _relative(own: Tensor, copy: Tensor) -> Tensor:
    """Each difference, relative to the largest output at its position (a thousandth of the largest anywhere at
    least)."""
    own, copy = own.detach().double(), copy.detach().double()
    scale = copy.abs().amax(-1, keepdim=True).clamp_min(1e-3 * float(copy.abs().max())).clamp_min(1e-300)
    return (own - copy).abs() / scale


def linearised_forward(own: Callable, block: nn.Module, anchor: Tensor, mu, bias_sink: Callable | None,
                       where: str, rule: ScanRule, keep: Callable | None = None) -> Callable:
    """The forward that replaces a scan block's inside dpa's context (``rule``: Mamba-2's, or Mamba's): its own
    forward gives out_proj's input n (no graph; seen by a hook held for the call), ``LinearisedScan`` the rule up to
    n, and out_proj runs on it as the block's forward ran it, with the unit tap on its input: the same value, checked
    against what the block's forward returned. ``keep(h, mask)``: where the edge scores are asked for, the block's
    input is kept for them."""
    def forward(hidden_states, *args, **kwargs):
        if not bool(torch.isfinite(hidden_states).all()):
            raise NonFiniteError(f"non-finite activations (NaN or inf) reach {where} from its input (the embeddings "
                                 "or an earlier layer: a weight NaN or inf there, or an overflow)")
        if keep is not None:
            keep(hidden_states.detach(), kwargs.get("attention_mask"))
        seen: list[Tensor] = []
        handle = block.out_proj.register_forward_pre_hook(owned(lambda _m, a: seen.append(a[0])))  # (this thread's)
        try:
            with torch.no_grad():
                value = own(hidden_states, *args, **kwargs)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise UnsupportedModelError(f"unsupported module: {where}'s forward called out_proj {len(seen)} times; "
                                        f"the {rule.name} block dpa linearises calls it once")
        readers = READERS.get().get(block)  # MIB's graph: a key and a value input besides the query's
        inputs = (hidden_states,) if readers is None else (hidden_states, readers["key"], readers["value"])
        mask = kwargs.get("attention_mask")
        copied = readers is not None and not rule.apart  # the value fed per reader is the copy's (Mamba's block)
        n = seen[0]
        if copied:
            with torch.no_grad():
                check_copy(block, seen[0], rule.scan_block(block, hidden_states, mask)[1], rule, where, hidden_states,
                           mask)
                n = rule.scan_block(block, dict(readers, query=hidden_states), mask)[1].to(n.dtype)
            readers["done"] = True  # (``readers_value``: nothing left to replace)
        n = LinearisedScan.apply(anchor, n, block, mask, mu, bias_sink, where, rule, *inputs)
        out = block.out_proj(n)
        if not copied and not agree(value, out.detach(), rule.name, block, where):  # its forward changed it
            raise UnsupportedModelError(
                f"unsupported module: {where} ({type(block).__name__}) returned another output than its out_proj "
                f"gave (relative difference {_difference(value, out):.2g}; its forward wrapped or patched, also "
                "behind a hook?): dpa refuses rather than attribute another computation with this rule")
        return out
    return forward


def check_block(layer: nn.Module, mixer: Mixer, d_model: int, i: int) -> ScanShape:
    """Layer ``i``'s Mamba-2 block is the one the rule describes: transformers' forward; in_proj
    [z | xBC | dt] and out_proj without biases, a depthwise convolution over xBC (a bias allowed: the bias share),
    the parameters dt_bias, A_log, D and the norm's weight, one per head or channel, and nothing else; and it
    computes ``scan_block``'s value on a probe (which covers its gated norm, as a probe covers every norm dpa
    freezes)."""
    block, where = own_block(layer, mixer, i)
    s = shape_of(block)
    if (s.inner != s.heads * s.head_dim or s.heads % s.groups or s.inner % s.norm_group
            or getattr(block, "activation", None) != "silu"):
        raise UnsupportedModelError(
            f"unsupported module: {where} has {s.heads} heads of {s.head_dim} for {s.inner} channels, {s.groups} "
            f"groups, a norm over groups of {s.norm_group} and activation {getattr(block, 'activation', None)!r}; "
            "the rule reads heads x head_dim channels, whole heads per group and a SiLU after the convolution")
    check_projections(layer, mixer, {mixer.in_proj: (s.rows, d_model), mixer.heads: (d_model, s.inner)}, i)
    conv = check_conv(block, where, mixer.kind, s.conv, s.kernel)
    want = {"in_proj.weight": (s.rows, d_model), "out_proj.weight": (d_model, s.inner),
            "conv1d.weight": (s.conv, 1, s.kernel), "dt_bias": (s.heads,), "A_log": (s.heads,), "D": (s.heads,),
            **({} if s.gating == "none" else {"norm.weight": (s.inner,)})}  # (Falcon-H1's released: no norm)
    input_scales(block)
    if conv.bias is not None:
        want["conv1d.bias"] = (s.conv,)
    check_computes(block, want, d_model, where, mixer.kind, RULE)
    return s


def check_conv(block: nn.Module, where: str, kind: str, channels: int, kernel: int) -> nn.Conv1d:
    """The block's ``conv1d`` is the depthwise causal convolution the scan rules read (a bias allowed)."""
    conv = getattr(block, "conv1d", None)
    if (type(conv) is not nn.Conv1d or conv.groups != channels or tuple(conv.weight.shape) != (channels, 1, kernel)
            or conv.stride != (1,) or conv.dilation != (1,)):
        raise UnsupportedModelError(
            f"unsupported module: {where}.conv1d is {type(conv).__name__ if conv is not None else 'missing'}"
            + ("" if type(conv) is not nn.Conv1d else f" of shape {tuple(conv.weight.shape)}, groups {conv.groups}, "
               f"stride {conv.stride}, dilation {conv.dilation}")
            + f"; the {kind} rule reads a depthwise nn.Conv1d over {channels} channels with {kernel} taps, "
            "stride 1 and dilation 1")
    return conv


def check_computes(block: nn.Module, want: dict[str, tuple[int, ...]], d_model: int, where: str, kind: str,
                   rule: ScanRule) -> None:
    """The block holds exactly the parameters ``want`` (name -> shape) the rule reads, and its own forward gives the
    rule's copy's value (``rule.scan_block``) on a probe (two prompts of 7 positions, the second with two padded
    ones): a patched forward, a patched function of its modelling file (its scan, its convolution, its padding mask)
    or a kernel computing something else is refused by name. To float32's rounding: the module's scan runs in
    float32 whatever the model's dtype."""
    have = {n: tuple(p.shape) for n, p in block.named_parameters()}
    if have != want:
        raise UnsupportedModelError(f"unsupported module: {where} holds the parameters {sorted(have)}; the {kind} "
                                    f"rule reads exactly {sorted(want)} with their shapes, so it would miss the others")
    w = weight_rows(block.out_proj)  # (the probe in the block's dtype and on its device)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, d_model, generator=g, dtype=torch.float64).to(w.device, w.dtype)
    mask = torch.ones(2, 7, dtype=torch.long, device=w.device)
    mask[1, :2] = 0
    training, block.training = block.training, False  # as dpa runs it: the fused training path is not attributed
    try:
        why = disagreement(lambda: block(h, attention_mask=mask), lambda: rule.scan_block(block, h, mask)[0],
                           lambda own, copy: agree(own, copy, rule.name, block, where,
                                                   tolerance(rule, block, h, mask)))
    finally:
        block.training = training
    if why is not None:
        raise UnsupportedModelError(
            f"unsupported module: {where} ({type(block).__name__}) does not compute the {rule.name} block dpa "
            f"linearises{why} (the {kind} rule, book: {rule.book}; its forward, or a function it calls, patched?): "
            "dpa refuses rather than attribute another computation with this rule")


RULE = ScanRule("Mamba-2", "state-space-duality", scan_block, scan_edges, check_block)
