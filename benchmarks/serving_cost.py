"""Where one streamed response's time goes in the served path (CPU micro-benchmark, real tritonserver).

    python benchmarks/serving_cost.py                 # 2000 responses per case
    python benchmarks/serving_cost.py --responses 500 --formats full slim
    python benchmarks/serving_cost.py --formats slim3 slim   # the one-tensor slim response against the 3-tensor one
    python benchmarks/serving_cost.py --formats slim slimtext --profile   # 6 detokenizer outputs against 3

A bench repository (written to a temp dir) holds `sendcost`, a decoupled Python model that sends N
engine responses built by freetoken_core.serving.triton.response exactly as the engine's sender thread
does, timing each phase inside the stub; `sendcost_ens`, an ensemble sendcost -> the real
`detokenizer` (wrapped to time its execute); and `detok_batched` cases when the detokenizer config has
a dynamic batcher. Phases per response:

  numpy     the output dict (response.py)            pb        pb_utils.Tensor x k + InferenceResponse
  send      response_sender.send (Python -> stub -> server, one IPC message per response)
  busy      how much a pure-Python thread (the engine thread's stand-in) slows down while sends run: the GIL

and, per detokenizer execute: inputs read (get_input_tensor_by_name + as_numpy), decode, outputs.
The client is tritonclient's gRPC stream (Python), so client-side responses/s is a floor, not a cap.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

SENDCOST_MODEL = '''
import json, os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils
from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.triton import response as R

OUT = os.environ.get("FREETOKEN_COST_OUT", "/tmp")


def busy_loop(stop, counter):
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1
        counter[0] = n


class TritonPythonModel:
    def initialize(self, args):
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

    def execute(self, requests):
        for request in requests:
            fmt = pb_utils.get_input_tensor_by_name(request, "fmt").as_numpy().reshape(-1)[0].decode()
            n = int(pb_utils.get_input_tensor_by_name(request, "n").as_numpy().reshape(-1)[0])
            busy = bool(pb_utils.get_input_tensor_by_name(request, "busy").as_numpy().reshape(-1)[0])
            threading.Thread(target=self.run, args=(request.get_response_sender(), fmt, n, busy), daemon=True).start()
        return None

    def outputs(self, fmt, i, n):
        last = i == n - 1
        msg = DetokenizeMsg(uid=1, next_tokens=[1000 + i % 500], finished=last,
                            finish_reason="length" if last else None, num_prompt_tokens=128, num_output_tokens=i + 1)
        ctx = [300, 301, 302]
        key = "/tmp/freetoken-cancel-abcdefgh/engine.sock#" + "0" * 32
        if fmt == "full":
            return R.build_outputs(msg, msg.next_tokens, None, ctx, "", "", key)
        if fmt == "slim":
            return R.build_ensemble_outputs(msg, msg.next_tokens, None, ctx, "", "", key if i == 0 else "")
        if fmt == "slimtext":  # a client that turned the optional outputs off (return_<name>=false)
            return R.build_ensemble_outputs(msg, msg.next_tokens, None, ctx, "", "", key if i == 0 else "",
                                            omit=frozenset(("finish_reason", "num_input_tokens", "num_output_tokens")))
        if fmt == "slim3":  # the slim layout before its tokens moved into meta: 3 tensors (stub cost only)
            out = {"next_tokens": np.asarray(msg.next_tokens, dtype=np.int32),
                   "meta": np.array([int(last), 128, i + 1], dtype=np.int32),
                   "context_tokens": np.asarray(ctx, dtype=np.int32)}
            if last:
                out["finish_reason"] = np.array([b"length"], dtype=np.object_)
            if i == 0:
                out["cancel_key"] = np.array([key.encode()], dtype=np.object_)
            return out
        raise ValueError(fmt)

    def run(self, sender, fmt, n, busy):
        pb = pb_utils
        t_np = t_pb = t_send = 0.0
        stop, counter = threading.Event(), [0]
        if busy:
            th = threading.Thread(target=busy_loop, args=(stop, counter), daemon=True)
            th.start()
            time.sleep(0.2)
            c0 = counter[0]; t0b = time.perf_counter(); time.sleep(0.3)
            alone = (counter[0] - c0) / (time.perf_counter() - t0b)
        t_start = time.perf_counter()
        c_start = counter[0]
        for i in range(n):
            a = time.perf_counter()
            out = self.outputs(fmt, i, n)
            b = time.perf_counter()
            resp = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in out.items()])
            c = time.perf_counter()
            sender.send(resp, flags=self.final if i == n - 1 else 0)
            d = time.perf_counter()
            t_np += b - a; t_pb += c - b; t_send += d - c
        wall = time.perf_counter() - t_start
        res = {"fmt": fmt, "n": n, "tensors": len(out), "numpy_us": 1e6 * t_np / n, "pb_us": 1e6 * t_pb / n,
               "send_us": 1e6 * t_send / n, "wall_us": 1e6 * wall / n}
        if busy:
            res["busy_share"] = ((counter[0] - c_start) / wall) / alone if alone else 0.0
            stop.set()
        with open(os.path.join(OUT, f"sendcost-{fmt}-{int(busy)}.json"), "w") as f:
            json.dump(res, f)
'''

SENDCOST_CONFIG = '''
name: "sendcost"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "fmt" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "n" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "busy" data_type: TYPE_BOOL dims: [ 1 ] }
]
OUTPUTS
instance_group [ { count: 1 kind: KIND_CPU } ]
'''

# the real detokenizer, its execute timed (one line of JSON per 200 executes)
DETOK_WRAPPER = '''
import importlib.util, json, os, time
import numpy as np
spec = importlib.util.spec_from_file_location("real_detok", os.path.join(os.path.dirname(__file__), "real_model.py"))
real = importlib.util.module_from_spec(spec); spec.loader.exec_module(real)
OUT = os.environ.get("FREETOKEN_COST_OUT", "/tmp")


class TritonPythonModel(real.TritonPythonModel):
    def initialize(self, args):
        super().initialize(args)
        self.n_exec = self.n_req = 0
        self.t = 0.0
        self.profile = None
        if os.environ.get("FREETOKEN_COST_PROFILE"):  # --profile: where an execute's time goes, by function
            import cProfile
            self.profile = cProfile.Profile()

    def execute(self, requests):
        a = time.perf_counter()
        if self.profile is not None:
            self.profile.enable()
        out = super().execute(requests)
        if self.profile is not None:
            self.profile.disable()
        self.t += time.perf_counter() - a
        self.n_exec += 1
        self.n_req += len(requests)
        if self.n_exec % 20 == 0:
            with open(os.path.join(OUT, "detok.json"), "w") as f:
                json.dump({"executes": self.n_exec, "requests": self.n_req, "exec_us": 1e6 * self.t / self.n_exec}, f)
            if self.profile is not None:
                self.profile.dump_stats(os.path.join(OUT, "detok.prof"))
        return out
'''


def batched_detokenizer(config: str, max_batch: int) -> str:
    """The detokenizer config with Triton's dynamic batcher in front (an experiment: issue 13)."""
    import re

    config = config.replace("max_batch_size: 0", f"max_batch_size: {max_batch}\ndynamic_batching {{ }}")
    return re.sub(r"(\{ name: \"\w+\" data_type: \w+ dims: \[ -?1 \](?: optional: true)?) \}",
                  r"\1 allow_ragged_batch: true }", config.split("output [")[0]) + "output [" + config.split("output [")[1]


def write_repo(dest: Path, model_path: str, detok_batch: int = 0, detok_instances: int = 1) -> None:
    from freetoken_core.serving.launch.repository import set_instance_count, set_parameter, source_repository

    src = source_repository()
    outs = src.joinpath("freetoken", "config.pbtxt").read_text()
    out_block = outs[outs.index("output ["):outs.index("\n]", outs.rindex("name: \"meta\""))+2]
    (dest / "sendcost" / "1").mkdir(parents=True)
    (dest / "sendcost" / "config.pbtxt").write_text(SENDCOST_CONFIG.replace("OUTPUTS", out_block))
    (dest / "sendcost" / "1" / "model.py").write_text(SENDCOST_MODEL)
    det = dest / "detokenizer"
    shutil.copytree(src / "detokenizer", det, ignore=shutil.ignore_patterns("__pycache__"))
    (det / "config.pbtxt").write_text(set_parameter((det / "config.pbtxt").read_text(), "model_path", model_path))
    if detok_batch:
        (det / "config.pbtxt").write_text(batched_detokenizer((det / "config.pbtxt").read_text(), detok_batch))
    (det / "config.pbtxt").write_text(set_instance_count((det / "config.pbtxt").read_text(), detok_instances))
    os.rename(det / "1" / "model.py", det / "1" / "real_model.py")
    (det / "1" / "model.py").write_text(DETOK_WRAPPER)
    ens = src.joinpath("ensemble", "config.pbtxt").read_text()
    det_step = ens[ens.index('model_name: "detokenizer"'):]
    det_inputs = [ln.strip() for ln in det_step.splitlines() if "input_map" in ln]
    det_outputs = [ln.strip() for ln in det_step.splitlines() if "output_map" in ln]
    (dest / "sendcost_ens" / "1").mkdir(parents=True)
    (dest / "sendcost_ens" / "config.pbtxt").write_text(textwrap.dedent(f'''
        name: "sendcost_ens"
        platform: "ensemble"
        max_batch_size: 0
        input [
          {{ name: "fmt" data_type: TYPE_STRING dims: [ 1 ] }},
          {{ name: "n" data_type: TYPE_INT32 dims: [ 1 ] }},
          {{ name: "busy" data_type: TYPE_BOOL dims: [ 1 ] }}
        ]
        output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
                 {{ name: "next_tokens" data_type: TYPE_INT32 dims: [ -1 ] }} ]
        ensemble_scheduling {{ step [
          {{ model_name: "sendcost" model_version: -1
            input_map {{ key: "fmt" value: "fmt" }} input_map {{ key: "n" value: "n" }}
            input_map {{ key: "busy" value: "busy" }}
            {" ".join(ln.replace("input_map", "output_map") for ln in det_inputs)} }},
          {{ model_name: "detokenizer" model_version: -1
            {" ".join(det_inputs)}
            {" ".join(ln for ln in det_outputs if "text_output" in ln or "next_tokens_out" in ln)} }}
        ] }}
    '''))


def run_case(url: str, model: str, fmt: str, n: int, busy: bool, streams: int = 1) -> float:
    """Client-side responses/s for `streams` concurrent requests of n responses each."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    done: queue.Queue = queue.Queue()
    count = [0]

    def cb(result, error):
        if error is not None:
            done.put(str(error))
            return
        resp = result.get_response()
        if resp.outputs:
            count[0] += 1
        if resp.parameters["triton_final_response"].bool_param:
            done.put(None)

    client.start_stream(callback=cb)
    t0 = time.perf_counter()
    for s in range(streams):
        ins = []
        for name, arr, dt in [("fmt", np.array([fmt.encode()], dtype=object), "BYTES"),
                              ("n", np.array([n], np.int32), "INT32"), ("busy", np.array([busy]), "BOOL")]:
            t = grpcclient.InferInput(name, [1], dt)
            t.set_data_from_numpy(arr)
            ins.append(t)
        client.async_stream_infer(model, ins, request_id=f"{fmt}-{s}", enable_empty_final_response=True)
    for _ in range(streams):
        err = done.get(timeout=600)
        if err:
            raise RuntimeError(err)
    dt = time.perf_counter() - t0
    client.stop_stream()
    client.close()
    return count[0] / dt


def read_json(path: Path, timeout: float = 10.0) -> dict:
    """The stub writes its timings just after the FINAL send: wait for them."""
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def detok_inprocess(model_path: str, n: int) -> dict[str, float]:
    """The detokenizer's own work per response, without Triton (text_models.detokenize_response)."""
    from freetoken_core.serving.triton.text_models import detokenize_response
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    tok = load_tokenizer(model_path)
    t = {"next_tokens": np.array([1000], np.int32), "context_tokens": np.array([300, 301, 302], np.int32),
         "finished": np.array([False]), "finish_reason": np.array([b""], object),
         "num_input_tokens": np.array([128], np.uint32), "num_output_tokens": np.array([5], np.uint32),
         "logprobs": np.zeros(0, np.float32), "prompt_text": np.array([b""], object),
         "detok_params": np.array([b""], object)}
    a = time.perf_counter()
    for _ in range(n):
        detokenize_response(tok, t)
    return {"detokenize_response_us": 1e6 * (time.perf_counter() - a) / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--responses", type=int, default=2000)
    p.add_argument("--formats", nargs="+", default=["full", "slim"])
    p.add_argument("--detok-batch", type=int, default=0, help="> 0: dynamic batcher in front of the detokenizer")
    p.add_argument("--detok-instances", type=int, default=1, help="detokenizer instance count")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the second ensemble case")
    p.add_argument("--model-path", default=None, help="tokenizer for the detokenizer (default SmolLM2)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the detokenizer's executes; prints the top functions by own time")
    args = p.parse_args()

    from freetoken_core.models.gguf import default_model_path
    from freetoken_core.serving.launch.server import spawn_tritonserver, wait_ready

    model_path = args.model_path or default_model_path()
    work = Path(tempfile.mkdtemp(prefix="freetoken-cost-"))
    out = work / "out"
    out.mkdir()
    write_repo(work / "repo", model_path, args.detok_batch, args.detok_instances)
    print("in-process:", detok_inprocess(model_path, 5000), flush=True)
    env = {"FREETOKEN_COST_OUT": str(out), **({"FREETOKEN_COST_PROFILE": "1"} if args.profile else {})}
    handle = spawn_tritonserver(work / "repo", log_path=work / "server.log", env=env)
    try:
        wait_ready(handle, 300, models=("sendcost", "detokenizer", "sendcost_ens"))
        n = args.responses
        rows = []
        seen = {"executes": 0, "requests": 0, "exec_us": 0.0}  # the detokenizer's totals before this format's runs
        for fmt in args.formats:
            run_case(handle.grpc_url, "sendcost", fmt, 50, False)  # warm up
            rps = run_case(handle.grpc_url, "sendcost", fmt, n, False)
            stub = read_json(out / f"sendcost-{fmt}-0.json")
            run_case(handle.grpc_url, "sendcost", fmt, n, True)
            busy = read_json(out / f"sendcost-{fmt}-1.json")
            # the detokenizer reads the current layouts only: slim3 is measured in the stub alone
            ens = run_case(handle.grpc_url, "sendcost_ens", fmt, n, False) if fmt != "slim3" else float("nan")
            ens8 = (run_case(handle.grpc_url, "sendcost_ens", fmt, n // args.streams, False, streams=args.streams)
                    if fmt != "slim3" else float("nan"))
            total = json.loads((out / "detok.json").read_text()) if (out / "detok.json").exists() else seen
            executes = total["executes"] - seen["executes"]  # this format's executes only
            spent_us = total["exec_us"] * total["executes"] - seen["exec_us"] * seen["executes"]
            det = {"executes": executes, "requests": total["requests"] - seen["requests"],
                   "exec_us": spent_us / executes if executes else 0.0}
            seen = total
            rows.append((fmt, stub, busy, rps, ens, ens8, det))
    except BaseException:
        print("\n".join(ln for ln in handle.log_tail(200000).splitlines() if ln.startswith("E")))
        raise
    finally:
        handle.stop()
    print(f"\n{args.responses} responses per case; per-response times inside the stub (us), client rates (responses/s)")
    print("| format | tensors | numpy | pb | send | wall | busy thread keeps | freetoken alone resp/s | ensemble resp/s "
          f"(1 stream) | ensemble resp/s ({args.streams} streams) | detok executes/requests | detok exec us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, s, b, rps, ens, ens8, det in rows:
        print(f"| {fmt} | {s['tensors']} | {s['numpy_us']:.1f} | {s['pb_us']:.1f} | {s['send_us']:.1f} | "
              f"{s['wall_us']:.1f} | {b.get('busy_share', 0):.0%} | {rps:.0f} | {ens:.0f} | {ens8:.0f} | "
              f"{det.get('executes', 0)}/{det.get('requests', 0)} | {det.get('exec_us', 0):.0f} |")
    if args.profile and (out / "detok.prof").exists():
        import pstats

        print("\nthe detokenizer's executes, by own time (cProfile inside the stub):")
        pstats.Stats(str(out / "detok.prof")).sort_stats("tottime").print_stats(18)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
