"""Host-side profile of speculative decoding (where a verify step's Python time goes).

    python benchmarks/dev/profile_spec.py --model DIR [--k 8] [--device cuda] [--dtype bfloat16]

Runs bench_spec.py's repetitive workload once to warm up, then once under cProfile, and prints
the functions with the most own time and the scheduler/spec functions by cumulative time.

On CUDA with the pipelined path it also times the pipelined steps without the profiler: CUDA events
around each graph replay give the device time of a step and the period between consecutive steps;
a period well above the device time means the host is what limits the step rate.
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import cProfile
import pstats
import statistics
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared bench_decode / bench_spec helpers
from bench_spec import WORKLOADS, add_rows_config_arg, apply_rows_config  # noqa: E402
from freetoken_core import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--kernels", action="store_true", help="also a torch.profiler table of device time per kernel")
    add_rows_config_arg(ap)
    args = ap.parse_args()
    apply_rows_config(args)
    llm = LLM(args.model, speculative="ngram", num_speculative_tokens=args.k, dtype=args.dtype, device=args.device,
              max_running_req=4, page_size=16, kv_cache_gb=1.0, memory_fraction=0.3)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.chat(WORKLOADS["repetitive"], params)
    prof = cProfile.Profile()
    prof.enable()
    res = llm.chat(WORKLOADS["repetitive"], params)[0]
    prof.disable()
    print(f"{len(res.token_ids)} tokens, accepted {res.spec_accepted} / proposed {res.spec_proposed}")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(r"scheduler|spec|engine|verify", 30)
    pl = llm.scheduler.spec.pipeline
    if pl is not None and pl.runner is not None:
        time_pipelined_steps(llm, pl, params)
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kp:
            llm.chat(WORKLOADS["repetitive"], params)
        print(kp.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


class ReplayTimer:
    """CUDA events around every replay of the pipeline's verify graph, while the `with` lasts."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __enter__(self) -> "ReplayTimer":
        replay = self._replay = self.runner.replay_as_captured

        def timed(bs: int) -> torch.Tensor:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(bs)
            end.record()
            self.events.append((start, end))
            return out

        self.runner.replay_as_captured = timed
        return self

    def __exit__(self, *exc) -> None:
        self.runner.replay_as_captured = self._replay
        torch.cuda.synchronize()

    def device_ms(self) -> list[float]:
        return [s.elapsed_time(e) for s, e in self.events]

    def period_ms(self) -> list[float]:
        """Start of one step to the start of the next."""
        return [a[0].elapsed_time(b[0]) for a, b in zip(self.events, self.events[1:])]


def time_pipelined_steps(llm: LLM, pl, params: SamplingParams) -> None:
    with ReplayTimer(pl.runner) as timer:
        t0 = time.perf_counter()
        res = llm.chat(WORKLOADS["repetitive"], params)[0]
        wall = time.perf_counter() - t0
    device_ms, period_ms = timer.device_ms(), timer.period_ms()
    print(f"\npipelined steps: {len(device_ms)} for {len(res.token_ids)} tokens in {wall * 1e3:.1f} ms wall")
    print(f"device time per step: median {statistics.median(device_ms):.3f} ms, mean {statistics.mean(device_ms):.3f} ms")
    if period_ms:
        print(f"step period (start to start): median {statistics.median(period_ms):.3f} ms, "
              f"mean {statistics.mean(period_ms):.3f} ms")

if __name__ == "__main__":
    main()
