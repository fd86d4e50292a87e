"""Small prefill steps, eager against captured (engine/prefill_graph.py), on random weights of real shapes.

    python benchmarks/bench_prefill_graph.py [--shapes smollm2-135m,llama-3.2-1b,qwen3-30b-a3b]
        [--tokens 16,64,128,256,512] [--reqs 1,2,4] [--max-tokens 512] [--repeats 20]

Served load brings prompts one or a few at a time (each finished stream brings the next), so each is a
prefill step of its own while every running request waits for it. One row: a scheduler step that admits n
prompts of t tokens and prefills them (admission, forward, sampling, the tokens back on the host): the median
wall time of `--repeats` steps, eager and from the graphs, alternating, in one process on the same weights.
Then, per shape, what one arriving prompt costs `--decoders` running requests, with separate steps (the prefill
step, in which no one decodes) and with `mixed_prefill` (the mixed step minus the decode step it replaces).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_decode import SHAPES, write_shape
from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.scheduler.scheduler import Scheduler


def prefill_step_s(sched: Scheduler, n: int, t: int) -> float:
    """One step that prefills n prompts of t tokens (max_tokens 1: the step ends them)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(n):
        sched.add_request(torch.randint(10, sched.engine.vocab_size - 10, (t,)).tolist(), params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sched.step()
    dt = time.perf_counter() - t0
    while sched.has_work():  # nothing left normally; a prompt past the step budget would continue here
        sched.step()
    return dt


def timed_steps(sched: Scheduler, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        sched.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def arrival_cost(name: str, root: Path, decoders: int, context: int, prompt: int, args) -> None:
    """What one arriving prompt costs `decoders` running requests: with separate steps, the prefill step
    (no one decodes in it); mixed (mixed_prefill), the mixed step minus the decode step it replaces."""
    cfg = EngineConfig(model_path=str(write_shape(name, root)), load_format="dummy", dtype="bfloat16",
                       device="cuda", max_running_req=decoders + 1, page_size=16, max_seq_len=4096,
                       max_extend_tokens=2048, prefill_graph_max_tokens=args.max_tokens, mixed_prefill=True,
                       memory_fraction=0.5)
    sched = Scheduler(cfg)
    long = SamplingParams(max_tokens=4096 - context - 256, ignore_eos=True)
    for _ in range(decoders):
        sched.add_request(torch.randint(10, sched.engine.vocab_size - 10, (context,)).tolist(), long)
    timed_steps(sched, 20)  # admitted, prefilled, decoding
    decode_ms = 1e3 * timed_steps(sched, 50)
    cost: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeats + 1):
        for mixed in (False, True):
            cfg.mixed_prefill = mixed
            sched.add_request(torch.randint(10, sched.engine.vocab_size - 10, (prompt,)).tolist(),
                              SamplingParams(max_tokens=1, ignore_eos=True))
            ms = 1e3 * timed_steps(sched, 1)  # the arrival's step (with or without the decoders' rows)
            if i:
                cost[mixed].append(ms - decode_ms if mixed else ms)
            timed_steps(sched, 3)
    sep, mix = (statistics.median(cost[m]) for m in (False, True))
    print(f"| {decoders} | {context} | {prompt} | {decode_ms:.3f} | {sep:.3f} | {mix:.3f} |", flush=True)
    del sched
    gc.collect()
    torch.cuda.empty_cache()


def bench_shape(name: str, root: Path, args) -> None:
    cfg = EngineConfig(model_path=str(write_shape(name, root)), load_format="dummy", dtype="bfloat16",
                       device="cuda", max_running_req=max(args.reqs), page_size=16, max_seq_len=4096,
                       max_extend_tokens=max(args.max_tokens, max(args.tokens) * max(args.reqs)),
                       prefill_graph_max_tokens=args.max_tokens, prefill_graph_max_reqs=max(args.reqs),
                       memory_fraction=0.5)
    t0 = time.perf_counter()
    sched = Scheduler(cfg)
    engine = sched.engine
    runner = engine.prefill_graph_runner
    print(f"\n## {name}: engine built in {time.perf_counter() - t0:.1f} s, prefill graphs {sorted(runner.graphs)}")
    print("| prompts x tokens | bucket | eager ms | graph ms | eager / graph |")
    print("|---|---|---|---|---|")
    for n in args.reqs:
        for t in args.tokens:
            rows = n * t
            if rows > runner.max_tokens:
                continue
            times: dict[str, list[float]] = {"eager": [], "graph": []}
            for i in range(args.repeats + 2):  # the first of each is a warm-up
                for mode in ("eager", "graph") if i % 2 == 0 else ("graph", "eager"):
                    engine.prefill_graph_runner = runner if mode == "graph" else None
                    dt = prefill_step_s(sched, n, t)
                    if i >= 2:
                        times[mode].append(dt)
            engine.prefill_graph_runner = runner
            e, g = (1e3 * statistics.median(times[m]) for m in ("eager", "graph"))
            print(f"| {n} x {t} | {runner.bucket(rows)} | {e:.2f} | {g:.2f} | {e / g:.2f}x |", flush=True)
    del sched, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    if args.decoders:
        print(f"\n{name}: what one arriving prompt costs the running requests, ms (prefill graphs on)")
        print("| decoding requests | their context | prompt tokens | decode step ms | separate: prefill step | "
              "mixed: mixed - decode step |")
        print("|---|---|---|---|---|---|")
        for d in args.decoders:
            for c in args.contexts:
                arrival_cost(name, root, d, c, args.arrival_tokens, args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="16,64,128,256,512")
    ap.add_argument("--reqs", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--decoders", default="16,64", help="running requests for the arrival-cost table ('' = none)")
    ap.add_argument("--arrival-tokens", type=int, default=128)
    ap.add_argument("--contexts", default="128,2048", help="the running requests' prompt lengths")
    args = ap.parse_args()
    args.decoders = [int(x) for x in args.decoders.split(",") if x]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.tokens = [int(x) for x in args.tokens.split(",")]
    args.reqs = [int(x) for x in args.reqs.split(",")]
    print(f"# prefill steps, eager vs CUDA graphs: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes.split(","):
            bench_shape(name, Path(tmp), args)


if __name__ == "__main__":
    main()
