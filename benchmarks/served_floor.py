"""What issue 13's served shape costs with nothing in it: the floor under the one-stream ratio.

Writes a model repository of the served shape (tokenizer -> decoupled engine -> decoupled detokenizer, chained by
an ensemble, all Python-backend models like ours) in which every model does next to nothing: the tokenizer turns
the prompt's bytes into ids, the "engine" streams one token a step on a fixed schedule (first token `--ttft-ms`
after its request reached the model, then one every `--step-ms`, by absolute deadlines so nothing drifts), the
detokenizer answers each response with a short string and the FINAL flag in one send, as ours does. Then it
measures one stream, request after request, with perf_analyzer (gRPC streaming, as benchmarks/gpu_perf_analyzer.sh)
or, without perf_analyzer on PATH, with a tritonclient loop.

The engine's own time in a request is ttft + (n - 1) x step, what the in-process engine takes (SmolLM2 shape on
the H200: TTFT 1.87 ms, 0.70 ms a step). What a client measures beyond it is what the shape and Triton's Python
backend cost on this host before any of our serving code runs: set it beside the real server's one-stream
overhead (benchmarks/RESULTS.md) to see how much of that is ours.

    python3 benchmarks/served_floor.py --ttft-ms 1.87 --step-ms 0.70 --out-tokens 128 [--export DIR]
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODELS = ("floor_tokenizer", "floor_engine", "floor_detokenizer", "floor")

TOKENIZER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


EXTRA = 0  # write_repository(extra=): more small tensors at each hop


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            ids = np.frombuffer(text if isinstance(text, bytes) else text.encode(), dtype=np.uint8).astype(np.int32)
            extra = [pb_utils.Tensor(f"extra_{i}", np.array([i], np.int32)) for i in range(EXTRA)]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)] + extra))
        return out
'''

ENGINE = '''
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


EXTRA = 0  # write_repository(extra=): more small tensors at each hop


def wait_until(deadline):
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left - 2e-4 if left > 4e-4 else 0)  # sleep(0) lets execute()'s thread have the GIL


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.ttft = float(params["ttft_ms"]["string_value"]) / 1e3
        self.step = float(params["step_ms"]["string_value"]) / 1e3
        self.inbox = queue.SimpleQueue()
        self.done = threading.Event()
        self.late = []  # how late each send started against its deadline (s)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def execute(self, requests):
        now = time.perf_counter()
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "max_tokens").as_numpy().reshape(-1)[0])
            for i in range(EXTRA):
                pb_utils.get_input_tensor_by_name(r, f"extra_{i}").as_numpy()
            self.inbox.put((r.get_response_sender(), max(n, 1), now))
        return None

    def run(self):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        active = []  # [sender, tokens left, deadline of its next token]
        while not self.done.is_set():
            try:
                items = [self.inbox.get(timeout=0.1)] if not active else []
            except queue.Empty:
                continue
            while True:
                try:
                    items.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            active += [[sender, n, t0 + self.ttft] for sender, n, t0 in items]
            deadline = min(a[2] for a in active)
            wait_until(deadline)
            now = time.perf_counter()
            for a in [a for a in active if a[2] <= now]:
                self.late.append(now - a[2])
                a[1] -= 1
                response = pb_utils.InferenceResponse([pb_utils.Tensor("next_tokens", np.array([7], np.int32))])
                a[0].send(response, flags=final if a[1] == 0 else 0)
                if a[1] == 0:
                    active.remove(a)
                else:
                    a[2] += self.step  # by absolute deadlines: a late send does not delay the next ones
            if len(self.late) >= 10000:
                late = sorted(self.late)
                print(f"floor_engine: sends late p50 {late[len(late) // 2] * 1e6:.0f} us, "
                      f"p99 {late[int(len(late) * 0.99)] * 1e6:.0f} us", flush=True)
                self.late = []

    def finalize(self):
        self.done.set()
        self.thread.join(5)
'''

DETOKENIZER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


EXTRA = 0  # write_repository(extra=): more small tensors at each hop


class TritonPythonModel:
    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for r in requests:
            n = pb_utils.get_input_tensor_by_name(r, "next_tokens").as_numpy().size
            text = np.array([b" tok" * n], dtype=np.object_)
            extra = [pb_utils.Tensor(f"extra_out_{i}", np.array([n], np.uint32)) for i in range(EXTRA)]
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)] + extra),
                                         flags=final)
        return None
'''


def _config(name: str, body: str) -> str:
    return f'name: "{name}"\nmax_batch_size: 0\n{body.strip()}\n'


CONFIGS = {
    "floor_tokenizer": '''backend: "python"
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] }TOK_OUT ]
instance_group [ { count: 1 kind: KIND_CPU } ]''',
    "floor_engine": '''backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }ENG_IN ]
output [ { name: "next_tokens" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "ttft_ms" value: { string_value: "TTFT" } }
parameters { key: "step_ms" value: { string_value: "STEP" } }''',
    "floor_detokenizer": '''backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "next_tokens" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }DET_OUT ]
instance_group [ { count: 1 kind: KIND_CPU } ]''',
    "floor": '''platform: "ensemble"
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }DET_OUT ]
ensemble_scheduling {
  step [
    { model_name: "floor_tokenizer" model_version: -1
      input_map { key: "text_input" value: "text_input" }
      output_map { key: "input_ids" value: "_input_ids" }TOK_MAP },
    { model_name: "floor_engine" model_version: -1
      input_map { key: "input_ids" value: "_input_ids" }
      input_map { key: "max_tokens" value: "max_tokens" }ENG_MAP
      output_map { key: "next_tokens" value: "_next_tokens" } },
    { model_name: "floor_detokenizer" model_version: -1
      input_map { key: "next_tokens" value: "_next_tokens" }
      output_map { key: "text_output" value: "text_output" }DET_MAP }
  ]
}''',
}
SOURCES = {"floor_tokenizer": TOKENIZER, "floor_engine": ENGINE, "floor_detokenizer": DETOKENIZER}


def _extra_tensors(extra: int) -> dict[str, str]:
    """The config text of `extra` more small tensors at each hop: tokenizer outputs that the engine reads, and
    detokenizer outputs that the ensemble answers with (ours carries 3, ~6 and 4 more than this floor)."""
    def each(fmt: str) -> str:
        return "".join(fmt.format(i=i) for i in range(extra))

    return {
        "TOK_OUT": each(',\n        {{ name: "extra_{i}" data_type: TYPE_INT32 dims: [ 1 ] }}'),
        "ENG_IN": each(',\n        {{ name: "extra_{i}" data_type: TYPE_INT32 dims: [ 1 ] optional: true }}'),
        "DET_OUT": each(',\n        {{ name: "extra_out_{i}" data_type: TYPE_UINT32 dims: [ 1 ] }}'),
        "TOK_MAP": each('\n      output_map {{ key: "extra_{i}" value: "_extra_{i}" }}'),
        "ENG_MAP": each('\n      input_map {{ key: "extra_{i}" value: "_extra_{i}" }}'),
        "DET_MAP": each('\n      output_map {{ key: "extra_out_{i}" value: "extra_out_{i}" }}'),
    }


def write_repository(dest: Path, ttft_ms: float, step_ms: float, extra: int = 0) -> Path:
    """The floor's repository; `extra` > 0: that many more small tensors at each hop (what a tensor costs)."""
    marks = _extra_tensors(extra)
    for name in MODELS:
        (dest / name / "1").mkdir(parents=True, exist_ok=True)
        body = CONFIGS[name].replace("TTFT", f"{ttft_ms:g}").replace("STEP", f"{step_ms:g}")
        for mark, text in marks.items():
            body = body.replace(mark, text)
        (dest / name / "config.pbtxt").write_text(_config(name, body))
        if name in SOURCES:
            source = SOURCES[name].lstrip().replace("EXTRA = 0  #", f"EXTRA = {extra}  #")
            (dest / name / "1" / "model.py").write_text(source)
    return dest


def prompts() -> list[str]:
    sys.path.insert(0, str(Path(__file__).parent))
    from pa_summary import PROMPTS  # the prompts of the real server's perf_analyzer runs

    return list(PROMPTS)


def python_client(grpc_url: str, n_requests: int, out_tokens: int) -> list[tuple[float, float, int]]:
    """(latency s, TTFT s, responses) of n_requests sent one after another on one gRPC stream."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url)
    q: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: q.put((time.perf_counter(), result, error)))
    texts = prompts()
    rows = []
    try:
        for i in range(n_requests):
            text = grpcclient.InferInput("text_input", [1], "BYTES")
            text.set_data_from_numpy(np.array([texts[i % len(texts)].encode()], dtype=np.object_))
            max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
            max_tokens.set_data_from_numpy(np.array([out_tokens], dtype=np.int32))
            t0 = time.perf_counter()
            client.async_stream_infer("floor", [text, max_tokens], request_id=str(i))
            first, responses = None, 0
            while True:
                t, result, error = q.get(timeout=60)
                if error is not None:
                    raise RuntimeError(error)
                responses += 1
                first = first or t
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            rows.append((t - t0, first - t0, responses))
    finally:
        client.stop_stream()
        client.close()
    return rows


def perf_analyzer(grpc_url: str, out_tokens: int, measure_ms: int, export: Path) -> list[tuple[float, float, int]]:
    """(latency s, TTFT s, responses) of every request of perf_analyzer's one-stream run (its export file)."""
    data = export / "floor-inputs.json"
    data.write_text(json.dumps({"data": [{"text_input": [p], "max_tokens": [out_tokens]} for p in prompts()]}))
    result = export / "floor-1.json"
    subprocess.run(["perf_analyzer", "-m", "floor", "-u", grpc_url, "-i", "grpc", "--streaming", "--input-data",
                    str(data), "--concurrency-range", "1", "--measurement-interval", str(measure_ms),
                    "--stability-percentage", "10", "--max-trials", "10", "--profile-export-file", str(result)],
                   check=True, stdout=subprocess.DEVNULL, timeout=measure_ms * 15 // 1000 + 60)
    rows = []
    for req in json.loads(result.read_text())["experiments"][0]["requests"]:
        stamps = req["response_timestamps"]
        rows.append(((stamps[-1] - req["timestamp"]) / 1e9, (stamps[0] - req["timestamp"]) / 1e9, len(stamps)))
    return rows


def summary(rows: list[tuple[float, float, int]], ttft_ms: float, step_ms: float, out_tokens: int) -> str:
    lat = sorted(1e3 * r[0] for r in rows)
    ttft = sorted(1e3 * r[1] for r in rows)
    engine_ms = ttft_ms + (out_tokens - 1) * step_ms
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    mean = statistics.mean(lat)
    return "\n".join([
        "| requests | engine's own ms | client ms p10 / p50 / mean / p99 | overhead ms p10 / p50 / mean | "
        "TTFT ms p50 / p99 | responses a request | ratio (engine / client mean) |",
        "|---|---|---|---|---|---|---|",
        f"| {len(rows)} | {engine_ms:.2f} | {pct(lat, .1):.2f} / {pct(lat, .5):.2f} / {mean:.2f} / {pct(lat, .99):.2f} "
        f"| {pct(lat, .1) - engine_ms:.2f} / {pct(lat, .5) - engine_ms:.2f} / {mean - engine_ms:.2f} "
        f"| {pct(ttft, .5):.2f} / {pct(ttft, .99):.2f} | {statistics.mean(r[2] for r in rows):.1f} "
        f"| {engine_ms / mean:.3f} |",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ttft-ms", type=float, default=1.87)
    p.add_argument("--step-ms", type=float, default=0.70)
    p.add_argument("--out-tokens", type=int, default=128)
    p.add_argument("--measure-ms", type=int, default=8000, help="perf_analyzer's window")
    p.add_argument("--requests", type=int, default=100, help="requests of the tritonclient loop")
    p.add_argument("--client", choices=("auto", "perf_analyzer", "python"), default="auto")
    p.add_argument("--export", type=Path, default=None, help="where perf_analyzer's export goes (default: a temp dir)")
    p.add_argument("--extra-tensors", type=int, default=0,
                   help="this many more small tensors at each hop (tokenizer -> engine, detokenizer -> client): what "
                        "a tensor costs one stream, against ours, which carries 3-6 more than the floor at each")
    p.add_argument("--trace", type=Path, default=None,
                   help="also write a Triton trace of every request (TIMESTAMPS) there, and print its timeline "
                        "(benchmarks/pa_summary.py trace), to set beside the real ensemble's (gpu_perf_analyzer.sh TRACE)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from freetoken_core.serving.launch.server import spawn_tritonserver, wait_ready

    client = args.client if args.client != "auto" else ("perf_analyzer" if shutil.which("perf_analyzer") else "python")
    work = Path(tempfile.mkdtemp(prefix="served-floor-"))
    export = args.export or work
    export.mkdir(parents=True, exist_ok=True)
    repo = write_repository(work / "repo", args.ttft_ms, args.step_ms, args.extra_tensors)
    trace_args = [] if args.trace is None else [
        f"--trace-config=triton,file={args.trace}", "--trace-config=triton,log-frequency=20",
        "--trace-config=level=TIMESTAMPS", "--trace-config=rate=1"]
    handle = spawn_tritonserver(repo, log_path=work / "server.log", extra_args=trace_args)
    try:
        wait_ready(handle, 300, models=MODELS)
        if client == "perf_analyzer":
            rows = perf_analyzer(handle.grpc_url, args.out_tokens, args.measure_ms, export)
        else:
            python_client(handle.grpc_url, 3, args.out_tokens)  # warm-up
            rows = python_client(handle.grpc_url, args.requests, args.out_tokens)
    finally:
        handle.stop()
    print(f"served floor, one stream, {client} client, {args.out_tokens} tokens a request:")
    print(summary(rows, args.ttft_ms, args.step_ms, args.out_tokens))
    late = [line for line in (work / "server.log").read_text().splitlines() if "floor_engine: sends late" in line]
    print("\n".join(late[-3:]))
    if args.trace is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from pa_summary import trace_timeline

        print(trace_timeline(args.trace))
    shutil.rmtree(work / "repo", ignore_errors=True)


if __name__ == "__main__":
    main()
