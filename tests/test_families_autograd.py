"""One suite over the table of every supported family (SwiGLU and GeGLU alike), against an autograd computation
written here, independently of dpa: the linearised model is the HF model itself with its modules' forwards
replaced for the test (norm scales detached, act(s) = s * ratio(s) with ratio detached, each branch's output
passing mu of its gradient), and autograd's gradients give the scores.

Checked on tiny float64 models of each family and head layout: the forward oracle (the instrumented forward's
logits are the model's, bit for bit), each path alone and the default weights (token, head and neuron
scores), completeness under conservative weights, and component sums (edges to heads).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import dpa
from dpa import request
from dpa.families import layer_modules
from dpa.instrument import instrument, unembed
from dpa.linearise import Scores

from .conftest import (ALL_FAMILIES, HYBRID_FAMILIES, LAYOUTS, MHA_ONLY, MOE_FAMILIES, PARALLEL_FAMILIES, hf_logits,
                       random_ids, tiny_model)

TARGET = 5
PATHS = {"query": (1, 0, 0, 0, 0), "key": (0, 1, 0, 0, 0), "value": (0, 0, 1, 0, 0), "gate": (0, 0, 0, 1, 0),
         "up": (0, 0, 0, 0, 1), "default": (0.25, 0.25, 0.5, 0.5, 0.5),
         "router": (0, 0, 0, 0, 0, 1, 0), "expert": (0, 0, 0, 0.5, 0.5, 0, 1)}  # the last two: experts only


def path_weights(model, path):
    """PATHS[path] for this model: on a mixture of experts the GLU paths run through the experts (router 0,
    expert 1) and the default is balanced (0.5, 0.5); ``None`` where the path does not exist."""
    mu = PATHS[path]
    moe = dpa.spec_for(model).n_experts > 0
    if len(mu) == 7:
        return mu if moe else None
    return mu + ((0.5, 0.5) if path == "default" else (0, 1)) if moe else mu
# Written here from the definitions, not taken from dpa: the frozen factor of each activation and the
# diagonal each norm multiplies by besides 1/rms.
RATIO = {"silu": torch.sigmoid,
         "gelu_tanh": lambda s: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (s + 0.044715 * s ** 3))),
         "gelu": lambda s: 0.5 * (1 + torch.erf(s / math.sqrt(2))),
         "relu2": lambda s: s.clamp(min=0)}  # relu(s)^2 = s * max(s, 0)
GAIN = {"rms": lambda w: w, "rms_1p": lambda w: 1 + w, "layer": lambda w: w}
CLAMPED = {"alpha": 1.0}  # times the experts' own alpha in the reference's clamped GLU (GPT-OSS)


@pytest.fixture(scope="module", params=[(f, lay) for f in ALL_FAMILIES + HYBRID_FAMILIES + PARALLEL_FAMILIES
                                        for lay in LAYOUTS
                                        if lay == "mha" or f not in MHA_ONLY], ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    family, layout = request.param
    return tiny_model(family, LAYOUTS[layout])


def pre_cap_logits(model, ids=None, inputs_embeds=None):
    """The logits before any final soft-cap (what dpa attributes): the decoder stack, then the unembedding (divided
    by Granite's logits_scaling, times Falcon-H1's lm_head_multiplier, as their forwards do)."""
    spec = dpa.spec_for(model)
    if ids is not None:
        ids = ids[None]
    if inputs_embeds is not None and spec.family == "falcon_h1":  # (its forward multiplies the embeddings it looks up
        inputs_embeds = inputs_embeds * model.config.embedding_multiplier  # itself, not those it is given)
    logits = spec.unembed(model)(spec.base(model)(input_ids=ids, inputs_embeds=inputs_embeds).last_hidden_state)
    return logits / getattr(model.config, "logits_scaling", 1) * getattr(model.config, "lm_head_multiplier", 1)


@contextlib.contextmanager
def linearised(model, mu, moe=None):
    """The model's own modules with the three changes, as instance forwards (removed on exit). ``moe``
    collects, per sparse layer, the tensors whose gradients give the expert and expert-neuron scores."""
    moe = {} if moe is None else moe
    spec = dpa.spec_for(model)
    parts = spec.parts
    changed = []

    def set_forward(module, forward):
        module.forward = forward
        changed.append(module)

    def frozen_norm(norm):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        gain = GAIN[parts.norm_kind](norm.weight)
        if parts.norm_kind == "layer":  # (x - mean) / std with std detached, times gamma, plus beta
            return lambda x: ((x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True)
                                                                           + eps).detach() * gain + norm.bias)
        return lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach() * gain

    def scaled(module, m):  # m: one weight, or one per output feature (a fused projection)
        own = type(module).forward
        return lambda x: (lambda out: m * out + (1 - m) * out.detach())(own(module, x))

    ratio = RATIO[spec.activation]
    set_forward(spec.final_norm(model), frozen_norm(spec.final_norm(model)))
    names = ("query", "key", "value", "gate", "up", "router", "expert")
    weight = dict(zip(names, mu))
    for i, mods in enumerate(layer_modules(model, spec)):
        for norm in (*mods.norms, *mods.head_norms):
            set_forward(norm, frozen_norm(norm))
        if mods.experts is not None:  # (a dense layer of a mixed layout, Jamba's or Qwen's mlp_only_layers: below)
            set_forward(mods.experts, _experts(mods, weight, ratio, moe.setdefault(i, {})))
            if mods.shared is not None:
                set_forward(mods.shared, _shared(mods.shared, weight, ratio, moe[i]))
                if mods.shared_gate is not None:  # (Granite's shared MLP, beside the block, has none)
                    set_forward(mods.shared_gate, scaled(mods.shared_gate, weight["router"]))
        elif mods.mlp is None:  # a layer of one block (Mamba-2's): no MLP
            pass
        elif mods.activation is None:  # an MLP calling its activation as a function: down(act(gate x) * up x)
            set_forward(mods.mlp, _inline_glu(mods, ratio))
        else:
            set_forward(mods.activation, lambda s: s * ratio(s).detach())
        if mods.kind == "scan":  # a Mamba-2 or Mamba block: its whole forward, linearised as a recurrence
            block = mods.attention
            set_forward(block, (_selective_block if hasattr(block, "x_proj") else _ssm_block)(block, weight))
        if mods.beside is not None:  # a Mamba-2 block beside attention (Falcon-H1's)
            set_forward(mods.beside.attention, _ssm_block(mods.beside.attention, weight))
        if mods.kind == "delta":  # a Gated DeltaNet: its whole forward, linearised as a recurrence
            set_forward(mods.attention, _delta_block(mods.attention, weight))
        for module in {id(m): m for m in mods.branches.values()}.values():
            held = [n for n in names if mods.branches.get(n) is module]
            if mods.kind in ("scan", "delta") and held[0] == "query":  # its in_proj: weighted inside the block's
                continue
            if held == ["query"] and module.weight.shape[0] == 2 * spec.n_heads * spec.d_head:  # Qwen3-Next's gated
                m = torch.zeros(spec.n_heads, 2, spec.d_head, dtype=torch.float64)  # attention: q_proj's output is
                m[:, 0] = weight["query"]  # [q | gate] per head (its view(..., head_dim * 2).chunk(2)); the gate,
                set_forward(module, scaled(module, m.flatten()))  # a sigmoid of it times the head's output, frozen
                continue
            if not parts.gated and held == ["gate", "up"]:  # one branch s = W1 x: the gate and up paths both reach it
                set_forward(module, scaled(module, weight["gate"] + weight["up"]))  # (a mixer's gate and up inside
                continue  # its block keep their own weights: Nemotron-H's Mamba-2 blocks)
            if len(held) == 1:
                set_forward(module, scaled(module, weight[held[0]]))
                continue
            m = torch.zeros(sum(mods.weight(n).shape[0] for n in held), dtype=torch.float64)
            for n in held:  # written here from the layout, not with dpa's column index
                m[_columns(spec, n, mods.kind)] = weight[n]
            set_forward(module, scaled(module, m))
    try:
        yield
    finally:
        for module in changed:
            del module.forward


def _ssm_block(block, weight):
    """Bamba's Mamba-2 block (transformers' ``BambaMixer``), linearised, written here from its modeling code as the
    plain recurrence over positions (dpa runs the scan's attention form): per head a state S_t = exp(a Delta_t)
    S_{t-1} + Delta_t x_t B_t^T read by C_t, plus the skip D x_t. Frozen: the step Delta, the sigmoids of the two
    SiLUs, the gated norm's scale. Weighted: x (value), B (key), C (query) in the scan, y (up) and SiLU(z) (gate) at
    the norm; the skip at weight one. The decay a = -exp(A_log) rounded to float32, as the module's forward makes it.
    Falcon-H1's (``FalconH1Mixer``): its input times ssm_in_multiplier, in_proj's output times mup_vector, and no
    norm (y * SiLU(z)) or the norm of y before the gate, as its config says."""
    def m(x, mu):
        return mu * x + (1 - mu) * x.detach()

    def forward(hidden_states, attention_mask=None, **_):
        b, t, _ = hidden_states.shape
        heads, p, groups, n = block.num_heads, block.head_dim, block.n_groups, block.ssm_state_size
        inner, conv = block.intermediate_size, block.conv_dim
        pad = (lambda x: x) if attention_mask is None else (lambda x: x * attention_mask[..., None])
        projected = block.in_proj(pad(hidden_states) * getattr(block, "ssm_in_multiplier", 1.0))
        z, xbc, dt = (projected * getattr(block, "mup_vector", 1.0)).split([inner, conv, heads], dim=-1)
        k = block.conv1d.weight.shape[-1]
        u = torch.nn.functional.conv1d(xbc.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, padding=k - 1,
                                       groups=conv)[..., :t].transpose(1, 2)
        x, B, C = pad(u * torch.sigmoid(u).detach()).split([inner, groups * n, groups * n], dim=-1)
        dt = torch.nn.functional.softplus(dt + block.dt_bias).clamp(*block.time_step_limit).detach()
        a = -torch.exp(block.A_log.float()).double()
        xs, Bs, Cs = m(x, weight["value"]), m(B, weight["key"]), m(C, weight["query"])
        state, ys = torch.zeros(b, heads, p, n, dtype=x.dtype), []
        for i in range(t):
            Bi, Ci = (v[:, i].view(b, groups, n).repeat_interleave(heads // groups, dim=1) for v in (Bs, Cs))
            state = state * torch.exp(dt[:, i] * a)[..., None, None] + (
                dt[:, i, :, None] * xs[:, i].view(b, heads, p))[..., None] * Bi[:, :, None, :]
            ys.append((state * Ci[:, :, None, :]).sum(-1) + block.D[:, None] * x[:, i].view(b, heads, p))
        y = torch.stack(ys, dim=1).flatten(2)
        yz = m(y, weight["up"]) * m(z * RATIO["silu"](z).detach(), weight["gate"])  # (the SiLU gate: RATIO's)
        if isinstance(block.norm, torch.nn.Identity):  # Falcon-H1 without its gated norm (mamba_rms_norm false)
            return block.out_proj(yz)
        before = getattr(block.norm, "norm_before_gate", False)  # Falcon-H1's: the norm of y, then the gate
        size = getattr(block.norm, "group_size", None) or inner // getattr(block.norm, "n_groups", 1)
        grouped = (y if before else yz).view(b, t, -1, size)
        r = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + block.norm.variance_epsilon).detach()
        return block.out_proj(block.norm.weight * (yz.view(b, t, -1, size) * r).flatten(2))
    return forward


def _selective_block(block, weight):
    """Mamba's block (transformers' ``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``), linearised, written here from its modeling
    code: per channel a state s_t = exp(Delta_t A) s_{t-1} + Delta_t x_t B_t read by C_t, plus the skip D x_t, times
    SiLU(z). Frozen: the step Delta, the sigmoids of the two SiLUs, Falcon-Mamba's and Jamba's norms' scales (of the
    step's input, B and C). Weighted: x (value), B (key), C (query) in the scan, y (up) and SiLU(z) (gate); the skip at
    weight one. A, D and the step's bias rounded to float32, as the module's forward makes them."""
    def m(x, mu):
        return mu * x + (1 - mu) * x.detach()

    def rms(v, norm):  # FalconMambaWeightlessRMSNorm: v / rms(v), no gain; JambaRMSNorm: times its weight
        if hasattr(norm, "variance_epsilon"):
            return norm.weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps).detach()

    def forward(hidden_states, attention_mask=None, **_):
        b, t, _ = hidden_states.shape
        inner, n, rank = block.intermediate_size, block.ssm_state_size, block.time_step_rank
        pad = (lambda x: x) if attention_mask is None else (lambda x: x * attention_mask[..., None])
        xi, z = block.in_proj(pad(hidden_states)).chunk(2, dim=-1)
        k = block.conv1d.weight.shape[-1]
        u = torch.nn.functional.conv1d(xi.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, padding=k - 1,
                                       groups=inner)[..., :t].transpose(1, 2)
        x = pad(u * torch.sigmoid(u).detach())
        d, B, C = block.x_proj(x).split([rank, n, n], dim=-1)
        if hasattr(block, "b_layernorm"):
            d, B, C = rms(d, block.dt_layernorm), rms(B, block.b_layernorm), rms(C, block.c_layernorm)
        dt = torch.nn.functional.softplus(d @ block.dt_proj.weight.T + block.dt_proj.bias.float().double()).detach()
        a = -torch.exp(block.A_log.float()).double()  # [I N]
        xs, Bs, Cs = m(x, weight["value"]), m(B, weight["key"]), m(C, weight["query"])
        state, ys = torch.zeros(b, inner, n, dtype=x.dtype), []
        for i in range(t):
            state = state * torch.exp(dt[:, i, :, None] * a) + (dt[:, i] * xs[:, i])[..., None] * Bs[:, i, None, :]
            ys.append((state * Cs[:, i, None, :]).sum(-1) + block.D.float().double() * x[:, i])
        y = torch.stack(ys, dim=1)
        return block.out_proj(m(y, weight["up"]) * m(z * RATIO["silu"](z).detach(), weight["gate"]))
    return forward


def _delta_block(block, weight):
    """Qwen3-Next's Gated DeltaNet (transformers' ``Qwen3NextGatedDeltaNet``), linearised, written here from its
    modeling code as the recurrence over positions (transformers' ``torch_recurrent_gated_delta_rule``): per value head
    a state decayed by alpha_t, the memory under the key erased by beta_t and beta_t k_t v_t^T written, read by q_t;
    then the gated norm. Frozen: alpha and beta, the L2 scales of q and k, the key where it erases, the convolution's
    sigmoids, the gated norm's scale and SiLU(z)'s sigmoid. Weighted: q (query), the written k (key), v (value) in
    the rule; its output (up) and SiLU(z) (gate) at the norm. A_log and a rounded to float32, as the forward does."""
    def m(x, mu):
        return mu * x + (1 - mu) * x.detach()

    def unit(x):  # L2-normalised with the scale frozen (transformers' l2norm, eps 1e-6)
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6).detach()

    def forward(hidden_states, attention_mask=None, **_):
        b, t, _ = hidden_states.shape
        hk, hv, dk, dv = block.num_k_heads, block.num_v_heads, block.head_k_dim, block.head_v_dim
        g = hv // hk
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None]
        q, k, v, z = block.in_proj_qkvz(hidden_states).view(b, t, hk, -1).split([dk, dk, g * dv, g * dv], dim=-1)
        bb, a = block.in_proj_ba(hidden_states).view(b, t, hk, -1).split([g, g], dim=-1)
        mixed = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1)
        kernel = block.conv1d.weight.shape[-1]
        u = torch.nn.functional.conv1d(mixed.transpose(1, 2), block.conv1d.weight, block.conv1d.bias,
                                       padding=kernel - 1, groups=mixed.shape[-1])[..., :t].transpose(1, 2)
        q, k, v = (u * torch.sigmoid(u).detach()).split([hk * dk, hk * dk, hv * dv], dim=-1)
        per_value = lambda x: x.reshape(b, t, hk, dk).repeat_interleave(g, dim=2)  # noqa: E731
        erase = unit(per_value(k)).detach()
        q = unit(per_value(m(q, weight["query"]))) / dk ** 0.5
        k, v = unit(per_value(m(k, weight["key"]))), m(v, weight["value"]).reshape(b, t, hv, dv)
        beta = torch.sigmoid(bb.reshape(b, t, hv)).detach()
        alpha = torch.exp(-block.A_log.float().exp() * torch.nn.functional.softplus(
            a.reshape(b, t, hv).float() + block.dt_bias)).detach()
        state, outs = torch.zeros(b, hv, dk, dv, dtype=v.dtype), []
        for i in range(t):
            state = state * alpha[:, i, :, None, None]
            memory = (state * erase[:, i, :, :, None]).sum(-2)  # what the state holds under the key
            be = beta[:, i, :, None, None]
            state = state - be * erase[:, i, :, :, None] * memory[:, :, None, :] + be * k[:, i, :, :, None] * \
                v[:, i, :, None, :]
            outs.append((state * q[:, i, :, :, None]).sum(-2))
        o = torch.stack(outs, dim=1)  # [b t hv dv]
        r = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + block.norm.variance_epsilon).detach()
        z = z.reshape(b, t, hv, dv)
        y = block.norm.weight * m(o, weight["up"]) * r * m(z * RATIO["silu"](z).detach(), weight["gate"])
        return block.out_proj(y.reshape(b, t, -1))
    return forward


def _inline_glu(mods, ratio):
    """LFM2's MLP, w2(F.silu(w1(x)) * w3(x)), written here with SiLU linearised (its projections' forwards are
    the reference's own, scaled by mu)."""
    gate, up, down = mods.branches["gate"], mods.branches["up"], mods.neurons
    return lambda x: (lambda s: down(s * ratio(s).detach() * up(x)))(gate(x))


def _scale(x, m):
    """Identity forward, m times the gradient backward."""
    return m * x + (1 - m) * x.detach()


def _experts(mods, weight, ratio, keep):
    """HF's eager experts loop, written here, with the experts' input scaled by mu_expert, the routing weights
    by mu_router, each expert a linearised GLU (gate and up scaled by their mu)."""
    experts = mods.experts

    def forward(hidden, index, routing):
        hidden = _scale(hidden, weight["expert"])
        keep["routing"], keep["index"] = _scale(routing, weight["router"]), index
        keep["routing"].retain_grad()
        out = torch.zeros_like(hidden)
        gated = hasattr(experts, "gate_up_proj")  # (Nemotron-H's: up_proj alone, act(s))
        for e in range((experts.gate_up_proj if gated else experts.up_proj).shape[0]):
            rows, slot = torch.where(index == e)
            if not gated:  # one branch s, reached by the gate's and the up's paths
                s = _scale(torch.nn.functional.linear(hidden[rows], experts.up_proj[e]), weight["gate"] + weight["up"])
                a = s * ratio(s).detach()
                a.retain_grad()
                keep[e] = (rows, a)
                y = torch.nn.functional.linear(a, experts.down_proj[e]) * keep["routing"][rows, slot, None]
                out = out.index_add(0, rows, y)
                continue
            if hasattr(experts, "limit"):  # GPT-OSS (HF's eager code): [in, out] weights, biases, gate and up
                gu = hidden[rows] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]  # interleaved, clamped
                gate, up = _scale(gu[..., ::2], weight["gate"]), _scale(gu[..., 1::2], weight["up"])
                c = gate.clamp(max=experts.limit)
                act = c * torch.sigmoid(c * experts.alpha * CLAMPED["alpha"])
                up = up * (up.clamp(-experts.limit, experts.limit) / up).detach() + 1
                a = gate * (act / gate).detach() * up
                a.retain_grad()
                keep[e] = (rows, a)
                y = (a @ experts.down_proj[e] + experts.down_proj_bias[e]) * keep["routing"][rows, slot, None]
                out = out.index_add(0, rows, y)
                continue
            gate, up = torch.nn.functional.linear(hidden[rows], experts.gate_up_proj[e]).chunk(2, dim=-1)
            gate, up = _scale(gate, weight["gate"]), _scale(up, weight["up"])
            a = gate * ratio(gate).detach() * up
            a.retain_grad()
            keep[e] = (rows, a)
            y = torch.nn.functional.linear(a, experts.down_proj[e]) * keep["routing"][rows, slot, None]
            out = out.index_add(0, rows, y)
        return out
    return forward


def _shared(shared, weight, ratio, keep):
    """The shared expert from HF's modeling code: Qwen2-MoE's gate_proj, up_proj, down_proj; Granite 4.0-H's
    shared_mlp, whose input_linear's output chunks into gate and up, and output_linear."""
    def forward(x):
        x = _scale(x, weight["expert"])
        if hasattr(shared, "input_linear"):  # Granite
            gate, up = shared.input_linear(x).chunk(2, dim=-1)
            gate, up = _scale(gate, weight["gate"]), _scale(up, weight["up"])
            keep["shared_a"] = gate * ratio(gate).detach() * up
            keep["shared_a"].retain_grad()
            keep["shared_y"] = shared.output_linear(keep["shared_a"])
            keep["shared_y"].retain_grad()
            return keep["shared_y"]
        if not hasattr(shared, "gate_proj"):  # Nemotron-H's: act(up x), one branch
            s = _scale(shared.up_proj(x), weight["gate"] + weight["up"])
            keep["shared_a"] = s * ratio(s).detach()
            keep["shared_a"].retain_grad()
            keep["shared_y"] = shared.down_proj(keep["shared_a"])
            keep["shared_y"].retain_grad()
            return keep["shared_y"]
        gate, up = _scale(shared.gate_proj(x), weight["gate"]), _scale(shared.up_proj(x), weight["up"])
        keep["shared_a"] = gate * ratio(gate).detach() * up
        keep["shared_a"].retain_grad()
        keep["shared_y"] = shared.down_proj(keep["shared_a"])
        keep["shared_y"].retain_grad()
        return keep["shared_y"]
    return forward


def _moe_scores(spec, keep, n_tokens):
    """Expert scores [slot] and neuron scores [d_mlp] of one sparse layer from the kept tensors' gradients."""
    experts = torch.zeros(spec.expert_slots, dtype=torch.float64)
    experts.index_add_(0, keep["index"].flatten(), (keep["routing"] * keep["routing"].grad).flatten())
    neurons = torch.zeros(spec.d_mlp, dtype=torch.float64)
    for e in range(spec.n_experts):
        rows, a = keep[e]
        neurons[e * spec.d_expert:(e + 1) * spec.d_expert] = (a * a.grad).sum(0)
    if "shared_y" in keep:
        experts[-1] = (keep["shared_y"] * keep["shared_y"].grad).sum()
        neurons[spec.n_experts * spec.d_expert:] = (keep["shared_a"] * keep["shared_a"].grad).reshape(
            -1, spec.d_shared).sum(0)
    return experts, neurons


def _columns(spec, name, kind="attention"):
    """The output features of a fused projection that are branch ``name``, from HF's modeling code: Phi-3
    and GPT-2 concatenate [q | k | v] and [gate | up]; GPT-NeoX interleaves [q k v] per head. LFM2's convolution
    chunks its in_proj into B, C, x (``B, C, x = BCx.chunk(3)``), which carry mu_key, mu_query, mu_value."""
    if kind == "conv":
        d = spec.d_model
        return {"key": slice(0, d), "query": slice(d, 2 * d), "value": slice(2 * d, 3 * d)}[name]
    dh, h, kv = spec.d_head, spec.n_heads, spec.n_kv_heads
    if name in ("gate", "up"):
        return slice(0, spec.d_mlp) if name == "gate" else slice(spec.d_mlp, 2 * spec.d_mlp)
    if spec.family == "gpt_neox":
        i = ("query", "key", "value").index(name)
        return [head * 3 * dh + i * dh + d for head in range(h) for d in range(dh)]
    start = {"query": 0, "key": h * dh, "value": (h + kv) * dh}[name]
    return slice(start, start + (h if name == "query" else kv) * dh)


def autograd_scores(model, ids, mu, target=TARGET):
    """Token, head, neuron (and learned position) scores of the linearised model by plain autograd."""
    spec = dpa.spec_for(model)
    emb = spec.embed(model)(ids[None]).detach().requires_grad_(True)
    z, a, pos = {}, {}, {}

    def keep(store, i):
        def pre(_m, args):
            args[0].retain_grad()
            store[i] = args[0]
        return pre

    def keep_out(_m, _args, out):  # the position embeddings as a leaf of their own
        pos[0] = out.detach().requires_grad_(True)
        return pos[0]

    handles, moe, beside = [], {}, {}
    for i, mods in enumerate(layer_modules(model, spec)):
        if mods.heads is not None:  # (Nemotron-H's MLP layers have no token mixer, no units)
            handles.append(mods.heads.register_forward_pre_hook(keep(z, i)))
        if mods.beside is not None:  # (Falcon-H1's Mamba-2 block beside attention: its units after the heads)
            handles.append(mods.beside.heads.register_forward_pre_hook(keep(beside, i)))
        if mods.neurons is not None:
            handles.append(mods.neurons.register_forward_pre_hook(keep(a, i)))
    if spec.positions(model) is not None:
        handles.append(spec.positions(model).register_forward_hook(keep_out))
    try:
        with torch.enable_grad(), linearised(model, mu, moe):
            logits = pre_cap_logits(model, inputs_embeds=emb)
            logits[0, -1, target].backward()
    finally:
        for h in handles:
            h.remove()
    heads = torch.stack([(z[i] * z[i].grad)[0].view(len(ids), spec.n_heads, -1).sum((0, 2)) if i in z else
                         torch.zeros(spec.n_heads, dtype=torch.float64) for i in range(spec.n_layers)])
    if beside:
        heads = torch.cat([heads, torch.stack([(beside[i] * beside[i].grad)[0].view(len(ids), spec.n_beside, -1).sum(
            (0, 2)) for i in range(spec.n_layers)])], dim=1)
    neurons = torch.zeros(spec.n_layers, spec.d_mlp, dtype=torch.float64)  # (Mamba-2's: no neurons)
    experts = torch.zeros(spec.n_layers, spec.expert_slots, dtype=torch.float64) if moe else None
    for i in range(spec.n_layers):
        if i in moe:
            experts[i], neurons[i] = _moe_scores(spec, moe[i], len(ids))
        elif i in a:  # a dense MLP (a mixed layout's dense layer: the row's first columns); none on a layer without
            neurons[i, :a[i].shape[-1]] = (a[i] * a[i].grad)[0].sum(0)
    positions = (pos[0] * pos[0].grad).sum(-1).reshape(-1) if pos else None
    return (emb * emb.grad)[0].sum(-1), heads, neurons, positions, experts


@pytest.mark.parametrize("path", [p for p in PATHS if len(PATHS[p]) == 5])
def test_each_path_alone_and_the_default_equal_autograd(model, path):
    check_path_against_autograd(model, path)


@pytest.mark.parametrize("family,layout", [(f, lay) for f in MOE_FAMILIES for lay in LAYOUTS])
@pytest.mark.parametrize("path", [p for p in PATHS if len(PATHS[p]) == 7])
def test_the_router_and_the_experts_alone_equal_autograd(family, layout, path):
    check_path_against_autograd(tiny_model(family, LAYOUTS[layout]), path)


def check_path_against_autograd(model, path):
    ids = random_ids(9)
    mu = path_weights(model, path)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*mu))
    tokens, heads, neurons, positions, experts = autograd_scores(model, ids, mu)
    torch.testing.assert_close(res.token_scores, tokens, rtol=1e-9, atol=1e-11)
    if experts is not None or res.expert_scores is not None:
        torch.testing.assert_close(res.expert_scores, experts, rtol=1e-9, atol=1e-11)
    if positions is not None or res.position_scores is not None:
        torch.testing.assert_close(res.position_scores, positions, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.head_scores, heads, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.neuron_scores, neurons, rtol=1e-9, atol=1e-11)


def test_the_autograd_reference_can_fail(model):
    """The check above is not vacuous: a wrong activation ratio or a wrong norm gain changes the scores."""
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*path_weights(model, "gate")))
    kind = dpa.spec_for(model).activation
    other = "silu" if kind != "silu" else "gelu_tanh"
    saved = RATIO[kind], CLAMPED["alpha"]
    RATIO[kind] = RATIO[other]
    CLAMPED["alpha"] = 2.0  # GPT-OSS's clamped GLU: a wrong alpha in the reference
    try:
        tokens, *_ = autograd_scores(model, ids, path_weights(model, "gate"))
    finally:
        RATIO[kind], CLAMPED["alpha"] = saved
    assert not torch.allclose(res.token_scores, tokens, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("gate", [0.0, 0.5, 1.0])
def test_completeness_under_conservative_weights(model, gate):
    ids = random_ids(10)
    moe = (0, 1) if dpa.spec_for(model).n_experts else ()  # router 0, experts 1
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, gate, 1 - gate, *moe))
    assert res.weights.conservative
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    assert res.target_logit == pytest.approx(logit, rel=1e-12, abs=1e-12)
    total = float(res.token_scores.sum()) + res.position_share + res.bias_share
    assert total == pytest.approx(logit, rel=1e-8, abs=1e-10)
    capped = hf_logits(model, ids[None])[0, -1, TARGET].item()  # the model's own logit, after any final soft-cap
    if dpa.spec_for(model).final_softcap is None:
        assert res.target.capped_logit is None and capped == pytest.approx(logit, rel=1e-12)
    else:
        cap = dpa.spec_for(model).final_softcap
        assert res.target.capped_logit == pytest.approx(capped, rel=1e-12, abs=1e-14)
        assert capped == pytest.approx(math.tanh(logit / cap) * cap, rel=1e-12, abs=1e-14)


def test_the_instrumented_forward_is_the_models(model):
    ids = random_ids(11)
    plain = hf_logits(model, ids[None])
    req = request.build(model, None, ids, 3)
    spec = req.spec
    scores = Scores.empty(spec, 1, len(ids), torch.float64, req.device, False)
    with instrument(model, req, weights=dpa.PathWeights(), scores=scores, lean=False) as session:
        hidden = session.forward()
    ours, theirs = spec.unembed(model)(hidden), spec.unembed(model)(spec.base(model)(input_ids=ids[None])[0])
    if spec.n_experts == 0:  # the model's own modules, the same kernels on the same inputs: bit for bit
        assert torch.equal(ours, theirs)
    else:  # dpa runs the experts itself (experts.py): the same sums in another order, equal to float64 rounding
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)
    # and dpa's logits from its hidden states (the unembedding, Granite's division, the final soft-cap) are the model's
    torch.testing.assert_close(plain, unembed(model, req, hidden), rtol=1e-13, atol=1e-13)


def test_edges_sum_to_heads_and_positions_to_neurons(model):
    ids = random_ids(9)
    res = dpa.attribute(model, None, ids, target=TARGET, edges=True, neuron_positions=True)
    torch.testing.assert_close(res.edge_scores.sum((2, 3)), res.head_scores, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.neuron_position_scores.sum(1), res.neuron_scores, rtol=1e-9, atol=1e-11)


def test_lean_equals_full(model):
    ids = random_ids(9)
    full = dpa.attribute(model, None, ids, target=TARGET, memory="full", edges=True)
    lean = dpa.attribute(model, None, ids, target=TARGET, memory="lean", edges=True)
    for name in ("token_scores", "head_scores", "neuron_scores", "edge_scores"):
        torch.testing.assert_close(getattr(lean, name), getattr(full, name), rtol=1e-12, atol=1e-14)


def test_the_explicit_attention_path_reproduces_the_model(model):
    """dpa's readable recomputation of alpha (edges, ablations, verify) gives the model's logits, also for a
    padded batch and for local (sliding) layers with their own rotary base."""
    from dpa.instrument import logits_at

    prompts = [random_ids(11, seed=1), random_ids(7, seed=2)]
    req = request.build(model, None, prompts)
    if req.spec.mixed:  # a hybrid's mixer layers have no attention probabilities: refused by name, model untouched
        with pytest.raises(dpa.UnsupportedModelError, match=r"layers\[0\] is a (conv|scan|delta) layer"):
            with instrument(model, req, explicit=True) as session:
                session.forward()
        assert all("forward" not in vars(m.attention) for m in layer_modules(model, req.spec) if m.attention is not None)
        return
    with torch.no_grad(), instrument(model, req, explicit=True) as session:
        ours = logits_at(model, req, session.forward())
    for b, p in enumerate(prompts):
        torch.testing.assert_close(ours[b], model(p[None]).logits[0, -1], rtol=1e-10, atol=1e-10)


# --- mixture of experts: transformers' implementations, and experts dpa would not see ---

@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_experts_values_are_the_models_whichever_implementation_it_runs(family, implementation):
    """dpa runs the experts from their weights; on a float32 model set to each of transformers' expert
    implementations the attributed logit is the model's own and the scores conserve it."""
    model = tiny_model(family, 2).float()
    model.config._experts_implementation = implementation
    ids = random_ids(12)
    logit = pre_cap_logits(model, ids)[0, -1, TARGET].item()
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(0, 0, 1, 0.5, 0.5, 0, 1))
    assert res.target_logit == pytest.approx(logit, rel=1e-5, abs=1e-6)
    assert abs(res.completeness_gap) < 1e-5 * max(1.0, abs(logit))
    sparse = list(dpa.spec_for(model).expert_layers)  # (a dense layer of a mixed layout: no expert scores)
    assert not res.expert_scores[[i for i in range(res.expert_scores.shape[0]) if i not in sparse]].any()
    if not dpa.spec_for(model).parts.moe.biases:  # an expert's score is its neurons' (biases aside)
        torch.testing.assert_close(res.expert_scores[sparse].sum(1), res.neuron_scores[sparse].sum(1), rtol=1e-4,
                                   atol=1e-6)
    assert model.config._experts_implementation == implementation  # left as it was


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_dpa_does_not_read_are_refused_by_name(family):
    model = tiny_model(family, 2)
    layer = dpa.spec_for(model).expert_layers[-1]  # (the layers whose MLP is the sparse block)
    experts = layer_modules(model, dpa.spec_for(model))[layer].experts
    experts.register_parameter("scale", torch.nn.Parameter(torch.ones(4, dtype=torch.float64)))
    with pytest.raises(dpa.UnsupportedModelError, match=rf"layers\[{layer}\].*'scale'"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    del experts.scale
    experts.has_bias = not experts.has_bias
    with pytest.raises(dpa.UnsupportedModelError, match="has_bias"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    experts.has_bias = not experts.has_bias
    own = type(experts)

    class Doubled(own):  # a forward of its own: dpa runs the experts from their weights and would never see it
        def forward(self, *args):
            return 2 * super().forward(*args)
    experts.__class__ = Doubled
    with pytest.raises(dpa.UnsupportedModelError, match=rf"layers\[{layer}\]'s experts is a Doubled whose forward"):
        dpa.attribute(model, None, random_ids(5), target=TARGET)
    experts.__class__ = own


def test_router_weights_are_for_models_with_experts():
    model = tiny_model("llama", 2)
    with pytest.raises(dpa.InputError, match="no router"):
        dpa.attribute(model, None, random_ids(5), target=TARGET, weights=dpa.PathWeights(router=0.5, expert=0.5))
    with pytest.raises(dpa.InputError, match="together"):
        dpa.PathWeights(router=0.5)
    res = dpa.attribute(tiny_model("mixtral", 2), None, random_ids(5), target=TARGET)
    assert (res.weights.router, res.weights.expert) == (0.5, 0.5)  # the balanced default, recorded
    assert dpa.PathWeights.parse("0,0,1,0.5,0.5,0,1").conservative
    top = res.top_components(3)
    assert {c.kind for c in top["positive"] + top["negative"]} <= {"head", "neuron", "expert"}
    assert any(c.kind == "expert" for c in res.top_components(50, kinds=("expert",))["positive"]
               + res.top_components(50, kinds=("expert",))["negative"])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ablating_expert_neurons(family):
    """The faithfulness ablations reach the experts' neurons: keeping all gives the model's logits, keeping none
    leaves only the experts' biases (none but GPT-OSS's), one neuron off changes the logits by its own part."""
    from dpa.instrument import instrument, logits_at

    model = tiny_model(family, 2)
    spec = dpa.spec_for(model)
    ids = random_ids(8)
    req = request.build(model, None, [ids])

    def run(value, where=None):
        keep = {i: torch.full((1, 1, spec.d_mlp), value, dtype=torch.float64) for i in range(spec.n_layers)}
        if where is not None:
            keep[where[0]][0, 0, where[1]] = 1 - value
        with torch.no_grad(), instrument(model, req, neuron_keep=keep) as session:
            return logits_at(model, req, session.forward())[0]

    # (the model's logits before any cast: Nemotron-H's forward returns them in float32)
    torch.testing.assert_close(run(1.0), pre_cap_logits(model, ids)[0, -1], rtol=1e-12, atol=1e-12)
    blocks = [b for m in layer_modules(model, spec) for b in (m.mlp, *([m.shared] if m.shared_beside else []))
              if b is not None]  # (a layer without an MLP: Nemotron-H's)
    zeroed = [b.register_forward_hook(lambda _m, _a, out: (out[0] * 0, *out[1:]) if isinstance(out, tuple)
                                      else out * 0) for b in blocks]  # (Granite's shared MLP beside its block too)
    try:
        no_mlp = pre_cap_logits(model, ids)[0, -1]
    finally:
        for h in zeroed:
            h.remove()
    if not spec.parts.moe.biases:
        torch.testing.assert_close(run(0.0), no_mlp, rtol=1e-12, atol=1e-12)
    res = dpa.attribute(model, None, ids, target=TARGET)
    layer, neuron = divmod(int(res.neuron_scores.abs().flatten().argmax()), spec.d_mlp)
    assert not torch.allclose(run(1.0, (layer, neuron)), run(1.0), rtol=1e-9, atol=1e-12)
