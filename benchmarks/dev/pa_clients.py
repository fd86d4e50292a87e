"""perf_analyzer's companions in benchmarks/gpu_perf_analyzer.sh: the two clients it cannot be.

    python benchmarks/dev/pa_clients.py sse localhost:8000 CONCURRENCY SECONDS OUT_TOKENS [PROCESSES]
    python benchmarks/dev/pa_clients.py stream1 localhost:8001 localhost:8002 REQUESTS OUT_TOKENS

`stream1` is where one stream's request time goes: REQUESTS requests one after another on one gRPC
stream (the ensemble, as perf_analyzer's concurrency 1 sends them), timed by the client (send -> first
response = TTFT, first -> last response, last response -> the next send), beside what the `freetoken`
model saw in the same window (its TTFT and time-per-output-token histograms on the metrics port: from
its engine loop's arrival to the first token). Client TTFT minus the model's TTFT is the front of the
path (gRPC, ensemble, tokenizer, the stub's execute); total minus the client's TTFT minus the model's
(n - 1) x TPOT is the back (the last response's detokenizer execute and gRPC).

`sse` is a small load generator for Triton's HTTP `generate_stream` (SSE) on the ensemble: CONCURRENCY
streams spread over PROCESSES client processes (default: one per 8 streams, so the client is not the
limit; it reports its own CPU use so that you can tell), each stream sending its next request as soon as
the last one ended. Prints requests/s, SSE events (responses)/s, tokens/s, TTFT and inter-event p50/p99.

Both send benchmarks/dev/pa_summary.py's PROMPTS, as perf_analyzer's input files do.
"""

from __future__ import annotations

import json
import sys

from pa_summary import PROMPTS, ensemble_inputs


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


def _histogram(metrics_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram on Triton's metrics port, over all its label sets."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def stream_one(grpc_url: str, metrics_url: str, requests: int, out_tokens: int) -> str:
    """One stream, REQUESTS requests back to back (see the module docstring); a table of medians in ms."""
    import queue
    import statistics
    import time

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    events: queue.SimpleQueue = queue.SimpleQueue()

    def on_response(result, error):
        now = time.perf_counter()
        if error is not None:
            events.put(("error", now, str(error), 0))
            return
        resp = result.get_response()
        n = result.as_numpy("next_tokens").size if resp.outputs else 0
        events.put(("final" if resp.parameters["triton_final_response"].bool_param else "part", now, resp.id, n))

    client.start_stream(callback=on_response)
    rows: list[dict] = []
    ttft0 = tpot0 = None
    last_end = None
    for i in range(requests + 3):  # the first 3 warm the path up and are not counted
        if i == 3:
            ttft0, tpot0 = (_histogram(metrics_url, "freetoken_time_to_first_token_seconds"),
                            _histogram(metrics_url, "freetoken_time_per_output_token_seconds"))
            last_end = None
        payload = ensemble_inputs(PROMPTS[i % len(PROMPTS)], out_tokens)
        t_send = time.perf_counter()
        client.async_stream_infer("ensemble", payload, request_id=str(i), enable_empty_final_response=True)
        first = last = None
        tokens = responses = 0
        while True:
            kind, now, info, n = events.get(timeout=120)
            if kind == "error":
                raise RuntimeError(info)
            if n:
                first = first if first is not None else now
                last, tokens, responses = now, tokens + n, responses + 1
            if kind == "final":
                end = now
                break
        if i >= 3:
            rows.append({"ttft": first - t_send, "body": last - first, "final_after_last": end - last,
                         "total": end - t_send, "idle_before": (t_send - last_end) if last_end else 0.0,
                         "tokens": tokens, "responses": responses})
        last_end = end
    client.stop_stream()
    ttft1 = _histogram(metrics_url, "freetoken_time_to_first_token_seconds")
    tpot1 = _histogram(metrics_url, "freetoken_time_per_output_token_seconds")
    ms = lambda key: 1000 * statistics.median(r[key] for r in rows)  # noqa: E731
    mean = lambda a, b: 1000 * (b[0] - a[0]) / max(1.0, b[1] - a[1])  # noqa: E731
    s_ttft, s_tpot = mean(ttft0, ttft1), mean(tpot0, tpot1)
    tokens = statistics.median(r["tokens"] for r in rows)
    back = ms("total") - ms("ttft") - (tokens - 1) * s_tpot
    return "\n".join([
        "| requests | tokens | responses | total ms | client TTFT | model TTFT | front (client - model TTFT) | "
        "model TPOT | body (first -> last) | back (total - TTFT - (n-1) TPOT) | FINAL after last | client idle |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {len(rows)} | {tokens:.0f} | {statistics.median(r['responses'] for r in rows):.0f} | {ms('total'):.2f} | "
        f"{ms('ttft'):.2f} | {s_ttft:.2f} | {ms('ttft') - s_ttft:.2f} | {s_tpot:.3f} | {ms('body'):.2f} | {back:.2f} | "
        f"{ms('final_after_last'):.3f} | {ms('idle_before'):.3f} |"])


def main(argv: list[str]) -> int:
    if argv[0] == "stream1":
        print(stream_one(argv[1], argv[2], int(argv[3]), int(argv[4])))
    elif argv[0] == "sse":
        print(sse_load(argv[1], int(argv[2]), float(argv[3]), int(argv[4]), int(argv[5]) if len(argv) > 5 else 0))
    else:
        raise SystemExit(f"unknown command {argv[0]!r}: sse or stream1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
