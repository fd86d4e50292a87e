"""The OpenAI-compatible API against the gRPC ensemble it fronts: the same closed-loop streaming load on each.

    freetoken-core serve --grpc-port 8001 &          # the OpenAI API listens on 9000
    python benchmarks/bench_openai.py --grpc-url 127.0.0.1:8001 --openai-url http://127.0.0.1:9000/v1
    python benchmarks/bench_openai.py --serve-shape llama-3.2-1b --param device=cuda --param dtype=bfloat16 \
        --param max_running_req=64 --concurrency 1,16,64 --requests 256 --output-tokens 128

--serve-shape SHAPE (benchmarks/bench_serving.py SHAPES: random weights, SmolLM2's tokenizer) or --serve-model DIR
starts tritonserver and the OpenAI API itself, as `freetoken-core serve` does (--param NAME=VALUE as its), and
stops both at the end (their logs: freetoken-bench-openai-*.log in the temporary directory).

N clients per side, each sending its next request when its previous one finished (a closed loop), spread over
--client-procs processes on both sides alike (default: a process per 8 CPUs, at most one per stream), so that one
client process's CPU does not cap the rate it measures (streaming
/v1/completions through the official `openai` async client on one side, streaming ensemble requests over
tritonclient's asyncio gRPC (the frontend's own EnsembleClient, serving/openai/ensemble_client.py) on the other).
Both send the same prompts (~--prompt-tokens tokens), --output-tokens with ignore_eos, so both generate exactly
requests x output-tokens tokens. Each prompt starts with its own tag, so that no request is served from the prefix
cache that an earlier one (or the other side) filled. Prints per side output tok/s and TTFT p50/p90 (time to the
first token-carrying response), and the ratio OpenAI / gRPC; --json writes the same numbers. --rounds N runs the
sides N times in turn at each concurrency (gRPC, OpenAI, gRPC, ...) and the table shows each side's medians: a
baseline that moves between runs (the gRPC side's TTFT at 16 streams did) moves both sides' figures alike.

--load-generator perf_analyzer (perf_analyzer on PATH, e.g. the GPU host's) drives both sides with the same C++ load
generator instead: streaming /v1/chat/completions (its `openai` service kind) against the ensemble over gRPC streaming,
the same one-message chat on each; per side a warm-up, then a run of up to --pa-trials windows of --pa-ms, its numbers
from the profile export (benchmarks/openai_pa.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai_pa  # noqa: E402 (benchmarks/ on the path first)
from bench_serving import SHAPES  # noqa: E402


@dataclass(frozen=True)
class SideResult:
    """One side's run at one concurrency: what it generated, how fast, and its first-token times."""

    side: str
    concurrency: int
    requests: int
    output_tokens: int  # all requests together, as the server counted them
    seconds: float
    ttft_p50_ms: float
    ttft_p90_ms: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


# one request: prompt -> (seconds to its first token, output tokens)
OneRequest = Callable[[str], Awaitable[tuple[float, int]]]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between the nearest ranks."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def closed_loop(one: OneRequest, prompts: list[str], concurrency: int) -> tuple[float, list[tuple[float, int]]]:
    """`concurrency` clients take the prompts in order, each its next one when its previous request finished.
    Returns (wall seconds, (ttft, tokens) per request)."""
    queue = list(reversed(prompts))
    results: list[tuple[float, int]] = []

    async def client() -> None:
        while queue:
            results.append(await one(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(min(concurrency, len(prompts)))))
    return time.perf_counter() - t0, results


def openai_request(client, model: str, max_tokens: int) -> OneRequest:
    async def one(prompt: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if ttft is None and any(c.text for c in chunk.choices):
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return (ttft if ttft is not None else time.perf_counter() - t0), tokens
    return one


def grpc_request(client, max_tokens: int) -> OneRequest:
    from freetoken_core.serving.openai.ensemble_client import EnsembleRequest

    async def one(prompt: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        async for step in client.generate(EnsembleRequest(text_input=prompt, max_tokens=max_tokens, ignore_eos=True)):
            if ttft is None and step.token_ids:
                ttft = time.perf_counter() - t0
            tokens += len(step.token_ids)
        return (ttft if ttft is not None else time.perf_counter() - t0), tokens
    return one


def tagged_prompts(side: str, prompts: list[str], concurrency: int, warmup: int) -> tuple[list[str], list[str]]:
    """(warm-up prompts, timed prompts), each opened by its own tag so that no request hits the prefix cache."""
    return ([f"[{side} {concurrency} warm {i}] {p}" for i, p in enumerate(prompts[:warmup])],
            [f"[{side} {concurrency} {i:05d}] {p}" for i, p in enumerate(prompts)])


@dataclass(frozen=True)
class ClientSpec:
    """What a client process needs to build its side's client (picklable: crosses into the process)."""

    side: str
    openai_url: str
    grpc_url: str | None
    api_key: str
    model: str
    output_tokens: int
    timeout: float


def _client_process(spec: ClientSpec, warm: list[str], timed: list[str], concurrency: int, barrier, out) -> None:
    """A share of one side's clients in a process of its own: warm up, wait for every process, run, report."""
    async def main() -> list[tuple[float, int]]:
        async with SideClient(spec) as one:
            await closed_loop(one, warm, concurrency)
            barrier.wait()
            return (await closed_loop(one, timed, concurrency))[1]
    try:
        out.put(asyncio.run(main()))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which raises it)
        barrier.abort()
        out.put(e)


class SideClient:
    """`async with SideClient(spec) as one`: one side's client for a process, closed at the end."""

    def __init__(self, spec: ClientSpec) -> None:
        self.spec = spec

    async def __aenter__(self) -> OneRequest:
        if self.spec.side == "openai":
            import openai

            self.client = openai.AsyncOpenAI(base_url=self.spec.openai_url, api_key=self.spec.api_key, max_retries=0,
                                             timeout=self.spec.timeout)
            return openai_request(self.client, self.spec.model, self.spec.output_tokens)
        from freetoken_core.serving.openai.ensemble_client import EnsembleClient

        self.client = EnsembleClient(self.spec.grpc_url)
        return grpc_request(self.client, self.spec.output_tokens)

    async def __aexit__(self, *exc) -> None:
        await self.client.close()


def run_side_in_processes(spec: ClientSpec, prompts: list[str], concurrency: int, warmup: int,
                          procs: int) -> SideResult:
    """One side's closed loop with its clients spread over `procs` processes; the clock runs from the moment every
    process has warmed up until the last one's last request ended."""
    ctx = multiprocessing.get_context("spawn")
    warm, timed = tagged_prompts(spec.side, prompts, concurrency, warmup)
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(spec, warm[i::procs], timed[i::procs], len(range(i, concurrency, procs)), barrier, out))
               for i in range(procs)]
    for w in workers:
        w.start()
    try:
        barrier.wait(timeout=spec.timeout)
    except threading.BrokenBarrierError:
        pass  # a process failed before the start: its exception is in `out`
    t0 = time.perf_counter()
    shares = [out.get(timeout=spec.timeout * len(timed)) for _ in workers]
    seconds = time.perf_counter() - t0
    for w in workers:
        w.join()
    if errors := [r for r in shares if isinstance(r, BaseException)]:
        raise errors[0]
    results = [r for share in shares for r in share]
    ttfts = [1e3 * t for t, _ in results]
    return SideResult(spec.side, concurrency, len(results), sum(n for _, n in results), seconds,
                      percentile(ttfts, 0.5), percentile(ttfts, 0.9))


async def run_side(side: str, one: OneRequest, prompts: list[str], concurrency: int, warmup: int) -> SideResult:
    warm, tagged = tagged_prompts(side, prompts, concurrency, warmup)
    await closed_loop(one, warm, concurrency)
    seconds, results = await closed_loop(one, tagged, concurrency)
    ttfts = [1e3 * t for t, _ in results]
    return SideResult(side, concurrency, len(results), sum(n for _, n in results), seconds,
                      percentile(ttfts, 0.5), percentile(ttfts, 0.9))


def run_side_pa(args: argparse.Namespace, side: str, model: str, prompts: list[str], concurrency: int,
                workdir: Path) -> SideResult:
    """One side at one concurrency under perf_analyzer: --pa-prompts tagged prompts (so that none repeats within a
    run, nor hits the prefix cache that another filled)."""
    batch = [prompts[i % len(prompts)] for i in range(args.pa_prompts)]
    warm, timed = tagged_prompts(side, batch, concurrency, len(batch))
    target = openai_pa.PaTarget(side, args.openai_url, args.grpc_url, model, args.api_key, args.output_tokens,
                                args.perf_analyzer)
    m = openai_pa.run_side(target, warm, timed, concurrency, args.pa_ms, args.pa_trials, args.pa_stability,
                            workdir)
    return SideResult(side, concurrency, m.requests, round(m.output_tokens), m.seconds,
                      percentile(m.ttfts_ms, 0.5), percentile(m.ttfts_ms, 0.9))


async def bench(args: argparse.Namespace, prompts: list[str], failed: list[str]) -> list[SideResult]:
    """Every side at every concurrency; a perf_analyzer run that fails is named in `failed` and skipped."""
    import openai

    from freetoken_core.serving.openai.ensemble_client import EnsembleClient

    oa = openai.AsyncOpenAI(base_url=args.openai_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    grpc = EnsembleClient(args.grpc_url)
    model = args.model or (await oa.models.list()).data[0].id
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="freetoken-bench-openai-pa-")) if args.load_generator == "perf_analyzer" \
        else None
    try:
        for c in args.concurrency:
            n = args.requests or 4 * c
            batch = [prompts[i % len(prompts)] for i in range(n)]
            warmup = min(n, max(2, c)) if args.warmup is None else args.warmup
            procs = min(c, args.client_procs)
            for side in [side for _ in range(args.rounds) for side in args.sides]:
                if workdir is not None:
                    try:
                        r = await asyncio.to_thread(run_side_pa, args, side, model, prompts, c, workdir)
                    except RuntimeError as e:  # no stable measurement: the other runs still count
                        print(f"concurrency {c}: {side:6s} not measured: {e}", flush=True)
                        failed.append(f"{side} at {c}")
                        continue
                elif procs > 1:
                    spec = ClientSpec(side, args.openai_url, args.grpc_url, args.api_key, model, args.output_tokens,
                                      args.timeout)
                    r = await asyncio.to_thread(run_side_in_processes, spec, batch, c, warmup, procs)
                else:
                    one = openai_request(oa, model, args.output_tokens) if side == "openai" else \
                        grpc_request(grpc, args.output_tokens)
                    r = await run_side(side, one, batch, c, warmup)
                clients = f"perf_analyzer, exports in {workdir}" if workdir is not None else \
                    f"{procs} client process{'es' if procs > 1 else ''}"
                print(f"concurrency {c}: {side:6s} {r.tok_s:9.1f} output tok/s, TTFT p50 {r.ttft_p50_ms:.1f} ms "
                      f"p90 {r.ttft_p90_ms:.1f} ms ({r.requests} requests, {r.output_tokens} tokens, {clients})",
                      flush=True)
                results.append(r)
    finally:
        await grpc.close()
        await oa.close()
    return results


@dataclass(frozen=True)
class Summary:
    """One side at one concurrency over its rounds: the median of each figure."""

    tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float


def summarize(results: list[SideResult]) -> Summary:
    med = statistics.median
    return Summary(med(r.tok_s for r in results), med(r.ttft_p50_ms for r in results),
                   med(r.ttft_p90_ms for r in results))


def table(results: list[SideResult]) -> str:
    """Per concurrency both sides (the medians of their rounds) and OpenAI / gRPC."""
    rounds: dict[tuple[int, str], list[SideResult]] = {}
    for r in results:
        rounds.setdefault((r.concurrency, r.side), []).append(r)
    by = {key: summarize(rs) for key, rs in rounds.items()}
    lines = ["| concurrency | gRPC tok/s | OpenAI tok/s | OpenAI / gRPC | gRPC TTFT p50 / p90 ms | "
             "OpenAI TTFT p50 / p90 ms |", "|---|---|---|---|---|---|"]
    for c in sorted({r.concurrency for r in results}):
        g, o = by.get((c, "grpc")), by.get((c, "openai"))
        ratio = f"{o.tok_s / g.tok_s:.3f}" if g and o else "-"
        lines.append(f"| {c} | {f'{g.tok_s:.1f}' if g else '-'} | {f'{o.tok_s:.1f}' if o else '-'} | {ratio} | "
                     f"{f'{g.ttft_p50_ms:.1f} / {g.ttft_p90_ms:.1f}' if g else '-'} | "
                     f"{f'{o.ttft_p50_ms:.1f} / {o.ttft_p90_ms:.1f}' if o else '-'} |")
    return "\n".join(lines)


def start_served(args: argparse.Namespace):
    """tritonserver + the OpenAI API on free ports, as `freetoken-core serve` starts them; returns the handle (its
    stop() stops both) and sets args.grpc_url / args.openai_url / args.model_path to them."""
    from bench_serving import shape_model_dir

    from freetoken_core.models.gguf import default_model_path
    from freetoken_core.serving.launch.server import free_ports, start_server
    from freetoken_core.serving.openai.process import FrontendOptions, start_frontend

    overrides = dict(pair.split("=", 1) for pair in args.param)
    model = args.serve_model
    if args.serve_shape:
        model = shape_model_dir(args.serve_shape, args.model_path or default_model_path())
        overrides["load_format"] = "dummy"
    overrides["model_path"] = args.model_path = model
    logs = Path(tempfile.gettempdir())
    handle = start_server(overrides, ready_timeout=900, log_path=logs / "freetoken-bench-openai-tritonserver.log")
    try:
        port = free_ports(1)[0]
        workers = {} if args.openai_workers is None else {"workers": args.openai_workers}
        handle.frontend = start_frontend(handle.grpc_url, handle.repo_dir,
                                         FrontendOptions(port=port, host="127.0.0.1", **workers),
                                         log_path=logs / "freetoken-bench-openai-frontend.log",
                                         metrics_url=handle.metrics_url)
    except BaseException:
        handle.stop()
        raise
    args.grpc_url, args.openai_url = handle.grpc_url, f"http://127.0.0.1:{port}/v1"
    print(f"serving {model} {overrides}: gRPC {args.grpc_url}, OpenAI {args.openai_url}", flush=True)
    return handle


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency wants positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--openai-url", default="http://127.0.0.1:9000/v1", help="the OpenAI API's base URL")
    p.add_argument("--grpc-url", default=None, help="Triton's gRPC address (host:port), the ensemble behind it")
    served = p.add_mutually_exclusive_group()
    served.add_argument("--serve-shape", choices=sorted(SHAPES), default=None,
                        help="serve random weights of this shape here (instead of --grpc-url / --openai-url)")
    served.add_argument("--serve-model", default=None, help="serve this model directory here")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="with --serve-*: a serving parameter, as `freetoken-core serve --param` (repeatable)")
    p.add_argument("--model", default=None, help="the served model's name (default: the first of /v1/models)")
    p.add_argument("--api-key", default="unused", help="the frontend's --api-key, if it has one")
    p.add_argument("--model-path", default=None,
                   help="a directory with the served model's tokenizer, to size the prompts (default: SmolLM2)")
    p.add_argument("--concurrency", type=concurrency_list, default=[1, 16, 64], help="e.g. 1,16,64")
    p.add_argument("--requests", type=int, default=None, help="timed requests per side and concurrency (4 x it)")
    p.add_argument("--warmup", type=int, default=None, help="untimed requests first (default: max(2, concurrency))")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--sides", nargs="+", choices=["grpc", "openai"], default=["grpc", "openai"])
    p.add_argument("--rounds", type=int, default=1, help="the sides in turn this many times; the table shows medians")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 1) // 8),
                   help="processes the clients of a side are spread over (at most one per stream)")
    p.add_argument("--openai-workers", type=int, default=None,
                   help="with --serve-*: the OpenAI API's worker processes (`serve --openai-workers`; default as serve's)")
    p.add_argument("--load-generator", choices=["python", "perf_analyzer"], default="python",
                   help="python: the openai SDK against tritonclient (/v1/completions); perf_analyzer: perf_analyzer "
                        "on both sides (/v1/chat/completions; --requests, --warmup, --client-procs unused)")
    p.add_argument("--perf-analyzer", default="perf_analyzer", help="the perf_analyzer binary")
    p.add_argument("--pa-ms", type=int, default=4000, help="perf_analyzer's measurement window (ms)")
    p.add_argument("--pa-trials", type=int, default=6, help="perf_analyzer's most windows to reach stability")
    p.add_argument("--pa-stability", type=int, default=10,
                   help="perf_analyzer's --stability-percentage: how far apart its last 3 windows may be")
    p.add_argument("--pa-prompts", type=int, default=16384,
                   help="distinct tagged prompts a perf_analyzer run cycles through (more than it sends: none repeats)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if bad := [pair for pair in args.param if "=" not in pair]:
        p.error(f"--param wants NAME=VALUE, got {bad[0]!r}")
    if not (args.grpc_url or args.serve_shape or args.serve_model):
        p.error("give --grpc-url (and --openai-url) of a running server, or --serve-shape / --serve-model")

    from bench_serving import make_prompts

    from freetoken_core.models.gguf import default_model_path
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    handle = start_served(args) if args.serve_shape or args.serve_model else None
    try:
        prompts = make_prompts(load_tokenizer(args.model_path or default_model_path()), 64, args.prompt_tokens)
        failed: list[str] = []
        results = asyncio.run(bench(args, prompts, failed))
    finally:
        if handle is not None:
            handle.stop()
    print(f"\n~{args.prompt_tokens} prompt / {args.output_tokens} output tokens (ignore_eos), streaming, closed loop, "
          f"load generator {args.load_generator}" + (f", medians of {args.rounds} rounds" if args.rounds > 1 else ""))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "tok_s": r.tok_s} for r in results], f, indent=2)
    if failed:
        print(f"not measured: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
