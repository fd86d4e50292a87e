"""Device time of one pipelined speculative verify step (n-gram drafts, k + 1 rows) on random
weights of a real model's shape, batch 1.

    python benchmarks/dev/bench_verify_step.py [--shape llama-3-8b] [--k 8] [--rows-gemm auto|all|off] [--tokens 256]

Random weights give no meaningful acceptance, but a pipelined step always scores k + 1 rows, so
its cost is measurable without a real checkpoint (profile_spec.py needs one, with a tokenizer).
CUDA events around each graph replay give the device time per step and the period between steps.

--rows-gemm picks how the verify rows' projections run: `auto` is the engine's rule (the Triton
`rows_gemm` for weights under `triton_gemv.ROWS_GEMM_MAX_ELEMENTS`, cuBLAS above), `all` sends
every weight to rows_gemm, `off` every weight to cuBLAS.
"""

from __future__ import annotations

import sys
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared bench_decode / bench_spec helpers
from bench_decode import SHAPES, write_shape  # noqa: E402
from freetoken_core.config import EngineConfig, SamplingParams  # noqa: E402
from freetoken_core.kernels import gemv as triton_gemv  # noqa: E402
from freetoken_core.scheduler.scheduler import Scheduler  # noqa: E402
from profile_spec import ReplayTimer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rows-gemm", default="auto", choices=["auto", "all", "off"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--memory-fraction", type=float, default=0.5, help="EngineConfig.memory_fraction")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: the pipelined verify step is a CUDA graph")
    if args.rows_gemm != "auto":  # the weight-size bar of the engine's rule, moved to one end
        triton_gemv.ROWS_GEMM_MAX_ELEMENTS = 0 if args.rows_gemm == "off" else 1 << 62
    model = write_shape(args.shape, Path(tempfile.mkdtemp()))
    sched = Scheduler(EngineConfig(
        model_path=str(model), load_format="dummy", dtype="bfloat16", device="cuda", max_running_req=4,
        page_size=16, kv_cache_gb=2.0, memory_fraction=args.memory_fraction, speculative="ngram", num_speculative_tokens=args.k,
    ))
    prompt = list(range(100, 140)) * 6  # repetitive: the drafter always proposes
    for _ in range(2):  # the first run warms up; the second is timed
        with ReplayTimer(sched.spec.pipeline.runner) as timer:
            sched.add_request(prompt, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
            t0 = time.perf_counter()
            while sched.has_work():
                sched.step()
            wall = time.perf_counter() - t0
    steps, device, period = len(timer.events), statistics.median(timer.device_ms()), statistics.median(timer.period_ms())
    print(f"# {torch.cuda.get_device_name()}, {args.shape} random weights, bf16, batch 1, k={args.k}, "
          f"rows_gemm {args.rows_gemm}, {time.strftime('%Y-%m-%d')}")
    print(f"{steps} pipelined steps: device {device:.3f} ms per step, period {period:.3f} ms, "
          f"{args.tokens} tokens in {wall * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
