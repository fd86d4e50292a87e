"""Helpers of benchmarks/gpu_perf_analyzer.sh: write perf_analyzer's input files; summarize its CSVs.

    python benchmarks/pa_summary.py inputs DIR OUT_TOKENS      # DIR/ensemble.json, DIR/freetoken.json
    python benchmarks/pa_summary.py table DIR OUT_TOKENS 1 16 64 128
    python benchmarks/pa_summary.py sse localhost:8000 CONCURRENCY SECONDS OUT_TOKENS [PROCESSES]
    python benchmarks/pa_summary.py top DIR [N]    # py-spy raw profiles (gpu_perf_analyzer.sh PYSPY_OUT)

`sse` is a small load generator for Triton's HTTP `generate_stream` (SSE) on the ensemble: CONCURRENCY
streams spread over PROCESSES client processes (default: one per 8 streams, so the client is not the
limit; it reports its own CPU use so that you can tell), each stream sending its next request as soon as
the last one ended. Prints requests/s, SSE events (responses)/s, tokens/s, TTFT and inter-event p50/p99.

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
    # a variable-sized input needs its shape spelled out in perf_analyzer's JSON
    (work / "freetoken.json").write_text(json.dumps(
        {"data": [{"input_ids": {"content": x, "shape": [len(x)]}, **common} for x in ids]}))


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
        if not any((work / f"{target}-{c}.txt").exists() for c in concurrencies):
            continue  # not run (TARGETS)
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


def _sse_worker(args: tuple[str, int, float, int, int]) -> dict:
    """One client process: `streams` threads, each looping generate_stream requests until the deadline."""
    import http.client
    import threading
    import time

    url, streams, seconds, out_tokens, seed = args
    host, port = url.rsplit(":", 1)
    stats = {"requests": 0, "events": 0, "tokens": 0, "ttft": [], "gaps": [], "errors": 0}
    lock = threading.Lock()
    t_end = time.perf_counter() + seconds
    cpu0 = time.process_time()

    def run(i: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        n = 0
        while time.perf_counter() < t_end:
            body = json.dumps({"text_input": PROMPTS[(seed + i + n) % len(PROMPTS)], "max_tokens": out_tokens,
                               "stream": True, "ignore_eos": True})
            n += 1
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v2/models/ensemble/generate_stream", body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                last, events, tokens, ttft, gaps = None, 0, 0, None, []
                for line in resp:
                    if not line.startswith(b"data:"):
                        continue
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
                    events += 1
                    ids = json.loads(line[5:]).get("next_tokens")  # a one-token response is a bare int
                    tokens += 1 if isinstance(ids, int) else len(ids or [])
                resp.read()
            except Exception:  # noqa: BLE001
                with lock:
                    stats["errors"] += 1
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                continue
            with lock:
                if time.perf_counter() <= t_end:  # count only requests that ended inside the window
                    stats["requests"] += 1
                    stats["events"] += events
                    stats["tokens"] += tokens
                    stats["ttft"].append(ttft or 0.0)
                    stats["gaps"].extend(gaps)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 150)
    stats["cpu_s"] = time.process_time() - cpu0
    return stats


def sse_load(url: str, concurrency: int, seconds: float, out_tokens: int, processes: int = 0) -> str:
    from multiprocessing import Pool

    procs = processes or max(1, (concurrency + 7) // 8)
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    with Pool(procs) as pool:
        parts = pool.map(_sse_worker, [(url, n, seconds, out_tokens, i * 101) for i, n in enumerate(per) if n])
    tot = {k: sum(p[k] for p in parts) for k in ("requests", "events", "tokens", "errors", "cpu_s")}
    ttft = sorted(x for p in parts for x in p["ttft"])
    gaps = sorted(x for p in parts for x in p["gaps"])
    pct = lambda xs, q: 1000 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return (f"| sse | {concurrency} | {tot['requests'] / seconds:.1f} | {tot['events'] / seconds:.0f} | "
            f"{tot['tokens'] / max(1, tot['events']):.2f} | {tot['tokens'] / seconds:.0f} | "
            f"ttft {pct(ttft, .5):.1f}/{pct(ttft, .99):.1f} | itl {pct(gaps, .5):.2f}/{pct(gaps, .99):.2f} | "
            f"errors {tot['errors']}, client cpu {tot['cpu_s'] / seconds:.2f} cores over {len(parts)} procs |")


def profile_top(folder: Path, n: int = 12) -> str:
    """Per py-spy raw profile (lines `frame;frame;... count`): the share of samples spent in each
    function itself (leaf) and under it (inclusive, once per stack), the top `n` of each."""
    out = []
    for path in sorted(folder.glob("*.txt")):
        leaf: dict[str, int] = {}
        incl: dict[str, int] = {}
        total = 0
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [f.strip() for f in stack.split(";") if f.strip()]
            if not frames:
                continue
            c = int(count)
            total += c
            leaf[frames[-1]] = leaf.get(frames[-1], 0) + c
            for f in set(frames):
                incl[f] = incl.get(f, 0) + c
        out.append(f"== {path.name}: {total} samples")
        for title, table_ in (("self", leaf), ("inclusive", incl)):
            out.append(f"  {title}:")
            for f, c in sorted(table_.items(), key=lambda kv: -kv[1])[:n]:
                out.append(f"    {100 * c / max(1, total):5.1f}%  {f[:150]}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv[0] == "top":
        print(profile_top(Path(argv[1]), int(argv[2]) if len(argv) > 2 else 12))
        return 0
    if argv[0] == "sse":
        print(sse_load(argv[1], int(argv[2]), float(argv[3]), int(argv[4]), int(argv[5]) if len(argv) > 5 else 0))
        return 0
    cmd, work, out_tokens = argv[0], Path(argv[1]), int(argv[2])
    if cmd == "inputs":
        write_inputs(work, out_tokens)
    else:
        print(table(work, out_tokens, argv[3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
