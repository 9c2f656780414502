"""Checks that the modules dpa freezes or linearises compute what their description says: each activation module
the kind the config names (``check_activations``), each norm its kind's arithmetic with its own weight and epsilon
(``check_norms``). Run by ``families.spec_for`` on every model it checks."""

from __future__ import annotations

import torch
from torch import nn

from .errors import UnsupportedModelError
from .mixers import check_inline_mlp, every_layer_kind as _kinds, layer_descriptions
from .registry import Family
from .rules.norm import NORM_KINDS
from .spec import get, norm_eps


def _computes(module: nn.Module, kind: str) -> bool:
    """Whether an activation module computes the activation ``kind`` (s * ratio(s), functions.ACTIVATION_RATIO):
    its own forward on a probe over [-8, 8] in float64, against the formula."""
    from .functions import ACTIVATION_RATIO

    s = torch.linspace(-8, 8, 161, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = module.forward(s)
    except Exception:  # noqa: BLE001 -- a module that cannot run on the probe computes no kind dpa knows
        return False
    want = s * ACTIVATION_RATIO[kind](s)
    return isinstance(out, torch.Tensor) and out.shape == s.shape and torch.allclose(
        out.to(torch.float64), want, rtol=1e-6, atol=1e-9)


def check_activations(model: nn.Module, family: Family, kind: str) -> None:
    """Every activation module dpa linearises must compute the kind the config names (``activation_kind``):
    the gate rule's frozen factor is that kind's, while the value is the module's own. A module computing
    another function (``mlp.act_fn = nn.GELU()`` in a SiLU model) is refused by name, never linearised wrongly."""
    from .functions import ACTIVATION_RATIO

    key, _ = family.activation_config
    layers = get(model, family.layers)
    for i, (layer, on) in enumerate(zip(layers, layer_descriptions(model.config, family, len(layers)))):
        if on.mlp is None:  # (one block per layer, Nemotron-H's: the MLP layers' alone)
            continue
        moe = on.moe  # (a dense layer of a mixed layout: its MLP's activation)
        paths = [p for p in (on.activation, moe and moe.shared and f"{moe.shared}.{moe.shared_parts[3]}") if p]
        if on.activation is None and on.moe is None:  # called inline (LFM2)
            check_inline_mlp(layer, on, kind, i)
        for path in paths:
            module = get(layer, path)
            if not _computes(module, kind):
                other = [k for k in ACTIVATION_RATIO if k != kind and _computes(module, k)]
                found = f"it computes {other[0]}" if other else "it computes none of " + ", ".join(ACTIVATION_RATIO)
                raise UnsupportedModelError(
                    f"unsupported module: layers[{i}].{path} is a {type(module).__name__}"
                    f"{' whose forward was replaced on the instance' if 'forward' in vars(module) else ''}"
                    " that does not compute "
                    f"{kind}, the activation the config names ({key}={getattr(model.config, key, None)!r}); {found}. "
                    "dpa linearises the activation the config names, so it refuses rather than attribute with "
                    "another activation's gate rule")


def check_norms(model: nn.Module, family: Family) -> None:
    """Every norm dpa freezes must compute its kind's arithmetic (``rules.norm.NORM_KINDS``) with its own weight
    (and bias) and epsilon: the frozen backward is built from them, the value is the module's own. A norm computing
    something else (a subclass with another forward, an adapter) is refused by name. Checked on a probe [4, width]
    in the norm's dtype and device against the arithmetic in float64, to the dtype's rounding."""
    arithmetic = NORM_KINDS[family.norm_kind]
    layers = get(model, family.layers)
    kinds = _kinds(model.config, family, len(layers))
    where = [(f"layers[{i}].{path}", get(layer, path)) for i, layer in enumerate(layers)
             for path in (*family.norms, *(family.on_layer(kinds[i]).head_norms or ()))] + [
        (family.final_norm, get(model, family.final_norm))]
    probes: dict = {}
    for name, norm in where:
        w = getattr(norm, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise UnsupportedModelError(f"unsupported module: {name} is a {type(norm).__name__} without a 1-D weight "
                                        f"(the {family.norm_kind} norm of the {family.model_type} description has one)")
        key = (w.shape[0], w.dtype, w.device)
        if key not in probes:
            g = torch.Generator().manual_seed(0)
            probes[key] = (3 * torch.randn(4, w.shape[0], generator=g, dtype=torch.float64)).to(w.device, w.dtype)
        x = probes[key]
        beta = getattr(norm, "bias", None)
        with torch.no_grad():
            try:
                own = norm.forward(x)
            except Exception as err:  # noqa: BLE001
                raise UnsupportedModelError(f"unsupported module: {name} ({type(norm).__name__}) does not run as a "
                                            f"norm over its weight's width ({err})") from None
            extra = () if beta is None else (beta.detach().double(),)
            want = arithmetic(x.double(), w.detach().double(), norm_eps(norm), *extra)[0]
        miss = (own.double() - want).norm() / want.norm() if isinstance(own, torch.Tensor) and own.shape == x.shape \
            else float("inf")
        if not miss <= 1e-5 + 16 * torch.finfo(w.dtype).eps:
            raise UnsupportedModelError(
                f"unsupported module: {name} is a {type(norm).__name__} that does not compute the "
                f"{family.norm_kind} norm of its weight (relative difference {float(miss):.2g} on a probe); dpa "
                "freezes a norm from its weight and epsilon, so it refuses a norm that computes something else")
