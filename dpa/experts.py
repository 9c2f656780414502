"""Mixture of experts in the linearised model (book: mixture-of-experts and beyond-swiglu).

A sparse block computes y = sum_{e in top-k(x)} w_e(x) E_e(x) (+ sigmoid(x . g) S(x), a shared expert).
Linearised as every other block: the experts are *content* (each a GLU, linearised as the dense MLP:
gate path with its ratio frozen, up path; a non-gated expert, Nemotron 3's act(s) = s relu(s), as the non-gated
MLP: one branch s with mu_gate + mu_up), the router is *control*: its weights w_e depend on x through a
softmax, whose gradient is the router's delta, w_e (lambda . E_e - sum_f w_f lambda . E_f) for a softmax over
the top k (the attention delta again), or through sigmoids (Nemotron 3's: (1 - s_f) w_f (lambda . E_f -
lambda . y / c)); the router runs its own forward, so its delta is autograd's. The top-k set is frozen at its
forward value (the indices, and whatever chose them, carry no gradient). mu_expert scales the gradient entering the
experts, mu_router the gradient leaving the routing weights for the router; mu_router = 0, mu_expert = 1 conserves
the target. Experts working in a latent space (Nemotron 3's fc1/fc2 latent projections, linear) need nothing more.

dpa runs the experts itself, from the module's 3-D weights (transformers' fused layout: ``gate_up_proj``
[expert 2*d_expert d_model], ``down_proj`` [expert d_model d_expert]) in a per-expert loop with the same
arithmetic as transformers' eager loop -- whichever implementation (eager, batched_mm, grouped_mm) the model
is set to, the values are the same to rounding, and ``families.check_experts`` refuses a module holding
anything dpa would not read. Taps on the way: an expert's score is w_e . dL/dw_e (what it writes, dotted with
the target), per position; its neurons' scores a . grad_a, read as u . grad_u on the up half.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .families import LayerModules, own_forward
from .functions import ACTIVATION_RATIO, Branch, LinearisedActivation, Tap, agreeing
from .guard import wrap


def linearise_experts(session, i: int, mods: LayerModules, override: Callable, factors) -> None:
    """Install the linearised sparse block of layer ``i``: the experts' forward, and the shared expert's
    taps and factors. ``factors``: the layer's ``linearise.LayerFactors`` (``factors.mlp`` is the common factor
    the MLP's input norm already applies)."""
    block = LinearisedExperts(session, i, mods, factors)
    override(mods.experts, block.forward)
    if mods.shared is not None:
        _shared_expert(session, i, mods, override, factors.router, factors.expert, block.glu, block.expert_buffer,
                       wrap)


class LinearisedExperts:
    """Layer ``i``'s routed experts, linearised: each expert's GLU (gate: control, up: content, with the neuron
    tap), the routing weights as a control input (mu_router, with the expert tap), the experts' input scaled by
    mu_expert, and each bias an input no token owns (its share in the bias, carrying mu_expert)."""

    def __init__(self, session, i: int, mods: LayerModules, factors):
        spec, scores = session.spec, session.scores
        self.session, self.i, self.spec, self.mu, self.scores = session, i, spec, session.weights, scores
        self.anchor = session.anchor
        self.router_factor, self.expert_factor = factors.router, factors.expert
        self.experts = experts = mods.experts
        self.clamped = spec.parts.moe.glu == "clamped"
        if self.clamped:  # GPT-OSS: act(g) = c(g) sigmoid(alpha c(g)), c(g) = min(g, limit), linearised as g * ratio
            alpha, self.limit = float(experts.alpha), float(experts.limit)
            limit = self.limit
            self.act_value = lambda g: g.clamp(max=limit) * torch.sigmoid(g.clamp(max=limit) * alpha)
        self.ratio = _safe_ratio(self.act_value) if self.clamped else ACTIVATION_RATIO[spec.activation]
        # A bias inside an expert is an input no token owns, inside the expert branch: its share carries mu_expert.
        self.inner = 0.0 if self.expert_factor is None else self.expert_factor * factors.mlp
        self.bias_sink = scores.sink("bias") if scores is not None else None
        self.store = session.recording.branches if "branches" in session.record else None
        self.expert_buffer = self.neuron_buffer = None
        if scores is not None:
            b, t = scores.shape
            self.expert_buffer = scores.buffer("expert_positions", i, (b, t, spec.expert_slots))
            self.neuron_buffer = scores.buffer("neuron_positions" if scores.positions else "neurons", i,
                                               (b, t, spec.d_mlp) if scores.positions else (b, spec.d_mlp))

    def add_neurons(self, rows: Tensor, columns: slice, values: Tensor, t: int) -> None:
        """values [rows d] at token rows (flattened batch * pos) into the neuron buffer's columns."""
        buffer = self.neuron_buffer
        if buffer.dim() == 3:
            buffer.view(-1, buffer.shape[-1])[:, columns].index_add_(0, rows, values)
        else:
            buffer[:, columns].index_add_(0, rows // t, values)

    def constant(self, c: Tensor, rows: Tensor, t: int, share: float) -> Tensor:
        """A bias (or GPT-OSS's + 1) added at token rows: the value, and its share b . grad * share in the bias."""
        if self.bias_sink is None or share == 0:
            return c
        session, scores = self.session, self.scores
        n = session.only[1] if session.only is not None else scores.shape[0]  # prompts (or rows run again)

        def reduce(x, g):  # per prompt of the batch
            out = torch.zeros(n, dtype=scores.dtype, device=x.device)
            return out.index_add_(0, rows // t, (x * g).sum(-1).to(out.dtype))
        return Tap.apply(c, self.anchor, reduce, lambda v: self.bias_sink(v * share), 0.0)

    def glu(self, gate: Tensor, up: Tensor | None, rows: Tensor, columns: slice, t: int,
            act: nn.Module | None = None) -> Tensor:
        """act(gate) * up, linearised: the gate path with its ratio frozen (mu_gate), the up path (mu_up) with
        the neuron tap u . grad_u. GPT-OSS's clamped GLU: act as above, and up' = min(max(u, -limit), limit) + 1,
        linearised as u * rho(u) (rho frozen) plus the constant 1, an input no token owns (bias share). Without
        an up (non-gated experts, Nemotron-H's act(s)): the one branch s carries mu_gate + mu_up, the neuron tap
        a . grad_a on the activation's output."""
        mu = self.mu
        if self.clamped:  # (GPT-OSS's: written inline, no activation module)
            own = self.act_value
        else:
            module = act or self.experts.act_fn
            own = module.forward
            if own_forward(module):  # code not transformers': checked on every call
                own = agreeing(own, lambda s: s * self.ratio(s), f"an expert's {type(module).__name__}")
        weight = mu.gate if up is not None else mu.gate + mu.up  # (non-gated: both paths reach s)
        if weight == 0:
            with torch.no_grad():
                a = own(gate)
        else:
            a = LinearisedActivation.apply(gate, own, self.ratio, weight)
        if up is None:
            return self._neuron_tap(a, rows, columns, t, 1.0)
        if self.clamped:
            limit = self.limit
            clip = lambda u: u.clamp(min=-limit, max=limit)  # noqa: E731
            up = LinearisedActivation.apply(up, clip, _safe_ratio(clip), 1.0)
            up = up + self.constant(torch.ones_like(up), rows, t, self.inner)  # its gradient carries mu_up (below)
        return a * self._neuron_tap(up, rows, columns, t, mu.up)

    def _neuron_tap(self, x: Tensor, rows: Tensor, columns: slice, t: int, factor: float) -> Tensor:
        """The neuron tap x . grad_x into the layer's neuron buffer, with ``factor`` on the gradient passing it."""
        if self.neuron_buffer is not None and self.session.only is None:
            sink = lambda v: self.add_neurons(rows, columns, v.to(self.neuron_buffer.dtype), t)  # noqa: E731
            return Tap.apply(x, self.anchor, torch.mul, sink, factor)
        return x if factor == 1 else Branch.apply(x, factor, None, None)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The experts module's forward: the model's own arithmetic (``run_experts``) with the rules above."""
        scores, expert_factor, router_factor = self.scores, self.expert_factor, self.router_factor
        rows_total = hidden_states.shape[0]
        t = scores.shape[1] if scores is not None else rows_total
        only = self.session.only  # circuit graphs run the block again, each row keeping one expert's term (circuit.py)
        if only is not None:
            t = rows_total // only[1]
            top_k_weights = top_k_weights * (top_k_index == only[0][:, None]).to(top_k_weights.dtype)
        if self.store is not None:
            self.store[("router", self.i)] = (top_k_index.detach(), top_k_weights.detach())
        x = (hidden_states.detach() if expert_factor is None else hidden_states if expert_factor == 1
             else Branch.apply(hidden_states, expert_factor, None, None))
        expert_buffer = self.expert_buffer
        if expert_buffer is not None and only is None:
            def reduce(w, g):  # w . dL/dw per (token, slot), summed into [token expert]
                out = torch.zeros(rows_total, expert_buffer.shape[-1], dtype=expert_buffer.dtype, device=w.device)
                return out.scatter_add_(1, top_k_index, (w * g).to(out.dtype))
            sink = lambda v: expert_buffer.view(-1, expert_buffer.shape[-1]).add_(v)  # noqa: E731
            weights = Tap.apply(top_k_weights, self.anchor, reduce, sink, router_factor or 0.0)
        elif router_factor is None:
            weights = top_k_weights.detach()
        else:
            weights = top_k_weights if router_factor == 1 else Branch.apply(top_k_weights, router_factor, None, None)
        bias = lambda b, rows: self.constant(b, rows, t, self.inner)  # noqa: E731
        return run_experts(self.experts, self.spec.n_experts, self.spec.d_expert, x, top_k_index, weights,
                           lambda gate, up, rows, cols: self.glu(gate, up, rows, cols, t), bias)


def run_experts(experts: nn.Module, n: int, d_e: int, x: Tensor, index: Tensor, weights: Tensor,
                glu: Callable, bias: Callable) -> Tensor:
    """sum over the routed experts of weight * E_e(x) [tokens d_model], from the experts' fused weights, with
    transformers' eager arithmetic: ``glu(gate, up, rows, columns)`` gives each expert's activations (columns:
    its neurons among the layer's), ``bias(b, rows)`` each bias term as it is added."""
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, weights.dtype))  # (the sum in the routing weights'
    # dtype where it is wider, as transformers' loop adds Nemotron 3's float32-weighted terms in a bfloat16 model)
    transposed = getattr(experts, "is_transposed", False)
    concatenated = getattr(experts, "is_concatenated", True)
    biases = getattr(experts, "has_bias", False)
    gated = getattr(experts, "has_gate", True)  # (False: up_proj alone, act(s), Nemotron-H's)
    for e in torch.unique(index).tolist():
        if e >= n:  # an expert-parallel sentinel
            continue
        rows, slot = torch.where(index == e)
        w_gu, w_down = (experts.gate_up_proj if gated else experts.up_proj)[e], experts.down_proj[e]
        h = x[rows]
        gu = h @ w_gu if transposed else F.linear(h, w_gu)
        if biases:  # the gate's and up's shares carry their mu: the bias is below their factors
            gu = gu + bias(experts.gate_up_proj_bias[e].expand_as(gu), rows)
        gate, up = (gu, None) if not gated else gu.chunk(2, dim=-1) if concatenated else (gu[..., 0::2], gu[..., 1::2])
        a = glu(gate, up, rows, slice(e * d_e, (e + 1) * d_e))
        y = a @ w_down if transposed else F.linear(a, w_down)
        if biases:
            y = y + bias(experts.down_proj_bias[e].expand_as(y), rows)
        out = out.index_add(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
    return out.to(x.dtype)


def mask_experts(spec, mods: LayerModules, override: Callable, keep: Tensor) -> None:
    """The sparse block of one layer with its neurons multiplied by ``keep`` [rows pos|1 d_mlp] (the ablations of
    the faithfulness protocol and the widget's verify): the model's own values otherwise, and its own gradient."""
    experts = mods.experts
    if spec.parts.moe.glu == "clamped":
        alpha, limit = float(experts.alpha), float(experts.limit)
        act = lambda g: g.clamp(max=limit) * torch.sigmoid(g.clamp(max=limit) * alpha)  # noqa: E731
        up_value = lambda u: u.clamp(min=-limit, max=limit) + 1  # noqa: E731
    else:
        act, up_value = experts.act_fn.forward, (lambda u: u)

    def flat(x: Tensor) -> Tensor:  # keep as [tokens d_mlp], the rows of the flattened block input
        return keep.to(x.dtype).expand(-1, x.shape[0] // keep.shape[0] if keep.shape[1] == 1 else -1, -1
                                       ).reshape(x.shape[0], -1)

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        k = flat(hidden_states)
        glu = lambda gate, up, rows, cols: act(gate) * (1 if up is None else up_value(up)) * k[rows, cols]  # noqa: E731
        return run_experts(experts, spec.n_experts, spec.d_expert, hidden_states, top_k_index, top_k_weights,
                           glu, lambda b, rows: b)

    override(experts, forward)
    if mods.shared is not None:
        start, act_shared = spec.n_experts * spec.d_expert, mods.shared_act()

        def shared(x: Tensor) -> Tensor:  # on [rows d_model] (inside the block) or [b t d_model] (beside it)
            rows = x.reshape(-1, x.shape[-1])
            gate, up = mods.shared_glu(rows)  # (up None: a non-gated shared expert)
            return mods.shared_down(act_shared(gate) * (1 if up is None else up) * flat(rows)[:, start:]
                                    ).reshape(x.shape)
        override(mods.shared, shared)


def _safe_ratio(value: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """value(s) / s, the factor a linearisation freezes, with its limit at s = 0 (the slope there)."""
    def ratio(s: Tensor) -> Tensor:
        eps = torch.finfo(s.dtype).tiny
        small = s.abs() < eps
        at_zero = (value(torch.full_like(s[:1], 1e-6)) / 1e-6).expand_as(s) if small.any() else None
        out = value(s) / torch.where(small, torch.ones_like(s), s)
        return out if at_zero is None else torch.where(small, at_zero, out)
    return ratio


def _shared_expert(session, i, mods, override, router_factor, expert_factor, glu, expert_buffer, wrap) -> None:
    """The shared expert: Qwen2-MoE's sigmoid(x . g) S(x), or Granite's S(x) beside the sparse block, ungated. S is
    content (a GLU, its neurons after the routed experts'), its gate a control path like the router. Its expert
    score is S(x) . dL/dS, the last slot."""

    spec, anchor = session.spec, session.anchor
    shared, d_s = mods.shared, spec.d_shared
    columns = slice(spec.n_experts * spec.d_expert, spec.n_experts * spec.d_expert + d_s)

    def forward(x: Tensor) -> Tensor:  # the shared GLU from its own projections, on [rows d_model] or [b t d_model]
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        t = session.scores.shape[1] if session.scores is not None else x.shape[0]
        only = session.only
        if only is not None:
            t = x.shape[0] // only[1]
        x = x.detach() if expert_factor is None else x if expert_factor == 1 else Branch.apply(x, expert_factor,
                                                                                                  None, None)
        rows = torch.arange(x.shape[0], device=x.device)
        y = mods.shared_down(glu(*mods.shared_glu(x), rows, columns, t, mods.shared_act()))
        if only is not None:  # a row keeping a routed expert's term drops the shared expert's
            return (y * (only[0] == spec.n_experts)[:, None].to(y.dtype)).reshape(shape)
        if expert_buffer is not None:
            sink = lambda v: expert_buffer.view(-1, expert_buffer.shape[-1])[:, -1].add_(v)  # noqa: E731
            y = Tap.apply(y, anchor, lambda y, g: (y * g).sum(-1).to(expert_buffer.dtype), sink, 1)
        return y.reshape(shape)

    override(shared, forward)
    if mods.shared_gate is None:  # (Granite's, beside the block: no gate)
        return
    gate_forward = mods.shared_gate.forward
    if router_factor is None:
        override(mods.shared_gate, lambda x: gate_forward(x).detach())
    elif router_factor != 1:
        override(mods.shared_gate, lambda x: Branch.apply(gate_forward(x), router_factor, None, None))
