"""How much host work a one-stream decode step can take on before the step rate drops (issue 13's body).

The served engine process does, per step, what the in-process engine does plus one thing: it sends the step's
messages to its `freetoken` instance (encode, pickle, a pipe write that wakes the reader: ~23-28 us on the H200
host, benchmarks/RESULTS.md nineteenth session). Whether that shows in the step rate depends on the slack between
the host's own work a step and the device's: with overlap scheduling the message goes out while the next step
runs on the device, so only what the host cannot hide behind it lengthens a step.

One request at a time on perf_analyzer's prompts (benchmarks/pa_summary.py PROMPTS), 128 tokens each, stepping the
Scheduler directly; after every step the host spends `extra` more: a busy loop of that many microseconds, or
`pipe`: the engine process's own send of the step's messages (serving/engine_proc/engine_server.py encode + pickle +
`Connection.send`) to a reader process blocked in `recv()`, as the served path has it. Prints the median ms a
decode step (from the second token to the last), the median time a step waits for the device
(`HostCopy.wait`), and the median host time outside that wait.

    python3 benchmarks/step_slack.py --shape smollm2-135m [--extra-us 0 10 25 50] [--requests 12]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _reader(conn) -> None:  # the instance's side: take each message as it comes
    try:
        while True:
            conn.recv()
    except EOFError:
        pass


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def run(sched, prompts: list[list[int]], out_tokens: int, after_step) -> tuple[float, float, float]:
    """Median (ms a decode step, ms a step waits for the device, host ms a step outside that wait)."""
    from freetoken_core.config import SamplingParams
    from freetoken_core.engine import sampler

    waits: list[float] = []
    real_wait = sampler.HostCopy.wait

    def timed_wait(self):
        t = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            waits.append(time.perf_counter() - t)

    sampler.HostCopy.wait = timed_wait
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    step_ms, wait_ms, host_ms = [], [], []
    try:
        for ids in prompts:
            sched.add_request(ids, params)
            stamps = []  # (time a token came out, device wait inside that step)
            while sched.has_work():
                waits.clear()
                t0 = time.perf_counter()
                msgs = sched.step()
                after_step(msgs)
                t1 = time.perf_counter()
                if any(m.next_tokens for m in msgs):
                    stamps.append((t1, sum(waits), t1 - t0))
            for (a, _, _), (b, w, h) in zip(stamps[1:], stamps[2:]):  # decode steps only
                step_ms.append(1e3 * (b - a))
                wait_ms.append(1e3 * w)
                host_ms.append(1e3 * (h - w))
    finally:
        sampler.HostCopy.wait = real_wait
    return statistics.median(step_ms), statistics.median(wait_ms), statistics.median(host_ms)


def main() -> int:
    from bench_serving import shape_model_dir
    from pa_summary import PROMPTS

    from freetoken_core.serving.engine_proc.protocol import encode
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=".gpu-model/smollm2", help="tokenizer files (and config.json)")
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--extra-us", type=float, nargs="*", default=[0, 10, 25, 50])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--out-tokens", type=int, default=128)
    args = p.parse_args()

    from freetoken_core.llm import LLM

    model_path = shape_model_dir(args.shape, args.model_path)
    llm = LLM(model_path, max_running_req=1, dtype=args.dtype, device=args.device, load_format="dummy")
    sched = llm.scheduler
    tok = load_tokenizer(model_path)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    run(sched, prompts[:3], args.out_tokens, lambda msgs: None)  # warm up

    ctx = mp.get_context("spawn")
    recv_end, send_end = ctx.Pipe(duplex=False)
    reader = ctx.Process(target=_reader, args=(recv_end,), daemon=True)
    reader.start()

    def pipe_send(msgs) -> None:
        if msgs:
            send_end.send([encode(m) for m in msgs])  # a StepBatch (protocol.py)

    cases = [(f"busy {x:g} us", lambda msgs, us=x: _spin(us)) for x in args.extra_us]
    cases.append(("pipe (the engine process's send)", pipe_send))
    print(f"| {args.shape}, {args.out_tokens} tokens, one request at a time | ms a decode step | device wait ms | "
          "host ms outside the wait |\n|---|---|---|---|")
    for name, after in cases + cases[:1]:  # the first case again: how much the host drifted meanwhile
        step, wait, host = run(sched, prompts, args.out_tokens, after)
        print(f"| {name} | {step:.4f} | {wait:.4f} | {host:.4f} |", flush=True)
    send_end.close()
    reader.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
