"""Each kernel of a decode step alone, under Nsight Compute: duration, DRAM bytes, bandwidth, registers.

    ncu --nvtx --nvtx-include 'profile/' --graph-profiling node --clock-control none --cache-control all \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size,\
launch__registers_per_thread --csv --page raw \
        python3 benchmarks/dev/ncu_decode.py run --shape qwen3-30b-a3b --prompt 16 --page-size 1 > ncu.csv
                                                              (PYTHONPATH=$PWD, from the repository root)
    python3 benchmarks/dev/ncu_decode.py table ncu.csv

`run` builds the shape (random bf16 weights, CUDA graphs, PDL), decodes `--warm` steps of one
request, then runs `--steps` steps inside an NVTX range named "profile", the only kernels ncu
profiles. ncu runs the graph's kernels one at a time with L2 flushed before each (`--cache-control
all`), so the table says what each kernel costs alone, launch and ramp included; the step inside the
graph (bench_decode.py) is shorter, since PDL overlaps neighbours. `table` groups the CSV's rows by
kernel and grid and prints medians per launch and the total per step.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import statistics
import sys
import tempfile
from pathlib import Path

# what `table` reads: the ncu command's --metrics
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "launch__grid_size", "launch__block_size",
           "launch__registers_per_thread")


def run(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_decode's shapes
    from bench_decode import write_shape
    from profile_decode import make_sched, start

    with tempfile.TemporaryDirectory() as tmp:
        # memory_fraction as bench_decode's: the 30B's weights alone take 60 GB
        sched = make_sched(write_shape(args.shape, Path(tmp)), True, 1, page_size=args.page_size,
                           max_seq_len=args.max_seq_len, memory_fraction=0.8)
        start(sched, 1, args.prompt, args.warm + args.steps + 8)  # the prompt's prefill
        for _ in range(args.warm):
            sched.step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        for _ in range(args.steps):
            sched.step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        sched.engine.close()


def table(csv_path: Path, steps: int) -> None:
    lines = csv_path.read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise SystemExit(f"{csv_path}: no ncu table (run ncu with --csv --page raw; did it profile any kernel?)")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[header:]))))[1:]  # the row after the header: units
    missing = [m for m in METRICS if rows and m not in rows[0]]
    if missing:
        raise SystemExit(f"{csv_path}: ncu was run without {', '.join(missing)} (its --metrics must name them)")

    def num(row: dict, key: str) -> float:
        return float(row[key].replace(",", ""))

    groups: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    regs: dict[str, set[str]] = collections.defaultdict(set)
    for row in rows:
        key = f"{row['Kernel Name'][:40]} grid {row['launch__grid_size']} x {row['launch__block_size']}"
        groups[key].append((num(row, "gpu__time_duration.sum"), num(row, "dram__bytes_read.sum")))
        regs[key].add(row["launch__registers_per_thread"])
    print("| kernel, grid x block | launches a step | us (median) | MB read | TB/s | registers | us a step |")
    print("|---|---|---|---|---|---|---|")
    total = 0.0
    for key, vals in sorted(groups.items(), key=lambda kv: -sum(t for t, _ in kv[1])):
        t = statistics.median(v[0] for v in vals)
        b = statistics.median(v[1] for v in vals)
        per_step = sum(v[0] for v in vals) / steps / 1e3
        total += per_step
        print(f"| {key} | {len(vals) / steps:g} | {t / 1e3:.2f} | {b / 1e6:.2f} | {b / t / 1e3:.2f} | "
              f"{'/'.join(sorted(regs[key]))} | {per_step:.1f} |")
    print(f"kernels alone, summed: {total / 1e3:.3f} ms a step")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="decode under an NVTX range (launch this under ncu)")
    r.add_argument("--shape", default="qwen3-30b-a3b")
    r.add_argument("--prompt", type=int, default=16)
    r.add_argument("--page-size", type=int, default=1)
    r.add_argument("--warm", type=int, default=40)
    r.add_argument("--max-seq-len", type=int, default=288,
                   help="as bench_decode.py sizes it (prompt + 256 new + 16): the graphs' attention splits follow it")
    r.add_argument("--steps", type=int, default=2)
    t = sub.add_parser("table", help="summarise ncu's --csv --page raw output")
    t.add_argument("csv", type=Path)
    t.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        table(args.csv, args.steps)


if __name__ == "__main__":
    main()
