"""What a benchmark run measures: its ``Settings``, and the attribution methods it runs (named, resolved, checked).

``resolve_methods(settings)`` turns the method names of a ``Settings`` (or the paper's table) into functions
with the run's options bound; ``check_methods`` checks an override of them; ``sweep_methods`` makes the DPA
variants of a sensitivity sweep.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..baselines import COMPONENT_METHODS, INPUT_METHODS
from ..checks import check_bool, check_choice, check_float, check_int
from ..errors import InputError, InputTypeError, UnsupportedModelError
from ..weights import PRESETS, PathWeights
from .curves import GRANULARITIES, ONE_KIND, Unit
from .datasets import CHAT_DATASETS, DATASETS, GENERATED
from .prompts import check_prompt

# The methods of the paper's tables (activation patching and occlusion are opt-in: one forward per unit).
PAPER_METHODS = {
    "input": ("dpa", "random", "last_layer_attention", "mean_attention", "attention_rollout", "gradient",
              "input_x_gradient", "integrated_gradients", "depass", "ifr"),
    "component": ("dpa", "dpa_mid", "random", "attn_only", "mlp_only", "norm_only", "gradient", "atp", "ifr"),
}


@dataclass(frozen=True)
class Settings:
    """What one benchmark run measures. Fields other than ``methods`` and ``limit`` must match
    when a run is resumed in the same folder."""

    dataset: str
    unit: Unit
    methods: tuple[str, ...] = ()
    limit: int | None = None  # valid samples to evaluate (None: all)
    component_units: str = "fine"  # fine: edges + position-level neurons; coarse: heads + neurons; edges; neurons
    weights: PathWeights = field(default_factory=PathWeights)  # for DPA
    contrast: bool = False  # IOI: True attributes logit(IO) - logit(S) (a variant); False the IO logit, as the
    # reference code does. The metric is p(IO) either way
    seed: int = 0  # random baseline and tie-breaking
    steps: int = 20  # integrated gradients
    batch_size: int = 16  # ablated copies per forward pass
    max_tokens: int = 400
    min_probability: float = 0.1
    filter: str = "paper"  # paper: the model must get the sample right; length: only the token limit
    data_dir: str | None = None
    n_generated: int = 1000  # ioi_templates
    prompt: str = "chat"  # squad_v2.0, imdb: the chat template, or "plain" text for a base model (prompts.py)

    def __post_init__(self) -> None:
        """Every field checked (and put in its canonical form) here, once, for the Python API and the CLI alike."""
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (a frozen dataclass)
        check_choice("dataset", self.dataset, DATASETS + GENERATED)
        check_choice("unit", self.unit, ("input", "component"))
        fix("methods", check_method_names(self.methods))
        if self.limit is not None:
            fix("limit", check_int("limit (valid samples to evaluate; None for all)", self.limit, low=1))
        check_choice("component_units", self.component_units, GRANULARITIES)
        if not isinstance(self.weights, PathWeights):
            raise InputTypeError(f"weights must be a dpa.PathWeights (e.g. PathWeights(0, 0, 1, 0, 1) or "
                                 f"PathWeights.parse('0,0,1,0,1')), got {type(self.weights).__name__}")
        fix("contrast", check_bool("contrast", self.contrast))
        fix("seed", check_int("seed", self.seed))
        fix("steps", check_int("steps", self.steps, low=1))
        fix("batch_size", check_int("batch_size", self.batch_size, low=1))
        fix("max_tokens", check_int("max_tokens", self.max_tokens, low=1))
        p = check_float("min_probability", self.min_probability)
        if not 0 <= p < 1:
            raise InputError(f"min_probability must be in [0, 1) (a sample is kept when p(target) > min_probability), "
                             f"got {p}")
        fix("min_probability", p)
        check_choice("filter", self.filter, ("paper", "length"))
        if self.data_dir is not None:
            if not isinstance(self.data_dir, (str, os.PathLike)):
                raise InputTypeError(f"data_dir must be a folder (a str or path) or None, got "
                                     f"{type(self.data_dir).__name__}")
            fix("data_dir", os.fspath(self.data_dir))
        fix("n_generated", check_int("n_generated", self.n_generated, low=1))
        check_prompt(self.prompt)
        if self.prompt != "chat" and self.dataset not in CHAT_DATASETS:
            raise InputError(f"prompt={self.prompt!r} applies to the chat datasets ({', '.join(CHAT_DATASETS)}); "
                             f"{self.dataset} is raw text already")

    def identity(self) -> dict:
        keep = ("dataset", "unit", "component_units", "weights", "contrast", "seed", "steps", "max_tokens",
                "min_probability", "filter", "n_generated")
        d = asdict(self)
        out = {k: d[k] for k in keep}
        if self.dataset in CHAT_DATASETS:  # units: the paragraph / review alone (issue 20); a folder
            out["context_units"] = "paragraph"  # from before, whose units were the whole user turn, is not resumed
        if self.prompt != "chat":  # recorded only when not the chat template, which every earlier run used
            out["prompt"] = self.prompt
        return out


def check_method_names(methods) -> tuple[str, ...]:
    """Method names as a tuple of non-empty strings (a list or tuple of them; () for the paper's table)."""
    if isinstance(methods, str):
        raise InputTypeError(f"methods must be a tuple of method names, e.g. ({methods!r},), not the string "
                             f"{methods!r} (a string would be read letter by letter)")
    if not isinstance(methods, (tuple, list)):
        raise InputTypeError(f"methods must be a tuple of method names (or 'paper' / 'all' in it), got "
                             f"{type(methods).__name__}")
    bad = next((m for m in methods if not isinstance(m, str) or not m.strip()), None)
    if bad is not None:
        raise InputTypeError(f"methods must hold method names (non-empty strings), got {bad!r}")
    return tuple(methods)


def available_methods(unit: Unit) -> dict[str, Callable]:
    check_choice("unit", unit, ("input", "component"))
    return INPUT_METHODS if unit == "input" else COMPONENT_METHODS


def resolve_methods(settings: Settings) -> dict[str, Callable]:
    """Method name -> function with the run's options bound (weights, seed, steps, units)."""
    registry = available_methods(settings.unit)
    names = list(settings.methods) or ["paper"]
    if "all" in names:
        names = list(registry)
    elif "paper" in names:
        names = [n for n in names if n != "paper"] + list(PAPER_METHODS[settings.unit])
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise InputError(f"unknown {settings.unit} method(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(registry)} (or 'paper', 'all')")
    pool = {"weights": settings.weights, "seed": settings.seed, "steps": settings.steps,
            "units": "coarse" if settings.component_units == "coarse" else "fine"}
    out = {}
    for name in dict.fromkeys(names):
        fn = registry[name]
        params = inspect.signature(fn).parameters
        out[name] = functools.partial(fn, **{k: v for k, v in pool.items() if k in params})
    return out


def check_methods(methods) -> dict[str, Callable]:
    """``evaluate``'s ``methods`` override: a dict of method name -> attribution function."""
    if not isinstance(methods, Mapping):
        raise InputTypeError(f"methods must be a dict of method name -> attribution function, got "
                             f"{type(methods).__name__}")
    if not methods:
        raise InputError("methods is empty: give at least one method name -> attribution function")
    for name, fn in methods.items():
        if not isinstance(name, str) or not name.strip():
            raise InputTypeError(f"methods: each name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise InputTypeError(f"methods[{name!r}] must be an attribution function (model, tokenizer, prompt, "
                                 f"target, ...) -> Attribution, got {type(fn).__name__}")
    return dict(methods)



def check_kinds(settings: Settings, methods) -> None:
    """A method that scores one kind of component has nothing to rank among units of the other kind."""
    if settings.unit != "component" or settings.component_units not in ("edges", "neurons"):
        return
    wrong = [n for n in methods if ONE_KIND.get(n, settings.component_units) != settings.component_units]
    if wrong:
        raise InputError(f"{', '.join(wrong)} score(s) {ONE_KIND[wrong[0]]} only: nothing to rank among "
                         f"--component-units {settings.component_units}")


def check_supported(methods: dict[str, Callable], spec) -> None:
    """Each method handles the layers of the model ``spec`` describes (``dpa.baselines.supports``)."""
    from ..baselines import supports

    unsupported = [name for name, fn in methods.items() if not supports(fn, spec)]
    if unsupported:
        raise UnsupportedModelError(f"method(s) {', '.join(unsupported)} do not handle the layers of {spec.family} "
                                    "(see dpa.baselines.supports: the methods that recompute layers from their "
                                    "weights read some layouts only, dpa_mid needs the residual between attention "
                                    "and a dense MLP, and the methods that read attention probabilities do not run "
                                    "on a hybrid's convolution layers); leave them out (--methods)")


def sweep_methods(settings: Settings, families, ps) -> tuple[dict[str, Callable], list[dict]]:
    """DPA under each (family, p): methods named by their weights (shared points run once)."""
    from ..baselines import dpa_component, dpa_input

    if isinstance(families, str) or not isinstance(families, (tuple, list)):
        raise InputTypeError(f"families must be a list of family names ({', '.join(PRESETS)}), got {families!r}")
    unknown = [f for f in families if f not in PRESETS]
    if unknown or not families:
        raise InputError(f"families must name one or more of {', '.join(PRESETS)}, got {list(families)!r}")
    if isinstance(ps, (str, bytes)) or not isinstance(ps, (tuple, list)) or not ps:
        raise InputTypeError(f"ps must be a non-empty list of numbers in [0, 1], got {ps!r}")
    ps = [check_float(f"ps[{i}]", p, low=0, high=1) for i, p in enumerate(ps)]
    base = dpa_input if settings.unit == "input" else dpa_component
    methods, points = {}, []
    for family in families:
        for p in ps:
            w = PathWeights.preset(family, p)
            name = "dpa[" + ",".join(f"{x:g}" for x in w.as_tuple()) + "]"
            methods[name] = functools.partial(base, weights=w)
            points.append({"family": family, "p": p, "weights": w.to_dict(), "method": name})
    return methods, points

