"""Which cancellation signals does Triton (2.51) give the models of an ensemble? A minimal repro.

No LLM: a decoupled `gen` model (the engine's stand-in) produces N steps of 0.1 s in a thread and
polls `request.is_cancelled()` / `response_sender.is_cancelled()` before each; `pass_nd` (not
decoupled) and `pass_d` (decoupled) stand in for the detokenizer and record `request.is_cancelled()`.
Two ensembles chain them: `ens_nd` (gen -> pass_nd) and `ens_d` (gen -> pass_d). With `probe` set, a
non-streaming `gen` request also sends an internal "probe" response every step; `pass_d` completes a
probe with the FINAL flag alone, so no client sees it, while the ensemble still schedules it as a
new step (which is where Triton propagates a cancellation: it never cancels the step in flight).

Each case sends one request, cancels it after ~0.6 s (gRPC: `stop_stream(cancel_requests=True)`;
HTTP: close the socket), waits, and reports which model saw the cancel and when. Also: how many
responses a client sees for a non-streaming request with probes, and what a model can see that
tells HTTP /generate from /generate_stream.

    python benchmarks/repro_cancel_signals.py          # prints a table; ~30 s on a 2-core box

tests/serving/test_cancel_signals.py runs the same cases and asserts the behaviour serving relies on.
"""

from __future__ import annotations

import json
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEP_S = 0.1
N_STEPS = 40  # 4 s of "generation": long enough that a cancel that works shows clearly

GEN = '''
import json, os, threading, time
import numpy as np
import triton_python_backend_utils as pb

LOG = os.environ["FT_REPRO_LOG"]
_lock = threading.Lock()


def log(**kw):
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps({**kw, "t": time.time()}) + "\\n")


def flag(request, name):
    t = pb.get_input_tensor_by_name(request, name)
    return bool(t.as_numpy().reshape(-1)[0]) if t is not None else False


def response(tok, probe):
    return pb.InferenceResponse([pb.Tensor("tok", np.asarray(tok, dtype=np.int32)),
                                 pb.Tensor("is_probe", np.array([probe]))])


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            threading.Thread(target=self.run, args=(r,), daemon=True).start()
        return None

    def run(self, request):
        sender = request.get_response_sender()
        rid = request.request_id()
        n = int(pb.get_input_tensor_by_name(request, "n").as_numpy().reshape(-1)[0])
        stream, probe = flag(request, "stream"), flag(request, "probe")
        log(model="gen", id=rid, event="start", parameters=request.parameters(), stream=stream)
        for step in range(n):
            time.sleep(%(step)r)
            if request.is_cancelled() or sender.is_cancelled():
                log(model="gen", id=rid, event="cancelled", step=step)
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            try:
                if stream:
                    sender.send(response([step], False))
                elif probe:
                    sender.send(response([], True))
            except Exception as e:
                log(model="gen", id=rid, event="send_failed", step=step, error=str(e))
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
        sender.send(response(list(range(n)), False), flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        log(model="gen", id=rid, event="finished")
''' % {"step": STEP_S}

PASS = '''
import json, os, threading, time
import numpy as np
import triton_python_backend_utils as pb

LOG = os.environ["FT_REPRO_LOG"]
DECOUPLED = %(decoupled)r
_lock = threading.Lock()


def log(**kw):
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps({**kw, "t": time.time()}) + "\\n")


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            rid = r.request_id()
            if r.is_cancelled():
                log(model="pass", id=rid, event="cancelled")
            probe = pb.get_input_tensor_by_name(r, "is_probe")
            probe = bool(probe.as_numpy().reshape(-1)[0]) if probe is not None else False
            tok = pb.get_input_tensor_by_name(r, "tok").as_numpy().reshape(-1)
            resp = pb.InferenceResponse([pb.Tensor("text", np.array([str(tok.tolist()).encode()], dtype=np.object_))])
            if not DECOUPLED:
                out.append(resp)
                continue
            sender = r.get_response_sender()
            if probe:  # nothing for the client: the FINAL flag alone
                sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(resp, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None if DECOUPLED else out
'''

GEN_CONFIG = '''
name: "gen"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "n" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "probe" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [
  { name: "tok" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "is_probe" data_type: TYPE_BOOL dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

PASS_CONFIG = '''
name: "%(name)s"
backend: "python"
max_batch_size: 0
%(policy)s
input [
  { name: "tok" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "is_probe" data_type: TYPE_BOOL dims: [ 1 ] }
]
output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

ENS_CONFIG = '''
name: "%(name)s"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "n" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "probe" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "gen" model_version: -1
      input_map { key: "n" value: "n" } input_map { key: "stream" value: "stream" }
      input_map { key: "probe" value: "probe" }
      output_map { key: "tok" value: "_tok" } output_map { key: "is_probe" value: "_is_probe" } },
    { model_name: "%(passer)s" model_version: -1
      input_map { key: "tok" value: "_tok" } input_map { key: "is_probe" value: "_is_probe" }
      output_map { key: "text" value: "text" } }
  ]
}
'''

MODELS = ("gen", "pass_nd", "pass_d", "ens_nd", "ens_d")


def write_repository(root: Path) -> Path:
    files = {
        "gen/config.pbtxt": GEN_CONFIG, "gen/1/model.py": GEN,
        "pass_nd/config.pbtxt": PASS_CONFIG % {"name": "pass_nd", "policy": ""},
        "pass_nd/1/model.py": PASS % {"decoupled": False},
        "pass_d/config.pbtxt": PASS_CONFIG % {"name": "pass_d", "policy": "model_transaction_policy { decoupled: true }"},
        "pass_d/1/model.py": PASS % {"decoupled": True},
        "ens_nd/config.pbtxt": ENS_CONFIG % {"name": "ens_nd", "passer": "pass_nd"},
        "ens_d/config.pbtxt": ENS_CONFIG % {"name": "ens_d", "passer": "pass_d"},
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for ens in ("ens_nd", "ens_d"):
        (root / ens / "1").mkdir(exist_ok=True)  # an ensemble needs a version directory too
    return root


@dataclass
class Case:
    name: str
    model: str
    transport: str  # grpc | http_generate | http_stream
    stream: bool
    probe: bool = False
    cancel: bool = True


CASES = [
    Case("grpc stream, direct", "gen", "grpc", True),
    Case("grpc stream, ensemble", "ens_nd", "grpc", True),
    # the serving detokenizer is decoupled (issue 13: it acks after its send): it must see the cancel too
    Case("grpc stream, ensemble, decoupled detok", "ens_d", "grpc", True),
    Case("grpc non-stream, direct", "gen", "grpc", False),
    Case("grpc non-stream, ensemble", "ens_nd", "grpc", False),
    Case("grpc non-stream, ensemble + probes", "ens_d", "grpc", False, probe=True),
    Case("http generate, direct", "gen", "http_generate", False),
    Case("http generate, ensemble", "ens_nd", "http_generate", False),
    Case("http generate, ensemble + probes", "ens_d", "http_generate", False, probe=True),
    Case("http generate_stream, direct", "gen", "http_stream", True),
    Case("http generate_stream, ensemble", "ens_nd", "http_stream", True),
]


def _grpc_inputs(grpcclient, case: Case, n: int):
    out = []
    for name, arr, dt in (("n", np.array([n], np.int32), "INT32"), ("stream", np.array([case.stream]), "BOOL"),
                          ("probe", np.array([case.probe]), "BOOL")):
        t = grpcclient.InferInput(name, [1], dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def run_grpc(url: str, case: Case, rid: str, n: int = N_STEPS, cancel_after: float | None = 0.6) -> list:
    """Returns the (result, error) pairs the client saw before it cancelled (or until FINAL)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(case.model, _grpc_inputs(grpcclient, case, n), request_id=rid,
                              enable_empty_final_response=True)
    seen = []
    if cancel_after is not None:
        time.sleep(cancel_after)
        client.stop_stream(cancel_requests=True)
    else:
        while True:
            result, error = got.get(timeout=60)
            seen.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    client.close()
    while not got.empty():
        seen.append(got.get())
    return seen


def run_http(port: int, case: Case, rid: str, n: int = N_STEPS, cancel_after: float | None = 0.6) -> bytes:
    """POST to generate / generate_stream on a raw socket; close it after `cancel_after` s (None: read all)."""
    path = "generate_stream" if case.transport == "http_stream" else "generate"
    body = json.dumps({"id": rid, "n": n, "stream": case.stream, "probe": case.probe}).encode()
    head = (f"POST /v2/models/{case.model}/{path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(head + body)
    data = b""
    if cancel_after is not None:
        time.sleep(cancel_after)
    else:
        while chunk := s.recv(65536):
            data += chunk
    s.close()
    return data


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outcome(events: list[dict], rid: str) -> dict:
    """What the models saw for one request id."""
    mine = [e for e in events if e.get("id") == rid]
    gen_cancel = next((e["step"] for e in mine if e["model"] == "gen" and e["event"] == "cancelled"), None)
    t0 = next((e["t"] for e in mine if e["event"] == "start"), None)
    t_pass = next((e["t"] for e in mine if e["model"] == "pass" and e["event"] == "cancelled"), None)
    send_failed = next((e["step"] for e in mine if e["model"] == "gen" and e["event"] == "send_failed"), None)
    return {
        "gen_saw_cancel_at_step": gen_cancel,
        "gen_send_failed_at_step": send_failed,
        "gen_ran_to_end": any(e["model"] == "gen" and e["event"] == "finished" for e in mine),
        "pass_saw_cancel": t_pass is not None,
        # seconds from the request's start until the detokenizer stand-in first saw it cancelled
        "pass_saw_cancel_after_s": None if t_pass is None or t0 is None else round(t_pass - t0, 2),
        "parameters": next((e.get("parameters") for e in mine if e["event"] == "start"), None),
    }


class ReproServer:
    """A tritonserver on the repro repository, events logged to one file."""

    def __init__(self, workdir: Path) -> None:
        from freetoken_core.serving.launch.server import spawn_tritonserver, wait_ready

        self.log_path = workdir / "events.jsonl"
        repo = write_repository(workdir / "repo")
        self.handle = spawn_tritonserver(repo, log_path=workdir / "tritonserver.log",
                                         env={"FT_REPRO_LOG": str(self.log_path)})
        wait_ready(self.handle, 120, models=MODELS)

    def events(self) -> list[dict]:
        return read_log(self.log_path)

    def stop(self) -> None:
        self.handle.stop()


def run_cancel_cases(server: ReproServer, cases: list[Case] = CASES) -> dict[str, dict]:
    """All cases at once (each takes N_STEPS * STEP_S if its cancel is not seen); returns outcomes by name."""
    h = server.handle
    threads = []
    for i, case in enumerate(cases):
        rid = f"case{i}"
        if case.transport == "grpc":
            target, args = run_grpc, (h.grpc_url, case, rid)
        else:
            target, args = run_http, (h.http_port, case, rid)
        threads.append(threading.Thread(target=target, args=args, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    time.sleep(N_STEPS * STEP_S + 1.0)  # every request has now either seen its cancel or finished
    events = server.events()
    return {case.name: outcome(events, f"case{i}") for i, case in enumerate(cases)}


def probe_visibility(server: ReproServer) -> dict[str, object]:
    """A non-streaming request with probes, not cancelled: what does each client see?"""
    h = server.handle
    seen = run_grpc(h.grpc_url, Case("", "ens_d", "grpc", False, probe=True), "vis-grpc", n=5, cancel_after=None)
    with_outputs = [r for r, e in seen if e is None and r.get_response().outputs]
    errors = [str(e) for _, e in seen if e is not None]
    raw = run_http(h.http_port, Case("", "ens_d", "http_generate", False, probe=True), "vis-http", n=5,
                   cancel_after=None)
    head, _, body = raw.partition(b"\r\n\r\n")
    return {"grpc_responses_with_outputs": len(with_outputs), "grpc_errors": errors,
            "grpc_text": with_outputs[-1].as_numpy("text")[0].decode() if with_outputs else None,
            "http_status_line": head.split(b"\r\n", 1)[0].decode(), "http_body": body.decode(errors="replace")}


def generate_vs_stream_parameters(server: ReproServer) -> tuple[object, object]:
    """The request parameters a model sees for the same body on /generate and on /generate_stream."""
    h = server.handle
    run_http(h.http_port, Case("", "gen", "http_generate", True), "ep-generate", n=1, cancel_after=None)
    run_http(h.http_port, Case("", "gen", "http_stream", True), "ep-stream", n=1, cancel_after=None)
    events = server.events()
    return outcome(events, "ep-generate")["parameters"], outcome(events, "ep-stream")["parameters"]


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="freetoken-cancel-repro-"))
    server = ReproServer(workdir)
    try:
        results = run_cancel_cases(server)
        vis = probe_visibility(server)
        gen_params, stream_params = generate_vs_stream_parameters(server)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"cancel sent ~0.6 s after each request's start; the stand-in engine runs {N_STEPS} steps of {STEP_S} s\n")
    print(f"{'case':<40} {'gen (engine) saw cancel':>24} {'ran to end':>11} {'pass (detok) saw cancel':>24}")
    for name, r in results.items():
        step = r["gen_saw_cancel_at_step"]
        seen = f"step {step}" if step is not None else (
            f"send failed @{r['gen_send_failed_at_step']}" if r["gen_send_failed_at_step"] is not None else "no")
        pass_seen = f"after {r['pass_saw_cancel_after_s']} s" if r["pass_saw_cancel"] else "no"
        print(f"{name:<40} {seen:>24} {str(r['gen_ran_to_end']):>11} {pass_seen:>24}")
    print("\nnon-streaming request with probes, not cancelled:", json.dumps(vis))
    print("request parameters seen by the model: /generate", gen_params, " /generate_stream", stream_params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
