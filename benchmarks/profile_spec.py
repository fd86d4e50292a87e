"""Host-side profile of speculative decoding (where a verify step's Python time goes).

    python benchmarks/profile_spec.py --model DIR [--k 8] [--device cuda] [--dtype bfloat16]

Runs bench_spec.py's repetitive workload once to warm up, then once under cProfile, and prints
the functions with the most own time and the scheduler/spec functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from bench_spec import WORKLOADS
from freetoken_core import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=192)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
