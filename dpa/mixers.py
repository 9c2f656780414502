"""Token mixers other than attention (``registry.Mixer``): which layers have them, and the checks that a model's
mixer blocks and inline MLPs are what dpa's rules describe (book: gated-short-convolution).

A gated short convolution (LFM2's ``Lfm2ShortConv``) computes y = out_proj(C * conv(B * x)) with [B | C | x] =
in_proj(h): a map of degree three, linear in each of B, C and x. dpa linearises it with no Function of its own:
the block runs its own forward, and the path weights scale the gradient entering each of in_proj's three blocks of
columns, exactly as a fused q/k/v projection's (``linearise._projection``). What must hold for that to be the rule:
no bias inside the product (a bias breaks the multilinearity), a depthwise convolution with no bias, and the
block's forward transformers' own (a patched forward could compute anything else).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .errors import NonFiniteError, UnsupportedModelError
from .registry import MLP_LAYER, Family, Mixer
from .spec import get, is_projection, own_forward, weight_rows, why_not_projection


def layer_kinds(config, family: Family) -> tuple[str, ...]:
    """Each layer's token mixer from the config's ``layer_types``: "attention", or the kind of the ``Mixer`` whose
    ``layer_type`` it is; empty for a family without mixers (every layer attention)."""
    if not family.mixers:
        return ()
    by_type = {m.layer_type: m.kind for m in family.mixers}
    for t in _mlp_types(family):  # one block per layer: this type's block is an MLP or the sparse block (no token
        by_type[t] = MLP_LAYER  # mixer)
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise UnsupportedModelError(f"unsupported config: layer_types has {len(types)} entries for "
                                    f"num_hidden_layers={config.num_hidden_layers}; dpa reads each layer's mixer there")
    return tuple(by_type.get(t, "attention") for t in types)


def every_layer_kind(config, family: Family, n: int) -> tuple[str, ...]:
    """Each of the n layers' kind (``layer_kinds``), "attention" throughout for a family without mixers."""
    return layer_kinds(config, family) or ("attention",) * n


def sparse_layers(config, family: Family, n: int) -> tuple[bool, ...]:
    """Per layer, whether its MLP is the sparse block (``Experts.layers``), as the modelling code decides it from the
    config; empty where every layer's is (or the family has no experts)."""
    moe = family.moe
    if moe is None or moe.layers == "every":
        return ()
    if moe.layers == "sparse_step":  # Qwen's decoder layers
        step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", ()) or ())
        sparse = tuple(i not in dense and bool(getattr(config, "num_experts", 0)) and (i + 1) % step == 0
                       for i in range(n))
    elif moe.layers == "layer_type":  # Nemotron-H's "moe" layers
        sparse = tuple(t == moe.layer_type for t in getattr(config, "layer_types", None) or [])
    else:  # "layers_num_experts": Jamba's
        counts = list(getattr(config, moe.layers))
        if len(counts) != n:
            raise UnsupportedModelError(f"unsupported config: {moe.layers} has {len(counts)} entries for {n} layers")
        sparse = tuple(c > 1 for c in counts)
    return () if all(sparse) else sparse


def layer_descriptions(config, family: Family, n: int) -> tuple[Family, ...]:
    """Each of the n layers' description (``Family.on_layer``): its token mixer's paths, and its MLP's (dense or
    sparse, ``sparse_layers``)."""
    sparse = sparse_layers(config, family, n) or (True,) * n
    return tuple(family.on_layer(kind, s) for kind, s in zip(every_layer_kind(config, family, n), sparse))


def mixer_layer_types(family: Family) -> tuple[str, ...]:
    """The ``layer_types`` values of the family's mixer layers and MLP layers (accepted besides full and sliding
    attention)."""
    return tuple(m.layer_type for m in family.mixers) + _mlp_types(family)


def _mlp_types(family: Family) -> tuple[str, ...]:
    """The layer_types values of a family of one block per layer whose block is an MLP: dense (``mlp_layers``) or
    the sparse block (``Experts.layer_type``, Nemotron-H's "moe")."""
    if family.mlp_layers is None:
        return ()
    return (family.mlp_layers,) + ((family.moe.layer_type,) if family.moe and family.moe.layer_type else ())


def check_mixer_config(config, family: Family) -> None:
    """The settings a mixer's rule needs: each of its ``biases`` off (a bias inside y = C * conv(B * x), or on a
    Mamba-2 block's projections, makes the block no longer multilinear in its factors, so no weights summing to one
    would conserve the target)."""
    for mixer in (*family.mixers, *filter(None, [family.beside])):
        for key in mixer.biases:
            if getattr(config, key, False):
                raise UnsupportedModelError(
                    f"unsupported config setting {key}={getattr(config, key)!r}: the {family.model_type} description "
                    f"linearises its {mixer.kind} blocks as a product of factors, each linear in the block's input "
                    f"(book: {mixer.book}); a bias inside the product is not")


def check_mixer(layer: nn.Module, mixer: Mixer, d_model: int, i: int) -> None:
    """Layer ``i``'s mixer block is the one the rule describes: transformers' forward, a fused ``in_proj`` of
    3 x d_model features and an output projection d_model -> d_model, neither with a bias, and a depthwise
    convolution without a bias; nothing else holding parameters."""
    block, where = own_block(layer, mixer, i)
    check_projections(layer, mixer, {mixer.in_proj: (len(mixer.factors) * d_model, d_model),
                                     mixer.heads: (d_model, d_model)}, i)
    conv = getattr(block, "conv", None)
    if (type(conv) is not nn.Conv1d or conv.bias is not None or conv.groups != d_model
            or tuple(conv.weight.shape[:2]) != (d_model, 1)):
        raise UnsupportedModelError(
            f"unsupported module: {where}.conv is {type(conv).__name__ if conv is not None else 'missing'}"
            f"{' with a bias' if getattr(conv, 'bias', None) is not None else ''}; the {mixer.kind} rule reads a "
            f"depthwise nn.Conv1d over {d_model} channels without a bias")
    known = {f"{p.rsplit('.', 1)[-1]}.weight" for p in (mixer.in_proj, mixer.heads)} | {"conv.weight"}
    names = {n for n, _ in block.named_parameters()}
    if names != known:
        raise UnsupportedModelError(f"unsupported module: {where} holds the parameters {sorted(names)}; the "
                                    f"{mixer.kind} rule reads exactly {sorted(known)}, so it would miss the others")
    _check_computes(block, get(layer, mixer.in_proj), get(layer, mixer.heads), conv, where, mixer.kind)


def own_block(layer: nn.Module, mixer: Mixer, i: int) -> tuple[nn.Module, str]:
    """Layer ``i``'s mixer block and its name; refused by name where its forward is not transformers'."""
    where = f"layers[{i}].{mixer.module}"
    block = get(layer, mixer.module)
    if own_forward(block):
        forward = type(block).forward
        raise UnsupportedModelError(
            f"unsupported module: {where} is a {type(block).__name__} whose forward is its own "
            f"({getattr(forward, '__qualname__', forward)}, not transformers'): dpa's rule for the {mixer.kind} block "
            "is derived for transformers' computation, so what that forward changes would be attributed wrongly")
    return block, where


def check_projections(layer: nn.Module, mixer: Mixer, shapes: dict[str, tuple[int, int]], i: int) -> None:
    """Each of a mixer block's projections (path -> [out x in]) is a projection of that shape without a bias."""
    for path, want in shapes.items():
        proj = get(layer, path)
        if not is_projection(proj):
            raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is {why_not_projection(proj)}")
        shape = tuple(weight_rows(proj).shape)
        if shape != want or getattr(proj, "bias", None) is not None:
            raise UnsupportedModelError(
                f"unsupported module: layers[{i}].{path} is [{shape[0]} x {shape[1]}]"
                f"{' with a bias' if getattr(proj, 'bias', None) is not None else ''}; the {mixer.kind} rule reads "
                f"[{want[0]} x {want[1]}] without a bias")


def gated_conv(in_proj: nn.Module, out_proj: nn.Module, conv: nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
    """The gated short convolution, written from the book (gated-short-convolution): [B | C | x] = in_proj(h),
    out_proj(C * conv(B * x)) with the depthwise causal convolution (K - 1 zeros before the first position)."""
    B, C, x = in_proj(h).chunk(3, dim=-1)
    k, t = conv.weight.shape[-1], h.shape[-2]
    mixed = torch.nn.functional.conv1d((B * x).transpose(-1, -2), conv.weight, padding=k - 1, groups=conv.groups)
    return out_proj(C * mixed[..., :t].transpose(-1, -2))


def _check_computes(block: nn.Module, in_proj: nn.Module, out_proj: nn.Module, conv: nn.Conv1d, where: str,
                    kind: str) -> None:
    """The block's own forward computes the rule's block (``gated_conv``) on a probe: a patched forward (also one
    wrapped with functools.wraps), a patched function of its modelling file (its convolution, its padding mask)
    or a kernel computing something else is refused by name. To the dtype's rounding: a kernel may sum in
    another order."""
    w = weight_rows(in_proj)
    h = (torch.randn(1, 5, w.shape[1], generator=torch.Generator().manual_seed(0))).to(w.device, w.dtype)
    tol = 1e-9 if w.dtype == torch.float64 else 1e-4 if w.dtype == torch.float32 else 3e-2
    close = lambda own, want: own.shape == want.shape and torch.allclose(  # noqa: E731
        own.double(), want.double(), rtol=tol, atol=tol * float(want.abs().max()))
    why = disagreement(lambda: block(h), lambda: gated_conv(in_proj, out_proj, conv, h), close)
    if why is not None:
        raise UnsupportedModelError(
            f"unsupported module: {where} ({type(block).__name__}) does not compute out_proj(C * conv(B * x)), the "
            f"{kind} block dpa linearises{why} (its forward, or a function it calls, patched?): dpa refuses rather "
            "than attribute another computation with this rule")


def disagreement(own: Callable[[], torch.Tensor], rule: Callable[[], torch.Tensor], same: Callable) -> str | None:
    """None where a module's own computation and the rule's agree on a probe (no graph); else what the refusal says
    beside it: "" where they differ, what was raised where the module cannot run on the probe (then it is not the
    one described either)."""
    try:
        with torch.no_grad():
            return None if bool(same(own(), rule())) else ""
    except NonFiniteError:  # the weights themselves: said as for any layer
        raise
    except Exception as err:  # noqa: BLE001 -- any failure on the probe: not the module the rule describes
        return f" (on a probe it raised {type(err).__name__}: {str(err)[:200]})"


def glu(activation) -> object:
    """The dense MLP forward dpa runs where the modelling code calls its activation as a function (LFM2's
    ``w2(F.silu(w1(x)) * w3(x))``): ``down(act(gate(x)) * up(x))`` through the MLP's own projections, with
    ``activation(s)`` in the function's place (the linearised one in dpa's backward)."""
    def forward(gate: nn.Module, up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return down(activation(gate(x)) * up(x))
    return forward


ACTIVATIONS = {"silu": torch.nn.functional.silu}  # the functions modelling code calls inline, by kind


def check_inline_mlp(layer: nn.Module, family: Family, kind: str, i: int) -> None:
    """A dense MLP whose forward calls its activation as a function computes ``down(act(gate(x)) * up(x))`` with the
    activation of ``kind``, bit for bit on a probe: dpa runs it so in the linearised forward (``glu``), where the
    activation's backward is replaced."""
    mlp = get(layer, family.mlp)
    gate, up = get(layer, family.branches["gate"]), get(layer, family.branches["up"])
    down = get(layer, family.neurons)
    if kind not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {kind} called inline by layers[{i}].{family.mlp}")
    w = weight_rows(gate)
    x = (2 * torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))).to(w.device, w.dtype)
    why = disagreement(lambda: mlp(x), lambda: glu(ACTIVATIONS[kind])(gate, up, down, x), torch.equal)
    if why is not None:
        raise UnsupportedModelError(
            f"unsupported module: layers[{i}].{family.mlp} is a {type(mlp).__name__} that does not compute "
            f"{family.neurons.rsplit('.', 1)[-1]}({kind}({family.branches['gate'].rsplit('.', 1)[-1]}(x)) * "
            f"{family.branches['up'].rsplit('.', 1)[-1]}(x)), the MLP the {family.model_type} description "
            f"linearises{why}")


def mixer_edges(spec, layer: nn.Module, recording, index: int, lam: torch.Tensor) -> torch.Tensor:
    """A convolution layer's edge scores [batch unit query key], the terms its unit scores sum: with
    y_t = C_t * sum_k w_k * (B * x)_{t-k} per channel, query t reads key s = t - k through
    lambda_t * C_t * w_k * B_s * x_s, summed over the unit's channels (``lam``: the gradient at the output
    projection's input [batch pos d_model]; B, C and x the recorded branch outputs, in the forward's dtype)."""
    mixer = spec.parts.mixer(spec.kind(index))
    weight = get(layer, mixer.module).conv.weight.detach()  # [d_model 1 K]: F.conv1d with K - 1 zeros padded before
    take = lambda name: recording.branches[(name, index)].to(lam.device, lam.dtype)  # noqa: E731
    read, write = lam * take("query"), take("key") * take("value")  # lambda_t * C_t, and B_s * x_s: [b t d]
    b, t, d = lam.shape
    k_size = weight.shape[-1]
    out = lam.new_zeros(b, spec.n_heads, t, t)
    for lag in range(min(k_size, t)):
        w = weight[:, 0, k_size - 1 - lag].to(lam.device, lam.dtype)  # the tap at lag k
        term = (read[:, lag:] * w * write[:, :t - lag]).view(b, t - lag, spec.n_heads, -1).sum(-1)  # [b q unit]
        q = torch.arange(lag, t, device=lam.device)
        out[:, :, q, q - lag] = term.transpose(1, 2)
    return out
