"""``dpa mib PAIRS --out DIR``: circuit discovery on a file of clean/counterfactual pairs, MIB's way."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from .methods import METHODS


def add_command(commands) -> None:
    p = commands.add_parser(
        "mib", help="score every edge of MIB's graph on clean/counterfactual pairs and measure the circuits' "
                    "faithfulness (CPR, CMD)",
        description="Circuit discovery measured the way MIB measures it (the book's chapter Circuit discovery, "
                    "benchmarked): every edge of the model's graph (input, heads, MLPs -> heads' q/k/v, MLPs, "
                    "logits) is scored on the pairs of PAIRS, the circuits of the top 0.1% .. 100% of edges are "
                    "run with every other edge patched to the counterfactual, and CPR (higher is better) and CMD "
                    "(lower is better) are the areas under the faithfulness curve. DIR gets graph.json (the EAP-IG "
                    "Graph JSON MIB's leaderboard reads), faithfulness.json and faithfulness.png; started again on "
                    "the same DIR, the run goes on where it stopped.")
    p.add_argument("pairs", type=Path, metavar="PAIRS",
                   help="JSON lines: {\"clean\", \"counterfactual\", \"answer\", \"counterfactual_answer\"} (or the "
                        "lists \"answers\", \"counterfactual_answers\" for the probability difference)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the run's folder")
    p.add_argument("--method", default="dpa-cf",
                   choices=METHODS,
                   help="how edges are scored (default dpa-cf: Δ_u . g^DPA)")
    p.add_argument("--temperature", type=float, metavar="T", help="with --method gim: the softmax temperature "
                                                                  "(default 2, GIM's)")
    p.add_argument("--model", metavar="NAME_OR_PATH", help="a built-in model, an HF id or a local folder")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="pairs per pass (default 8)")
    p.add_argument("--no-evaluate", action="store_true", help="score the edges only")
    p.add_argument("--size", type=float, metavar="P",
                   help="also write circuit.json: the EAP-IG graph with the top P share of edges marked in_graph")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=functools.partial(run, parser=p))


def run(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    import dpa

    from ..models import read_tokenizer_and_config, resolve
    from ..request import sizes_of
    from .discover import discover, read_pairs
    from .methods import check_method

    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if args.size is not None and not 0 < args.size <= 1:
        parser.error("--size is a share of the edges, in (0, 1]")
    if args.temperature is not None and args.method != "gim":
        parser.error("--temperature is for --method gim")
    check_method(args.method, None, args.temperature)
    tokenizer, config = read_tokenizer_and_config(resolve(args.model), quick=True)
    sizes = sizes_of(config)
    pairs = read_pairs(args.pairs, tokenizer, vocab_size=sizes.vocab_size)  # read once (a pipe can be read once)
    pairs.check(sizes)  # a bad line fails before the weights load
    model, tokenizer = dpa.load_model(args.model, device=args.device)
    found = discover(model, tokenizer, pairs, method=args.method, temperature=args.temperature,
                     evaluate=not args.no_evaluate, batch_size=args.batch_size, out=args.out,
                     progress=not args.quiet)
    print(found.summary())
    print(f"wrote {args.out / 'graph.json'}")
    if found.faithfulness is not None:
        import io

        import matplotlib
        import matplotlib.pyplot

        from ..files import write_bytes

        matplotlib.use("Agg")
        ax, png = found.plot(), io.BytesIO()
        ax.figure.savefig(png, dpi=120, bbox_inches="tight", format="png")
        matplotlib.pyplot.close(ax.figure)
        write_bytes(args.out / "faithfulness.png", png.getvalue())  # dpa's one writer
        print(f"wrote {args.out / 'faithfulness.json'} and {args.out / 'faithfulness.png'}")
    if args.size is not None:
        found.save_json(args.out / "circuit.json", args.size)
        print(f"wrote {args.out / 'circuit.json'} ({int(found.circuit(args.size).sum())} edges kept)")
    return 0
