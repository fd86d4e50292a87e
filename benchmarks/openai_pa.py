"""bench_openai.py --load-generator perf_analyzer: perf_analyzer (C++, the same load generator) on both sides.

The OpenAI side is perf_analyzer's `openai` service kind against POST .../v1/chat/completions (HTTP, async; the
payload's "stream": true makes it read the SSE stream: perf_analyzer's --streaming is gRPC only and refused with
-i http); the gRPC side is the ensemble over gRPC streaming, as benchmarks/gpu_perf_analyzer.sh runs it. Both send
the same chat: one user message (a tagged prompt), max_tokens = --output-tokens, ignore_eos, streamed.

Each measured run writes a profile export; summarize() reads both sides' the same way: a response carries tokens
when it brought text (OpenAI: an SSE chunk's choices[0].delta.content or .text; gRPC: text_output), a request's
TTFT is its first such response, and its --output-tokens (ignore_eos) are spread evenly over those responses to
count the tokens that arrived in perf_analyzer's last 3 windows (the ones it reports as stable).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_API_KEY = "unused"  # bench_openai's --api-key default: the frontend was started without a key
WARMUP_ARGS = ["--concurrency-range", "16", "--measurement-interval", "1000", "--max-trials", "3",
               "--stability-percentage", "100"]  # gpu_perf_analyzer.sh's WARMUP: every model instance served
WARMUP_TIMEOUT_S = 120


@dataclass(frozen=True)
class PaTarget:
    """Where one side's perf_analyzer sends its requests."""

    side: str  # "openai" or "grpc"
    openai_url: str  # the OpenAI API's base URL (http://host:port/v1)
    grpc_url: str | None  # Triton's gRPC host:port
    model: str  # the served model's name, as /v1/models lists it
    api_key: str
    output_tokens: int
    binary: str = "perf_analyzer"


@dataclass(frozen=True)
class Measured:
    """One side's run at one concurrency, from its profile export."""

    requests: int  # sent within the measured span
    output_tokens: float  # that arrived within it
    seconds: float  # the span
    ttfts_ms: list[float]  # of the requests sent within it


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def input_data(target: PaTarget, prompts: list[str]) -> dict:
    """perf_analyzer's --input-data JSON: one entry a request. For the openai service kind an entry is the whole
    request body ({"payload": [body]}); for Triton one value list per ensemble input."""
    if target.side == "openai":
        return {"data": [{"payload": [{"model": target.model, "messages": chat(p), "max_tokens": target.output_tokens,
                                       "stream": True, "ignore_eos": True}]} for p in prompts]}
    return {"data": [{"messages": [json.dumps(chat(p))], "max_tokens": [target.output_tokens],
                      "ignore_eos": [True], "stream": [True]} for p in prompts]}


def openai_endpoint(openai_url: str) -> tuple[str, str]:
    """(perf_analyzer's -u, its --endpoint) for an OpenAI base URL: http://h:p/v1 -> ("h:p", "v1/chat/completions")."""
    parts = urlsplit(openai_url)
    server = parts.netloc if parts.scheme in ("", "http") else f"{parts.scheme}://{parts.netloc}"
    return server, f"{parts.path.strip('/') or 'v1'}/chat/completions"


def command(target: PaTarget, data_file: Path, load_args: list[str]) -> list[str]:
    """The perf_analyzer command line of one side."""
    if target.side == "openai":
        server, endpoint = openai_endpoint(target.openai_url)
        cmd = [target.binary, "-m", target.model, "--service-kind", "openai", "--endpoint", endpoint, "-u", server,
               "-i", "http", "--async"]
        if target.api_key != DEFAULT_API_KEY:
            cmd += ["-H", f"Authorization:Bearer {target.api_key}"]  # perf_analyzer splits 'Name:Value' at the ':'
    else:
        from freetoken_core.serving.openai.ensemble_client import ENSEMBLE_MODEL

        cmd = [target.binary, "-m", ENSEMBLE_MODEL, "-u", target.grpc_url, "-i", "grpc", "--streaming"]
    return cmd + ["--input-data", str(data_file)] + load_args


def measured_args(concurrency: int, interval_ms: int, trials: int, stability: int, export: Path) -> list[str]:
    # --max-threads C: a thread a stream. perf_analyzer's streams on one thread start at the same input entry and
    # step alike, so several streams would send the same prompt (a prefix-cache hit) at once
    return ["--concurrency-range", str(concurrency), "--max-threads", str(concurrency),
            "--measurement-interval", str(interval_ms), "--stability-percentage", str(stability), "--max-trials", str(trials),
            "--percentile", "50", "--profile-export-file", str(export)]


def _run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{what}: perf_analyzer ran past {timeout:.0f} s: {' '.join(cmd)}") from e


def _tail(out: subprocess.CompletedProcess, lines: int = 15) -> str:
    return "\n".join((out.stdout + out.stderr).splitlines()[-lines:])


def run_side(target: PaTarget, warm: list[str], timed: list[str], concurrency: int, interval_ms: int, trials: int,
             stability: int, workdir: Path) -> Measured:
    """Warm up (untimed), then one measured perf_analyzer run at `concurrency`; its export summarized."""
    stem = f"{target.side}-{concurrency}"
    files = {}
    for name, prompts in (("warm", warm), ("timed", timed)):
        files[name] = workdir / f"{stem}-{name}.json"
        files[name].write_text(json.dumps(input_data(target, prompts)))
    out = _run(command(target, files["warm"], WARMUP_ARGS), WARMUP_TIMEOUT_S, f"{stem} warm-up")
    if out.returncode != 0:  # as gpu_perf_analyzer.sh: a warm-up that did not settle is no reason to stop
        print(f"{stem} warm-up: perf_analyzer exited {out.returncode}:\n{_tail(out, 3)}", flush=True)
    export = workdir / f"{stem}.json"
    cmd = command(target, files["timed"], measured_args(concurrency, interval_ms, trials, stability, export))
    print(" ".join(cmd), flush=True)
    # up to `trials` windows of ~1.2 x the interval, the ramp, and the requests still out at the end
    out = _run(cmd, interval_ms * trials * 1.5 / 1000 + 120, stem)
    if out.returncode != 0 or not export.is_file():
        print(_tail(out), flush=True)
        raise RuntimeError(f"{stem}: perf_analyzer exited {out.returncode} (if it found no stable measurement: "
                           f"raise --pa-ms, --pa-trials or --pa-stability): {' '.join(cmd)}")
    return summarize(json.loads(export.read_bytes().decode("utf-8", "replace")), target.side, concurrency,
                     target.output_tokens)


def _sse_has_text(event: str) -> bool:
    """Whether one SSE event (its lines) is a chunk with text: not the role-only first chunk, nor [DONE]."""
    data = "\n".join(line[5:].lstrip() for line in event.split("\n") if line.startswith("data:"))
    if not data or data == "[DONE]":
        return False
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") or c.get("text") for c in chunk.get("choices") or [])


def openai_carries(outputs: list[dict]) -> list[bool]:
    """Which responses brought text. A response is what one read of the HTTP stream returned: it may hold several
    SSE events, or cut one in two (the event counts where it ends)."""
    pending, carries = "", []
    for output in outputs:
        pending += (output.get("response") or "").replace("\r\n", "\n")
        *events, pending = pending.split("\n\n")
        carries.append(any(_sse_has_text(e) for e in events))
    if carries and pending.strip():  # a last event without its blank line
        carries[-1] = carries[-1] or _sse_has_text(pending)
    return carries


def triton_carries(outputs: list[dict]) -> list[bool]:
    """Which responses brought text: a non-empty text_output. perf_analyzer writes every output of the model into
    each response, an absent one as ""; the decoupled model's final flag comes as a response whose outputs are all
    empty. A response with no outputs recorded at all counts, unless it is the last of several (that final flag)."""
    def has_text(i: int, output: dict) -> bool:
        if "text_output" in output:
            return bool(output["text_output"])
        if output:
            return any(v not in ("", None, []) for v in output.values())
        return i < len(outputs) - 1 or len(outputs) == 1
    return [has_text(i, o) for i, o in enumerate(outputs)]


def token_stamps(side: str, request: dict) -> list[int]:
    """The timestamps (ns) of a request's responses that brought tokens."""
    stamps = request.get("response_timestamps") or []
    outputs = request.get("response_outputs")
    if not outputs or len(outputs) != len(stamps):  # no outputs exported: every response counts
        return list(stamps)
    carries = openai_carries(outputs) if side == "openai" else triton_carries(outputs)
    return [t for t, c in zip(stamps, carries) if c]


def measured_span(experiment: dict) -> tuple[int, int]:
    """perf_analyzer's last 3 windows (those it reported), else every window, else first send to last response."""
    bounds = experiment.get("window_boundaries") or []
    if len(bounds) >= 4:
        return bounds[-4], bounds[-1]
    if len(bounds) >= 2:
        return bounds[0], bounds[-1]
    reqs = [r for r in experiment.get("requests", []) if r.get("response_timestamps")]
    if not reqs:
        raise ValueError("the export has no window boundaries and no answered requests")
    return min(r["timestamp"] for r in reqs), max(r["response_timestamps"][-1] for r in reqs)


def summarize(export: dict, side: str, concurrency: int, output_tokens: int) -> Measured:
    """One side's numbers from a profile export: {"experiments": [{"experiment": {"mode": "concurrency", "value": C},
    "requests": [{"timestamp": ns, "response_timestamps": [ns, ...], "response_outputs": [...]}, ...],
    "window_boundaries": [ns, ...]}]} (the experiment at `concurrency`, else the last)."""
    experiments = export.get("experiments") or []
    if not experiments:
        raise ValueError("the profile export has no experiments")
    exp = next((e for e in experiments if int(e.get("experiment", {}).get("value", -1)) == concurrency),
               experiments[-1])
    start, end = measured_span(exp)
    tokens, ttfts, sent = 0.0, [], 0
    for req in exp.get("requests", []):
        stamps = token_stamps(side, req)
        tokens += output_tokens / len(stamps) * sum(1 for t in stamps if start <= t < end) if stamps else 0.0
        if start <= req["timestamp"] < end:
            sent += 1
            if stamps:
                ttfts.append((stamps[0] - req["timestamp"]) / 1e6)
    if not ttfts:
        raise ValueError(f"{side} at {concurrency} streams: no request sent in the measured span got a token")
    return Measured(sent, tokens, (end - start) / 1e9, ttfts)
