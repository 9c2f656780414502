"""The checks that a model's mixture-of-experts blocks are the ones its family's description reads
(``registry.Experts``): the experts' fused layout and flags, the router, the shared expert's projections."""

from __future__ import annotations

from torch import nn

from .errors import UnsupportedModelError
from .registry import Family
from .spec import get, in_features, is_projection, weight_rows


def check_experts(layer: nn.Module, family: Family, i: int) -> None:
    """The experts dpa attributes must be exactly the ones it reads: transformers' fused layout (3-D
    ``gate_up_proj`` and ``down_proj``, the flags ``use_experts_implementation`` sets), nothing else. A
    layout or a parameter dpa does not read is refused by name: never a partial attribution."""
    moe = family.moe
    try:
        experts, router = get(layer, moe.experts), get(layer, moe.router)
    except AttributeError as err:
        raise UnsupportedModelError(f"layers[{i}] has no mixture-of-experts block where the {family.model_type} "
                                    f"description expects one ({err}; the config's layout of sparse and dense "
                                    f"layers, {moe.layers}, edited after loading?)") from None
    names = {n for n, _ in experts.named_parameters()}
    layout = {"has_gate": family.gated, "has_bias": moe.biases, "has_post_expert_norm": False,  # what dpa reads; the
              "is_transposed": moe.transposed, "is_concatenated": not moe.transposed}  # model's own loop ignores the
    # layout flags, dpa's reads them: an edited flag would read the weights another way
    for flag, want in layout.items():
        if getattr(experts, flag, None) != want:
            raise UnsupportedModelError(f"unsupported experts in layers[{i}]: {type(experts).__name__}.{flag} is "
                                        f"{getattr(experts, flag, None)!r} (dpa reads experts with {flag}={want})")
    first = "gate_up_proj" if family.gated else "up_proj"  # (non-gated experts: act(up x), Nemotron-H's)
    read = {first, "down_proj"} | ({"gate_up_proj_bias", "down_proj_bias"} if moe.biases else set())
    if names != read or getattr(experts, first).dim() != 3:
        raise UnsupportedModelError(f"unsupported experts in layers[{i}]: parameters {sorted(names)}; dpa reads "
                                    f"exactly {', '.join(sorted(read))}, so it would miss the others")
    count = getattr(experts, "num_experts", None)  # the experts' forward skips an index at or above it (a sentinel)
    held = getattr(experts, first).shape[0]
    if isinstance(count, int) and count != held:
        raise UnsupportedModelError(
            f"unsupported experts in layers[{i}]: {type(experts).__name__}.num_experts is {count} while it holds "
            f"{held} experts' weights; its forward skips the experts at or above num_experts "
            "(expert parallelism's sentinel), dpa runs every expert it holds: make the two agree")
    for path in moe.latent or ():  # the projections into and out of the experts' space: linear, no bias
        module = get(layer, path)
        if not isinstance(module, nn.Identity) and (not is_projection(module) or module.bias is not None):
            raise UnsupportedModelError(f"unsupported module: layers[{i}].{path} is a {type(module).__name__}"
                                        f"{' with a bias' if is_projection(module) else ''}; dpa reads it as a "
                                        "linear map without a bias (or the identity)")
    if moe.glu == "clamped" and not all(isinstance(getattr(experts, a, None), (int, float)) for a in ("alpha", "limit")):
        raise UnsupportedModelError(f"unsupported experts in layers[{i}]: the clamped GLU needs numbers alpha, limit")
    router_params = {n for n, _ in router.named_parameters()}
    if router_params != ({"weight", "bias"} if moe.router_bias else {"weight"}):
        raise UnsupportedModelError(f"unsupported router in layers[{i}]: parameters {sorted(router_params)} (the "
                                    f"{family.model_type} description knows {'weight, bias' if moe.router_bias else 'weight'})")


def expert_sizes(layers: list[tuple[int, nn.Module]], family: Family) -> tuple[int, int, int]:
    """The routed experts' count and neurons each, and the shared expert's neurons, on the sparse layers (index,
    layer): the same on every one, as one row of expert and neuron scores per layer needs."""
    sizes = {}
    for i, layer in layers:
        experts = get(layer, family.moe.experts)
        down = experts.down_proj  # [expert d_model d_expert], or [expert d_expert d_model] transposed
        sizes[i] = (down.shape[0], down.shape[1 if getattr(experts, "is_transposed", False) else 2])
    if len(set(sizes.values())) > 1:
        raise UnsupportedModelError(f"unsupported model: the layers' experts differ ((count, neurons) by layer: "
                                    f"{sizes}); dpa scores every sparse layer's experts in one row of the same width")
    n, d = next(iter(sizes.values()))
    return n, d, shared_width(layers, family) if family.moe.shared else 0


def shared_width(layers: list[tuple[int, nn.Module]], family: Family) -> int:
    """The shared expert's neurons (its down projection's inputs), the same on every sparse layer (index, layer),
    with its gate and up projections of as many outputs each (or 2x, fused as [gate | up])."""
    moe = family.moe
    gate, up, down, _ = (f"{moe.shared}.{p}" for p in moe.shared_parts)
    width = in_features(get(layers[0][1], down))
    for i, layer in layers:
        rows = {p: weight_rows(get(layer, p)).shape[0] for p in (gate, up)}
        want = {up: width} if not family.gated else {gate: 2 * width} if gate == up else {gate: width, up: width}
        if in_features(get(layer, down)) != width or rows != want:
            raise UnsupportedModelError(f"unsupported module: layers[{i}]'s shared expert has {rows} outputs and "
                                        f"{in_features(get(layer, down))} neurons; dpa reads {want} and {width}")
    return width
