"""Circuit graphs (book: circuits-as-graphs) against autograd, on tiny float64 models of every family and head layout.

The reference is written here, independently of dpa: the linearised model of test_families_autograd (the HF
model with its modules' forwards replaced) and, for each destination v, one forward in which every block but
v's reads a *detached* residual stream, so that only direct paths remain. Each source's write is scaled by
(1 + eps) at its own projection's input (a token's embedding, a head's slice of o_proj's input, a neuron's
activation); the gradient of S_v = z_v . G_v (G_v from a full backward of the target, held fixed) with respect
to the eps is then E(source -> v). Path patching in the linearised model is checked in forward mode: removing
out_u from v's input changes S_v by the directional derivative, exactly, because the linearised model is linear
in that input.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

import dpa
from dpa.circuit import circuit
from dpa.errors import InputError
from dpa.families import layer_modules

from .conftest import ALL_FAMILIES, HYBRID_FAMILIES, LAYOUTS, MHA_ONLY, PARALLEL_FAMILIES, random_ids, tiny_model
from .test_families_autograd import TARGET, linearised, pre_cap_logits

CONSERVATIVE = (0, 0, 1, 0.3, 0.7)
DEFAULT = (0.25, 0.25, 0.5, 0.5, 0.5)
VALUE_ONLY = (0, 0, 1, 0.5, 0.5)


def weights(model, mu):
    """``mu`` for this model: on a mixture of experts, with the router and expert weights (router 0 and experts 1
    where the GLU weights conserve, else balanced)."""
    if not dpa.spec_for(model).n_experts:
        return mu
    return mu + ((0, 1) if mu[:3] == (0, 0, 1) else (0.5, 0.5))


@pytest.fixture(scope="module", params=[(f, lay) for f in ALL_FAMILIES + HYBRID_FAMILIES + PARALLEL_FAMILIES for lay in LAYOUTS
                                        if lay == "mha" or f not in MHA_ONLY],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    family, layout = request.param
    return tiny_model(family, LAYOUTS[layout])


def _reader(mods, block):
    """The module that reads the residual stream for a block: its input norm, or the block itself (OLMo 2)."""
    if mods.block_inputs:
        return mods.block_inputs[block]
    return mods.attention if block == 0 else mods.mlp


def _blocks(mods):
    """The layer's blocks: attention (or its mixer) and the MLP, or the mixer alone (Mamba-2's layers), or the MLP
    alone (Nemotron-H's MLP layers)."""
    return tuple(b for b, block in enumerate((mods.attention, mods.mlp)) if block is not None)


def _tap(mods, block):
    return mods.heads if block == 0 else mods.neurons


class Reference:
    """Direct effects by autograd in the linearised model, as described in the module docstring."""

    def __init__(self, model, ids, mu):
        self.model, self.ids, self.mu = model, ids, mu
        self.spec = dpa.spec_for(model)
        self.mods = layer_modules(model, self.spec)
        self.G = self._tap_gradients()

    def _run(self, hooks):
        leaf = (self.spec.embed(self.model), lambda _m, _a, out: out.detach().requires_grad_(True), False)
        hooks = [leaf, *hooks]  # the embeddings as a leaf: the model's own parameters need no gradient
        handles = [module.register_forward_pre_hook(fn, with_kwargs=True) if pre else module.register_forward_hook(fn)
                   for module, fn, pre in hooks]
        try:
            with torch.enable_grad(), linearised(self.model, self.mu):
                return pre_cap_logits(self.model, self.ids)[0, -1, TARGET]
        finally:
            for h in handles:
                h.remove()

    def _tap_gradients(self):
        """G at every o_proj and down input, and at every layer's output (an expert's G): the gradient of the
        target there (a full linearised backward)."""
        z = {}

        def keep(key):
            def pre(_m, args, kwargs):
                if args[0].requires_grad:
                    args[0].retain_grad()
                z[key] = args[0]
            return pre

        def keep_out(key):
            def post(_m, _args, out):
                out = out[0] if isinstance(out, tuple) else out
                out.retain_grad()
                z[key] = out
            return post
        hooks = [(m.heads, keep((i, 0)), True) for i, m in enumerate(self.mods) if m.heads is not None]
        hooks += [(m.beside.heads, keep((i, "beside")), True) for i, m in enumerate(self.mods) if m.beside is not None]
        hooks += [(m.neurons, keep((i, 1)), True) for i, m in enumerate(self.mods) if m.neurons is not None]
        hooks += [(m.layer, keep_out((i, 1)), False) for i, m in enumerate(self.mods) if m.neurons is None]
        self._run(hooks).backward()
        G = {k: torch.zeros_like(v[0]) if v.grad is None else v.grad[0].detach() for k, v in z.items()}
        # an expert's G is at the block's output, which the layer scales before adding it (Granite's forward:
        # residual + output * residual_multiplier)
        scale = getattr(self.model.config, "residual_multiplier", 1.0)
        return {k: v * scale if k[1] == 1 and self.mods[k[0]].neurons is None else v for k, v in G.items()}

    def _beside(self, node):
        """Whether ``node`` is a unit of the block beside attention (Falcon-H1's SSM heads, after the heads)."""
        return node.kind == "head" and node.index >= self.spec.n_heads

    def _key(self, node):
        return (node.layer, "beside") if self._beside(node) else (node.layer, node.block)

    def _place(self, node):
        """The module whose input holds the unit's channels."""
        m = self.mods[node.layer]
        return m.beside.heads if self._beside(node) else _tap(m, node.block)

    def _mask(self, node, shape):
        m = torch.zeros(shape, dtype=torch.float64)
        width = self.spec.unit_width(node.layer) if node.kind == "head" else 1
        cols = slice(None) if node.kind == "expert" else slice(node.index * width, (node.index + 1) * width)
        if self._beside(node):  # its channels of the beside block's out_proj input
            j = node.index - self.spec.n_heads
            cols = slice(j * self.spec.beside_width, (j + 1) * self.spec.beside_width)
        m[slice(None) if node.position is None else node.position, cols] = 1
        return m

    def _rows(self, node, n):
        """[rows] 1 where a unit sits (its position, or every position)."""
        m = torch.zeros(n, dtype=torch.float64)
        m[slice(None) if node.position is None else node.position] = 1
        return m

    def effects(self, circ, dest):
        """E(source -> dest) for every token and unit of ``circ`` [sources], sources in the circuit's order."""
        nodes = circ.nodes
        sources = [i for i, n in enumerate(nodes) if n.kind in ("token", "head", "neuron", "expert")]
        eps = torch.zeros(len(sources), dtype=torch.float64, requires_grad=True)
        where = {i: k for k, i in enumerate(sources)}
        tokens = [i for i in sources if nodes[i].kind == "token"]
        v = nodes[dest]
        captured = {}
        hooks = []

        def scale_tokens(_m, _args, out):
            return out * (1 + eps[[where[i] for i in tokens]])[None, :, None]
        hooks.append((self.spec.embed(self.model), scale_tokens, False))
        for li, m in enumerate(self.mods):
            for b in _blocks(m):
                mine = [i for i in sources if nodes[i].kind != "token" and nodes[i].layer == li and nodes[i].block == b]
                if b == 1 and m.experts is not None:
                    hooks += self._expert_hooks(m, mine, eps, where, nodes, v if (li, b) == (v.layer, v.block) else None,
                                                captured)
                else:
                    def scale(_m, args, kwargs, mine=mine, key=(li, b)):
                        z = args[0]
                        captured[key] = z
                        factor = 1 + sum((eps[where[i]] * self._mask(nodes[i], z.shape[1:]) for i in mine),
                                         torch.zeros(z.shape[1:], dtype=torch.float64))
                        return (z * factor, *args[1:]), kwargs
                    beside = [i for i in mine if self._beside(nodes[i])]
                    hooks.append((_tap(m, b), functools.partial(scale, mine=[i for i in mine if i not in beside]),
                                  True))
                    if b == 0 and m.beside is not None:  # the units beside attention: at their own tap
                        hooks.append((m.beside.heads, functools.partial(scale, mine=beside, key=(li, "beside")),
                                      True))
                if v.kind == "target" or (li, b) != (v.layer, v.block):
                    hooks.append((_reader(m, b), _detach, True))
        value = self._run(hooks)
        if v.kind == "target":
            s = value
        elif v.kind == "expert":
            key = (v.layer, 1)
            s = (captured["term"] * self.G[key] * self._mask(v, self.G[key].shape)).sum()
        else:
            key = self._key(v)
            s = (captured[key][0] * self.G[key] * self._mask(v, self.G[key].shape)).sum()
        (grad,) = torch.autograd.grad(s, eps, allow_unused=True)
        return sources, (torch.zeros_like(eps) if grad is None else grad)

    def _expert_hooks(self, m, mine, eps, where, nodes, dest, captured):
        """A sparse block's writes scaled per expert unit: eps times a routed expert's term (the block run with
        the other experts' routing weights zeroed) added at its rows, the shared expert's output scaled at its
        rows. For a destination expert, its term of the block is kept before this layer's own units are scaled."""
        n_routed = self.spec.n_experts
        routed = [i for i in mine if nodes[i].index < n_routed]
        shared = [i for i in mine if nodes[i].index == n_routed]
        hooks = []

        def add_terms(_m, args, out):
            hidden, index, weights = args

            def term(e):  # expert e's term of the block: the other experts' routing weights zeroed
                return m.experts.forward(hidden, index, weights * (index == e).to(weights.dtype))
            if dest is not None and dest.index < n_routed:  # (experts in a latent space, Nemotron 3's: the term as
                z = term(dest.index)  # the projection out of it writes it)
                captured["term"] = z if m.latent_out is None else m.latent_out(z)
            for i in routed:
                out = out + eps[where[i]] * self._rows(nodes[i], len(hidden))[:, None] * term(nodes[i].index)
            return out
        hooks.append((m.experts, add_terms, False))
        if m.shared is not None:
            def gate(_m, _args, out):  # (HF runs the shared expert first, then its gate)
                if dest is not None and dest.index == n_routed:
                    captured["term"] = torch.sigmoid(out) * captured["shared"]

            def scale_shared(_m, _args, out):  # out [rows d], or [1 pos d] beside the block (Granite's, ungated)
                if dest is not None and dest.index == n_routed:
                    captured["shared"] = out.reshape(-1, out.shape[-1])
                    if m.shared_gate is None:
                        captured["term"] = captured["shared"]
                rows = out.reshape(-1, out.shape[-1]).shape[0]
                factor = 1 + sum((eps[where[i]] * self._rows(nodes[i], rows) for i in shared),
                                 torch.zeros(rows, dtype=torch.float64))
                return (out.reshape(rows, -1) * factor[:, None]).reshape(out.shape)
            hooks += [(m.shared, scale_shared, False)]
            hooks += [(m.shared_gate, gate, False)] if m.shared_gate is not None else []
        return hooks


def _detach(_m, args, kwargs):
    """A block reading the residual stream cut from everything below (a fresh leaf: the reference's experts keep
    their activations' gradients, so something must require one)."""
    if args:
        return (args[0].detach().requires_grad_(True), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_(True)}


def _destinations(circ):
    return [i for i, n in enumerate(circ.nodes) if n.kind in ("head", "neuron", "expert", "target")]


def _scale(circ):
    return float(circ.scores[:-1].abs().max())


@pytest.mark.parametrize("mu,positions", [(CONSERVATIVE, True), (DEFAULT, True), (DEFAULT, False)],
                         ids=["conservative", "default", "components"])
def test_every_edge_equals_autograd(model, mu, positions):
    ids = random_ids(5)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, mu)), nodes=12, positions=positions)
    ref = Reference(model, ids, weights(model, mu))
    scale = _scale(circ)
    for d in _destinations(circ):
        sources, expected = ref.effects(circ, d)
        torch.testing.assert_close(circ.edges[sources, d], expected, rtol=1e-8, atol=1e-10 * scale)


def test_the_reference_can_fail(model):
    """The comparison above is not vacuous: a direct effect through a cut block differs."""
    ids = random_ids(5)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, DEFAULT)), nodes=12)
    ref = Reference(model, ids, weights(model, VALUE_ONLY))  # other path weights: other effects
    diffs = [float((circ.edges[s, d] - e).abs().max()) for d in _destinations(circ)
             for s, e in [ref.effects(circ, d)]]
    assert max(diffs) > 1e-6 * _scale(circ)


@pytest.mark.parametrize("positions", [True, False], ids=["positions", "components"])
def test_flow_identities_on_every_unit(model, positions):
    """nodes=None: every unit is a node. Out-flow: each score is the sum of its outgoing direct effects (no
    rest); in-flow under conservative weights: each unit's incoming effects, tokens' and biases' add up to its
    score (no gap, no rest)."""
    ids = random_ids(5)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, CONSERVATIVE)), nodes=None,
                   positions=positions)
    scale = _scale(circ)
    real = [i for i, n in enumerate(circ.nodes) if n.kind != "rest"]
    assert float(circ.out_rest.abs().max()) <= 1e-8 * scale
    torch.testing.assert_close(circ.edges[real].sum(1)[:-1] + circ.out_rest[real][:-1], circ.scores[real][:-1],
                               rtol=0, atol=1e-10 * scale)
    rests = [i for i, n in enumerate(circ.nodes) if n.kind == "rest"]
    assert float(circ.scores[rests].abs().max()) <= 1e-8 * scale
    assert float(circ.in_gap.abs().max()) <= 1e-8 * scale
    inflow = circ.edges.sum(0) + circ.bias_in + circ.in_gap
    for d in _destinations(circ):
        assert float(inflow[d]) == pytest.approx(float(circ.scores[d]), rel=1e-8, abs=1e-10 * scale)
    # the scores are DPA's
    res = dpa.attribute(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, CONSERVATIVE)))
    heads = torch.zeros_like(res.head_scores)
    neurons = torch.zeros_like(res.neuron_scores)  # (a mixed layout, Jamba's: neurons and experts, by layer)
    experts = None if res.expert_scores is None else torch.zeros_like(res.expert_scores)
    for i, n in enumerate(circ.nodes):
        if n.kind == "head":
            heads[n.layer, n.index] += circ.scores[i]
        elif n.kind in ("neuron", "expert"):
            (neurons if n.kind == "neuron" else experts)[n.layer, n.index] += circ.scores[i]
    torch.testing.assert_close(heads, res.head_scores, rtol=1e-10, atol=1e-12)
    sparse = list(dpa.spec_for(model).expert_layers)  # the experts' layers; the others' units are neurons
    dense = [i for i in range(res.neuron_scores.shape[0]) if i not in sparse]
    if experts is not None:
        torch.testing.assert_close(experts, res.expert_scores, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(neurons[dense], res.neuron_scores[dense], rtol=1e-10, atol=1e-12)
    assert circ.scores[circ.target_index] == pytest.approx(res.target_logit, rel=1e-12)


def test_the_in_flow_gap_is_the_control_paths_part(model):
    """Under the default weights the in-flow misses the query/key and gate paths' part: the reported gap is
    the score minus the autograd in-flow (tokens' and units') minus the biases'."""
    ids = random_ids(5)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, DEFAULT)), nodes=12)
    ref = Reference(model, ids, weights(model, DEFAULT))
    scale = _scale(circ)
    gaps = []
    for d in _destinations(circ):
        _, e = ref.effects(circ, d)
        rest = next(i for i, n in enumerate(circ.nodes) if n.kind == "rest" and n.of == d)
        expected = circ.scores[d] - e.sum() - circ.edges[rest, d] - circ.bias_in[d]
        assert float(circ.in_gap[d]) == pytest.approx(float(expected), rel=1e-8, abs=1e-10 * scale)
        gaps.append(abs(float(circ.in_gap[d])))
    spec = dpa.spec_for(model)
    heads = [d for d in _destinations(circ) if circ.nodes[d].kind == "head"
             and spec.kind(circ.nodes[d].layer) == "attention"]
    experts = [d for d in _destinations(circ) if circ.nodes[d].kind == "expert"]
    if heads:  # an attention head's query and key paths (a softmax's first-order terms) carry a part its edges miss
        assert max(gaps) > 1e-4 * scale
    elif not experts:  # scan and convolution units' edges hold their query and key terms too (ssd.scan_edges), and a
        assert max(gaps) <= 1e-8 * scale  # neuron's gate path, a frozen-ratio activation, conserves: no gap (an
        # expert's router path, a control, may have one: checked above against the reference)


def test_path_patching_in_the_linearised_model_equals_the_edge(model):
    """Removing out_u from v's input in the linearised model (forward mode: a dual number on the write, only v's
    block reading it) changes S_v by exactly E(u -> v), for the largest edges of the graph."""
    ids = random_ids(5)
    mu = DEFAULT
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, mu)), nodes=12)
    ref = Reference(model, ids, weights(model, mu))
    units = [i for i in circ.units if circ.nodes[i].kind != "expert"]  # (an expert's write: no single tap)
    dests = [d for d in _destinations(circ) if circ.nodes[d].kind != "expert"]
    block = circ.edges[units][:, dests].abs()
    top = torch.topk(block.flatten(), 4).indices
    for k in top.tolist():
        u, d = units[k // block.shape[1]], dests[k % block.shape[1]]
        assert patched_change(ref, circ, u, d) == pytest.approx(float(circ.edges[u, d]), rel=1e-8,
                                                                abs=1e-10 * _scale(circ))


def patched_change(ref, circ, u, d):
    """S_v's change when u's write (through its projection and post-norm) is removed from the residual stream as
    v's block reads it: the tangent of S_v for a tangent -1 on u's slice of its projection input, with every
    other block reading a detached stream (the forward mode's detach drops the tangent)."""
    unit, v = circ.nodes[u], circ.nodes[d]
    captured = {}
    with forward_ad.dual_level():
        def remove(_m, args, kwargs, key=ref._key(unit)):
            z = args[0]
            captured[key] = z.detach()  # S_v reads its own tap unchanged
            tangent = -z.detach() * ref._mask(unit, z.shape[1:])
            return (forward_ad.make_dual(z.detach(), tangent), *args[1:]), kwargs
        hooks = [(ref._place(unit), remove, True)]
        for li, m in enumerate(ref.mods):
            places = [((li, b), _tap(m, b)) for b in _blocks(m)] + (
                [((li, "beside"), m.beside.heads)] if m.beside is not None else [])
            for key, tap in places:
                if key != ref._key(unit) and tap is not None:
                    hooks.append((tap, lambda _m, a, k, key=key: captured.__setitem__(key, a[0]), True))
            for b in _blocks(m):
                if v.kind == "target" or (li, b) != (v.layer, v.block):
                    hooks.append((_reader(m, b), _detach_dual, True))
        with sdpa_kernel(SDPBackend.MATH):  # (sdpa's fused CPU kernel has no forward mode)
            value = ref._run(hooks)
        if v.kind == "target":
            s = value
        else:
            key = ref._key(v)
            s = (captured[key][0] * ref.G[key] * ref._mask(v, ref.G[key].shape)).sum()
        tangent = forward_ad.unpack_dual(s).tangent
    return 0.0 if tangent is None else -float(tangent)


def _detach_dual(_m, args, kwargs):
    """A block reading the residual stream without the tangent (its value unchanged)."""
    def plain(x):
        return forward_ad.unpack_dual(x).primal
    if args:
        return (plain(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": plain(kwargs["hidden_states"])}


def test_pruning_keeps_the_flows_whole():
    model = tiny_model("llama", 2)
    ids = random_ids(6)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, CONSERVATIVE)), nodes=40)
    small = circ.prune(0.5)
    assert 0 < len(small.units) < len(circ.units)
    assert all(small.nodes[i].kind == "token" for i in range(len(ids)))
    scale = _scale(circ)
    for d in _destinations(small):  # every kept node's in-flow still adds up
        inflow = small.edges[:, d].sum() + small.bias_in[d] + small.in_gap[d]
        assert float(inflow) == pytest.approx(float(small.scores[d]), rel=1e-9, abs=1e-12 * scale)
    real = [i for i, n in enumerate(small.nodes) if n.kind not in ("rest", "target")]
    torch.testing.assert_close(small.edges[real].sum(1) + small.out_rest[real], small.scores[real], rtol=1e-9,
                               atol=1e-12 * scale)
    for d in _destinations(circ):  # a bias-free model: the in-flow by position adds up to the in-flow
        assert float(circ.in_positions[d].sum()) == pytest.approx(float(circ.edges[:, d].sum()), rel=1e-9, abs=1e-12)
    for d in _destinations(small):
        assert torch.equal(small.in_positions[d], circ.in_positions[circ.index(small.nodes[d].label)])
    assert circ.prune(1.0).units == circ.units
    assert circ.prune(0.0).units == []
    from dpa.circuit import prune_units
    infl = torch.tensor([0.5, 0.0, 0.5])
    assert prune_units(infl, [0, 1, 2], 1.0) == [0, 1, 2], "1: nothing pruned, a unit of no influence too"
    assert prune_units(infl, [0, 1, 2], 0.99) == [0, 2]
    infl = circ.influence()
    assert float(infl[circ.target_index]) == 1.0
    kept = {small.nodes[i].label for i in small.units}
    dropped = [i for i in circ.units if circ.nodes[i].label not in kept]
    assert min(float(infl[circ.index(small.nodes[i].label)]) for i in small.units) >= max(
        float(infl[i]) for i in dropped)


def test_json_and_lookup():
    model = tiny_model("gpt2", 4)
    circ = circuit(model, None, random_ids(5), target=TARGET, nodes=6)
    data = circ.to_json()
    assert data["kind"] == "circuit" and len(data["nodes"]) == len(circ.nodes)
    for s, d, e in data["edges"]:
        assert e == pytest.approx(float(circ.edges[s, d]))
    label = circ.nodes[circ.units[0]].label
    assert circ.score(label) == float(circ.scores[circ.units[0]])
    with pytest.raises(InputError, match="no node 'L9.H9@0'"):
        circ.index("L9.H9@0")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_node_counts_are_refused(bad):
    with pytest.raises(InputError, match="nodes must be"):
        circuit(tiny_model("llama"), None, random_ids(4), target=TARGET, nodes=bad)


def test_one_prompt_only():
    with pytest.raises(InputError):
        circuit(tiny_model("llama"), None, [random_ids(4), random_ids(4)], target=TARGET)


def test_verify_by_path_patching_on_the_real_model():
    """On the real (not linearised) tiny model the patched change of the target is near the edge for the largest
    edges into the target; unit -> unit edges give a finite measure; the model keeps no hook."""
    model = tiny_model("llama", 2)
    ids = random_ids(6)
    circ = circuit(model, None, ids, target=TARGET, weights=dpa.PathWeights(*weights(model, CONSERVATIVE)), nodes=10)
    t = circ.target_index
    top = torch.topk(circ.edges[circ.units, t].abs(), 3).indices.tolist()
    for k in top:
        out = circ.verify(model, None, (circ.units[k], "target"))
        assert out["edge"] == circ.edge(circ.units[k], t)
        assert out["direct"] == out["target"]
        assert 0.7 < out["ratio"] < 1.3
    pairs = [(u, d) for u in circ.units for d in circ.units if abs(circ.edge(u, d)) > 0]
    u, d = max(pairs, key=lambda p: abs(circ.edge(*p)))
    out = circ.verify(model, None, (circ.nodes[u].label, circ.nodes[d].label))
    assert all(map(lambda k: torch.isfinite(torch.tensor(out[k])), ("direct", "target")))
    assert out["direct"] * out["edge"] > 0
    assert 0.5 < out["ratio"] < 2  # the patched change against the first-order prediction (every path at mu = 1)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_verify_refuses_what_it_cannot_patch():
    model = tiny_model("llama", 2)
    circ = circuit(model, None, random_ids(6), target=TARGET, nodes=10)
    rest = next(i for i, n in enumerate(circ.nodes) if n.kind == "rest")
    with pytest.raises(InputError, match="source"):
        circ.verify(model, None, (rest, "target"))
    last, first = circ.units[-1], circ.units[0]
    with pytest.raises(InputError, match="not upstream"):
        circ.verify(model, None, (last, first))
    with pytest.raises(InputError, match="edge must be"):
        circ.verify(model, None, "target")


def test_patch_read():
    """Path patching from a position: the clean prompt as its own corruption changes nothing; another token at
    the read position changes the score; a prompt of another length, a position out of range and a rest node
    are refused."""
    model = tiny_model("llama", 2)
    ids = random_ids(6)
    circ = circuit(model, None, ids, target=TARGET, nodes=10)
    head = next(i for i in circ.units if circ.nodes[i].kind == "head" and circ.nodes[i].position == 5)
    same = circ.patch_read(model, None, head, 2, ids)
    assert same["change"] == 0 and same["clean"] == pytest.approx(circ.score(head), rel=1e-9)
    other = ids.clone()
    other[2] = (other[2] + 1) % 96
    moved = circ.patch_read(model, None, head, 2, other)
    assert moved["change"] != 0 and moved["in_flow"] == float(circ.in_positions[head, 2])
    with pytest.raises(InputError, match="same positions"):
        circ.patch_read(model, None, head, 2, ids[:4])
    with pytest.raises(InputError, match="position must be"):
        circ.patch_read(model, None, head, 9, ids)
    with pytest.raises(InputError, match="a head, a neuron or an expert"):
        circ.patch_read(model, None, "target", 2, ids)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "nemotron_h"])  # (Nemotron 3: latent experts)
def test_verify_into_an_expert(family):
    """An expert's score on the real model is its own term of the sparse block (z_v . G_v): read back from the
    clean run it is the DPA score; an edge into an expert gives a finite patched change."""
    model = tiny_model(family, 2)
    ids = random_ids(6)
    circ = circuit(model, None, ids, target=TARGET, nodes=16)
    experts = [i for i in circ.units if circ.nodes[i].kind == "expert"]
    assert experts
    for d in experts[:3]:
        same = circ.patch_read(model, None, d, 0, ids)
        assert same["clean"] == pytest.approx(circ.score(d), rel=1e-9, abs=1e-12) and same["change"] == 0
    u, d = max(((u, d) for u in circ.units for d in experts if circ.edge(u, d)), key=lambda p: abs(circ.edge(*p)))
    out = circ.verify(model, None, (u, d))
    assert all(torch.isfinite(torch.tensor(out[k])) for k in ("direct", "target", "first_order"))
