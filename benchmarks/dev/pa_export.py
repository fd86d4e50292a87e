"""Where a closed loop's slots go: perf_analyzer's per-request timestamps (--profile-export-file) summarized.

    python benchmarks/dev/pa_export.py [--out-tokens 128] FILE.json [FILE.json ...]   # gpu_perf_analyzer.sh PA_EXPORT=DIR
    python benchmarks/dev/pa_export.py --arrivals [--out-tokens 128] FILE.json ...     # when each token reached the client
    python benchmarks/dev/pa_export.py --slow [--gpu GPU.csv] FILE.json ...            # spells of slow requests

Why (issue 13): perf_analyzer at concurrency C keeps C requests outstanding, so by Little's law requests/s x mean
latency should be C. On the H200 host the Llama-3.2-1B shape read 94.2 requests/s x 159.6 ms (p50) = 15.0 at 16
streams while SmolLM2 read 16.0: about one stream of 16 idle, which alone is most of that shape's 16-stream gap to
in-process. This tells which it is, per experiment (concurrency): requests slower than the median (mean latency
above p50: a tail), or time between a request's last response and the client's next send (the client or the
server's FINAL after the last response).

Per measurement window (perf_analyzer's `window_boundaries`): requests that ended in it, requests/s, tokens/s
(requests x OUT_TOKENS, default 128: ignore_eos) and busy streams in it. The first window shows perf_analyzer's
ramp: it starts its streams a few at a time (Llama-3.2-1B at 16 streams: 5 every ~150 ms, 12.9 busy streams in a
first window of 3.6 s against 15.9 in the next two).

Per experiment: requests; mean / p50 / p99 latency (send -> last response); mean TTFT (send -> first response);
busy streams (the summed latencies over the span from the first send to the last response, i.e. mean requests in
flight); and the client gap: with C streams, the k-th send after the first C follows the k-th completion (a closed
loop), so gap_k = send_(C+k) - completion_k in time order: its p50 / mean / p99.

The export's layout (perf_analyzer 2.x): {"experiments": [{"experiment": {"mode": "concurrency", "value": C},
"requests": [{"timestamp": ns, "response_timestamps": [ns, ...], ...}, ...], "window_boundaries": [ns, ...]}]}.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LoopSummary:
    concurrency: int
    requests: int
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttft_mean_ms: float
    busy_streams: float  # mean requests in flight over the run
    gap_p50_ms: float
    gap_mean_ms: float
    gap_p99_ms: float


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _spans(requests: list[dict]) -> list[tuple[int, int, int]]:
    """(send, first response, last response) of each request that got a response, in send order (ns)."""
    return sorted((r["timestamp"], r["response_timestamps"][0], r["response_timestamps"][-1])
                  for r in requests if r.get("response_timestamps"))


def summarize(concurrency: int, requests: list[dict]) -> LoopSummary | None:
    """One experiment's requests (those with at least one response)."""
    spans = _spans(requests)
    if len(spans) <= concurrency:
        return None
    ms = 1e-6  # the timestamps are ns
    latencies = [(end - send) * ms for send, _, end in spans]
    sends = [send for send, _, _ in spans]
    ends = sorted(end for _, _, end in spans)
    gaps = [(sends[concurrency + k] - ends[k]) * ms for k in range(len(spans) - concurrency)]
    span = (max(ends) - sends[0]) * ms
    return LoopSummary(concurrency, len(spans), statistics.fmean(latencies), _pct(latencies, 0.5),
                       _pct(latencies, 0.99), statistics.fmean((first - send) * ms for send, first, _ in spans),
                       sum(latencies) / span, _pct(gaps, 0.5), statistics.fmean(gaps), _pct(gaps, 0.99))


@dataclass
class Window:
    start_s: float  # from the first boundary
    end_s: float
    requests: int  # that ended in the window
    busy_streams: float  # requests in flight, averaged over the window


def windows(requests: list[dict], boundaries: list[int]) -> list[Window]:
    spans = _spans(requests)
    out = []
    for a, b in zip(boundaries, boundaries[1:]):
        done = sum(1 for _, _, end in spans if a <= end < b)
        busy = sum(max(0, min(end, b) - max(send, a)) for send, _, end in spans) / (b - a)
        out.append(Window((a - boundaries[0]) * 1e-9, (b - boundaries[0]) * 1e-9, done, busy))
    return out


def experiments(path: Path) -> list[tuple[int, list[dict], list]]:
    """An export's runs: (concurrency, requests, window boundaries) each."""
    return [(int(exp["experiment"]["value"]), exp.get("requests", []), exp.get("window_boundaries", []))
            for exp in json.loads(path.read_text()).get("experiments", [])]


def read_export(path: Path) -> list[tuple[LoopSummary, list[Window]]]:
    out = []
    for concurrency, requests, boundaries in experiments(path):
        summary = summarize(concurrency, requests)
        if summary is not None:
            out.append((summary, windows(requests, boundaries)))
    return out


def table(paths: list[Path], out_tokens: int = 128) -> str:
    lines = ["| file | streams | requests | latency mean / p50 / p99 ms | TTFT mean ms | busy streams | "
             "client gap p50 / mean / p99 ms |", "|---|---|---|---|---|---|---|"]
    window_lines = ["| file | streams | window s | requests ended | requests/s | tok/s | busy streams |",
                    "|---|---|---|---|---|---|---|"]
    for path in paths:
        for s, wins in read_export(path):
            lines.append(f"| {path.name} | {s.concurrency} | {s.requests} | {s.latency_mean_ms:.1f} / "
                         f"{s.latency_p50_ms:.1f} / {s.latency_p99_ms:.1f} | {s.ttft_mean_ms:.2f} | "
                         f"{s.busy_streams:.2f} | {s.gap_p50_ms:.2f} / {s.gap_mean_ms:.2f} / {s.gap_p99_ms:.2f} |")
            for w in wins:
                rate = w.requests / (w.end_s - w.start_s)
                window_lines.append(f"| {path.name} | {s.concurrency} | {w.start_s:.2f}-{w.end_s:.2f} | {w.requests} | "
                                    f"{rate:.1f} | {rate * out_tokens:.0f} | {w.busy_streams:.2f} |")
    return "\n".join(lines + [""] + window_lines)


ARRIVAL_TOKENS = (1, 2, 4, 16, 64, 120, 126, 127, 128)
SLOW_FACTOR = 1.05  # a request this much over the median latency counts as slow (slow_spells)


def _tokens_in(output: dict) -> int:
    """Tokens a streamed response brought: its next_tokens (a list, or one value), else one."""
    tokens = output.get("next_tokens", 0) if isinstance(output, dict) else 0
    return len(tokens) if isinstance(tokens, list) else 1


def token_arrivals(requests: list[dict], out_tokens: int) -> dict[int, float]:
    """The median time (ms from its send) at which a request's k-th token reached the client, for each k of
    ARRIVAL_TOKENS up to out_tokens, over the requests that got all out_tokens. Token k arrives with the response
    that carries it, so the medians show where one stream's time goes: the first token (the front), the slope
    from token 16 to 120 (the engine's pace as delivered), the last gap (the last response)."""
    per_k: dict[int, list[float]] = {k: [] for k in ARRIVAL_TOKENS if k <= out_tokens}
    for req in requests:
        stamps = req.get("response_timestamps") or []
        outputs = req.get("response_outputs") or [{}] * len(stamps)
        arrival, count = {}, 0
        for t, output in zip(stamps, outputs):
            n = _tokens_in(output)
            for k in range(count + 1, count + n + 1):
                arrival[k] = (t - req["timestamp"]) / 1e6
            count += n
        if count >= out_tokens:
            for k, values in per_k.items():
                values.append(arrival[k])
    return {k: statistics.median(v) for k, v in per_k.items() if v}


def arrivals_table(paths: list[Path], out_tokens: int = 128) -> str:
    ks = [k for k in ARRIVAL_TOKENS if k <= out_tokens]
    lines = ["| file | streams | " + " | ".join(f"token {k} ms" for k in ks) + " | ms a token, 16 -> 120 | last gap ms |",
             "|---|---|" + "---|" * (len(ks) + 2)]
    for path in paths:
        for concurrency, requests, _ in experiments(path):
            med = token_arrivals(requests, out_tokens)
            if len(med) < len(ks):
                continue
            slope = (med[120] - med[16]) / 104 if 120 in med and 16 in med else float("nan")
            gap = med[out_tokens] - med[out_tokens - 1] if out_tokens - 1 in med else float("nan")
            lines.append(f"| {path.parent.name}/{path.name} | {concurrency} | " + " | ".join(f"{med[k]:.2f}" for k in ks)
                         + f" | {slope:.4f} | {gap:.3f} |")
    return "\n".join(lines)


@dataclass
class SlowSpell:
    start_s: float  # the spell's first send, from the run's first send
    end_s: float  # its last request's last response
    requests: int
    latency_p50_ms: float
    longest_gap_ms: float  # the longest time between two responses of one of its requests


def slow_spells(requests: list[dict], factor: float = SLOW_FACTOR, bridge: int = 1) -> list[SlowSpell]:
    """Runs of requests (in send order) that took more than `factor` x the median latency, joined across at most
    `bridge` requests that did not. Why (issue 13): a one-stream run's mean falls below its median when the engine
    steps slower for a while (seen: 2.5 s of 13-25% slower requests in a 29 s run, no long gap in any of them); this says when, for how long, and whether it was one stall (a long gap) or every step."""
    spans = sorted((r["timestamp"], r["response_timestamps"]) for r in requests if r.get("response_timestamps"))
    if not spans:
        return []
    t0 = spans[0][0]
    latency = [(stamps[-1] - sent) / 1e6 for sent, stamps in spans]
    limit = factor * statistics.median(latency)
    slow = [i for i, value in enumerate(latency) if value > limit]
    groups: list[list[int]] = []
    for i in slow:
        if groups and i - groups[-1][-1] <= bridge + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    spells = []
    for group in groups:
        first, last = group[0], group[-1]
        gaps = [max((b - a for a, b in zip(spans[i][1], spans[i][1][1:])), default=0) / 1e6 for i in group]
        spells.append(SlowSpell((spans[first][0] - t0) / 1e9, (spans[last][1][-1] - t0) / 1e9, len(group),
                                statistics.median(latency[i] for i in group), max(gaps)))
    return spells


@dataclass
class GpuSample:
    t_s: float  # seconds since the epoch, as the export's timestamps (ns) / 1e9
    sm_mhz: float
    power_w: float
    reasons: str  # the clock event reasons' bit mask, as nvidia-smi prints it


def read_gpu_log(path: Path) -> list[GpuSample]:
    """`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader,
    nounits -lms 100` lines (gpu_perf_analyzer.sh GPU_LOG=1). Its timestamps are the host's local time: read this
    file on the host that wrote it. Lines it could not measure ([N/A], a cut last line) are skipped."""
    from datetime import datetime

    samples = []
    for line in path.read_text().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            continue
        try:
            t = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(GpuSample(t, float(fields[1]), float(fields[2]), fields[3]))
        except ValueError:
            continue
    return samples


def _gpu_during(samples: list[GpuSample], start_s: float, end_s: float) -> str:
    """The SM clock (min / median MHz), the power median and the clock event reasons seen in [start_s, end_s]."""
    inside = [g for g in samples if start_s <= g.t_s <= end_s]
    if not inside:
        return "no samples"
    reasons = sorted({g.reasons for g in inside})
    return (f"SM {min(g.sm_mhz for g in inside):.0f} / {statistics.median(g.sm_mhz for g in inside):.0f} MHz, "
            f"{statistics.median(g.power_w for g in inside):.0f} W, reasons {' '.join(reasons)}")


def slow_table(paths: list[Path], factor: float = SLOW_FACTOR, gpu: list[GpuSample] | None = None) -> str:
    lines = [f"| file | streams | median ms | spell s | slow requests (> {factor:g} x median) | their p50 ms | "
             "longest gap ms |" + (" GPU in the spell (whole run) |" if gpu else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if gpu else "")]
    for path in paths:
        for concurrency, requests, _ in experiments(path):
            reqs = [r for r in requests if r.get("response_timestamps")]
            if not reqs:
                continue
            med = statistics.median((r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in reqs)
            name = f"{path.parent.name}/{path.name} | {concurrency} | {med:.2f}"
            t0 = min(r["timestamp"] for r in reqs) / 1e9
            t1 = max(r["response_timestamps"][-1] for r in reqs) / 1e9
            for spell in slow_spells(reqs, factor) or [None]:
                row = (f"| {name} | none | 0 | | |" if spell is None else
                       f"| {name} | {spell.start_s:.2f}-{spell.end_s:.2f} | {spell.requests} | "
                       f"{spell.latency_p50_ms:.2f} | {spell.longest_gap_ms:.2f} |")
                if gpu:
                    during = "" if spell is None else _gpu_during(gpu, t0 + spell.start_s, t0 + spell.end_s)
                    row += f" {during} ({_gpu_during(gpu, t0, t1)}) |"
                lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    tokens = 128
    arrivals = False
    if args[:1] == ["--slow"]:  # spells of slow requests (slow_spells), instead of the tables
        args = args[1:]
        gpu_log = None
        if args[:1] == ["--gpu"]:
            gpu_log, args = read_gpu_log(Path(args[1])), args[2:]
        print(slow_table([Path(p) for p in args], gpu=gpu_log))
        sys.exit(0)
    if args[:1] == ["--arrivals"]:  # when each token reached the client (token_arrivals), instead of the tables
        arrivals, args = True, args[1:]
    if args[:1] == ["--out-tokens"]:
        tokens, args = int(args[1]), args[2:]
    print((arrivals_table if arrivals else table)([Path(p) for p in args], tokens))
