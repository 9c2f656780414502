"""Path weights mu: how much of the target each branch passes on (book: path-weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from .checks import check_choice, check_float
from .errors import InputError, InputTypeError

# A decimal number as people write it (no '_' separators, no 'nan' or 'inf': those are refused as weights).
NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

# The paper's four sensitivity families of path weights (PathWeights.preset), named PRESETS here so that "family"
# means a model family everywhere else (dpa.families).
Preset = Literal["control_content", "attention", "query_key", "mlp"]
PRESETS: tuple[Preset, ...] = ("control_content", "attention", "query_key", "mlp")


@dataclass(frozen=True)
class PathWeights:
    """Multipliers for the five paths: attention query, key, value; GLU gate, up (and on a mixture-of-experts
    model the router and the experts).

    The paper constrains ``query + key + value = 1`` and ``gate + up = 1``; other
    values are allowed, and ``constrained`` says whether completeness can hold.
    The defaults are the paper's balanced setting (p = 0.5).
    """

    query: float = 0.25
    key: float = 0.25
    value: float = 0.5
    gate: float = 0.5
    up: float = 0.5
    router: float | None = None  # mixture of experts: the router (control) and the experts (content); None on a
    expert: float | None = None  # model without experts, and the balanced 0.5 / 0.5 on one (``for_model``)
    temperature: float = 1.0  # GIM's rule: the attention softmax's backward at this temperature (1: DPA's, exact)

    def __post_init__(self) -> None:
        for f in fields(self):  # numbers as plain floats: numpy scalars and 0-d tensors accepted
            value = getattr(self, f.name)
            if value is not None or f.name not in ("router", "expert"):
                object.__setattr__(self, f.name, check_float(f"path weight {f.name}", value))
        if (self.router is None) != (self.expert is None):
            raise InputError("give the router and expert weights together (router=..., expert=...), or neither")
        if not self.temperature > 0:
            raise InputError(f"the softmax temperature must be positive, got {self.temperature}")

    def with_temperature(self, temperature: float) -> PathWeights:
        """These weights with GIM's softmax rule at ``temperature`` (book: circuit-discovery): the attention softmax's
        backward uses s_T = softmax(x / T) in place of its probabilities s, grad_x = s_T * (grad_s - sum(grad_s
        s_T)), no 1/T factor. T = 1 is DPA's (the exact softmax Jacobian); GIM's default is 2."""
        from dataclasses import replace

        return replace(self, temperature=temperature)

    @property
    def moe(self) -> bool:
        """Whether the router and expert weights are set (a mixture-of-experts model's)."""
        return self.router is not None

    @property
    def constrained(self) -> bool:
        """True when mu_q + mu_k + mu_v = 1, mu_gate + mu_up = 1 (the paper's constraint) and, with experts,
        mu_router + mu_expert = 1."""
        return (abs(self.query + self.key + self.value - 1) < 1e-9 and abs(self.gate + self.up - 1) < 1e-9
                and (not self.moe or abs(self.router + self.expert - 1) < 1e-9))

    @property
    def conservative(self) -> bool:
        """True when the sum of token scores must equal the target (value path only, GLU summing to 1, with
        experts the experts' path only)."""
        return (self.query == 0 and self.key == 0 and self.value == 1 and abs(self.gate + self.up - 1) < 1e-9
                and (not self.moe or (self.router == 0 and self.expert == 1)))

    def as_tuple(self) -> tuple[float, ...]:
        """(q, k, v, gate, up), and router, expert where set."""
        five = (self.query, self.key, self.value, self.gate, self.up)
        return five + ((self.router, self.expert) if self.moe else ())

    def to_dict(self) -> dict[str, float]:
        """The weights by name; router and expert only where set (a mixture-of-experts model's), the temperature
        only where it is not 1, so that records and run configs read and resume as before these existed."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
                and not (f.name == "temperature" and self.temperature == 1)}

    def for_model(self, has_experts: bool, family: str = "this model") -> PathWeights:
        """These weights for a model with or without experts: the balanced router 0.5 / expert 0.5 filled in on
        one with experts; router and expert weights on one without are an error."""
        from dataclasses import replace

        if has_experts:
            return self if self.moe else replace(self, router=0.5, expert=0.5)
        if self.moe:
            raise InputError(f"router and expert path weights are for mixture-of-experts models; {family} has no "
                             "router (leave them out)")
        return self

    @classmethod
    def parse(cls, text: str) -> PathWeights:
        """From ``"q,k,v,gate,up"``, e.g. ``"0.25,0.25,0.5,0.5,0.5"``, or with experts
        ``"q,k,v,gate,up,router,expert"``."""
        if not isinstance(text, str):
            raise InputTypeError(f"path weights must be a string 'q,k,v,gate,up', got {text!r}")
        parts = [p.strip() for p in text.split(",")]
        if len(parts) not in (5, 7):
            raise InputError(f"expected five comma-separated weights q,k,v,gate,up (or seven, with router,expert), "
                             f"got {text!r}")
        if not all(NUMBER.fullmatch(p) for p in parts):
            raise InputError(f"path weights {text!r} are not five numbers q,k,v,gate,up (e.g. 0.25,0.25,0.5,0.5,0.5)")
        return cls(*(float(p) for p in parts))

    @classmethod
    def preset(cls, family: str, p: float) -> PathWeights:
        """One of the paper's sensitivity families at p in [0, 1] (book: path-weights)."""
        p = check_float("p", p, low=0.0, high=1.0)
        check_choice("family", family, PRESETS)
        return getattr(cls, family)(p)

    @classmethod
    def control_content(cls, p: float) -> PathWeights:
        """Content share p on both blocks: q = k = (1-p)/2, v = p, gate = 1-p, up = p."""
        p = check_float("p", p, low=0.0, high=1.0)
        return cls((1 - p) / 2, (1 - p) / 2, p, 1 - p, p)

    @classmethod
    def attention(cls, p: float) -> PathWeights:
        """Attention only: q = k = (1-p)/2, v = p; GLU balanced."""
        p = check_float("p", p, low=0.0, high=1.0)
        return cls((1 - p) / 2, (1 - p) / 2, p, 0.5, 0.5)

    @classmethod
    def query_key(cls, p: float) -> PathWeights:
        """Query against key: q = p/2, k = (1-p)/2, v = 0.5 (the paper's table, not its sweep script)."""
        p = check_float("p", p, low=0.0, high=1.0)
        return cls(p / 2, (1 - p) / 2, 0.5, 0.5, 0.5)

    @classmethod
    def mlp(cls, p: float) -> PathWeights:
        """GLU only: gate = 1-p, up = p; attention at its default."""
        p = check_float("p", p, low=0.0, high=1.0)
        return cls(0.25, 0.25, 0.5, 1 - p, p)


def weights_argument(text: str) -> PathWeights:
    """``PathWeights.parse`` as an argparse ``type``: a bad value is the command's usage error, naming it (every
    command that takes ``--weights`` parses it here)."""
    import argparse

    try:
        return PathWeights.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
