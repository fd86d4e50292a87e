"""Attention of a mixed step (`mixed_prefill`): decoders' one-row requests beside an arriving prompt.

    python benchmarks/dev/bench_mixed_attention.py [--shapes smollm2-135m,llama-3.2-1b] [--decoders 64]
        [--contexts 128,1024] [--prompt 128] [--slots 129]

Served load mixes every arriving prompt into a step of the running requests' decode rows, and that step's
attention is one extend-kernel launch (attention/triton/extend.py) over the prefill graph's request slots.
Per shape and decoders' context, microseconds per launch (a CUDA graph of launches over `--layers` copies of
the cache, so the keys come from HBM as in a step, not from L2):

- extend, one-row requests grouped: the default (a KV head's query heads in one program);
- extend, a program per query head: the kernel before the grouping (`group_rows=False`);
- decode kernel, the decoders alone: what their rows cost in a decode step (the floor to compare with).

The grouped and ungrouped outputs are checked against each other first.
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared bench_decode / bench_spec helpers
from bench_decode import SHAPES  # noqa: E402
from bench_gemv import graph_time_us  # noqa: E402
from freetoken_core.attention.triton.decode import alloc_partials, alloc_split_counters, decode_attention, num_kv_splits  # noqa: E402
from freetoken_core.attention.triton.extend import extend_attention  # noqa: E402
from freetoken_core.engine.prefill_graph import prefill_graph_buckets  # noqa: E402
from freetoken_core.models.blocks import head_dim_of  # noqa: E402

PAGE_SIZE = 16


def run_shape(name: str, decoders: int, context: int, prompt: int, slots: int, layers: int) -> str:
    config = SimpleNamespace(**SHAPES[name])
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
    dev, dt = torch.device("cuda"), torch.bfloat16
    # decoders: `context` cached keys + their one row; the prompt: no prefix, `prompt` rows
    prefix = [context] * decoders + [0]
    ext = [1] * decoders + [prompt]
    pages_per_req = -(-(max(p + e for p, e in zip(prefix, ext))) // PAGE_SIZE)
    n_req = len(prefix)
    num_pages = n_req * pages_per_req + 1
    caches = [(torch.randn(num_pages, PAGE_SIZE, kv_heads, dim, device=dev, dtype=dt),
               torch.randn(num_pages, PAGE_SIZE, kv_heads, dim, device=dev, dtype=dt)) for _ in range(layers)]
    table = torch.arange(1, n_req * pages_per_req + 1, device=dev, dtype=torch.int32).view(n_req, pages_per_req)
    rows = sum(ext)
    bucket = next(b for b in prefill_graph_buckets(max(512, rows)) if b >= rows)
    q = torch.randn(bucket, heads, dim, device=dev, dtype=dt)
    # the prefill graph's slots: the real requests, then slots without rows (their programs exit at once)
    pad = slots - n_req
    ints = lambda xs: torch.tensor(xs, device=dev, dtype=torch.int32)  # noqa: E731
    starts = [sum(ext[:i]) for i in range(n_req)]
    t_rows = ints(list(range(n_req)) + [0] * pad)
    t_prefix, t_ext, t_starts = ints(prefix + [0] * pad), ints(ext + [0] * pad), ints(starts + [0] * pad)
    scale = dim ** -0.5

    def extend(i: int, group_rows: bool) -> torch.Tensor:
        k, v = caches[i % layers]
        return extend_attention(q, k, v, table, t_rows, t_prefix, t_ext, t_starts, bucket, scale,
                                group_rows=group_rows)

    grouped, ungrouped = extend(0, True), extend(0, False)
    torch.cuda.synchronize()
    err = (grouped[:rows].float() - ungrouped[:rows].float()).abs().max().item()
    assert err < 3e-2, f"{name}: grouped and ungrouped extend differ by {err}"

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = num_kv_splits(decoders, kv_heads, context + 1, sms)
    part_out, part_lse = alloc_partials(decoders, heads, splits, dim, dev) if splits > 1 else (None, None)
    counters = alloc_split_counters(decoders, kv_heads, dev) if splits > 1 else None
    dq, d_rows, d_lens = q[:decoders], t_rows[:decoders], ints([context + 1] * decoders)

    def decode(i: int) -> torch.Tensor:
        k, v = caches[i % layers]
        return decode_attention(dq, k, v, table, d_rows, d_lens, scale, num_splits=splits, part_out=part_out,
                                part_lse=part_lse, split_counters=counters)

    reps = 4 * layers
    t_grouped = graph_time_us(lambda i: extend(i, True), reps)
    t_ungrouped = graph_time_us(lambda i: extend(i, False), reps)
    t_decode = graph_time_us(decode, reps)
    return (f"| {name} | {heads} / {kv_heads} x {dim} | {decoders} x {context} + {prompt} | {t_grouped:.1f} | "
            f"{t_ungrouped:.1f} | {t_decode:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--decoders", type=int, default=64)
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--slots", type=int, default=129, help="the prefill graph's request slots (max_running_req + 1)")
    ap.add_argument("--layers", type=int, default=8, help="cache copies cycled through (keys from HBM)")
    args = ap.parse_args()
    print(f"# mixed-step attention: {torch.cuda.get_device_name()}, bf16, page size {PAGE_SIZE}, us per launch")
    print("| shape | heads / KV heads x dim | decoders x context + prompt | extend, grouped one-row | "
          "extend, a program per head | decode kernel, decoders alone |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            print(run_shape(name, args.decoders, context, args.prompt, args.slots, args.layers), flush=True)


if __name__ == "__main__":
    main()
