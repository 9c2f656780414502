"""MIB's protocol on tiny float64 models of every family (book: circuit-discovery): the reader-by-reader run against
HF's logits, f(full) = 1 and f(empty) = 0, the one-pass patched evaluation against patching edge by edge, EAP
against exact patching on a model made linear, and DPA's edge scores against dpa.attribute."""

from __future__ import annotations

import pytest
import torch

import dpa
from dpa.families import layer_modules, weight_rows
from dpa.instrument import unembed
from dpa.mib.evaluate import SIZES, area, evaluate
from dpa.mib.graph import Graph
from dpa.mib.methods import edge_scores
from dpa.mib.pairs import Pairs
from dpa.request import check_model
from tests.conftest import ALL_FAMILIES, EDGE_HYBRIDS, MHA_ONLY, PARALLEL_FAMILIES, hf_logits, tiny_model

LAYOUT = [(f, kv) for f in ALL_FAMILIES + EDGE_HYBRIDS + PARALLEL_FAMILIES for kv in ((4,) if f in MHA_ONLY else (4, 1))]


def _pairs(n=3, t=6, seed=0, metric="logit_diff", shared=0):
    """``shared``: the first tokens the same in both prompts (the patched run adds nothing there)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 96, (n, t), generator=g).tolist()
    counter = [c[:shared] + o[shared:] for c, o in zip(clean, torch.randint(3, 96, (n, t), generator=g).tolist())]
    if metric == "prob_diff":
        return Pairs(clean, counter, [[5, 6, 9]] * n, [[7, 8]] * n, metric)
    return Pairs(clean, counter, [[5]] * n, [[7 + i] for i in range(n)])


def _hf_metric(model, pairs, ids):
    with torch.no_grad():
        logits = hf_logits(model, torch.tensor(ids))[:, -1].double()
    return pairs.metric_of(list(range(len(pairs))))(logits)


def _metrics(model, pairs, kept):
    """m(circuit) per pair from the one-pass evaluation with a single size."""
    graph = Graph.of(check_model(model))
    scores = kept.double() * 2 - 1  # the kept edges first; then top(#kept) is exactly them, before pruning
    res = evaluate(model, pairs, scores, sizes=((int(kept.sum()) + 0.5) / graph.n_edges,), batch_size=2)
    return res, graph


@pytest.mark.parametrize("family,kv", LAYOUT, ids=lambda p: str(p))
def test_full_and_empty_runs_are_the_model_and_the_counterfactual(family, kv):
    model = tiny_model(family, kv)
    pairs = _pairs()
    res = evaluate(model, pairs, torch.randn(Graph.of(check_model(model)).exists.shape, dtype=torch.float64),
                   sizes=(0.0, 0.3, 1.0), batch_size=2)
    curve = res.cpr_curve
    torch.testing.assert_close(curve.full, _hf_metric(model, pairs, pairs.clean), rtol=0, atol=1e-10)
    torch.testing.assert_close(curve.empty, _hf_metric(model, pairs, pairs.counter), rtol=0, atol=1e-10)
    f = curve.f
    assert f[0].item() == 0.0 and f[-1].item() == 1.0  # exactly: the same code with every / no edge excluded
    assert curve.kept[0] == 0 and curve.kept[-1] == res.n_edges


def _brute(model, pairs, kept):
    """m(circuit) per pair, patching edge by edge: one reader at a time, each head alone (its o_proj term from
    o_proj's input and weight), every excluded edge's difference added in a Python loop."""
    spec = check_model(model)
    graph = Graph.of(spec)
    layers = layer_modules(model, spec)
    excluded = graph.excluded(kept)
    calls = {}
    hooks = [block.register_forward_pre_hook(
        lambda _m, a, k, i=i: calls.__setitem__(i, (a[1:], {x: v for x, v in k.items() if x != "hidden_states"})),
        with_kwargs=True) for j, m in enumerate(layers)
        for i, block in ((j, m.attention), (("beside", j), m.beside.attention if m.beside else None)) if block is not None]
    out = []
    try:
        for row in range(len(pairs)):
            ids = torch.tensor([pairs.clean[row]])
            with torch.no_grad():
                model(ids, use_cache=False)  # the attention arguments of this prompt (no cache: each call alone)
                cf = _brute_run(model, spec, graph, layers, calls, torch.tensor([pairs.counter[row]]), None, None)[1]
                logits = _brute_run(model, spec, graph, layers, calls, ids, excluded, cf)[0]
            out.append(pairs.metric_of([row])(logits[:, -1].double()))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(out)


def _brute_run(model, spec, graph, layers, calls, ids, excluded, other):
    mult = getattr(model.config, "residual_multiplier", 1.0)  # Granite's: each block's output, as its forward does
    x = spec.embed(model)(ids) * getattr(model.config, "embedding_multiplier", 1.0)
    if spec.positions(model) is not None:
        x = x + spec.positions(model)(torch.arange(ids.shape[1])[None])
    writes = [x]

    def read(resid, r, below):
        inp = resid
        for w in range(below):
            if excluded is not None and excluded[w, r]:
                inp = inp + (other[w] - writes[w])
        return inp

    for i, m in enumerate(layers):
        if m.attention is None:  # a layer without a token mixer (Nemotron-H's MLP layers): its heads write nothing
            writes.extend([torch.zeros_like(x)] * spec.n_heads)
            into = read(x, graph.mlp_reader(i), graph.below(i, 1))
            y = m.mlp(m.block_inputs[1](into))
            writes.append(y)
            x = x + y
            continue
        terms = []
        for mm, call, offset, count, into, out in _mixers(m, spec, calls, i):  # (Falcon-H1's: attention, then the
            terms += _unit_terms(mm, graph, call, offset, count, into, out, i, x, read)  # block beside it)
        bias = getattr(m.heads, "bias", None)
        o = sum(terms) + (0 if bias is None else bias)
        if m.post_norms[0] is not None:
            post = m.post_norms[0]
            scale = post(o) / o  # RMSNorm: gain / rms(o), elementwise
            terms = [t * scale for t in terms]
            block = post(o)
        else:
            block = o
        terms, block = [t * mult for t in terms], block * mult
        writes.extend(terms)
        mid = x + block
        source = x if spec.parallel else mid
        if m.mlp is None:  # a layer of one block (Mamba-2's): its MLP node writes nothing
            writes.append(torch.zeros_like(mid))
            x = mid
            continue
        into = read(source, graph.mlp_reader(i), graph.below(i, 1))
        h = m.block_inputs[1](into) if m.block_inputs else into
        y = m.mlp(h)
        y = y[0] if isinstance(y, tuple) else y
        y = y + m.shared(h) if m.shared_beside else y  # Granite's layer adds its shared MLP beside the sparse block
        y = (y if m.post_norms[1] is None else m.post_norms[1](y)) * mult
        writes.append(y)
        x = mid + y
    final = read(x, graph.logits, graph.n_writers)
    logits = unembed(model, _Req(spec), spec.final_norm(model)(final))
    return logits, writes


def _mixers(m, spec, calls, i):
    """Layer i's token mixers as the brute force runs them: (modules, call, first unit, units, input scale, output
    scale); attention (or a mixer), and on Falcon-H1 the Mamba-2 block beside it, its units after the heads."""
    out = [(m, calls[i], 0, spec.n_heads, m.scale("attention_in"), m.scale("attention_out"))]
    if m.beside is not None:
        out.append((m.beside, calls[("beside", i)], spec.n_heads, spec.n_beside, 1.0, m.scale("beside_out")))
    return out


def _unit_terms(m, graph, call, offset, count, into, scale, i, x, read):
    """Each of a mixer's units' output, one reader set at a time: its q, k and v readers' inputs (the layer's units
    ``offset`` + h), the block run on them (``into``: what the layer multiplies its normalised input by; a Falcon-H1
    block's own ssm_in_multiplier too), the unit's o_proj term read at the projection's input, times ``scale``."""
    hd = weight_rows(m.heads).shape[1] // count  # a unit's channels (a Mamba-2 block's: its own width)
    norm = m.block_inputs[0] if m.block_inputs else (lambda v: v)
    feed = into * getattr(m.attention, "ssm_in_multiplier", 1.0)  # (what in_proj's input is, from the block's)
    terms = []
    for h in range(count):
        normed = {name: norm(read(x, graph.reads(i, c, offset + h), graph.below(i, 0)))
                  for c, name in enumerate(("query", "key", "value"))}
        seen = {}
        hooks = []
        readers = (_mamba_readers if hasattr(m.attention, "x_proj") else  # a Mamba block or a Gated DeltaNet:
                   _delta_readers if hasattr(m.attention, "in_proj_ba") else None)  # no column of its input
        if readers is not None:  # projection is one reader's alone
            seen["z"] = readers(m.attention, normed, call[1].get("attention_mask"))
            w_o = weight_rows(m.heads)
            terms.append(seen["z"][..., h * hd:(h + 1) * hd] @ w_o[:, h * hd:(h + 1) * hd].T * scale)
            continue
        for name in ("query", "key", "value"):
            module = m.branches[name]

            def swap(mod, args, out, name=name):
                fresh = mod.forward(normed[name] * feed)
                col = m.columns.get(name)
                if col is None:
                    return fresh
                out = out.clone()
                out[..., col] = fresh[..., col]
                return out
            if name != "query":
                hooks.append(module.register_forward_hook(swap))
        hooks.append(m.heads.register_forward_pre_hook(lambda _m, a: seen.__setitem__("z", a[0])))
        try:
            m.attention(normed["query"] * into, *call[0], **call[1])
        finally:
            for hk in hooks:
                hk.remove()
        w_o = weight_rows(m.heads)
        terms.append(seen["z"][..., h * hd:(h + 1) * hd] @ w_o[:, h * hd:(h + 1) * hd].T * scale)
    return terms


def _mamba_readers(block, normed, mask):
    """A Mamba block (transformers' MambaMixer, FalconMambaMixer, JambaMambaMixer) written here from its modeling
    code, each reader with its own input (MIB's graph): z and C from the query's, B and the step from the key's, the
    content x (and its skip D x) from the value's. Returns out_proj's input."""
    inner, n, rank, t = block.intermediate_size, block.ssm_state_size, block.time_step_rank, normed["query"].shape[1]
    pad = (lambda v: v) if mask is None else (lambda v: v * mask[..., None])
    k = block.conv1d.weight.shape[-1]

    def stream(h):  # in_proj's first half, the causal depthwise convolution and its SiLU
        xi = pad(h) @ block.in_proj.weight[:inner].T
        u = torch.nn.functional.conv1d(xi.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, padding=k - 1,
                                       groups=inner)[..., :t].transpose(1, 2)
        return pad(torch.nn.functional.silu(u))

    xq, xk, xv = stream(normed["query"]), stream(normed["key"]), stream(normed["value"])
    z = pad(normed["query"]) @ block.in_proj.weight[inner:].T
    d, B, _ = block.x_proj(xk).split([rank, n, n], dim=-1)
    C = block.x_proj(xq)[..., rank + n:]
    if hasattr(block, "b_layernorm"):  # Falcon-Mamba's and Jamba's norms, the modules themselves
        d, B, C = block.dt_layernorm(d), block.b_layernorm(B), block.c_layernorm(C)
    dt = torch.nn.functional.softplus(d @ block.dt_proj.weight.T + block.dt_proj.bias.float().to(d.dtype))
    a = -torch.exp(block.A_log.float()).to(d.dtype)
    state, ys = torch.zeros(xv.shape[0], inner, n, dtype=xv.dtype), []
    for i in range(t):
        state = state * torch.exp(dt[:, i, :, None] * a) + (dt[:, i] * xv[:, i])[..., None] * B[:, i, None, :]
        ys.append((state * C[:, i, None, :]).sum(-1) + block.D.float().to(xv.dtype) * xv[:, i])
    return torch.stack(ys, dim=1) * torch.nn.functional.silu(z)


def _delta_readers(block, normed, mask):
    """A Gated DeltaNet (transformers' Qwen3NextGatedDeltaNet) written here from its modeling code, each reader with
    its own input (MIB's graph): q and the gate z from the query's, k, beta and the decay from the key's, the content v
    from the value's. The recurrence as transformers' torch_recurrent_gated_delta_rule runs it. Returns out_proj's
    input."""
    hk, hv, dk, dv = block.num_k_heads, block.num_v_heads, block.head_k_dim, block.head_v_dim
    g, t = hv // hk, normed["query"].shape[1]
    pad = (lambda v: v) if mask is None else (lambda v: v * mask[..., None])
    kernel = block.conv1d.weight.shape[-1]

    def parts(h):  # q, k, v, z [b t hk *] and b, a [b t hk g] of one input
        b_ = h.shape[0]
        return (*block.in_proj_qkvz(pad(h)).view(b_, t, hk, -1).split([dk, dk, g * dv, g * dv], dim=-1),
                *block.in_proj_ba(pad(h)).view(b_, t, hk, -1).split([g, g], dim=-1))

    (q, _, _, z, _, _), (_, k, _, _, bb, a), (_, _, v, _, _, _) = (parts(normed[n]) for n in ("query", "key", "value"))
    b_ = q.shape[0]
    mixed = torch.cat([x.reshape(b_, t, -1) for x in (q, k, v)], dim=-1)
    u = torch.nn.functional.conv1d(mixed.transpose(1, 2), block.conv1d.weight, block.conv1d.bias, padding=kernel - 1,
                                   groups=mixed.shape[-1])[..., :t].transpose(1, 2)
    q, k, v = torch.nn.functional.silu(u).split([hk * dk, hk * dk, hv * dv], dim=-1)
    unit = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = (unit(x.reshape(b_, t, hk, dk).repeat_interleave(g, dim=2)) for x in (q, k))
    q, v = q / dk ** 0.5, v.reshape(b_, t, hv, dv)
    beta = torch.sigmoid(bb.reshape(b_, t, hv))
    alpha = torch.exp(-block.A_log.float().exp() * torch.nn.functional.softplus(a.reshape(b_, t, hv).float()
                                                                                 + block.dt_bias))
    state, outs = torch.zeros(b_, hv, dk, dv, dtype=v.dtype), []
    for i in range(t):
        state = state * alpha[:, i, :, None, None]
        delta = (v[:, i] - (state * k[:, i, :, :, None]).sum(-2)) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, i, :, :, None]).sum(-2))
    o = torch.stack(outs, dim=1)
    z = z.reshape(b_, t, hv, dv)
    y = block.norm.weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + block.norm.variance_epsilon)
    return (y * torch.nn.functional.silu(z)).reshape(b_, t, -1)


class _Req:
    def __init__(self, spec):
        self.spec = spec


@pytest.mark.parametrize("family,kv", LAYOUT, ids=lambda p: str(p))
def test_one_pass_evaluation_equals_patching_edge_by_edge(family, kv):
    model = tiny_model(family, kv)
    pairs = _pairs(n=2, shared=2)
    graph = Graph.of(check_model(model))
    g = torch.Generator().manual_seed(3)
    kept = graph.prune(graph.exists & (torch.rand(graph.exists.shape, generator=g) < 0.5))
    res, _ = _metrics(model, pairs, kept)
    assert res.cpr_curve.kept == [int(kept.sum())]
    torch.testing.assert_close(res.cpr_curve.values[0], _brute(model, pairs, kept), rtol=0, atol=1e-10)


def _linear(model):
    """The tiny model made linear in its residual stream: q and k zero (uniform attention), every MLP parameter
    zero (its output is 0), every norm's eps 1e30 with its gain 1e15 (1/rms frozen at 1e-15 to float64's
    precision), no final soft-cap."""
    spec = check_model(model)
    with torch.no_grad():
        for m in layer_modules(model, spec):
            if hasattr(m.attention, "x_proj"):  # a Mamba block: its gate z zero, so that it writes nothing
                weight_rows(m.attention.in_proj)[m.attention.intermediate_size:] = 0
            if hasattr(m.attention, "in_proj_ba"):  # a Gated DeltaNet: its gate z zero (its rows per key head)
                block = m.attention
                rows = weight_rows(block.in_proj_qkvz).view(block.num_k_heads, -1, spec.d_model)
                rows[:, 2 * block.head_k_dim + block.num_v_heads // block.num_k_heads * block.head_v_dim:] = 0
            if m.beside is not None:  # a Mamba-2 block beside attention (Falcon-H1's): its query and key features
                for name in ("query", "key"):  # (z and C, B and dt) zero, so that it writes nothing
                    weight_rows(m.beside.branches[name])[m.beside.columns[name]] = 0
            if "output_gate" in m.columns:  # gated attention (Qwen3-Next): every head's gate sigmoid(0) = 1/2
                weight_rows(m.branches["query"])[m.columns["output_gate"]] = 0
            for name in () if m.attention is None or hasattr(m.attention, "x_proj") or hasattr(  # (Nemotron-H's MLP
                    m.attention, "in_proj_ba") else ("query", "key"):  # layers have no token mixer)
                rows = m.columns.get(name)
                w = weight_rows(m.branches[name])
                if rows is None:
                    w.zero_()
                else:
                    w[rows] = 0
                b = m.bias(name)
                if b is not None and rows is None:
                    b.zero_()
                elif b is not None:
                    m.branches[name].bias[rows] = 0
            for block in (m.mlp, *([m.shared] if m.shared_beside else [])) if m.mlp is not None else ():  # (and
                # Granite's shared MLP beside it; Mamba-2's layers have none)
                for p in block.parameters():
                    p.zero_()
        for name, mod in model.named_modules():
            if hasattr(mod, "weight") and ("norm" in type(mod).__name__.lower()):
                for attr in ("variance_epsilon", "eps", "epsilon"):
                    if hasattr(mod, attr):
                        setattr(mod, attr, 1e30)
                one_plus = spec.parts.norm_kind == "rms_1p"
                mod.weight.copy_(torch.full_like(mod.weight, 1e15 - (1 if one_plus else 0)))
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
    return model


LINEAR = [(f, kv) for f, kv in LAYOUT if f not in ("gemma2", "mamba", "falcon_mamba")] + [("gemma2", 4)]  # (exact
# patching of a sample of edges runs a forward per edge: 4 minutes on Mamba's 64 units a layer; Jamba runs the block)


@pytest.mark.parametrize("family,kv", LINEAR, ids=lambda p: str(p))
def test_eap_is_exact_patching_on_a_linear_model(family, kv):
    extra = {"final_logit_softcapping": None} if family == "gemma2" else {}
    model = _linear(tiny_model(family, kv, **extra))
    pairs = _pairs(n=2)
    graph = Graph.of(check_model(model))
    eap = edge_scores(model, pairs, "eap", batch_size=2)
    sample = graph.exists & (torch.rand(graph.exists.shape, generator=torch.Generator().manual_seed(0)) < 0.3)
    sample[:, graph.logits] = graph.exists[:, graph.logits]  # every edge into the logits, a third of the others
    exact = edge_scores(model, pairs, "exact", batch_size=2, edges=sample)
    assert eap[sample].abs().max() > 1e-3  # the value and logit edges carry something
    torch.testing.assert_close(exact[sample], eap[sample], rtol=1e-9, atol=1e-9 * float(eap.abs().max()))
    assert not bool((eap != 0)[~graph.exists].any()) and not bool((exact != 0)[~sample].any())
    ig = edge_scores(model, pairs, "eap-ig", batch_size=2)  # a linear model's gradient is the same at every point
    torch.testing.assert_close(ig, eap, rtol=1e-9, atol=1e-9 * float(eap.abs().max()))


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2", "qwen3_moe"])
@pytest.mark.parametrize("method,single", [("eap-ig", "eap"), ("dpa-ig", "dpa-cf")])
def test_one_interpolation_point_is_the_counterfactual_end(family, method, single):
    """With one step the interpolated methods read the gradient at the counterfactual's input alone (EAP-IG's
    points are k/steps, k = 0..steps-1): the single-point method on the swapped pairs, negated."""
    model = tiny_model(family, 4)
    pairs = _pairs(n=2)
    swapped = Pairs(pairs.counter, pairs.clean, pairs.answers, pairs.wrong)
    one = edge_scores(model, pairs, method, steps=1, batch_size=2)
    other = edge_scores(model, swapped, single, batch_size=2)
    assert one.abs().max() > 1e-6
    torch.testing.assert_close(one, -other, rtol=1e-9, atol=1e-9 * float(one.abs().max()))
    five = edge_scores(model, pairs, method, batch_size=2)
    assert not torch.allclose(five, one)


NO_CAP = [(f, kv) for f, kv in LAYOUT]


@pytest.mark.parametrize("family,kv", NO_CAP, ids=lambda p: str(p))
def test_dpa_edges_out_of_a_writer_add_up_to_its_dpa_score(family, kv):
    """out_u . g^DPA summed over u's readers is out_u . (the gradient at u's output): dpa.attribute's head score,
    its MLP's neurons (and down bias) together, the tokens' scores with the input."""
    extra = {"final_logit_softcapping": None} if family == "gemma2" else {}
    model = tiny_model(family, kv, **extra)
    spec = check_model(model)
    pairs = _pairs(n=2)
    graph = Graph.of(spec)
    scores = edge_scores(model, pairs, "dpa", batch_size=2)
    out = scores.sum(1)
    heads = torch.zeros(spec.n_layers, spec.row_width, dtype=torch.float64)
    tokens = 0.0
    for i in range(len(pairs)):
        a = dpa.attribute(model, None, pairs.clean[i], target=pairs.answers[i][0], contrast=pairs.wrong[i][0])
        heads += a.head_scores.double()
        tokens += float(a.token_scores.sum()) + float(a.position_scores.sum() if a.position_scores is not None else 0)
    got = torch.stack([out[graph.head(i, 0):graph.head(i, 0) + spec.row_width] for i in range(spec.n_layers)])
    torch.testing.assert_close(got, heads, rtol=1e-9, atol=1e-10)
    assert out[0].item() == pytest.approx(tokens, rel=1e-9, abs=1e-10)


def test_graph_counts_and_names():
    g = Graph(30, 9)  # SmolLM2-135M
    assert g.n_writers == 301 and g.n_readers == 30 * 28 + 1
    assert g.n_edges == sum(27 * (1 + 10 * i) + (10 + 10 * i) for i in range(30)) + 301
    assert g.edge_name(g.head(0, 1), g.reads(2, 0, 3)) == "a0.h1->a2.h3<q>"
    assert g.edge_name(0, g.logits) == "input->logits"
    p = Graph(2, 2, parallel=True)
    assert not bool(p.exists[p.head(0, 1), p.mlp_reader(0)])
    assert bool(Graph(2, 2).exists[1, Graph(2, 2).mlp_reader(0)])


def test_prune_drops_edges_off_every_path():
    g = Graph(2, 2)
    kept = torch.zeros_like(g.exists)
    kept[g.head(0, 0), g.mlp_reader(1)] = True  # a0.h0 -> m1, but m1 reaches nothing and nothing reaches a0.h0
    assert not bool(g.prune(kept).any())
    kept[g.mlp(1), g.logits] = True
    kept[0, g.reads(0, 2, 0)] = True  # input -> a0.h0<v>
    assert int(g.prune(kept).sum()) == 3


def test_areas_are_trapezoids_on_a_linear_axis():
    f = torch.ones(len(SIZES), dtype=torch.float64)
    assert area(f) == pytest.approx(1 - SIZES[0])
    assert area(f, absolute=True) == 0
    assert area(torch.zeros(len(SIZES), dtype=torch.float64), absolute=True) == pytest.approx(1 - SIZES[0])


def test_prob_diff_metric_runs_and_is_the_model_at_full():
    model = tiny_model("llama", 2)
    pairs = _pairs(metric="prob_diff")
    res = evaluate(model, pairs, torch.randn(Graph.of(check_model(model)).exists.shape, dtype=torch.float64),
                   sizes=(0.0, 1.0), batch_size=3)
    torch.testing.assert_close(res.cpr_curve.full, _hf_metric(model, pairs, pairs.clean), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3", "gpt_oss"])
def test_gim_edges_run_the_rule_on_the_models_own_kernel(family):
    import copy

    model = tiny_model(family, 1 if family != "phi3" else 2)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    pairs = _pairs(n=2)
    one = edge_scores(model, pairs, "gim", temperature=1.0, batch_size=2)
    assert torch.equal(one, edge_scores(model, pairs, "dpa-cf", batch_size=2))  # T = 1 is DPA
    hot = edge_scores(model, pairs, "gim", batch_size=2)  # GIM's T = 2
    assert float((hot - one).abs().max()) > 1e-6 * float(one.abs().max())
    torch.testing.assert_close(edge_scores(eager, pairs, "gim", batch_size=2), hot, rtol=0,
                               atol=1e-6 * float(hot.abs().max()))  # HF's eager softmax rounds to float32


def test_methods_refuse_what_they_do_not_take():
    model = tiny_model("llama", 2)
    pairs = _pairs(n=1)
    with pytest.raises(dpa.errors.InputError, match="one of"):
        edge_scores(model, pairs, "acdc")
    with pytest.raises(dpa.errors.InputError, match="GIM's rule"):
        edge_scores(model, pairs, "eap", temperature=2.0)
    with pytest.raises(dpa.errors.InputError, match="path weights"):
        edge_scores(model, pairs, "eap", weights=dpa.PathWeights())
    with pytest.raises(dpa.errors.InputError, match="as long"):
        Pairs([[1, 2, 3]], [[1, 2]], [[5]], [[7]])
    for bad in (dict(steps=0), dict(steps=-2), dict(steps=2.5), dict(batch_size=0)):  # never an empty loop's zeros
        with pytest.raises(dpa.errors.InputError, match="steps|batch_size"):
            edge_scores(model, pairs, "eap-ig", **bad)
    shape = Graph.of(check_model(model)).exists.shape
    for edges in (torch.ones(3, 3, dtype=torch.bool), torch.ones(1, shape[1], dtype=torch.bool),
                  torch.ones(shape), [[True]]):  # never broadcast over the writers
        with pytest.raises(dpa.errors.InputError, match="bool tensor"):
            edge_scores(model, pairs, "exact", edges=edges)
    with pytest.raises(dpa.errors.InputError, match="'exact' patches"):
        edge_scores(model, pairs, "eap", edges=torch.ones(shape, dtype=torch.bool))


def test_f_is_refused_where_it_is_undefined_and_sizes_must_increase():
    from dpa.mib.evaluate import faithfulness

    with pytest.raises(dpa.InputError, match="same mean metric"):
        faithfulness(torch.ones(2, 3), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0]))
    model = tiny_model("llama", 4)
    scores = torch.randn(Graph.of(check_model(model)).exists.shape, dtype=torch.float64)
    with pytest.raises(dpa.InputError, match="sizes must increase"):
        evaluate(model, _pairs(n=2), scores, sizes=(0.5, 0.1))
