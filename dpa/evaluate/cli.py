"""``dpa evaluate`` and ``dpa sweep``: the faithfulness benchmark from the command line.

``add_commands(subparsers)`` registers both commands on the ``dpa`` parser; ``main(argv)`` runs
them standalone (``python -m dpa.evaluate.cli evaluate ...``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import distributed
from ..errors import DPAError, InputError
from ..models import CHUNKED, DEFAULT_MODEL, ModelLoadError
from ..weights import PRESETS, PathWeights, weights_argument
from .datasets import DATASETS, GENERATED, DataError
from .prompts import PROMPTS

DTYPES = ("float32", "bfloat16", "float16", "float64")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, choices=DATASETS + GENERATED)
    p.add_argument("--unit", required=True, choices=("input", "component"),
                   help="input tokens, or attention edges + position-level neurons")
    p.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="output folder; an interrupted run resumes when started again with the same folder")
    p.add_argument("--data-dir", metavar="DIR", help="folder with the data files (default: ../shared/data)")
    p.add_argument("--limit", type=int, metavar="N", help="evaluate the first N valid samples (default: all)")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help=f"a built-in model ({', '.join(CHUNKED)}), an HF id or a local folder "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default float32)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for torch (default: torch's choice; 1 is often fastest on a busy machine)")
    p.add_argument("--component-units", choices=("fine", "coarse", "edges", "neurons"), default="fine",
                   help="fine: edges and position-level neurons, ranked jointly (the paper's units; in paper mode "
                        "counted as the reference code counts them, results README); coarse: heads and "
                        "neurons; edges / neurons: the fine units of one kind only, the other left intact")
    p.add_argument("--contrast", action=argparse.BooleanOptionalAction, default=False,
                   help="IOI: attribute logit(IO) - logit(S), a variant; the default, --no-contrast, attributes the "
                        "IO logit as the reference code does (the metric is p(IO) either way)")
    p.add_argument("--seed", type=int, default=0, help="random baseline and tie-breaking seed")
    p.add_argument("--batch-size", type=int, default=16, metavar="B", help="ablated copies per forward pass")
    p.add_argument("--n-generated", type=int, default=1000, metavar="N", help="ioi_templates: prompts to generate")
    p.add_argument("--filter", choices=("paper", "length"), default="paper",
                   help="paper: keep samples the model gets right (argmax, p > 0.1, <= 400 tokens); "
                        "length: only the 400-token limit (smoke runs)")
    p.add_argument("--prompt", choices=PROMPTS, default="chat",
                   help="squad_v2.0 / imdb: the chat template (the paper's form) or, for a base model without one, "
                        "plain text: instruction, blank line, user turn, 'Answer:'")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-figures", action="store_true", help="skip the matplotlib figures")


def add_commands(subparsers) -> None:
    """Register ``evaluate`` and ``sweep`` on a ``dpa`` subparsers object."""
    p = subparsers.add_parser(
        "evaluate", help="faithfulness benchmark: ablate top-ranked units, compare methods",
        description="Disruption / recovery curves and AUCs of attribution methods on a benchmark dataset.")
    _common(p)
    p.add_argument("--methods", default="paper", metavar="A,B,...",
                   help="comma-separated method names, 'paper' (the paper's table) or 'all' (default: paper)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--weights", type=weights_argument, metavar="q,k,v,gate,up", help="DPA path weights")
    group.add_argument("--preset", choices=PRESETS, help="DPA weights from a sensitivity family (with --p)")
    p.add_argument("--p", type=float, help="the preset's parameter (default 0.5)")
    p.add_argument("--steps", type=int, default=20, help="integrated gradients steps (default 20)")
    p.set_defaults(func=run_evaluate)
    s = subparsers.add_parser(
        "sweep", help="sensitivity of DPA's faithfulness to the path weights",
        description="Total AUC of DPA for each path-weight family (control_content, attention, query_key, mlp) "
                    "over p.")
    _common(s)
    s.add_argument("--families", default=",".join(PRESETS), metavar="F,...", help="families (default: all four)")
    s.add_argument("--ps", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], metavar="P,...",
                   help="values of p (default 0,0.25,0.5,0.75,1)")
    s.set_defaults(func=run_sweep)


def _settings(args, **extra):
    from .settings import Settings

    if args.limit is not None and args.limit < 1:
        raise InputError("--limit must be at least 1")
    if args.batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise InputError("--threads must be at least 1")
    if getattr(args, "steps", 1) < 1:
        raise InputError("--steps must be at least 1")
    if args.n_generated < 1:
        raise InputError("--n-generated must be at least 1")
    return Settings(dataset=args.dataset, unit=args.unit, limit=args.limit, component_units=args.component_units,
                    contrast=args.contrast, seed=args.seed, batch_size=args.batch_size,
                    data_dir=args.data_dir, n_generated=args.n_generated, filter=args.filter, prompt=args.prompt,
                    **extra)


def _load(args, group):
    import torch

    import dpa

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return dpa.load_model(args.model, device=distributed.device_for(group, args.device),
                          dtype=getattr(torch, args.dtype))


def _wrote(path: Path, names: list[str]) -> str:
    """'wrote DIR/a, b and c': the files this run wrote, named from what it was asked (--no-figures: none)."""
    return f"wrote {path / names[0]}" + "".join(f", {n}" for n in names[1:-1]) + f" and {names[-1]}"


def _report(path: Path, results: dict, figures: bool) -> None:
    from .results import figure_files

    print((path / "results.md").read_text(), end="")
    print(_wrote(path, ["results.json", "results.csv", "results.md", *figure_files(results, figures)]))


def _user_errors(run):
    """One-line messages (exit 2) for bad options, missing data and refused inputs."""

    def wrapped(args) -> int:
        try:
            return run(args)
        except (DPAError, DataError, ValueError, ModelLoadError) as err:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2

    return wrapped


@_user_errors
def run_evaluate(args) -> int:
    from .runner import evaluate
    from .settings import resolve_methods

    if args.preset is not None:
        weights = PathWeights.preset(args.preset, 0.5 if args.p is None else args.p)
    elif args.p is not None:
        raise InputError("--p needs --preset")
    else:
        weights = args.weights or PathWeights()
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods:
        raise InputError(f"--methods names no method ({args.methods!r}); give names, 'paper' or 'all'")
    settings = _settings(args, methods=methods, weights=weights, steps=args.steps)
    resolve_methods(settings)  # unknown names fail before the model loads
    with distributed.group() as group:
        model, tokenizer = _load(args, group)
        results = evaluate(model, tokenizer, settings, args.out, progress=not args.quiet, figures=not args.no_figures)
        if group.main:
            _report(args.out, results, not args.no_figures)
    return 0


@_user_errors
def run_sweep(args) -> int:
    from .runner import sweep

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in PRESETS]
    if unknown:
        raise InputError(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                         f"choose from {', '.join(PRESETS)}")
    if not families:
        raise InputError(f"--families names no family ({args.families!r}); choose from {', '.join(PRESETS)}")
    bad = [p for p in args.ps if not 0 <= p <= 1]
    if not args.ps or bad:
        raise InputError("--ps must be values in [0, 1]" + (f", got {', '.join(map(str, bad))}" if bad else ""))
    settings = _settings(args)  # bad options fail before the model loads
    with distributed.group() as group:
        model, tokenizer = _load(args, group)
        summary = sweep(model, tokenizer, settings, args.out, families=families, ps=args.ps,
                        progress=not args.quiet, figures=not args.no_figures)
        if group.main:
            print((args.out / "sweep.csv").read_text(), end="")
            names = ["sweep.json", "sweep.csv", *(() if args.no_figures else ("sweep.png",))]
            print(f"{_wrote(args.out, names)} ({summary['n_evaluated']} samples)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpa", description="DPA faithfulness benchmark")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
