"""Soak and cancel-storm benchmark of the served ensemble (issue 14).

N mixed requests at a given concurrency: gRPC streams, HTTP generate_stream (SSE), HTTP generate,
gRPC non-streaming; greedy, seeded sampling, stop words, chat messages. A fraction is cancelled at a
random point (gRPC client cancel, SSE socket closed mid-stream, HTTP generate socket closed before
the reply). Each request is one of a few templates, each run alone first (the "solo" reference).

Reports: requests, errors, requests with != 1 FINAL, output mismatches against the solo run
(fp32: must be 0; in bf16 batch-dependent kernels may legitimately change greedy output, so there
it is information), KV pages leaked (from /metrics, once idle), RSS of tritonserver and each stub
before / after (and at 20% of the run, for the growth over the last 80%), p50/p99 latency.

    python benchmarks/soak.py --requests 1000 --concurrency 16 --cancel-fraction 0.2
    python benchmarks/soak.py --grpc-url localhost:8001 --http-url localhost:8000 --metrics-url ...  # a running server

tests/serving/test_soak.py runs a short version against the test server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("grpc_stream", "sse", "http_generate", "grpc_nonstream")
STREAMING = {"grpc_stream": True, "sse": True, "http_generate": False, "grpc_nonstream": False}


@dataclass(frozen=True)
class Template:
    """One distinct request (its solo run is the reference for every copy of it)."""

    name: str
    inputs: dict[str, Any]  # ensemble inputs other than stream (JSON-able: HTTP bodies and gRPC alike)


def make_templates(max_tokens: int) -> list[Template]:
    chat = json.dumps([{"role": "system", "content": "Answer in one short sentence."},
                       {"role": "user", "content": "Why is the sky blue?"}])
    t = []
    for i, prompt in enumerate(["The capital of France is", "Write one sentence about the sea.",
                                "List three colours:", "数到五", "def fib(n):"]):
        n = max(4, max_tokens - 3 * i)
        t.append(Template(f"greedy{i}", {"text_input": prompt, "max_tokens": n}))
    t.append(Template("seeded", {"text_input": "Tell me a short story.", "max_tokens": max_tokens,
                                 "temperature": 0.8, "top_p": 0.95, "seed": 1234}))
    t.append(Template("seeded2", {"text_input": "Name a fruit.", "max_tokens": max(4, max_tokens // 2),
                                  "temperature": 1.0, "top_k": 20, "seed": 7}))
    t.append(Template("stop", {"text_input": "Count: one, two, three, four,", "max_tokens": max_tokens,
                               "stop_words": [" six", "\n"]}))
    t.append(Template("chat", {"messages": chat, "max_tokens": max_tokens}))
    t.append(Template("chat_template", {"text_input": "Say hello in French.", "apply_chat_template": True,
                                        "max_tokens": max_tokens, "ignore_eos": True}))
    return t


_GRPC_TYPES = {"text_input": "BYTES", "messages": "BYTES", "max_tokens": "INT32", "temperature": "FP32",
               "top_p": "FP32", "top_k": "INT32", "seed": "INT64", "stop_words": "BYTES", "stream": "BOOL",
               "apply_chat_template": "BOOL", "ignore_eos": "BOOL"}


def grpc_inputs(grpcclient: Any, inputs: dict[str, Any]) -> list[Any]:
    out = []
    for name, value in inputs.items():
        dtype = _GRPC_TYPES[name]
        values = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            arr = np.array([v.encode() for v in values], dtype=object)
        else:
            arr = np.array(values, dtype={"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": bool}[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@dataclass
class Outcome:
    template: str
    kind: str
    cancelled: bool
    text: str = ""
    finals: int = 0  # FINAL flags seen (gRPC); 1 for an HTTP reply that ended properly
    error: str | None = None
    latency_s: float = 0.0


# --- one request of each kind ---------------------------------------------------------------------
def run_grpc(url: str, tpl: Template, stream: bool, cancel_after: int | float | None) -> Outcome:
    """cancel_after: responses (streaming) or seconds (non-streaming) before stop_stream(cancel_requests=True)."""
    import tritonclient.grpc as grpcclient

    out = Outcome(tpl.name, "grpc_stream" if stream else "grpc_nonstream", cancel_after is not None)
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    t0 = time.perf_counter()
    parts: list[str] = []
    try:
        client.async_stream_infer("ensemble", grpc_inputs(grpcclient, {**tpl.inputs, "stream": stream}),
                                  request_id="s", enable_empty_final_response=True)
        deadline = t0 + (cancel_after if (cancel_after is not None and not stream) else 600)
        n = 0
        while True:
            try:
                result, error = q.get(timeout=max(0.01, deadline - time.perf_counter()))
            except queue.Empty:
                break  # the non-streaming cancel point
            if error is not None:
                out.error = str(error)
                out.finals += 1
                break
            resp = result.get_response()
            if resp.outputs:
                parts.append(b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8", "replace"))
                n += 1
            if resp.parameters["triton_final_response"].bool_param:
                out.finals += 1
                break
            if stream and cancel_after is not None and n >= cancel_after:
                break
        if not out.cancelled:
            time.sleep(0.05)  # a duplicate FINAL would show up here
            while not q.empty():
                result, error = q.get()
                if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                    out.finals += 1
    finally:
        client.stop_stream(cancel_requests=out.cancelled)
        client.close()
    out.text, out.latency_s = "".join(parts), time.perf_counter() - t0
    return out


def _http_body(tpl: Template, stream: bool) -> bytes:
    return json.dumps({**tpl.inputs, "stream": stream}).encode()


def run_sse(host: str, port: int, tpl: Template, cancel_after: int | None) -> Outcome:
    out = Outcome(tpl.name, "sse", cancel_after is not None)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v2/models/ensemble/generate_stream", _http_body(tpl, True),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        parts, n = [], 0
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                break
            parts.append(event.get("text_output", ""))
            n += 1
            if cancel_after is not None and n >= cancel_after:
                break  # the socket closes below, mid-stream
        else:
            out.finals = 1  # the chunked stream ended: the server sent its FINAL
        out.text = "".join(parts)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out.latency_s = time.perf_counter() - t0
    return out


def run_http_generate(host: str, port: int, tpl: Template, cancel_after_s: float | None) -> Outcome:
    out = Outcome(tpl.name, "http_generate", cancel_after_s is not None)
    t0 = time.perf_counter()
    if cancel_after_s is not None:  # send, wait, hang up before the reply: the disconnect Triton never reports
        body = _http_body(tpl, False)
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(cancel_after_s)
        out.latency_s = time.perf_counter() - t0
        return out
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v2/models/ensemble/generate", _http_body(tpl, False), {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        if "error" in reply:
            out.error = reply["error"]
        else:
            out.text, out.finals = reply.get("text_output", ""), 1
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out.latency_s = time.perf_counter() - t0
    return out


# --- the server side: metrics and memory ----------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + float(value)
            if 'finish_reason="' in name:
                reason = name.split('finish_reason="', 1)[1].split('"', 1)[0]
                out[f"{base}:{reason}"] = out.get(f"{base}:{reason}", 0.0) + float(value)
    return out


def rss_mb(server_pid: int | None) -> dict[str, float]:
    """RSS (MB) of tritonserver and of each Python stub, named by the model it runs."""
    if server_pid is None:
        return {}
    import psutil

    try:
        server = psutil.Process(server_pid)
        out = {"tritonserver": server.memory_info().rss / 2**20}
        for child in server.children(recursive=True):
            cmd = " ".join(child.cmdline())
            name = next((m for m in ("tokenizer", "freetoken", "detokenizer") if f"/{m}/1/model.py" in cmd), child.name())
            out[f"stub:{name}"] = out.get(f"stub:{name}", 0.0) + child.memory_info().rss / 2**20
        return out
    except psutil.Error:
        return {}


# --- the run --------------------------------------------------------------------------------------
@dataclass
class SoakConfig:
    requests: int = 300
    concurrency: int = 8
    cancel_fraction: float = 0.2
    max_tokens: int = 24
    seed: int = 0


@dataclass
class SoakReport:
    requests: int
    cancelled: int
    completed: int
    errors: int
    bad_finals: int  # completed requests with != 1 FINAL
    mismatches: int  # completed requests whose text differs from their template's solo run
    leaked_pages: float
    running_after: float
    waiting_after: float
    aborted: float  # finish_reason="abort" counted by the engine during the run
    p50_s: float
    p99_s: float
    wall_s: float
    rss_before_mb: dict[str, float]
    rss_at_20pct_mb: dict[str, float]
    rss_after_mb: dict[str, float]
    by_kind: dict[str, int] = field(default_factory=dict)
    rss_curve: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (requests done, RSS) every 10%
    examples: list[str] = field(default_factory=list)  # a few errors / mismatches, for the reader

    def rss_growth_pct(self, start: str = "rss_at_20pct_mb") -> dict[str, float]:
        a, b = getattr(self, start), self.rss_after_mb
        return {k: 100.0 * (b[k] - a[k]) / a[k] for k in a if k in b and a[k]}


def execute(kind: str, tpl: Template, cancel: Any, grpc_url: str, http_host: str, http_port: int) -> Outcome:
    if kind in ("grpc_stream", "grpc_nonstream"):
        return run_grpc(grpc_url, tpl, kind == "grpc_stream", cancel)
    if kind == "sse":
        return run_sse(http_host, http_port, tpl, cancel)
    return run_http_generate(http_host, http_port, tpl, cancel)


def wait_idle(metrics_url: str, timeout: float = 120.0) -> dict[str, float]:
    """Until nothing runs or waits and every page is free (or the timeout); returns the last scrape."""
    deadline = time.monotonic() + timeout
    m = scrape(metrics_url)
    while time.monotonic() < deadline:
        m = scrape(metrics_url)
        if (not m.get("freetoken_num_requests_running") and not m.get("freetoken_num_requests_waiting")
                and m.get("freetoken_kv_cache_free_pages") == m.get("freetoken_kv_cache_total_pages")):
            break
        time.sleep(0.2)
    return m


def run_soak(grpc_url: str, http_url: str, metrics_url: str, cfg: SoakConfig, server_pid: int | None = None,
             log=print) -> SoakReport:
    http_host, http_port = http_url.rsplit(":", 1)[0], int(http_url.rsplit(":", 1)[1])
    templates = make_templates(cfg.max_tokens)
    solo = {}
    for tpl in templates:  # the reference: each template alone on the server
        ref = run_grpc(grpc_url, tpl, True, None)
        if ref.error or ref.finals != 1:
            raise RuntimeError(f"solo run of {tpl.name} failed: {ref}")
        solo[tpl.name] = ref.text
    log(f"solo runs of {len(templates)} templates done")
    rng = random.Random(cfg.seed)
    plan = []
    for i in range(cfg.requests):
        kind, tpl = KINDS[i % len(KINDS)], rng.choice(templates)
        cancel = None
        if rng.random() < cfg.cancel_fraction:
            cancel = rng.randint(1, max(1, cfg.max_tokens // 2)) if STREAMING[kind] else rng.uniform(0.05, 1.0)
        plan.append((kind, tpl, cancel))
    wait_idle(metrics_url)
    m0 = scrape(metrics_url)
    rss0 = rss_mb(server_pid)
    rss20: dict[str, float] = {}
    curve: list[tuple[int, dict[str, float]]] = [(0, rss0)]
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    work: queue.Queue = queue.Queue()
    for item in plan:
        work.put(item)

    def worker() -> None:
        nonlocal rss20
        while True:
            try:
                kind, tpl, cancel = work.get_nowait()
            except queue.Empty:
                return
            try:
                o = execute(kind, tpl, cancel, grpc_url, http_host, http_port)
            except Exception as e:  # noqa: BLE001 (a client-side failure is an error of the run)
                o = Outcome(tpl.name, kind, cancel is not None, error=f"client: {type(e).__name__}: {e}")
            with lock:
                outcomes.append(o)
                done = len(outcomes)
                if done == max(1, cfg.requests // 5):
                    rss20 = rss_mb(server_pid)
                if done % max(1, cfg.requests // 10) == 0:
                    curve.append((done, rss_mb(server_pid)))
                    log(f"  {done}/{cfg.requests} requests")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    m1 = wait_idle(metrics_url)
    rss1 = rss_mb(server_pid)
    done = [o for o in outcomes if not o.cancelled]
    errors = [o for o in done if o.error]
    bad = [o for o in done if not o.error and o.finals != 1]
    mism = [o for o in done if not o.error and o.text != solo[o.template]]
    lat = sorted(o.latency_s for o in done if not o.error) or [0.0]
    by_kind: dict[str, int] = {}
    for o in outcomes:
        key = f"{o.kind}{'/cancelled' if o.cancelled else ''}"
        by_kind[key] = by_kind.get(key, 0) + 1
    examples = [f"error {o.kind} {o.template}: {o.error}" for o in errors[:3]]
    examples += [f"mismatch {o.kind} {o.template}: {o.text!r} != {solo[o.template]!r}" for o in mism[:3]]
    return SoakReport(
        requests=len(outcomes), cancelled=len(outcomes) - len(done), completed=len(done), errors=len(errors),
        bad_finals=len(bad), mismatches=len(mism),
        leaked_pages=m1.get("freetoken_kv_cache_total_pages", 0) - m1.get("freetoken_kv_cache_free_pages", 0),
        running_after=m1.get("freetoken_num_requests_running", 0), waiting_after=m1.get("freetoken_num_requests_waiting", 0),
        aborted=m1.get("freetoken_request_finished_total:abort", 0) - m0.get("freetoken_request_finished_total:abort", 0),
        p50_s=lat[len(lat) // 2], p99_s=lat[min(len(lat) - 1, int(len(lat) * 0.99))], wall_s=wall,
        rss_before_mb=rss0, rss_at_20pct_mb=rss20, rss_after_mb=rss1, by_kind=by_kind, examples=examples,
        rss_curve=curve,
    )


def format_report(r: SoakReport) -> str:
    lines = [
        f"requests {r.requests} (cancelled {r.cancelled}, completed {r.completed}) in {r.wall_s:.1f} s",
        f"errors {r.errors}   != 1 FINAL {r.bad_finals}   mismatches vs solo {r.mismatches}",
        f"leaked KV pages {r.leaked_pages:g}   running after {r.running_after:g}   waiting after {r.waiting_after:g}   "
        f"engine aborts {r.aborted:g}",
        f"latency p50 {r.p50_s:.2f} s   p99 {r.p99_s:.2f} s",
        "by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(r.by_kind.items())),
    ]
    growth = r.rss_growth_pct()
    for name in sorted(r.rss_after_mb):
        lines.append(f"RSS {name:<18} before {r.rss_before_mb.get(name, 0):7.1f} MB   at 20% "
                     f"{r.rss_at_20pct_mb.get(name, 0):7.1f} MB   after {r.rss_after_mb[name]:7.1f} MB   "
                     f"growth over the last 80%: {growth.get(name, 0.0):+.1f}%")
    if len(r.rss_curve) > 2:
        for name in sorted(r.rss_after_mb):
            lines.append(f"RSS {name:<18} by requests done: " + "  ".join(
                f"{done}:{rss.get(name, 0):.0f}" for done, rss in r.rss_curve))
    lines += r.examples
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="more freetoken parameters")
    p.add_argument("--grpc-url", help="use a running server (with --http-url and --metrics-url)")
    p.add_argument("--http-url")
    p.add_argument("--metrics-url")
    p.add_argument("--server-pid", type=int, help="tritonserver's pid, for RSS (a running server)")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args()
    cfg = SoakConfig(args.requests, args.concurrency, args.cancel_fraction, args.max_tokens, args.seed)
    handle = None
    if args.grpc_url:
        grpc_url, http_url, metrics_url, pid = args.grpc_url, args.http_url, args.metrics_url, args.server_pid
    else:
        import tempfile

        from freetoken_core.serving.launcher import start_server

        overrides = {"dtype": args.dtype, "device": args.device, "max_running_req": str(max(16, args.concurrency)),
                     "max_nonstream_tokens": "0"}
        if args.model_path:
            overrides["model_path"] = args.model_path
        overrides.update(dict(kv.split("=", 1) for kv in args.param))
        log_path = Path(tempfile.gettempdir()) / "freetoken-soak-tritonserver.log"
        handle = start_server(overrides, log_path=log_path, ready_timeout=600)
        grpc_url, http_url, metrics_url, pid = handle.grpc_url, handle.http_url, handle.metrics_url, handle.process.pid
    try:
        report = run_soak(grpc_url, http_url, metrics_url, cfg, pid)
    finally:
        if handle is not None:
            handle.stop()
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    ok = not (report.errors or report.bad_finals or report.leaked_pages or report.running_after)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
