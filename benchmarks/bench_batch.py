"""Throughput of ``dpa attribute --prompts``: 1 process against 2 under torchrun (gloo, one thread each).

    python benchmarks/bench_batch.py --data-dir ../shared/data [--n 200] [--rounds 2] [--batch-size 8] [--out FILE]

Writes the first N Known 1000 prompts (the model's own prediction as target) to a prompt file, then runs, in
alternation (so a busy machine slows both alike), ``python -m dpa attribute --prompts FILE --out DIR`` and
``torchrun --nproc-per-node 2 -m dpa attribute ...`` with OMP_NUM_THREADS=1, each into a fresh folder. Prints
prompts per second of the whole command (model loading included) and of the attribution itself (the run's
``seconds_this_run``: validation, batches and merge), and the 2-process / 1-process ratio of each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(cmd: list[str], out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd + ["--out", str(out), "--quiet"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return wall, summary["seconds_this_run"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=os.environ.get("DPA_DATA", "../shared/data"))
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, help="write the table as JSON here")
    args = p.parse_args()
    records = json.loads((Path(args.data_dir) / "known_1000.json").read_text())[: args.n]
    tmp = Path(tempfile.mkdtemp(prefix="dpa-bench-batch-"))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "id": r["known_id"]}) + "\n" for r in records))
    base = ["attribute", "--prompts", str(prompts), "--batch-size", str(args.batch_size)]
    if args.model:
        base += ["--model", args.model]
    commands = {1: [sys.executable, "-m", "dpa", *base],
                2: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dpa", *base]}
    times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for r in range(args.rounds):
        for n, cmd in commands.items():
            times[n].append(run(cmd, tmp / f"out-{n}"))
            wall, inner = times[n][-1]
            print(f"round {r + 1}: {n} process(es): {wall:.1f} s whole command, {inner:.1f} s attributing", flush=True)
    rows = []
    for n in (1, 2):
        wall = statistics.median(t[0] for t in times[n])
        inner = statistics.median(t[1] for t in times[n])
        rows.append({"processes": n, "threads_each": 1, "prompts": len(records), "batch_size": args.batch_size,
                     "wall_s": wall, "attribute_s": inner, "prompts_per_s_wall": len(records) / wall,
                     "prompts_per_s_attribute": len(records) / inner})
    ratio_wall = rows[1]["prompts_per_s_wall"] / rows[0]["prompts_per_s_wall"]
    ratio_inner = rows[1]["prompts_per_s_attribute"] / rows[0]["prompts_per_s_attribute"]
    print(f"\n{'processes':>9} {'prompts/s (whole)':>18} {'prompts/s (attributing)':>24}")
    for r in rows:
        print(f"{r['processes']:>9} {r['prompts_per_s_wall']:>18.2f} {r['prompts_per_s_attribute']:>24.2f}")
    print(f"2 / 1 processes: {ratio_wall:.2f}x whole command, {ratio_inner:.2f}x attributing")
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()} {os.cpu_count()} cores", "rows": rows,
                                        "ratio_wall": ratio_wall, "ratio_attribute": ratio_inner,
                                        "rounds": args.rounds}, indent=1) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
