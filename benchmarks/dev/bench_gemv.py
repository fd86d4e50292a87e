"""One-row GEMV (freetoken_core/kernels/gemv.py) vs cuBLAS (F.linear) on a model's weight shapes.

    python benchmarks/dev/bench_gemv.py [--shape llama-3-8b] [--fused] [--rows M] [--no-sweep]

--rows M times the multi-row kernel (`rows_gemm`, speculative verify steps: M = k + 1 rows) against
cuBLAS instead, and prints the configuration with the least time summed over the layer's weights.

Each timing cycles through copies of the weight totalling 512 MB, far past the L2, as a decode step
does (timing one weight again and again measures the L2, not HBM). Prints cuBLAS, the kernel's
default configuration and the best of a small sweep, as fractions of the copy bandwidth measured
in the same run. Results are checked against the fp32 reference first.
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared bench_decode / bench_spec helpers
from bench_decode import SHAPES, copy_bandwidth  # noqa: E402
from freetoken_core.kernels import fused_ops as triton_ops  # noqa: E402
from freetoken_core.kernels.gemv import ROWS_GEMM_CONFIG, default_config, gemv, gemv_reference, rows_gemm  # noqa: E402
from freetoken_core.kernels.norm_gemv import norm_gemv, norm_gemv_reference  # noqa: E402

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


def sweep_best(call, configs: list[dict], reps: int, best: float, best_cfg: dict) -> tuple[float, dict]:
    """The fastest of `call(i, **config)` over configs, starting from (best, best_cfg)."""
    for c in configs:
        try:
            t = graph_time_us(lambda i, c=c: call(i, **c), reps)
        except triton.runtime.errors.OutOfResources:  # tile too large for shared memory
            continue
        except Exception as e:  # noqa: BLE001  a tile this shape cannot compile (say so, sweep on)
            print(f"  (config {c} failed: {type(e).__name__})", flush=True)
            continue
        if t < best:
            best, best_cfg = t, c
    return best, best_cfg


# small-N weights (MoE routers, a shared expert's gate): N/16 programs leave most SMs idle and each one
# walks K in many dependent steps, so these tiles try 2 rows a program and long K steps
SMALL_N_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                   for bn, bk, w, s in itertools.product((2, 4), (512, 1024, 2048), (2, 4, 8), (1, 2))]


def weight_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of every one-row projection of a decode step: attention, dense MLP, the MoE router and a
    shared expert (its gate; with the shared expert stacked, FREETOKEN_FUSED_SHARED_EXPERT, the router
    has one row more), and the gated-delta-net projections of hybrid models."""
    h = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    hybrid = "linear_num_value_heads" in cfg
    q_rows = (2 if hybrid else 1) * nh * hd  # Qwen3.5/3.6 gated attention: q_proj emits [q | gate]
    shapes = {"qkv": (q_rows + 2 * nkv * hd, h), "o": (h, nh * hd)}
    if cfg.get("intermediate_size"):
        shapes["gate_up"], shapes["down"] = (2 * cfg["intermediate_size"], h), (h, cfg["intermediate_size"])
    if cfg.get("num_experts"):
        e = cfg["num_experts"]
        shapes["router"] = (e, h)
        if cfg.get("shared_expert_intermediate_size"):
            si = cfg["shared_expert_intermediate_size"]
            shapes.update({"router+shared gate": (e + 1, h), "shared gate": (1, h),
                           "shared gate_up": (2 * si, h), "shared down": (h, si)})
    if hybrid:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        shapes["gdn in_proj"] = (2 * hk * dk + 2 * hv * dv + 2 * hv, h)
        shapes["gdn out_proj"] = (h, hv * dv)
    shapes["lm_head"] = (cfg["vocab_size"], h)
    return shapes


def selected(shapes: dict, only: str) -> dict:
    """The weights named in --only (comma-separated), or all of them."""
    if not only:
        return shapes
    names = only.split(",")
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"unknown weight(s) {unknown}; this shape has {sorted(shapes)}")
    return {n: shapes[n] for n in names}


FUSED_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                 for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 3))]


def bench_fused(shape: str, bw: float, sweep: bool, only: str = "") -> None:
    """RMSNorm (+ residual add) [+ SiLU-and-mul] fused into the GEMV (`norm_gemv`) against the
    separate kernels it replaces, on the projections that follow a norm (qkv, gate_up)."""
    print("| weight | N x K | norm + gemv (+ silu) us | % bw | fused default us | % bw | best fused us | % bw | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = selected(weight_shapes(SHAPES[shape]), only)
    for name, gated in (("qkv", False), ("gate_up", True), ("shared gate_up", True), ("gdn in_proj", False)):
        if name not in shapes:
            continue
        n, k = shapes[name]
        copies = max(2, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        got = norm_gemv(x, r, g, 1e-5, ws[0], None, gated)
        want = norm_gemv_reference(x, r, g, 1e-5, ws[0], None, gated)
        err = (got[0].float() - want[0].float()).abs().max().item()
        assert err < 0.1 * want[0].float().abs().max().item(), f"{name}: max error {err}"
        pct = lambda us: 100 * n * k * 2 / (us * 1e-6) / bw  # noqa: E731
        reps = 2 * copies

        def unfused(i):
            h, _ = triton_ops.fused_add_rmsnorm(x, r, g, 1e-5)
            y = gemv(h, ws[i % copies])
            return triton_ops.silu_and_mul(y) if gated else y

        t_unfused = graph_time_us(unfused, reps)
        t_default = graph_time_us(lambda i: norm_gemv(x, r, g, 1e-5, ws[i % copies], None, gated), reps)
        best, best_cfg = sweep_best(lambda i, **c: norm_gemv(x, r, g, 1e-5, ws[i % copies], None, gated, **c),
                                    FUSED_CONFIGS if sweep else [], reps, t_default, {"default": ""})
        cfg = "/".join(str(v) for v in best_cfg.values())
        print(f"| {name} | {n} x {k} | {t_unfused:.1f} | {pct(t_unfused):.0f}% | {t_default:.1f} | {pct(t_default):.0f}% | "
              f"{best:.1f} | {pct(best):.0f}% | {cfg} | (max error {err:.3g})", flush=True)
        if gated:  # the other split: the norm kernel, then a GEMV with SiLU-and-mul fused
            def norm_then_gated(i, **c):
                h, _ = triton_ops.fused_add_rmsnorm(x, r, g, 1e-5)
                return norm_gemv(h, None, None, 1e-5, ws[i % copies], None, True, **c)

            t = graph_time_us(norm_then_gated, reps)
            tb, cb = sweep_best(norm_then_gated, FUSED_CONFIGS if sweep else [], reps, t, {})
            print(f"| {name}: norm kernel + gemv with silu | | | | {t:.1f} | {pct(t):.0f}% | {tb:.1f} | {pct(tb):.0f}% | "
                  f"{'/'.join(str(v) for v in cb.values())} |", flush=True)
        del ws


ROWS_CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
                for bn, bk, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (2, 3))]


def bench_rows(shape: str, m: int, bw: float, sweep: bool) -> None:
    print(f"| weight | N x K | cuBLAS us | % bw | rows_gemm default us | % bw | best us | best config |  ({m} rows)")
    print("|---|---|---|---|---|---|---|---|")
    totals = {i: 0.0 for i in range(len(ROWS_CONFIGS))}
    for name, (n, k) in weight_shapes(SHAPES[shape]).items():
        if name == "lm_head":  # verify rows' logits stay on cuBLAS (ParallelLMHead takes the GEMV at one row)
            continue
        copies = max(2, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(rows_gemm(x, ws[0]), gemv_reference(x, ws[0]), atol=1e-2, rtol=1e-2)
        pct = lambda us: 100 * n * k * 2 / (us * 1e-6) / bw  # noqa: E731
        reps = 2 * copies
        t_cublas = graph_time_us(lambda i: F.linear(x, ws[i % copies]), reps)
        t_default = graph_time_us(lambda i: rows_gemm(x, ws[i % copies]), reps)
        best, best_cfg = t_default, dict(ROWS_GEMM_CONFIG)
        for j, c in enumerate(ROWS_CONFIGS if sweep else []):
            try:
                t = graph_time_us(lambda i, c=c: rows_gemm(x, ws[i % copies], **c), reps)
            except triton.runtime.errors.OutOfResources:
                t = float("inf")
            totals[j] += t
            if t < best:
                best, best_cfg = t, c
        cfg = "/".join(str(v) for v in best_cfg.values())
        print(f"| {name} | {n} x {k} | {t_cublas:.1f} | {pct(t_cublas):.0f}% | {t_default:.1f} | {pct(t_default):.0f}% | "
              f"{best:.1f} | {cfg} |", flush=True)
        del ws
    if sweep:
        j = min(totals, key=totals.get)
        print(f"best configuration over the layer: {ROWS_CONFIGS[j]} ({totals[j]:.1f} us for the four weights)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--no-sweep", action="store_true", help="only cuBLAS and the default configuration")
    ap.add_argument("--fused", action="store_true", help="norm_gemv (RMSNorm fused in) against the separate kernels")
    ap.add_argument("--rows", type=int, default=0, help="time rows_gemm on this many rows instead")
    ap.add_argument("--only", default="", help="comma-separated weight names (as the table prints them)")
    args = ap.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, copy bw {bw / 1e12:.2f} TB/s, {args.shape}, one row, bf16")
    if args.fused:
        return bench_fused(args.shape, bw, not args.no_sweep, args.only)
    if args.rows:
        return bench_rows(args.shape, args.rows, bw, not args.no_sweep)
    print("| weight | N x K | cuBLAS us | % bw | gemv default us | % bw | best of sweep us | % bw | best config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in selected(weight_shapes(SHAPES[args.shape]), args.only).items():
        copies = max(2, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(gemv(x, ws[0]), gemv_reference(x, ws[0]), atol=1e-2, rtol=1e-2)
        pct = lambda us: 100 * n * k * 2 / (us * 1e-6) / bw  # noqa: E731
        reps = 2 * copies
        t_cublas = graph_time_us(lambda i: F.linear(x, ws[i % copies]), reps)
        t_default = graph_time_us(lambda i: gemv(x, ws[i % copies]), reps)
        configs = [] if args.no_sweep else CONFIGS + (SMALL_N_CONFIGS if n <= 1024 else [])
        best, best_cfg = sweep_best(lambda i, **c: gemv(x, ws[i % copies], **c), configs, reps, t_default,
                                    default_config(k))
        cfg = "/".join(str(v) for v in best_cfg.values())
        print(f"| {name} | {n} x {k} | {t_cublas:.1f} | {pct(t_cublas):.0f}% | {t_default:.1f} | {pct(t_default):.0f}% | "
              f"{best:.1f} | {pct(best):.0f}% | {cfg} |", flush=True)
        del ws


if __name__ == "__main__":
    main()
