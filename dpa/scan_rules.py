"""The blocks dpa linearises whole (``Mixer.rule`` "scan"), by ``Mixer.scan``: Mamba-2's state-space duality
(ssd.py), Mamba's selective scan (selective.py), Qwen3-Next's Gated DeltaNet (delta.py). Each is an
``ssd.ScanRule``: dpa's copy of the block, its edge scores and its checks."""

from __future__ import annotations

from . import delta, selective, ssd

RULES: dict[str, ssd.ScanRule] = {"ssd": ssd.RULE, "selective": selective.RULE, "delta": delta.RULE}


def scan_rule(mixer) -> ssd.ScanRule:
    """The scan rule of a ``Mixer`` whose ``rule`` is "scan" (``spec.scans(index)``: layer index's)."""
    return RULES[mixer.scan]
