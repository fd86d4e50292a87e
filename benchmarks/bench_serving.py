"""Serving overhead: the same workload in-process (LLM) and through tritonserver's ensemble (gRPC streaming).

    python benchmarks/bench_serving.py                       # 64 requests, ~128 prompt / 128 output tokens, concurrency 16
    python benchmarks/bench_serving.py --requests 16 --output-tokens 32
    python benchmarks/bench_serving.py --shape llama-3.2-1b --device cuda --dtype bfloat16 --concurrency 1 16 64

--shape NAME writes a model directory with that architecture's config.json (random weights:
--load-format dummy is implied) and SmolLM2's tokenizer files, so the real tokenizer serves it.

Both paths use the same engine settings (max_running_req = concurrency) and ignore_eos, so both
generate exactly requests x output_tokens tokens. Prints output tok/s for each and the ratio
(target: Triton >= 90% of in-process). Record results in benchmarks/RESULTS.md with the command.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time


os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = (
    "The history of the lighthouse begins with fires on hilltops, kept burning by watchmen who knew every rock "
    "of the coast. Later came towers of stone with lanterns of oil, then lenses that gathered the light into a "
    "beam visible for miles. Keepers lived in small houses at the foot of the towers, trimming wicks, cleaning "
    "glass, and writing the weather into logbooks that sailors never read. Storms broke windows; supply boats "
    "failed to come; children grew up knowing the tides better than the alphabet. "
) * 8


# Architectures by name: config.json fields over SmolLM2-135M's (Llama, vocab 49152, tied embeddings)
SHAPES: dict[str, dict] = {
    "smollm2-135m": {},
    # two layers of width 64: an engine step of a few ms on a CPU, so that the served path's own costs show
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "head_dim": 16},
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 8192, "head_dim": 64, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
}


def shape_model_dir(shape: str, tokenizer_dir: str) -> str:
    """A model directory: config.json of `shape` + the tokenizer files of tokenizer_dir (no weights)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    src = Path(tokenizer_dir)
    dest = Path(tempfile.gettempdir()) / f"freetoken-shape-{shape}"
    dest.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(SHAPES[shape])
    cfg["_model_name_or_path"] = f"random weights, {shape} shape"
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(dest)


def engine_fields(pairs: list[str]) -> dict:
    """FIELD=VALUE strings -> EngineConfig keyword arguments, typed as the field's default is."""
    import dataclasses

    from freetoken_core.config import EngineConfig

    known = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--engine wants FIELD=VALUE with an EngineConfig field, got {pair!r}")
        default = known[name].default
        out[name] = (value.lower() in ("1", "true") if isinstance(default, bool)
                     else type(default)(value) if isinstance(default, (int, float)) else value)
    return out


def make_prompts(tokenizer, n: int, prompt_tokens: int) -> list[str]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = []
    for i in range(n):
        start = (i * 7) % max(1, len(ids) - prompt_tokens)
        prompts.append(tokenizer.decode(ids[start:start + prompt_tokens]))
    return prompts


class StepTimes:
    """Where an in-process run's time goes: the wall time of each Scheduler.step() call (with overlap scheduling,
    the host's work for a step plus its wait for the one before), by whether the call launched a prefill. The
    in-process 64-stream side read 20-36k tok/s on one H200 host and in one engine (thirty-fourth session) while
    the served engine process stepped at p50 1.1-1.5 ms: these say whether prefill steps or slow decode steps hold
    it back."""

    def __init__(self, sched) -> None:
        self.step, self.prepare = sched.step, sched.engine.prepare_batch
        self.phases: list[str] = []
        self.times: dict[str, list[float]] = {"prefill": [], "decode": []}
        sched.engine.prepare_batch = self._prepare
        sched.step = self._step

    def _prepare(self, phase, *a, **kw):
        self.phases.append(phase)
        return self.prepare(phase, *a, **kw)

    def _step(self):
        self.phases.clear()
        t0 = time.perf_counter()
        out = self.step()
        self.times["prefill" if "prefill" in self.phases else "decode"].append(time.perf_counter() - t0)
        return out

    def reset(self) -> None:
        for v in self.times.values():
            v.clear()

    def line(self) -> str:
        import statistics

        parts = []
        for kind, ts in self.times.items():
            if ts:
                parts.append(f"{len(ts)} {kind} steps {1e3 * sum(ts):.0f} ms (p50 {1e3 * statistics.median(ts):.2f}, "
                             f"max {1e3 * max(ts):.1f})")
        return "; ".join(parts)


def bench_offline(model_path: str, prompts: list[str], out_tokens: int, concurrency: int, engine_kw: dict,
                  rounds: int = 3, window_s: float = 0.0, stability: float = 0.10, max_windows: int = 10) -> float:
    """Output tok/s of LLM.generate over all prompts. The warm-up is a full wave (every prefill and decode batch
    size of the timed runs compiles before them): with only two warm-up prompts, one run at 64 streams measured
    anywhere from 17k to 35k tok/s on the H200.

    window_s == 0: the median of `rounds` timed runs over the prompts.
    window_s > 0: perf_analyzer's measurement, in-process (the served side's rows are measured so): each window
    runs LLM.generate over the prompts again and again until window_s has passed, windows repeat until the last
    `rounds` of them agree within `stability` of their mean (at most max_windows), and the rate is their mean.
    Why: one ~1 s run at 64 streams swung by up to a third on the H200 hosts (twenty-ninth session, 26.7k-37.8k
    tok/s in one engine), and a ratio against one such run measured the host as much as the served path."""
    import gc
    import statistics

    from freetoken_core.config import SamplingParams
    from freetoken_core.llm import LLM

    llm = LLM(model_path, max_running_req=concurrency, **engine_kw)
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    llm.generate(prompts[:concurrency], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    steps = StepTimes(llm.scheduler)
    full_gcs: list[float] = []  # what each full (generation 2) collection during the timed runs took, s
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if info.get("generation") == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                full_gcs.append(time.perf_counter() - started.pop())

    def timed(min_s: float) -> float:
        steps.reset()  # the last window's steps are the ones reported
        tokens, t0 = 0, time.perf_counter()
        while True:
            tokens += sum(len(o.token_ids) for o in llm.generate(prompts, params))
            dt = time.perf_counter() - t0
            if dt >= min_s:
                return tokens / dt

    rates: list[float] = []
    stable = True
    gc.callbacks.append(on_gc)
    try:
        if window_s <= 0:
            rates = [timed(0.0) for _ in range(max(rounds, 1))]
            rate = statistics.median(rates)
        else:
            need = max(rounds, 1)
            while len(rates) < max(need, max_windows):
                rates.append(timed(window_s))
                last = rates[-need:]
                mean = sum(last) / len(last)
                stable = len(last) == need and all(abs(r - mean) <= stability * mean for r in last)
                if stable:
                    break
            rate = sum(rates[-need:]) / len(rates[-need:])
    finally:
        gc.callbacks.remove(on_gc)
    print(f"concurrency {concurrency}: in-process runs " + " / ".join(f"{r:.1f}" for r in rates)
          + (f" tok/s (windows of {window_s:g} s{'' if stable else ', NOT stable: the mean of the last three'})"
             if window_s > 0 else " tok/s")
          + f"; {len(full_gcs)} full garbage collections ({1e3 * sum(full_gcs):.0f} ms); last run: {steps.line()}",
          flush=True)
    del llm
    return rate


def bench_closed_loop(model_path: str, prompts: list[str], out_tokens: int, concurrency: int, engine_kw: dict,
                      delay_ms: float) -> tuple[float, float]:
    """In-process, with the served path's arrival pattern: `concurrency` clients, each sending its next prompt
    `delay_ms` after its previous request finished (a served client waits for the FINAL response, then its next
    request crosses tokenizer and engine intake), so prompts arrive one at a time where `bench_offline` admits
    them in lock step. Separates what that pattern costs the engine from what the transport costs. Returns
    (output tok/s, prefill steps per request)."""
    import heapq

    from freetoken_core.config import SamplingParams
    from freetoken_core.llm import LLM

    llm = LLM(model_path, max_running_req=concurrency, **engine_kw)
    llm.generate(prompts[:concurrency], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    sched, tok = llm.scheduler, llm.scheduler.tokenizer
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    steps = StepTimes(sched)  # a step launches at most one prefill: its prefill steps are the prefills
    due: list[tuple[float, int]] = []  # (time the client sends, prompt index)
    t0 = time.perf_counter()
    for i in range(min(concurrency, len(ids))):
        heapq.heappush(due, (t0, i))
    sent, done, tokens = min(concurrency, len(ids)), 0, 0
    while done < len(ids):
        now = time.perf_counter()
        while due and due[0][0] <= now:
            sched.add_request(ids[heapq.heappop(due)[1]], params)
        if not sched.has_work():
            time.sleep(max(0.0, due[0][0] - now))
            continue
        for m in sched.step():
            tokens += len(m.next_tokens)
            if m.finished:
                done += 1
                if sent < len(ids):
                    heapq.heappush(due, (time.perf_counter() + delay_ms / 1e3, sent))
                    sent += 1
    dt = time.perf_counter() - t0
    del llm
    return tokens / dt, len(steps.times["prefill"]) / len(ids)


def bench_one_request(model_path: str, out_tokens: int, engine_kw: dict, repeats: int = 20) -> str:
    """In-process, one request at a time on perf_analyzer's prompts (benchmarks/pa_summary.py PROMPTS): the
    median time of LLM.generate with max_tokens=1 (the request's TTFT plus the call's own cost) and with
    max_tokens=out_tokens, beside which pa_clients.py stream1 reads the served path's one-stream times."""
    import statistics

    from pa_summary import PROMPTS

    from freetoken_core.config import SamplingParams
    from freetoken_core.llm import LLM

    llm = LLM(model_path, max_running_req=1, **engine_kw)
    first, whole = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    for p in PROMPTS:  # warm up
        llm.generate([p], whole)
    t_first, t_whole = [], []
    for i in range(repeats):
        p = PROMPTS[i % len(PROMPTS)]
        t0 = time.perf_counter()
        llm.generate([p], first)
        t1 = time.perf_counter()
        llm.generate([p], whole)
        t_first.append(t1 - t0)
        t_whole.append(time.perf_counter() - t1)
    del llm
    f, w = 1000 * statistics.median(t_first), 1000 * statistics.median(t_whole)
    return (f"| in-process one request | TTFT (max_tokens 1) {f:.2f} ms | {out_tokens} tokens {w:.2f} ms | "
            f"per token after the first {(w - f) / max(1, out_tokens - 1):.3f} ms | {out_tokens / w * 1000:.1f} tok/s |")


def bench_triton(model_path: str, prompts: list[str], out_tokens: int, concurrency: int, engine_kw: dict,
                 stream: bool = True) -> tuple[float, float]:
    """Output tok/s through the ensemble (gRPC streams, a closed loop of `concurrency` clients), and the
    mean tokens per response."""
    import tritonclient.grpc as grpcclient
    from pa_summary import ensemble_inputs

    from freetoken_core.serving.launch.server import start_server

    overrides = {"model_path": model_path, "max_running_req": str(concurrency),
                 **{k: str(v) for k, v in engine_kw.items()}}
    import tempfile
    from pathlib import Path

    log_path = Path(tempfile.gettempdir()) / "freetoken-bench-tritonserver.log"
    handle = start_server(overrides, ready_timeout=600, log_path=log_path)
    try:
        client = grpcclient.InferenceServerClient(handle.grpc_url)
        done: queue.Queue = queue.Queue()
        counts: dict[str, int] = {}
        responses = [0]

        def on_response(result, error):
            if error is not None:
                done.put(("error", str(error)))
                return
            resp = result.get_response()
            if resp.outputs:
                counts[resp.id] = counts.get(resp.id, 0) + result.as_numpy("next_tokens").size
                responses[0] += 1
            if resp.parameters["triton_final_response"].bool_param:
                done.put(("done", resp.id))

        def inputs(text: str):
            return ensemble_inputs(text, out_tokens, stream)

        client.start_stream(callback=on_response)

        def run(batch: list[str]) -> float:
            counts.clear()
            responses[0] = 0
            sent = 0
            t0 = time.perf_counter()
            while sent < min(concurrency, len(batch)):
                client.async_stream_infer("ensemble", inputs(batch[sent]), request_id=str(sent),
                                          enable_empty_final_response=True)
                sent += 1
            finished = 0
            while finished < len(batch):
                kind, info = done.get(timeout=600)
                if kind == "error":
                    raise RuntimeError(info)
                finished += 1
                if sent < len(batch):
                    client.async_stream_infer("ensemble", inputs(batch[sent]), request_id=str(sent),
                                              enable_empty_final_response=True)
                    sent += 1
            return time.perf_counter() - t0

        run(prompts[:2])  # warm up
        dt = run(prompts)
        n = sum(counts.values())
        client.stop_stream()
        return n / dt, n / max(responses[0], 1)
    finally:
        handle.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-waves", type=int, default=4,
                   help="in-process: at least this many waves of `concurrency` requests per timed run (a single "
                        "wave times its prefill and ragged tail, not the steady state a served client sees)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16], help="several: one table row each")
    p.add_argument("--load-format", default=None, help="dummy: random weights of config.json's shape")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="random weights of this architecture with SmolLM2's tokenizer (implies --load-format dummy)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--no-stream", action="store_true", help="one response per request (isolates per-response cost)")
    p.add_argument("--only", choices=["offline", "triton", "request"], default=None,
                   help="run one path (for profiling); request: bench_one_request alone")
    p.add_argument("--closed-loop-ms", type=float, nargs="*", default=[],
                   help="also in-process with served arrivals: each client sends its next prompt this many ms "
                        "after its previous one finished (bench_closed_loop); several values: one column each")
    p.add_argument("--rounds", type=int, default=3,
                   help="in-process: timed runs per concurrency (their median), or with --window-s the windows "
                        "that must agree (their mean)")
    p.add_argument("--window-s", type=float, default=0.0,
                   help="in-process: time windows of at least this many seconds, repeated until the last --rounds "
                        "agree within --stability (as perf_analyzer measures the served side); 0: --rounds runs")
    p.add_argument("--stability", type=float, default=0.10, help="with --window-s: the agreement asked (0.10: 10%%)")
    p.add_argument("--engine", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="EngineConfig fields for both paths, e.g. prefill_graph_max_tokens=512")
    args = p.parse_args()

    from freetoken_core.models.gguf import default_model_path
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    model_path = args.model_path or default_model_path()
    if args.shape:
        model_path = shape_model_dir(args.shape, model_path)
        args.load_format = "dummy"
        print(f"model: {model_path} ({args.shape}, random weights)", flush=True)
    most = max([args.requests] + [args.min_waves * c for c in args.concurrency])
    all_prompts = make_prompts(load_tokenizer(model_path), most, args.prompt_tokens)
    prompts = all_prompts[:args.requests]
    engine_kw = {"dtype": args.dtype, "device": args.device}
    if args.num_pages:
        engine_kw["num_pages"] = args.num_pages
    if args.load_format:
        engine_kw["load_format"] = args.load_format
    engine_kw.update(engine_fields(args.engine))
    if args.only == "request":
        print(bench_one_request(model_path, args.output_tokens, {**engine_kw}), flush=True)
        return 0
    rows = []
    for c in args.concurrency:
        offline = served = float("nan")
        if args.only != "triton":
            n = max(args.requests, args.min_waves * c)
            offline = bench_offline(model_path, all_prompts[:n], args.output_tokens, c, engine_kw, args.rounds,
                                    args.window_s, args.stability)
            print(f"concurrency {c}: in-process LLM {offline:8.1f} output tok/s", flush=True)
        if args.only != "offline":
            served, per_response = bench_triton(model_path, prompts, args.output_tokens, c, engine_kw,
                                                not args.no_stream)
            print(f"concurrency {c}: tritonserver {'stream' if not args.no_stream else 'single'} {served:8.1f} "
                  f"output tok/s, {per_response:.2f} tokens per response", flush=True)
        loops = []
        for d in args.closed_loop_ms:
            rate, prefills = bench_closed_loop(model_path, prompts, args.output_tokens, c, engine_kw, d)
            loops.append((rate, prefills))
            print(f"concurrency {c}: in-process closed loop, {d:g} ms between requests: {rate:8.1f} output tok/s, "
                  f"{prefills:.2f} prefill steps per request", flush=True)
        rows.append((c, offline, served, loops))
    print(f"\n{args.requests} requests (in-process: at least {args.min_waves} waves), ~{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
          f"engine {engine_kw}")
    loop_cols = "".join(f" closed loop {d:g} ms tok/s (prefill steps/request) |" for d in args.closed_loop_ms)
    print(f"| concurrency | in-process tok/s | served tok/s | served / in-process |{loop_cols}\n"
          f"|---|---|---|---|{'---|' * len(args.closed_loop_ms)}")
    for c, offline, served, loops in rows:
        cells = "".join(f" {r:.1f} ({p:.2f}) |" for r, p in loops)
        print(f"| {c} | {offline:.1f} | {served:.1f} | {served / offline:.3f} |{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
