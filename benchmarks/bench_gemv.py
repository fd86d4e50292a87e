"""One-row GEMV (freetoken_core/layers/triton_gemv.py) vs cuBLAS (F.linear) on a model's weight shapes.

    python benchmarks/bench_gemv.py [--shape llama-3-8b]

Each timing cycles through copies of the weight totalling 512 MB, far past the L2, as a decode step
does (timing one weight again and again measures the L2, not HBM). Prints cuBLAS, the kernel's
default configuration and the best of a small sweep, as fractions of the copy bandwidth measured
in the same run. Results are checked against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton

from bench_decode import SHAPES, copy_bandwidth
from freetoken_core.layers.triton_gemv import default_config, gemv, gemv_reference

CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4))]
COPIES_BYTES = 512 << 20


def graph_time_us(fn, reps: int) -> float:
    """fn(i) makes call i of a CUDA graph of `reps` calls; returns microseconds per call."""
    for i in range(3):
        fn(i)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (10 * reps) * 1e6


def weight_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    return {"qkv": ((nh + 2 * nkv) * hd, h), "o": (h, nh * hd), "gate_up": (2 * inter, h), "down": (h, inter)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the default configuration")
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, copy bw {bw / 1e12:.2f} TB/s, {args.shape}, one row, bf16")
    print("| weight | N x K | cuBLAS us | % bw | gemv default us | % bw | best of sweep us | % bw | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in weight_shapes(SHAPES[args.shape]).items():
        copies = max(2, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(gemv(x, ws[0]), gemv_reference(x, ws[0]), atol=1e-2, rtol=1e-2)
        pct = lambda us: 100 * n * k * 2 / (us * 1e-6) / bw  # noqa: E731
        reps = 2 * copies
        t_cublas = graph_time_us(lambda i: F.linear(x, ws[i % copies]), reps)
        t_default = graph_time_us(lambda i: gemv(x, ws[i % copies]), reps)
        best, best_cfg = t_default, default_config(k)
        for c in [] if args.no_sweep else CONFIGS:
            try:
                t = graph_time_us(lambda i, c=c: gemv(x, ws[i % copies], **c), reps)
            except triton.runtime.errors.OutOfResources:  # tile too large for shared memory
                continue
            if t < best:
                best, best_cfg = t, c
        cfg = "/".join(str(v) for v in best_cfg.values())
        print(f"| {name} | {n} x {k} | {t_cublas:.1f} | {pct(t_cublas):.0f}% | {t_default:.1f} | {pct(t_default):.0f}% | "
              f"{best:.1f} | {pct(best):.0f}% | {cfg} |", flush=True)
        del ws


if __name__ == "__main__":
    main()
