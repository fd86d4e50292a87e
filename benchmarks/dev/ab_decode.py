"""A/B of decode speed between two source trees of freetoken_core on the same GPU, alternating runs.

    python benchmarks/dev/ab_decode.py --old DIR_WITH_OLD_freetoken_core [--shape llama-3-8b] [--bs 1,64]
                                   [--prompt 128] [--out-tokens 128] [--rounds 3]

Each run is a fresh `bench_decode.py` process (random weights, bf16, no prefill row) with PYTHONPATH
pointing at one tree; A and B alternate so drift of the machine hits both. Prints each run's tok/s
and the median per tree and batch size.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<model>[^|]+) \| (?P<bs>\d+) \| (?P<prompt>\d+) \| \d+ \| (?P<tok_s>\d+) \|")


def run_once(tree: Path, args) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{BENCHMARKS}", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(BENCHMARKS / "bench_decode.py"), "--shapes", args.shape, "--bs", args.bs,
           "--prompts", str(args.prompt), "--out-tokens", str(args.out_tokens), "--prefill", "0",
           "--page-size", str(args.page_size)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    rates = {int(m["bs"]): float(m["tok_s"]) for line in out.stdout.splitlines() if (m := ROW.match(line))}
    if not rates:
        raise SystemExit(f"bench_decode.py printed no rows for {tree}:\n{out.stdout[-3000:]}")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a directory holding the old freetoken_core package")
    ap.add_argument("--new", default=str(BENCHMARKS.parent), help="the directory holding the new one (this checkout)")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--bs", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    runs: dict[str, list[dict[int, float]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            rates = runs[name].append(run_once(trees[name], args)) or runs[name][-1]
            print(f"round {r} {name}: " + ", ".join(f"bs {b}: {v:.0f} tok/s" for b, v in sorted(rates.items())), flush=True)
    print(f"\n| {args.shape} bs | old median tok/s | new median tok/s | new/old |\n|---|---|---|---|")
    for bs in sorted(runs["old"][0]):
        old = statistics.median(r[bs] for r in runs["old"])
        new = statistics.median(r[bs] for r in runs["new"])
        print(f"| {bs} | {old:.0f} | {new:.0f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
