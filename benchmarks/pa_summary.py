"""Helpers of benchmarks/gpu_perf_analyzer.sh: write perf_analyzer's input files; summarize its CSVs.

    python benchmarks/pa_summary.py inputs DIR OUT_TOKENS      # DIR/ensemble.json, DIR/freetoken.json
    python benchmarks/pa_summary.py table DIR OUT_TOKENS 1 16 64 128

perf_analyzer's --verbose-csv row has "Inferences/Second" (requests/s), "Response Throughput"
(responses/s, decoupled models) and latency columns in microseconds; tokens per response =
requests/s x OUT_TOKENS / responses/s (every request generates OUT_TOKENS: ignore_eos).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a paged KV cache works.",
           "List ten uses for a paperclip.", "Translate to French: the weather is nice today."]


def write_inputs(work: Path, out_tokens: int) -> None:
    common = {"max_tokens": [out_tokens], "stream": [True], "ignore_eos": [True]}
    (work / "ensemble.json").write_text(json.dumps({"data": [{"text_input": [p], **common} for p in PROMPTS]}))
    # freetoken alone: token ids of a 32-token prompt (any ids below the vocab size work)
    ids = [[(1000 + 37 * i + 11 * j) % 49000 for j in range(32)] for i in range(len(PROMPTS))]
    (work / "freetoken.json").write_text(json.dumps({"data": [{"input_ids": x, **common} for x in ids]}))


def read_row(path: Path) -> dict[str, str] | None:
    if not path.is_file():
        return None
    rows = list(csv.DictReader(path.open()))
    return rows[-1] if rows else None


def _f(row: dict[str, str], *names: str) -> float | None:
    for n in names:
        if row.get(n) not in (None, ""):
            return float(row[n])
    return None


def table(work: Path, out_tokens: int, concurrencies: list[str]) -> str:
    lines = ["| target | concurrency | requests/s | responses/s | tokens/response | tok/s | p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for target in ("ensemble", "freetoken"):
        for c in concurrencies:
            row = read_row(work / f"{target}-{c}.csv")
            if row is None:
                lines.append(f"| {target} | {c} | (no result: see {work}/{target}-{c}.txt) |||||| ")
                continue
            rps = _f(row, "Inferences/Second") or 0.0
            resp = _f(row, "Response Throughput") or 0.0
            p50, p99 = _f(row, "p50 latency"), _f(row, "p99 latency")
            tpr = rps * out_tokens / resp if resp else float("nan")
            ms = lambda v: "-" if v is None else f"{v / 1000:.1f}"  # noqa: E731
            lines.append(f"| {target} | {c} | {rps:.1f} | {resp:.0f} | {tpr:.2f} | {rps * out_tokens:.0f} | "
                         f"{ms(p50)} | {ms(p99)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    cmd, work, out_tokens = argv[0], Path(argv[1]), int(argv[2])
    if cmd == "inputs":
        write_inputs(work, out_tokens)
    else:
        print(table(work, out_tokens, argv[3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
