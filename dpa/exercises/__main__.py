"""python -m dpa.exercises student-copy OUT [--root REPO]: the book's notebooks with the solutions emptied;
python -m dpa.exercises list: every exercise by chapter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .student import student_copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpa.exercises", description=__doc__.split(";")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("student-copy", help="write the book with every solution cell emptied into OUT")
    s.add_argument("out", help="a new (or empty) folder")
    s.add_argument("--root", default=str(Path(__file__).resolve().parents[2]),
                   help="the repository holding book/ (default: the one this package was installed from)")
    commands.add_parser("list", help="list the exercises by chapter")
    args = parser.parse_args(argv)
    if args.command == "list":
        from . import check
        for chapter, names in check.names().items():
            print(f"{chapter}: {', '.join(names)}")
        return 0
    try:
        counts = student_copy(args.root, args.out)
    except (OSError, ValueError) as err:  # a folder that exists, is not writable, ...: one line, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    total = sum(counts.values())
    print(f"wrote {len(counts)} notebooks to {Path(args.out) / 'book'} with {total} solutions emptied "
          f"({', '.join(f'{k[:-6]} {v}' for k, v in counts.items() if v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
