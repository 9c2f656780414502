"""A Mamba-2 block's sizes as its forward reads them (``ScanShape``, ``shape_of``) and the columns of its in_proj each
reader of MIB's graph takes (``factor_columns``): read by ``spec`` (a layer's modules), ``ssd`` (the rule) and
``families`` (the checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class ScanShape:
    """A Mamba-2 block's sizes, as its forward reads them (its own attributes)."""

    inner: int  # I = heads x head_dim: x, z, y and n
    heads: int  # H
    head_dim: int  # P
    groups: int  # G: B and C have G groups of N, each serving H / G heads
    state: int  # N
    kernel: int  # K, the convolution's taps
    norm_group: int  # the gated norm's group of channels
    limit: tuple[float, float]  # the clamp of the step
    chunk: int  # the positions of one chunk of the scan (dpa's copy reads the block's own)
    gating: str = "after"  # how y meets the gate z: "after", the gated norm of y * SiLU(z) (Bamba's, Mamba2Mixer's);
    # "before", the norm of y, then times SiLU(z) (Falcon-H1's with mamba_norm_before_gate); "none", y * SiLU(z)
    # without a norm (Falcon-H1's released configs: mamba_rms_norm false)

    @property
    def conv(self) -> int:
        return self.inner + 2 * self.groups * self.state

    @property
    def rows(self) -> int:  # in_proj's outputs: [z | xBC | dt]
        return self.inner + self.conv + self.heads

    def segments(self) -> dict[str, torch.Tensor]:
        """in_proj's output features of each part: z, x, B, C and dt, in its order [z | x B C | dt]."""
        sizes = {"z": self.inner, "x": self.inner, "B": self.groups * self.state, "C": self.groups * self.state,
                 "dt": self.heads}
        return dict(zip(sizes, torch.arange(self.rows).split(list(sizes.values()))))


_ATTRIBUTES = ("intermediate_size", "num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel_size",
               "chunk_size")


def shape_of(block: nn.Module) -> ScanShape:
    """The block's sizes from its own attributes; refused by name where one is missing or not what it should be."""
    values = {name: getattr(block, name, None) for name in _ATTRIBUTES}
    norm = getattr(block, "norm", None)
    gating, group = _gating(norm, values["intermediate_size"])
    limit = getattr(block, "time_step_limit", None)
    bounds = None
    if isinstance(limit, (tuple, list)) and len(limit) == 2 and all(
            v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit):
        bounds = (-math.inf if limit[0] is None else float(limit[0]), math.inf if limit[1] is None else float(limit[1]))
    if (not all(isinstance(v, int) and v > 0 for v in values.values())
            or group is None or bounds is None):
        raise UnsupportedModelError(f"unsupported module: {type(block).__name__} lacks the sizes of a Mamba-2 block "
                                    f"({', '.join(_ATTRIBUTES)}, its norm's group_size or n_groups, time_step_limit: "
                                    f"two numbers or None), or holds others (time_step_limit={limit!r})")
    return ScanShape(values["intermediate_size"], values["num_heads"], values["head_dim"], values["n_groups"],
                     values["ssm_state_size"], values["conv_kernel_size"], group, bounds, values["chunk_size"], gating)


def _gating(norm: nn.Module | None, inner) -> tuple[str, int | None]:
    """How the block's y meets its gate (``ScanShape.gating``) and the norm's group of channels (None: unknown), from
    its norm module: transformers' gated norm with a ``group_size`` (Bamba's); Falcon-H1's, with ``n_groups`` and
    ``norm_before_gate``; or ``nn.Identity`` (Falcon-H1 with mamba_rms_norm false: no norm). The probe of
    ``ssd.check_block`` vouches that the block computes what this reads."""
    if type(norm) is nn.Identity:
        return "none", inner if isinstance(inner, int) and inner > 0 else None
    if isinstance(getattr(norm, "group_size", None), int):
        return "after", norm.group_size
    groups, before = getattr(norm, "n_groups", None), getattr(norm, "norm_before_gate", None)
    if (isinstance(groups, int) and groups > 0 and isinstance(before, bool) and isinstance(inner, int)
            and inner % groups == 0):
        return ("before" if before else "after"), inner // groups
    return "after", None


def factor_columns(block: nn.Module) -> dict[str, torch.Tensor]:
    """A Mamba-2 block's in_proj output features (``ScanShape.segments``) of each reader MIB's graph gives a unit (book:
    circuit-discovery), as attention's: "query" the gate z and C (read at the output's position), "key" B and the
    step's dt (written with the input's position), "value" x (the content). The block's convolution is depthwise, so
    each feature can come from another input."""
    part = shape_of(block).segments()
    return {"query": torch.cat([part["z"], part["C"]]), "key": torch.cat([part["B"], part["dt"]]), "value": part["x"]}
