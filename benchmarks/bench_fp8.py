"""Block-FP8 kernels (freetoken_core/kernels/fp8_*.py) against their bf16 counterparts on Qwen3-30B-A3B shapes.

    PYTHONPATH=$PWD python3 benchmarks/bench_fp8.py [--no-sweep]
    PYTHONPATH=$PWD python3 benchmarks/bench_fp8.py --tiles    the GEMM and grouped-expert tiles, both modes, per row count

One-row GEMVs and the expert decode GEMVs time inside CUDA graphs cycling through weight copies far past the L2
(bench_gemv.graph_time_us), and print the share of the copy bandwidth their weight bytes took; the prefill GEMMs
and the grouped expert GEMM print TFLOP/s beside cuBLAS / the bf16 grouped GEMM. Every kernel is checked against
its reference first.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "dev"))  # bench_gemv's CUDA-graph timer
from bench_decode import copy_bandwidth  # noqa: E402
from bench_gemv import graph_time_us, sweep_best  # noqa: E402
from freetoken_core.kernels import fp8_gemm  # noqa: E402
from freetoken_core.kernels.fp8_gemm import fp8_gemm_w8a8, fp8_gemm_weight_only  # noqa: E402
from freetoken_core.kernels.fp8_gemm_ref import fp8_gemv_reference  # noqa: E402
from freetoken_core.kernels.fp8_gemv import fp8_gemv, fp8_norm_gemv, fp8_rows_gemm  # noqa: E402
from freetoken_core.kernels.fp8_moe import fp8_fused_moe_grouped  # noqa: E402
from freetoken_core.kernels.fp8_moe_gemv import fp8_fused_moe_decode  # noqa: E402
from freetoken_core.kernels.fp8_moe_ref import fp8_fused_moe_reference  # noqa: E402
from freetoken_core.kernels.fp8_ref import quantize_block_fp8  # noqa: E402
from freetoken_core.kernels.fused_moe import fused_moe_decode, fused_moe_grouped  # noqa: E402
from freetoken_core.kernels.fused_moe_ref import topk_softmax_ref  # noqa: E402
from freetoken_core.kernels.gemv import gemv, rows_gemm  # noqa: E402
from freetoken_core.kernels.norm_gemv import norm_gemv  # noqa: E402

COPIES_BYTES = 512 << 20
GEMV_SWEEP = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s)
              for bn, bk, w, s in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (2, 4))]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err < 0.05 * want.float().abs().max().item() + 1e-3, f"{what}: max error {err}"


def gemvs(bw: float, sweep: bool) -> None:
    print("| weight | N x K | bf16 us | % bw | fp8 default us | % bw | best fp8 us | % bw | best fp8 tile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k), fused in (("qkv (norm fused)", (5120, 2048), True), ("o", (2048, 4096), False),
                                ("dense gate_up", (2 * 6144, 4096), False), ("dense down", (4096, 6144), False)):
        copies = max(2, COPIES_BYTES // (n * k * 2))
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wq = [quantize_block_fp8(w) for w in wb]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        if fused:
            _close(fp8_norm_gemv(x, None, None, 1e-6, *wq[0])[0], fp8_gemv_reference(x, *wq[0]), name)
            bf16 = graph_time_us(lambda i: norm_gemv(x, r, g, 1e-6, wb[i % copies]), 2 * copies)
            call = lambda i, **c: fp8_norm_gemv(x, r, g, 1e-6, *wq[i % copies], **c)  # noqa: E731
        else:
            _close(fp8_gemv(x, *wq[0]), fp8_gemv_reference(x, *wq[0]), name)
            bf16 = graph_time_us(lambda i: gemv(x, wb[i % copies]), 2 * copies)
            call = lambda i, **c: fp8_gemv(x, *wq[i % copies], **c)  # noqa: E731
        default = graph_time_us(call, 2 * copies)
        best, cfg = sweep_best(call, GEMV_SWEEP if sweep else [], 2 * copies, default, {})
        fp8_bytes = n * k + (n // 128) * (k // 128) * 4
        pct = lambda us, b: 100 * b / (us * 1e-6) / bw  # noqa: E731
        print(f"| {name} | {n} x {k} | {bf16:.1f} | {pct(bf16, 2 * n * k):.0f} | {default:.1f} | "
              f"{pct(default, fp8_bytes):.0f} | {best:.1f} | {pct(best, fp8_bytes):.0f} | {cfg or 'default'} |",
              flush=True)
        del wb, wq
    n, k = 5120, 2048
    copies = COPIES_BYTES // (n * k * 2)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    wq = [quantize_block_fp8(w) for w in wb]
    x = torch.randn(9, k, device="cuda", dtype=torch.bfloat16)
    _close(fp8_rows_gemm(x, *wq[0]), fp8_gemv_reference(x, *wq[0]), "rows")
    t_bf16 = graph_time_us(lambda i: rows_gemm(x, wb[i % copies]), 2 * copies)
    t_cublas = graph_time_us(lambda i: F.linear(x, wb[i % copies]), 2 * copies)
    t_fp8 = graph_time_us(lambda i: fp8_rows_gemm(x, *wq[i % copies]), 2 * copies)
    print(f"\n9 rows, {n} x {k}: rows_gemm bf16 {t_bf16:.1f} us, cuBLAS {t_cublas:.1f} us, fp8_rows_gemm {t_fp8:.1f} us")


def experts_decode(bw: float, sweep: bool) -> None:
    e, h, inter, k = 128, 2048, 768, 8
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    q13, s13 = quantize_block_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    routes = [topk_softmax_ref(torch.randn(1, e, device="cuda"), k, True) for _ in range(16)]
    w, ids = routes[0]
    _close(fp8_fused_moe_decode(x, q13, s13, q2, s2, w, ids), fp8_fused_moe_reference(x, q13, s13, q2, s2, w, ids),
           "experts")
    t_bf16 = graph_time_us(lambda i: fused_moe_decode(x, w13, w2, *routes[i % 16]), 32)
    t_fp8 = graph_time_us(lambda i: fp8_fused_moe_decode(x, q13, s13, q2, s2, *routes[i % 16]), 32)
    fp8_bytes = k * 3 * h * inter
    print(f"\nexperts T=1 (128 x 2048 x 768, k=8): bf16 {t_bf16:.1f} us ({100 * 2 * fp8_bytes / t_bf16 / 1e-6 / bw:.0f}% bw),"
          f" fp8 {t_fp8:.1f} us ({100 * fp8_bytes / t_fp8 / 1e-6 / bw:.0f}% bw)", flush=True)
    if sweep:
        tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
                 for bn, bk, wp, st in itertools.product((4, 8, 16), (256, 512, 1024), (4,), (2, 3))]
        cfg = {"gate_up": None, "down": None}
        for part in ("gate_up", "down"):  # one after the other, the other part at its best so far
            best = (float("inf"), None)
            for tile in tiles:
                trial = {**cfg, part: tile}
                if None in trial.values():
                    trial = {p: trial[p] or dict(BLOCK_N=4 if p == "gate_up" else 8, BLOCK_K=256, num_warps=4,
                                                 num_stages=2) for p in trial}
                try:
                    t = graph_time_us(lambda i: fp8_fused_moe_decode(x, q13, s13, q2, s2, *routes[i % 16],
                                                                     config=trial), 32)
                except Exception:  # noqa: BLE001  a tile that cannot compile: sweep on
                    continue
                best = min(best, (t, tile), key=lambda p: p[0])
            cfg[part] = best[1]
            print(f"best fp8 expert {part} tile: {best[0]:.1f} us ({100 * fp8_bytes / best[0] / 1e-6 / bw:.0f}% bw)"
                  f" {best[1]}", flush=True)
    for tokens in (64, 2048):
        xs = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        w, ids = topk_softmax_ref(torch.randn(tokens, e, device="cuda"), k, True)
        _close(fp8_fused_moe_grouped(xs, q13, s13, q2, s2, w, ids), fp8_fused_moe_reference(xs, q13, s13, q2, s2, w, ids),
               "grouped")
        times = {name: graph_time_us(lambda i, f=f: f(), 4) for name, f in (
            ("bf16", lambda: fused_moe_grouped(xs, w13, w2, w, ids)),
            ("fp8 weight-only", lambda: fp8_fused_moe_grouped(xs, q13, s13, q2, s2, w, ids)),
            ("fp8 w8a8", lambda: fp8_fused_moe_grouped(xs, q13, s13, q2, s2, w, ids, w8a8=True)))}
        print(f"grouped T={tokens}: " + ", ".join(f"{n} {t:.1f} us" for n, t in times.items()), flush=True)


def prefill_gemms() -> None:
    print("\n| M x N x K | cuBLAS bf16 TFLOP/s | fp8 weight-only | fp8 w8a8 (quant included) |")
    print("|---|---|---|---|")
    for m, n, k in ((8192, 5120, 2048), (8192, 2048, 4096), (2048, 12288, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_block_fp8(wb)
        _close(fp8_gemm_weight_only(a, q, s), fp8_gemv_reference(a, q, s), "weight-only")
        _close(fp8_gemm_w8a8(a, q, s), fp8_gemv_reference(a, q, s), "w8a8")
        rate = lambda fn: 2 * m * n * k / (graph_time_us(lambda i: fn(), 5) * 1e-6) / 1e12  # noqa: E731
        print(f"| {m} x {n} x {k} | {rate(lambda: F.linear(a, wb)):.0f} | {rate(lambda: fp8_gemm_weight_only(a, q, s)):.0f}"
              f" | {rate(lambda: fp8_gemm_w8a8(a, q, s)):.0f} |", flush=True)


GEMM_TILES = [dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=w, num_stages=s)
              for m, n, w, s in ((64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
                                 (256, 128, 8, 3), (128, 64, 4, 4))]
SMALL_M_GEMM_TILES = [dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=w, num_stages=s)
                      for m, n, w, s in ((16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 3),
                                         (64, 64, 4, 4), (64, 128, 4, 3))]
GROUPED_TILES = {
    64: [dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=w, num_stages=s,
              down=dict(BLOCK_SIZE_N=dn))
         for m, n, dn, w, s in ((16, 128, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 8, 3), (32, 64, 128, 4, 4),
                                (16, 64, 64, 4, 5), (32, 128, 128, 8, 3))],
    8192: [dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n, BLOCK_SIZE_K=128, GROUP_SIZE_M=g, num_warps=w, num_stages=s,
                down=dict(BLOCK_SIZE_N=dn))
           for m, n, dn, g, w, s in ((64, 64, 128, 8, 4, 3), (64, 128, 128, 8, 8, 3), (128, 64, 128, 8, 8, 3),
                                     (128, 128, 128, 8, 8, 3), (128, 64, 128, 16, 8, 4), (64, 64, 64, 1, 4, 4))],
}


def tiles() -> None:
    """The dense GEMM's and the grouped expert GEMM's tiles, weight-only and w8a8, at the row counts of a batch-64
    decode step and an 8,192-token prefill, beside the bf16 paths they replace (Qwen3-30B-A3B shapes)."""
    print("\n| GEMM M x N x K | bf16 cuBLAS us | mode | default tile us | best tile us | best tile |")
    print("|---|---|---|---|---|---|")
    for m, n, k in ((64, 5120, 2048), (64, 2048, 4096), (8192, 5120, 2048), (8192, 2048, 4096)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_block_fp8(wb)
        t_bf16 = graph_time_us(lambda i: F.linear(a, wb), 5)
        for mode, fn in (("weight-only", fp8_gemm_weight_only), ("w8a8", fp8_gemm_w8a8)):
            _close(fn(a, q, s), fp8_gemv_reference(a, q, s), mode)
            call = lambda i, fn=fn, **c: fn(a, q, s, config=c or None)  # noqa: E731
            default = graph_time_us(call, 5)
            best, cfg = sweep_best(call, SMALL_M_GEMM_TILES if m < fp8_gemm.FEW_ROWS else GEMM_TILES, 5, default, {})
            print(f"| {m} x {n} x {k} | {t_bf16:.1f} | {mode} | {default:.1f} | {best:.1f} | {cfg or 'default'} |",
                  flush=True)
        if fp8_gemm.block_scaled_mm_supported(a, q, (128, 128)):
            _close(fp8_gemm.fp8_block_scaled_mm(a, q, s), fp8_gemv_reference(a, q, s), "block-scaled")
            t = graph_time_us(lambda i: fp8_gemm.fp8_block_scaled_mm(a, q, s), 5)
            print(f"| {m} x {n} x {k} | {t_bf16:.1f} | torch scaled_mm 1x128/128x128 | {t:.1f} | | |", flush=True)
    e, h, inter, top_k = 128, 2048, 768, 8
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * inter ** -0.5
    q13, s13 = quantize_block_fp8(w13)
    q2, s2 = quantize_block_fp8(w2)
    print("\n| experts, tokens | bf16 grouped us | mode | default tile us | best tile us | best tile |")
    print("|---|---|---|---|---|---|")
    for tokens, candidates in GROUPED_TILES.items():
        xs = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        w, ids = topk_softmax_ref(torch.randn(tokens, e, device="cuda"), top_k, True)
        t_bf16 = graph_time_us(lambda i: fused_moe_grouped(xs, w13, w2, w, ids), 4)
        for w8a8 in (False, True):
            call = lambda i, w8a8=w8a8, **c: fp8_fused_moe_grouped(xs, q13, s13, q2, s2, w, ids,  # noqa: E731
                                                                  config=c or None, w8a8=w8a8)
            _close(call(0), fp8_fused_moe_reference(xs, q13, s13, q2, s2, w, ids), "grouped")
            default = graph_time_us(call, 4)
            best, cfg = sweep_best(call, candidates, 4, default, {})
            print(f"| 128 x 2048 x 768, T={tokens} | {t_bf16:.1f} | {'w8a8' if w8a8 else 'weight-only'} | "
                  f"{default:.1f} | {best:.1f} | {cfg or 'default'} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--tiles", action="store_true", help="only the GEMM and grouped-expert tile sweep (both modes)")
    args = p.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"copy {bw / 1e12:.2f} TB/s")
    if args.tiles:
        tiles()
        return
    gemvs(bw, not args.no_sweep)
    experts_decode(bw, not args.no_sweep)
    prefill_gemms()


if __name__ == "__main__":
    main()
