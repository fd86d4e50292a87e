"""Helpers of benchmarks/gpu_perf_analyzer.sh: write perf_analyzer's input files; summarize what its runs left.
(Its two Python clients, SSE load and one timed stream, are benchmarks/pa_clients.py.)

    python benchmarks/pa_summary.py inputs DIR OUT_TOKENS      # DIR/ensemble.json, DIR/freetoken.json
    python benchmarks/pa_summary.py table DIR OUT_TOKENS 1 16 64 128
    python benchmarks/pa_summary.py top DIR [N]    # py-spy raw profiles (gpu_perf_analyzer.sh PYSPY_OUT)
    python benchmarks/pa_summary.py trace TRACE_JSON     # tritonserver --trace-config level=TIMESTAMPS output
    python benchmarks/pa_summary.py targets AB_OUTPUT    # gpu_served_ab.sh's output against issue 13's targets
    python benchmarks/pa_summary.py senders DIR 1 16 64 128   # the stubs' sender reports during each run

`trace` reads a Triton trace file (serve --server-arg=--trace-config=triton,file=F
--server-arg=--trace-config=level=TIMESTAMPS --server-arg=--trace-config=rate=1): for every ensemble request,
each timestamp of the ensemble and of its steps (tokenizer, freetoken, every detokenizer execution) as an
offset from the request's arrival (its GRPC_WAITREAD_END); prints the medians in time order, so a request's path reads top down.

`targets` reads what benchmarks/gpu_served_ab.sh printed (its in-process lines, before and after, and each
setting's ensemble table) and says, per setting, the ratio served / mean in-process at each concurrency and
whether issue 13's targets hold: >= 0.95 at 1, 16 and 64 streams, >= 8k responses/s at 64, <= 1.5 tokens a
response at 16.

`senders` reads DIR/sender-TARGET-C.txt (gpu_perf_analyzer.sh: the `freetoken` stubs' sender report lines,
serving/stream/sender.py, logged while that run went on; each stub logs one every 10 s) and prints, per run, the medians
over those reports of the detokenizer ack round trip (its p50 and p99: how long a response waits in the queue in
front of the detokenizers) and of the engine's time to a stream's first token, and the windows a stream had: the
queue the flow control allows, beside what perf_analyzer saw. A report may span the run before it (10 s intervals).

perf_analyzer's --verbose-csv row has "Inferences/Second" (requests/s), "Response Throughput"
(responses/s, decoupled models) and latency columns in microseconds; tokens per response =
requests/s x OUT_TOKENS / responses/s (every request generates OUT_TOKENS: ignore_eos).
"""

from __future__ import annotations

import csv
import json
import re
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


def ensemble_inputs(text: str, out_tokens: int, stream: bool = True) -> list:
    """gRPC inputs of one ensemble request: `text`, `out_tokens` new tokens, ignore_eos."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    ins = []
    for name, arr, dt in [("text_input", np.array([text.encode()], dtype=object), "BYTES"),
                          ("max_tokens", np.array([out_tokens], np.int32), "INT32"),
                          ("ignore_eos", np.array([True]), "BOOL"), ("stream", np.array([stream]), "BOOL")]:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        ins.append(t)
    return ins


def trace_timeline(path: Path) -> str:
    """Median offsets (ms) of each (model, timestamp) from the ensemble request's arrival."""
    import statistics

    records: dict[int, dict] = {}
    # with --trace-config triton,log-frequency=N the server writes PATH.0, PATH.1, ...
    files = [path] if path.is_file() else sorted(path.parent.glob(path.name + ".*"))
    items = [item for f in files for item in json.loads(f.read_text() or "[]")]
    for item in items:
        rec = records.setdefault(item["id"], {"model": None, "parent": None, "ts": {}})
        if "model_name" in item:
            rec["model"], rec["parent"] = item["model_name"], item.get("parent_id")
        for t in item.get("timestamps", []):
            rec["ts"].setdefault(t["name"], []).append(int(t["ns"]))
    children: dict[int, list[dict]] = {}
    for rec in records.values():
        if rec["parent"]:
            children.setdefault(rec["parent"], []).append(rec)
    offsets: dict[tuple[str, str], list[float]] = {}
    # the ensemble requests: the traces without a parent (any ensemble's name: served_floor.py calls its own "floor")
    roots = [(i, r) for i, r in records.items() if r["model"] and not r["parent"] and r["ts"]]
    for rid, root in roots:
        # from the request's arrival (a stream's GRPC_WAITREAD_START is when the server began waiting for it)
        t0 = min(root["ts"].get("GRPC_WAITREAD_END") or root["ts"].get("REQUEST_START") or
                 [min(min(v) for v in root["ts"].values())])
        kids = sorted(children.get(rid, []), key=lambda r: min(min(v) for v in r["ts"].values()) if r["ts"] else 0)
        by_model: dict[str, list[dict]] = {}
        for rec in kids:
            by_model.setdefault(rec["model"] or "?", []).append(rec)
        # each model's first, second and last execution within this request (the detokenizer runs once a response)
        named = [("ensemble", root)]
        for model, execs in by_model.items():
            named += [(model if k == 0 else f"{model}[2]" if k == 1 else f"{model}[last]", rec)
                      for k, rec in enumerate(execs) if k < 2 or k == len(execs) - 1]
        for name, rec in named:
            for ts_name, values in rec["ts"].items():
                values = sorted(values)  # a decoupled request's repeated timestamps: the first and the last
                offsets.setdefault((name, ts_name), []).append((values[0] - t0) / 1e6)
                if len(values) > 1:
                    offsets.setdefault((name, f"{ts_name} (last)"), []).append((values[-1] - t0) / 1e6)
    rows = sorted(((statistics.median(v), m, n, len(v)) for (m, n), v in offsets.items()))
    lines = [f"{len(roots)} ensemble requests traced", "| ms from the request's arrival (median) | model | "
             "timestamp | requests |", "|---|---|---|---|"]
    lines += [f"| {t:.3f} | {m} | {n} | {c} |" for t, m, n, c in rows]
    return "\n".join(lines)


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


RATIO_TARGET = 0.95  # served / in-process, at each of RATIO_STREAMS
RATIO_STREAMS = (1, 16, 64)
RESPONSES_TARGET = (64, 8000.0)  # ensemble responses/s at 64 streams
TOKENS_A_RESPONSE_TARGET = (16, 1.5)  # mean tokens a response at 16 streams


def parse_ab_output(text: str) -> tuple[dict[int, list[float]], dict[str, dict[int, dict[str, float]]]]:
    """gpu_served_ab.sh's output -> (in-process tok/s runs per concurrency, {setting: {concurrency: ensemble row}}),
    a row's fields: rps, responses, tokens_per_response, tok_s."""
    inprocess: dict[int, list[float]] = {}
    served: dict[str, dict[int, dict[str, float]]] = {}
    setting = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("=== served "):
            setting = line[line.find("[") + 1:line.rfind("]")] if "[" in line else line[len("=== served "):]
            served.setdefault(setting, {})
        elif line.startswith("=== "):
            setting = None
        elif "in-process LLM" in line and line.startswith("concurrency "):
            c = int(line.split()[1].rstrip(":"))
            inprocess.setdefault(c, []).append(float(line.split("in-process LLM")[1].split()[0]))
        elif line.startswith("| ensemble |") and setting is not None:
            cells = [x.strip() for x in line.strip("|").split("|")]
            try:
                rps, resp, tpr, toks = (float(cells[i]) for i in (2, 3, 4, 5))
            except (ValueError, IndexError):  # "(no result: ...)"
                continue
            served[setting][int(cells[1])] = {"rps": rps, "responses": resp, "tokens_per_response": tpr, "tok_s": toks}
    return inprocess, served


def targets_report(text: str) -> str:
    inprocess, served = parse_ab_output(text)
    means = {c: sum(v) / len(v) for c, v in inprocess.items()}
    out = []
    for setting, rows in served.items():
        out += [f"setting [{setting}]", "| streams | in-process runs | served tok/s | ratio | responses/s | tokens/response |",
                "|---|---|---|---|---|---|"]
        misses = []
        for c in sorted(set(rows) | set(RATIO_STREAMS)):
            row, mean = rows.get(c), means.get(c)
            runs = " / ".join(f"{x:,.1f}" for x in inprocess.get(c, [])) or "-"
            if row is None:
                out.append(f"| {c} | {runs} | no result | - | - | - |")
                if c in RATIO_STREAMS:
                    misses.append(f"{c} streams: no served result")
                continue
            ratio = row["tok_s"] / mean if mean else float("nan")
            out.append(f"| {c} | {runs} | {row['tok_s']:,.0f} | {ratio:.3f} | {row['responses']:,.0f} | "
                       f"{row['tokens_per_response']:.2f} |")
            if c in RATIO_STREAMS and not ratio >= RATIO_TARGET:
                misses.append(f"{c} streams: ratio {ratio:.3f} < {RATIO_TARGET}")
            if c == RESPONSES_TARGET[0] and row["responses"] < RESPONSES_TARGET[1]:
                misses.append(f"{c} streams: {row['responses']:,.0f} responses/s < {RESPONSES_TARGET[1]:,.0f}")
            if c == TOKENS_A_RESPONSE_TARGET[0] and row["tokens_per_response"] > TOKENS_A_RESPONSE_TARGET[1]:
                misses.append(f"{c} streams: {row['tokens_per_response']:.2f} tokens a response > "
                              f"{TOKENS_A_RESPONSE_TARGET[1]}")
        out.append("targets: " + ("all met" if not misses else "MISSED: " + "; ".join(misses)))
        out.append("")
    return "\n".join(out) if served else "no served ensemble table in this output"


_SENDER_FIELDS = {
    "ack_p50": re.compile(r"ack round trip p50/p99 ([0-9.]+)/"),
    "ack_p99": re.compile(r"ack round trip p50/p99 [0-9.]+/([0-9.]+) ms"),
    "first_ms": re.compile(r"first token ([0-9.]+) ms later"),
    "per_response": re.compile(r"\(([0-9.]+) per response\)"),
}
_SENDER_WINDOW = re.compile(r"window (\d+) a stream")


def sender_summary(lines: list[str]) -> dict[str, float | str] | None:
    """Medians over one run's sender report lines (None without any); windows: the distinct ones, ascending."""
    if not lines:
        return None
    out: dict[str, float | str] = {"reports": float(len(lines))}
    for name, pattern in _SENDER_FIELDS.items():
        values = sorted(float(m.group(1)) for m in map(pattern.search, lines) if m)
        out[name] = values[len(values) // 2] if values else float("nan")
    windows = sorted({int(m.group(1)) for m in map(_SENDER_WINDOW.search, lines) if m})
    out["windows"] = "/".join(map(str, windows)) or "-"
    return out


def senders_table(work: Path, concurrencies: list[str], targets: tuple[str, ...] = ("ensemble", "freetoken")) -> str:
    rows = ["| target | streams | sender reports | ack round trip p50 / p99 ms | engine to first token ms | "
            "tokens a response | windows a stream |", "|---|---|---|---|---|---|---|"]
    for target in targets:
        for c in concurrencies:
            path = work / f"sender-{target}-{c}.txt"
            if not path.exists():
                continue
            s = sender_summary([ln for ln in path.read_text().splitlines() if ln.startswith("sender:")])
            if s is None:
                rows.append(f"| {target} stubs | {c} | 0 | - | - | - | - |")
                continue
            rows.append(f"| {target} stubs | {c} | {s['reports']:.0f} | {s['ack_p50']:.1f} / {s['ack_p99']:.1f} | "
                        f"{s['first_ms']:.2f} | {s['per_response']:.2f} | {s['windows']} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[0] == "senders":
        print(senders_table(Path(argv[1]), argv[2:]))
        return 0
    if argv[0] == "targets":
        print(targets_report(Path(argv[1]).read_text()))
        return 0
    if argv[0] == "top":
        print(profile_top(Path(argv[1]), int(argv[2]) if len(argv) > 2 else 12))
        return 0
    if argv[0] == "trace":
        print(trace_timeline(Path(argv[1])))
        return 0
    cmd, work, out_tokens = argv[0], Path(argv[1]), int(argv[2])
    if cmd == "inputs":
        write_inputs(work, out_tokens)
    else:
        print(table(work, out_tokens, argv[3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
