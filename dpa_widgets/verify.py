"""Verify an attribution by intervention: ablate units and read the target probability.

Tokens are ablated by zeroing their embeddings; heads by zeroing all their attention
probabilities; neurons by zeroing SiLU(s) at every position (``dpa.evaluate.ablation``, the
faithfulness benchmark's own ablations). "disrupt" ablates the chosen units, "recover"
ablates every other unit of the same kind. The clean and the ablated copy run as one batch,
so both probabilities come from the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dpa
from dpa import Attribution, InputError, UnsupportedModelError
from dpa.checks import check_choice

MODES = ("disrupt", "recover")
UNITS = ("selection", "top_tokens", "top_components")


def run(model: nn.Module, result: Attribution, *, mode: str, units: str, k: int,
        head: list[int] | None = None, neuron: list[int] | None = None, token: int | None = None) -> dict[str, Any]:
    """Ablate and return {mode, units (names), token, p_before, p_after}.

    units="selection" ablates the selected head and/or neuron, or the selected token when
    only a token is selected; "top_tokens" the k tokens with the highest DPA score;
    "top_components" the k attention heads and neurons with the highest DPA scores (ranked jointly; the units
    ablation reaches: experts and a hybrid's convolution units are not among them).
    """
    check_choice("mode", mode, MODES)
    check_choice("units", units, UNITS)
    _check_selection(result, head, neuron, token)
    if result.target.token_id is None:
        raise InputError("verification needs a token target (this result attributes a vector)")
    if units == "top_tokens":
        scores = result.token_scores.detach().double()
        return _tokens(model, result, mode, scores.topk(min(k, scores.numel())).indices.tolist())
    if units == "selection" and head is None and neuron is None:
        if token is None:
            raise InputError("nothing is selected: click a head, neuron or token first")
        return _tokens(model, result, mode, [token])
    if units == "selection":
        heads = [tuple(head)] if head is not None else []
        neurons = [tuple(neuron)] if neuron is not None else []
    else:
        if "head" not in result.unit_kinds and result.neuron_scores.shape[1] == 0:  # (Mamba: scan units alone)
            raise InputError(f"ablation reaches attention heads and MLP neurons, and this model has neither (its "
                             f"units: {', '.join(result.unit_kinds)}); verify tokens here (units='top_tokens')")
        top = result.top_components(k, kinds=("head", "neuron"))["positive"]
        heads = [(c.layer, c.index) for c in top if c.kind == "head"]
        neurons = [(c.layer, c.index) for c in top if c.kind == "neuron"]
    return _components(model, result, mode, heads, neurons)


def _check_selection(result: Attribution, head, neuron, token) -> None:
    """A selected head [layer, head], neuron [layer, neuron] or token position must be one of the result's."""
    layers, heads = result.head_scores.shape
    for what, unit, size in (("head", head, heads), ("neuron", neuron, result.neuron_scores.shape[1])):
        if unit is not None and not (len(unit) == 2 and 0 <= unit[0] < layers and 0 <= unit[1] < size):
            raise InputError(f"the selected {what} {list(unit)} is not one of this result's: layers 0-{layers - 1}, "
                             f"{what}s 0-{size - 1}" if size else f"this result has no {what}s")
    if token is not None and not 0 <= token < len(result.token_ids):
        raise InputError(f"the selected token {token} is not one of this result's positions "
                         f"0-{len(result.token_ids) - 1}")


def _product(probs, result: Attribution) -> torch.Tensor:
    """p(target) per row from ``probs(position, token_id)``: for a target of several tokens the probability of the
    whole of it under teacher forcing, the product of its tokens' (each at its own position; a contrast's are not
    the target)."""
    t = result.target
    out = probs(t.position, t.token_id)
    for term in [x for x in t.terms or [] if not x.contrast][1:]:
        out = out * probs(term.position, term.token_id)
    return out


def _ids(result: Attribution) -> torch.Tensor:
    return torch.tensor(list(result.token_ids))


def _tokens(model: nn.Module, result: Attribution, mode: str, chosen: list[int]) -> dict[str, Any]:
    from dpa.evaluate.ablation import input_ablation_probs

    n = len(result.token_ids)
    keep = torch.ones(2, n)  # row 0 clean, row 1 ablated
    mask = torch.zeros(n, dtype=torch.bool)
    mask[chosen] = True
    keep[1] = (~mask).float() if mode == "disrupt" else mask.float()
    probs = _product(lambda position, token: input_ablation_probs(model, _ids(result), keep, position, token), result)
    return _report(mode, [f"token {p} {result.tokens[p]!r}" for p in chosen], result, probs)


def _components(model: nn.Module, result: Attribution, mode: str, heads: list[tuple[int, int]],
                neurons: list[tuple[int, int]]) -> dict[str, Any]:
    from dpa.evaluate.ablation import component_ablation_probs

    n_layers, n_heads = result.head_scores.shape
    n_heads = n_heads if result.beside is None else result.beside[1]  # (the attention heads: a row's first columns)
    d_mlp = result.neuron_scores.shape[1]
    _check_ablatable(result, mode, heads)
    spec = dpa.spec_for(model)
    for kind, units in (("head", heads), ("neuron", neurons)):  # (Nemotron-H's layers of one block)
        missing = next((f"{spec.lacks(kind, layer, i)} to ablate" for layer, i in units if spec.lacks(kind, layer, i)),
                       None)
        if missing:
            raise InputError(missing + "; select a unit of a layer that has it")
    chosen_h = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    chosen_n = torch.zeros(n_layers, d_mlp, dtype=torch.bool)
    for l, h in heads:
        chosen_h[l, h] = True
    for l, i in neurons:
        chosen_n[l, i] = True
    # keep masks, row 0 clean and row 1 ablated: [rows layer head 1 1] and [rows layer 1 d_mlp]
    ablated_h = chosen_h if mode == "disrupt" else ~chosen_h
    ablated_n = chosen_n if mode == "disrupt" else ~chosen_n
    attn_keep = torch.stack([torch.ones_like(chosen_h), ~ablated_h])[:, :, :, None, None]
    neuron_keep = torch.stack([torch.ones_like(chosen_n), ~ablated_n])[:, :, None, :]
    probs = _product(lambda position, token: component_ablation_probs(model, _ids(result), attn_keep, neuron_keep,
                                                                       position, token), result)
    names = [f"L{l}.H{h}" for l, h in heads] + [f"L{l}.N{i}" for l, i in neurons]
    return _report(mode, names, result, probs)


def _check_ablatable(result: Attribution, mode: str, heads: list[tuple[int, int]]) -> None:
    """Ablation reaches attention heads and neurons: a hybrid's mixer units (a convolution's, a Mamba-2 block's) have
    no attention probabilities to mask. Refused by name before any work: a selected mixer unit, and "recover", which
    would ablate every unit but the selection, mixer units included; and beside attention (Falcon-H1's layers, whose
    every row holds attention heads and a Mamba-2 block's units) any head or unit, as dpa's head ablations are
    (neurons and tokens are ablated as on any model)."""
    if result.beside is not None:
        if not heads and mode != "recover":
            return
        from .payload import unit_label

        names = ", ".join(unit_label(result, layer, column) for layer, column in heads)
        raise UnsupportedModelError(
            f"verification by ablation is not yet supported here for heads: this model's layers run attention and a "
            f"{result.beside[0]} block side by side (Falcon-H1's; book: parallel-mixers), and dpa's head ablations "
            f"read one token mixer per layer: no head or {result.beside[0]} unit can be ablated"
            + (f" ({names})" if names else "") + "; verify neurons or tokens instead (disrupt: select a neuron or a "
            "token, or units='top_tokens')")
    if result.layer_kinds is None:
        return
    from dpa.registry import MLP_LAYER, UNIT_LETTERS

    mixers = sorted({k for k in result.layer_kinds if k not in ("head", MLP_LAYER)})
    for layer, head in heads:
        kind = result.layer_kinds[layer]
        if kind == MLP_LAYER:  # (no unit at all: the model's check, in _components, names it)
            continue
        if kind != "head":
            raise UnsupportedModelError(f"L{layer}.{UNIT_LETTERS[kind]}{head} is a {kind} unit: verification by "
                                        "ablation reaches attention heads and neurons only (a mixer block has no "
                                        "attention probabilities to mask)")
    if mode == "recover" and mixers:
        raise UnsupportedModelError(f"recover ablates every unit but the selection, and this model's "
                                    f"{', '.join(mixers)} units cannot be ablated (no attention probabilities to "
                                    "mask): use disrupt, which ablates the selection alone")


def _report(mode: str, names: list[str], result: Attribution, probs: torch.Tensor) -> dict[str, Any]:
    return {"mode": mode, "units": names, "token": result.target.token,
            "p_before": float(probs[0]), "p_after": float(probs[1])}
