"""The linearised model's three changes and the score taps, installed on each layer (book: modified-backward).

The autograd Functions live in ``functions.py``; each one's forward gives the model's own value, only its backward
differs:

(a) ``FrozenNorm``: a norm with its scale frozen, ``g * gamma * r`` with r = 1/rms(x) at its forward value;
(b) ``LinearisedActivation``: SiLU(s) -> s * sigmoid(s) with sigmoid(s) frozen, ``g * sigmoid(s)``;
(c) ``Branch``: the gradient entering a branch times its mu (and, with a bias, the bias's share);
``Tap``: the identity that writes ``input . gradient`` (per token, head or neuron) as the gradient
passes and hands the gradient on, times a factor.

Each block's common factor (the mu most of its branches share) is applied where it costs nothing:
in the backward of the norm that feeds the block and nothing else (its gamma * r times the factor),
so those branches need no Function of their own and the others get the ratio; the taps above it
read the gradient unscaled.
``linearise_layer`` installs them on one decoder layer, from the family description's modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from .families import LayerModules, ModelSpec, norm_eps, own_forward, weight_rows
from .functions import ACTIVATION_RATIO, Branch, FrozenNorm, LinearisedActivation, Tap, agreeing, is_one
from .guard import wrap
from .mixers import ACTIVATIONS, glu
from .rules.norm import GAIN, NORM_KINDS

@dataclass
class Scores:
    """Scores the taps write during the backward, [batch ...] in ``dtype`` once ``settle`` has run.

    During the backward each tap only appends its part (no tensor arithmetic on the way down);
    ``settle`` stacks the parts into ``tokens`` [batch pos], ``heads`` [batch layer head], ``neurons``
    [batch layer d_mlp], ``neuron_positions`` [batch layer pos d_mlp] (when asked for) and ``bias``
    [batch], the share of inputs no token owns (projection biases)."""

    spec: ModelSpec
    shape: tuple[int, int]  # (batch, pos)
    dtype: torch.dtype
    device: torch.device
    positions: bool
    parts: dict = field(default_factory=dict)
    buffers: set = field(default_factory=set)  # the keys of parts that are one buffer added into in place
    tokens: Tensor | None = None
    heads: Tensor | None = None
    neurons: Tensor | None = None
    neuron_positions: Tensor | None = None
    bias: Tensor | None = None
    position_scores: Tensor | None = None  # [batch pos] learned position embeddings' scores (GPT-2), else None
    experts: Tensor | None = None  # [batch layer slot] expert scores (mixture of experts), else None
    expert_positions: Tensor | None = None  # [batch layer pos slot]

    @classmethod
    def empty(cls, spec: ModelSpec, batch: int, pos: int, dtype: torch.dtype, device, positions: bool) -> Scores:
        return cls(spec, (batch, pos), dtype, torch.device(device), positions)

    def sink(self, kind: str, layer: int | None = None) -> Callable[[Tensor], None]:
        parts = self.parts.setdefault((kind, layer), [])
        return parts.append

    def buffer(self, kind: str, layer: int, shape: tuple[int, ...]) -> Tensor:
        """A zero tensor the taps of one layer add into in place (the experts: many small parts)."""
        out = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.parts[(kind, layer)] = [out]
        self.buffers.add((kind, layer))
        return out

    def take(self) -> Scores:
        """What the backward so far wrote, settled into a new ``Scores``; this one is left empty for the next
        backward (the taps keep writing into the same lists and buffers, so they are emptied in place)."""
        taken = Scores(self.spec, self.shape, self.dtype, self.device, self.positions)
        for key, parts in self.parts.items():
            if key in self.buffers:
                taken.parts[key] = [parts[0].clone()]
                parts[0].zero_()
            else:
                taken.parts[key] = list(parts)
                parts.clear()
        taken.settle()
        return taken

    def settle(self) -> None:
        """Turn the parts the backward appended into the score tensors."""
        b, t = self.shape
        spec = self.spec
        sizes = {"heads": (b, spec.n_heads), "neurons": (b, spec.d_mlp), "neuron_positions": (b, t, spec.d_mlp)}

        def total(kind, layer, shape):
            out = torch.zeros(shape, dtype=self.dtype, device=self.device)  # (a dense layer's neurons in a row as
            for p in self.parts.get((kind, layer)) or ():  # wide as the experts': its first columns)
                out[..., :p.shape[-1]] += p.to(self.device, self.dtype)
            return out

        self.tokens = total("tokens", None, (b, t))
        self.bias = total("bias", None, (b,))
        self.position_scores = total("positions", None, (b, t)) if ("positions", None) in self.parts else None
        kinds = ["heads", "neuron_positions" if self.positions else "neurons"]
        for kind in kinds:
            setattr(self, kind, torch.stack([total(kind, i, sizes[kind]) for i in range(spec.n_layers)], dim=1))
        if spec.n_beside:  # the units of the mixer beside attention follow the heads in each layer's row (Falcon-H1)
            self.heads = torch.cat([self.heads, torch.stack([total("beside", i, (b, spec.n_beside))
                                                             for i in range(spec.n_layers)], dim=1)], dim=-1)
        if self.positions:
            self.neurons = self.neuron_positions.sum(2)
        if spec.n_experts:  # [batch layer pos slot] and their sums over positions
            self.expert_positions = torch.stack([total("expert_positions", i, (b, t, spec.expert_slots))
                                                 for i in range(spec.n_layers)], dim=1)
            self.experts = self.expert_positions.sum(2)


_REPLICATES: dict[tuple, bool] = {}


def replicates(norm: nn.Module, value: Callable[[Tensor], tuple[Tensor, Tensor]]) -> bool:
    """Whether ``value`` gives ``norm``'s own output bit for bit: checked once per norm class, forward,
    dtype and device, on a random input. A kernel, a patched class or another arithmetic fails it and
    the module's own forward is used instead."""
    w = norm.weight
    own = norm.forward
    key = (type(norm), getattr(own, "__func__", own), w.dtype, w.device.type)
    if key not in _REPLICATES:
        x = (3 * torch.randn(4, w.shape[-1], generator=torch.Generator().manual_seed(0))).to(w.device, w.dtype)
        with torch.no_grad():
            _REPLICATES[key] = torch.equal(own(x), value(x)[0])
    return _REPLICATES[key]


def freeze_norm(norm: nn.Module, kind: str, factor: float = 1.0,
                sink: Callable | None = None) -> Callable[[Tensor], Tensor]:
    """The forward that replaces ``norm``'s inside the context: the same value, the frozen backward
    (times ``factor``); a LayerNorm's bias share goes to ``sink``."""
    gamma, eps = norm.weight.detach(), norm_eps(norm)
    beta = getattr(norm, "bias", None)
    beta = None if beta is None else beta.detach()
    arithmetic = NORM_KINDS[kind]
    value = (lambda x: arithmetic(x, gamma, eps)) if beta is None else (lambda x: arithmetic(x, gamma, eps, beta))
    if own_forward(norm):  # code not transformers' (a class of someone else's, a patch): checked on every input
        own = agreeing(norm.forward, lambda x: value(x)[0], f"a {type(norm).__name__} frozen as a {kind} norm")
    else:
        own = None if replicates(norm, value) else norm.forward
    gain = GAIN[kind](gamma)
    pull = gain if factor == 1 else gain * factor
    share = None if beta is None else beta * factor
    centre = kind == "layer"
    return lambda x: FrozenNorm.apply(x, pull, value, own, eps, centre, share, sink)


def keep_input(store: dict, key) -> Callable:
    def pre(_module, args):
        store[key] = args[0]
    return pre


def _common(*mus: float) -> float:
    """The factor a block's tap carries: the value most of its branches share, so that as few branches
    as possible need a Function of their own (q = k = 0.25, v = 0.5 -> 0.25; only v gets a factor)."""
    nonzero = [m for m in mus if m != 0]
    return max(nonzero, key=nonzero.count) if nonzero else 1.0


def _own(mu: float, common: float) -> float | None:
    return None if mu == 0 else mu / common


@dataclass(frozen=True)
class LayerFactors:
    """How one layer's path weights mu are applied in its backward (``layer_factors``)."""

    attention: float  # the attention block's common factor, on its input norm's backward
    mlp: float  # the MLP's (or sparse block's) common factor, on its input norm's backward
    branch: dict  # {query, key, value, gate, up: the factor the projection's own Function applies (None: cut)}
    activation: float | None  # the gated activation's factor (its backward carries mu_gate); None: cut
    router: float | None  # a sparse block's router and experts (None: cut, or not a mixture of experts)
    expert: float | None


def layer_factors(mu, gated: bool, moe: bool, block_norms: bool, scan: bool = False) -> LayerFactors:
    """The factorisation of the path weights: every branch's mu = its block's common factor x its own factor.

    The common factor (``_common``: the mu most of the block's branches share) rides on the backward of the norm
    that feeds the block, so most branches need no Function of their own; a branch's own factor is mu / common
    (None where mu = 0: the branch is cut). Without such norms (``block_norms`` False: OLMo 2's blocks read the
    residual stream) the common factor is 1 and every branch carries its own mu. In a gated MLP the gate's mu is
    applied in the activation's backward (the gate projection's factor is 1) and the up branch's at the neuron tap;
    a non-gated MLP (GPT-2) has one branch, s, which both paths reach: its factor is mu_gate + mu_up. A mixture of
    experts carries the block's mu on its router and experts. Dense layers and experts read the same value. A Mamba-2
    block (``scan``) applies every mu inside dpa's Function over it (ssd.py): its common factor is 1."""
    total = mu.gate + mu.up
    attention = _common(mu.query, mu.key, mu.value) if block_norms and not scan else 1.0
    mlp = ((_common(mu.router, mu.expert) if moe else _common(mu.gate, mu.up) if gated else (total or 1.0))
           if block_norms else 1.0)
    branch = {name: _own(getattr(mu, name), attention) for name in ("query", "key", "value")}
    branch["gate"] = 1.0
    branch["up"] = mu.up / mlp if gated else 1.0  # 0: cut at the neuron tap
    return LayerFactors(attention=attention, mlp=mlp, branch=branch,
                        activation=_own(mu.gate, mlp) if gated else _own(total, mlp),
                        router=_own(mu.router, mlp) if moe else None, expert=_own(mu.expert, mlp) if moe else None)


def _freeze_norms(mods: LayerModules, kind: str, f: LayerFactors, bias_sink, override) -> None:
    """Every norm of the layer frozen; a block's common factor rides on its input norm's backward."""
    for norm in mods.norms:
        factor = (f.attention if mods.block_inputs and norm is mods.block_inputs[0] else
                  f.mlp if mods.block_inputs[1:] and norm is mods.block_inputs[1] else 1.0)
        override(norm, freeze_norm(norm, kind, factor, bias_sink))
    for norm in mods.head_norms:
        override(norm, freeze_norm(norm, kind))


def linearise_layer(session, i: int, mods: LayerModules, hook, override) -> None:
    spec, mu, scores, rec = session.spec, session.weights, session.scores, session.recording
    gated = spec.parts.gated
    moe = mods.experts is not None  # a mixture of experts: the router and the experts carry the block's mu
    scan = spec.scans(i)  # a Mamba-2 block: dpa's Function applies every mu inside it (ssd.py)
    # (with a Mamba-2 block beside attention, Falcon-H1's, the two blocks share the input norm: no common factor on it)
    f = layer_factors(mu, gated, moe, bool(mods.block_inputs), scan or mods.beside is not None)
    attn_common, mlp_common = f.attention, f.mlp
    bias_sink = scores.sink("bias") if scores is not None else None
    _freeze_norms(mods, spec.parts.norm_kind, f, bias_sink, override)

    def share(common: float) -> Callable[[Tensor], None]:  # a bias's share: the branch's gradient lacks `common`
        return lambda v: bias_sink(v if common == 1 else v * common) if bias_sink is not None else None

    store = rec.branches if "branches" in session.record else None
    projections: dict[nn.Module, list[str]] = {}
    mlp_branches = () if moe or mods.mlp is None else ("gate", "up") if gated else ("up",)
    for name in (() if scan or mods.attention is None else ("query", "key", "value")) + mlp_branches:
        projections.setdefault(mods.branches[name], []).append(name)
    factors, gate_factor = f.branch, f.activation
    n_heads = spec.n_heads
    if scores is None:
        reduce, neuron_sink = None, None
    elif scores.positions:  # the per-neuron sums are taken from these afterwards
        reduce, neuron_sink = torch.mul, scores.sink("neuron_positions", i)
    else:
        reduce, neuron_sink = (lambda x, g: (x * g).sum(1)), scores.sink("neurons", i)
    for module, names in projections.items():
        common = attn_common if names[0] in ("query", "key", "value") else mlp_common
        wrap(override, module, post=_projection(mods, names, factors, share(common), store, i, session.anchor,
                                                reduce if gated else None, neuron_sink if gated else None))
    out_bias = lambda module: (lambda out: Branch.apply(out, 1.0, module.bias.detach(), share(1.0)))  # noqa: E731
    if scan:
        _linearise_scan(session, i, mods, override, bias_sink)
    units = [(mods, "heads", n_heads)] + ([(mods.beside, "beside", spec.n_beside)] if mods.beside else [])
    for block, sink, count in units:  # the unit taps: attention's heads (a mixer's units), the beside mixer's
        if block is not mods:  # (Falcon-H1's Mamba-2 block beside attention: its rule, its units after the heads)
            _linearise_scan(session, i, block, override, bias_sink)
        if block.heads is not None:  # (none where the layer's one block is an MLP: Nemotron-H's)
            wrap(override, block.heads, pre=_unit_tap(session, i, sink, count),
                 post=out_bias(block.heads) if block.heads.bias is not None else None)
    if mods.mlp is None:  # a layer of one block (Mamba-2's): no MLP
        return
    if moe:
        from .experts import linearise_experts

        linearise_experts(session, i, mods, override, f)
        return
    _linearise_dense_mlp(session, i, mods, hook, override, gate_factor, (store, reduce, neuron_sink), out_bias)


def _unit_tap(session, i: int, sink: str, count: int) -> Callable[[Tensor], Tensor]:
    """The pre-forward of a token mixer's output projection: the tap that writes each of its ``count`` units' score
    (its slice of the projection's input, dotted with the gradient) to the sink ``sink`` of layer ``i``; the input
    recorded for the edge scores (attention's heads)."""
    scores, rec = session.scores, session.recording
    unit_sink = scores.sink(sink, i) if scores is not None else None

    def tap(x):
        b, t, _ = x.shape
        reduce = lambda x, g: (x * g).view(b, t, count, -1).sum((1, 3))  # noqa: E731
        y = Tap.apply(x, session.anchor, reduce, unit_sink, 1)
        if "head_inputs" in session.record:  # (the mixer beside attention's: keyed ("beside", i))
            rec.head_inputs[i if sink == "heads" else (sink, i)] = y
        return y
    return tap


def _linearise_dense_mlp(session, i: int, mods: LayerModules, hook, override, gate_factor: float | None,
                         taps: tuple, out_bias: Callable) -> None:
    """A dense MLP's activation linearised (its ratio frozen, times the gate's factor; None: cut), the neuron tap on
    its output where the MLP is not gated, the down projection's bias share, the neuron inputs recorded."""
    spec, rec, gated = session.spec, session.recording, session.spec.parts.gated
    store, reduce, neuron_sink = taps
    ratio = ACTIVATION_RATIO[spec.activation]
    # the module's own forward gives the value; an MLP calling its activation as a function (LFM2) is run as
    # down(act(gate x) * up x) through its own projections, checked to be its value bit for bit (mixers.glu)
    own = mods.activation.forward if mods.activation is not None else ACTIVATIONS[spec.activation]
    if mods.activation is not None and own_forward(mods.activation):  # code not transformers': checked on every call
        own = agreeing(own, lambda s: s * ratio(s),
                       f"layers[{i}]'s {type(mods.activation).__name__} (as {spec.activation})")

    def act(s):
        if store is not None:
            store[("gate", i)] = s.detach()
        if gate_factor is None:
            with torch.no_grad():
                a = own(s)
        else:
            a = LinearisedActivation.apply(s, own, ratio, gate_factor)
        if not gated:  # the neuron tap: a . grad_a on the activation's output
            a = Tap.apply(a, session.anchor, reduce, neuron_sink, 1)
        return a

    if mods.activation is not None:
        override(mods.activation, act)
    else:
        mlp = glu(act)
        override(mods.mlp, lambda x: mlp(mods.branches["gate"], mods.branches["up"], mods.neurons, x))
    if mods.neurons.bias is not None:
        wrap(override, mods.neurons, post=out_bias(mods.neurons))
    if "neuron_inputs" in session.record:
        hook(mods.neurons, keep_input(rec.neuron_inputs, i), pre=True)


def _linearise_scan(session, i: int, mods: LayerModules, override, bias_sink) -> None:
    """A Mamba-2 or Mamba block (``Mixer.rule`` "scan"): its own forward for the value, dpa's Function for the rule
    up to its output projection's input (``ssd.LinearisedScan``), where the unit tap reads as on attention's heads.
    Where the edge scores are asked for (the branches recorded), its input is kept for them (the rule's
    ``scan_edges``)."""
    from .scan_rules import scan_rule
    from .ssd import linearised_forward

    store = session.recording.branches
    keep = (lambda h, mask: store.__setitem__(("scan", i), (h, mask))) if "branches" in session.record else None
    block = mods.attention
    mixer = session.spec.parts.mixer(mods.kind)
    where = f"layers[{i}].{mixer.module}"
    override(block, linearised_forward(block.forward, block, session.anchor, session.weights, bias_sink, where,
                                       scan_rule(mixer), keep))


def _projection(mods: LayerModules, names: list[str], factors: dict, share: Callable, store: dict | None, i: int,
                anchor: Tensor, reduce: Callable | None, neuron_sink: Callable | None) -> Callable:
    """The post-forward of a projection holding the branches ``names`` (one, or several where fused): record
    each branch's output, scale the gradient entering each by its factor (None: cut), take the bias share,
    and for the up branch of a gated MLP the neuron tap u . grad_u, which carries mu_up."""
    module = mods.branches[names[0]]
    bias = module.bias.detach() if getattr(module, "bias", None) is not None else None
    up = names[-1] == "up" and reduce is not None
    gated = "query" in names and "output_gate" in mods.columns  # [q | gate] per head (Qwen3-Next): the gate frozen
    fused = len(names) > 1 or gated
    recorded = (*names, "output_gate") if gated else names
    if fused:  # one factor per output feature (features of no branch, an output gate's, get none: frozen); the up
        # branch's tap reads its columns only
        width = weight_rows(module).shape[0]
        vector = torch.zeros(width, dtype=module.weight.dtype, device=module.weight.device)
        for name in names:
            cols = mods.columns[name]
            vector[cols if isinstance(cols, slice) else cols.to(vector.device)] = factors[name] or 0.0
        factor: float | Tensor | None = vector
        if up:
            cols = mods.columns["up"]
            pick = (lambda x: x[..., cols]) if isinstance(cols, slice) else (lambda x: x.index_select(-1, cols.to(x.device)))
            reduce = (lambda r: lambda x, g: r(pick(x), pick(g)))(reduce)
    else:
        factor = factors[names[0]]

    def post(out):
        if store is not None:
            for name in recorded:
                store[(name, i)] = mods.output(name, out).detach()
        if factor is None:
            return out.detach()
        if up:  # the tap reads the unscaled gradient, then passes it on times mu_up / common (per feature
            return Tap.apply(out, anchor, reduce, neuron_sink, factor)  # where fused); no bias here (checked)
        if is_one(factor) and bias is None:
            return out
        return Branch.apply(out, factor, bias, share)
    return post


# --- GIM's softmax rule on the model's own attention kernel (eager or fused) ---

TEMPERED = "dpa_tempered"  # the attention implementation name a tempered attention module's config carries


class _Sinks:
    """The attention module as its kernel sees it, with its sink logits divided by the temperature (GPT-OSS's eager
    kernel reads ``module.sinks``)."""

    def __init__(self, module: nn.Module, temperature: float):
        self._module, self.sinks = module, module.sinks / temperature

    def __getattr__(self, name):
        return getattr(self._module, name)


def tempered_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """The attention interface of a module whose config carries ``TEMPERED``: its value is the module's own kernel's
    (``config._dpa_temper``: the implementation it had, and T), and its backward to the queries and keys is GIM's
    rule. The kernel run at temperature T (scores x / T: the scale, the soft-cap and the sinks divided by T) has
    the backward (1/T) s_T * (grad_s - sum(grad_s s_T)) to x, with the same grad_s = grad_out v^T; so T times it,
    added as a term whose value is exactly zero, gives the rule, while the value path keeps the exact s."""
    implementation, temperature = module.config._dpa_temper
    kernel = _kernel(module, implementation)
    out, weights = kernel(module, query.detach(), key.detach(), value, attention_mask, **kwargs)
    hot = dict(kwargs)
    scale = kwargs.get("scaling")
    hot["scaling"] = (query.shape[-1] ** -0.5 if scale is None else scale) / temperature
    if kwargs.get("softcap") is not None:
        hot["softcap"] = kwargs["softcap"] / temperature
    if kwargs.get("s_aux") is not None:
        hot["s_aux"] = kwargs["s_aux"] / temperature
    seen = _Sinks(module, temperature) if getattr(module, "sinks", None) is not None else module
    tempered, _ = kernel(seen, query, key, value.detach(), attention_mask, **hot)
    return out + Branch.apply(tempered - tempered.detach(), float(temperature), None, None), weights


def _kernel(module: nn.Module, implementation: str | None) -> Callable:
    """The attention function a module runs for ``implementation``: its modelling file's eager one, or the
    registered kernel (sdpa)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def temper(module: nn.Module, temperature: float) -> None:
    """Give an attention module GIM's softmax rule: its own config copied, with ``TEMPERED`` as its attention
    implementation (the module's forward looks the kernel up there). The caller puts ``module.config`` back."""
    if not _proxy_config(module, TEMPERED, tempered_attention, "_dpa_temper", float(temperature)):
        raise TypeError(f"{type(module).__name__} has no config of its own to set a softmax temperature on")


def _proxy_config(module: nn.Module, name: str, kernel: Callable, key: str, setting) -> bool:
    """Put on ``module`` a copy of its config whose attention implementation is ``name`` (``kernel``, registered
    once), with ``key`` = (the implementation it had, ``setting``) for the kernel to read. False where the module
    has no config of its own. The caller puts ``module.config`` back."""
    import copy

    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, kernel)
    config = module.__dict__.get("config")
    if config is None or not hasattr(config, "_attn_implementation"):
        return False
    proxy = copy.copy(config)
    setattr(proxy, key, (config._attn_implementation, setting))
    proxy._attn_implementation_internal = name
    module.__dict__["config"] = proxy
    return True

# --- A sliding-window layer over a long input: its own kernel on bands of queries ---

BANDED = "dpa_banded"  # the attention implementation name a banded attention module's config carries
BANDED_FROM = 1024  # inputs of this many tokens or more run their sliding-window layers by bands


def banded_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """A sliding-window layer's attention over a long input, by bands of ``window`` queries: each band of queries
    reads only the keys its window can reach (``window - 1`` before its first query to its last), through the
    module's own kernel (``config._dpa_band``: the implementation it had, and the window). Softmax is taken per
    query, so this is the same attention whenever the mask hides every key outside the band; the mask is checked
    for that, and anything else runs the kernel over the whole input. The fused kernels do not skip the hidden
    blocks: over n tokens this does about 2 n window dot products per head instead of n^2 / 2."""
    implementation, window = module.config._dpa_band
    kernel = _kernel(module, implementation)
    n = query.shape[2]
    bands = [(start, min(n, start + window), max(0, start - window + 1)) for start in range(0, n, window)]
    if attention_mask is None or key.shape[2] != n or attention_mask.shape[-2:] != (n, n) or not all(_hidden(attention_mask[..., a:b, :c]) and
                                                               _hidden(attention_mask[..., a:b, b:])
                                                               for a, b, c in bands):
        return kernel(module, query, key, value, attention_mask, **kwargs)
    outs = [kernel(module, query[:, :, a:b], key[:, :, c:b], value[:, :, c:b], attention_mask[..., a:b, c:b],
                   **kwargs)[0] for a, b, c in bands]  # each [batch band head dim]: the query axis second
    return torch.cat(outs, dim=1), None


def _hidden(mask: Tensor) -> bool:
    """Whether ``mask`` (boolean: True reads; or additive) hides every key it covers."""
    return not bool((mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2).any())


def band(module: nn.Module, window: int) -> None:
    """Run a sliding-window attention module by bands (``banded_attention``): its config copied, with ``BANDED``
    as its attention implementation (a module without a config of its own runs unbanded). The caller puts
    ``module.config`` back."""
    _proxy_config(module, BANDED, banded_attention, "_dpa_band", int(window))
