"""Tile sweep of the gated-delta-net decode recurrence (freetoken_core/kernels/gdn.py
`gdn_recurrent_update`) on the Qwen3.6-35B-A3B shape, timed as the layer calls it: raw gates
(`gating=`) and the gated output norm (`out_norm=`), so a tile that covers dv (BV = 128, the norm in
the kernel's epilogue) competes with smaller tiles plus the separate norm launch.

    python benchmarks/dev/bench_gdn.py [--batches 1,8,64] [--rows 1] [--budget-s 45]

Per layer and request the fp32 state is [32 v-heads, 128, 128] = 2 MiB, read and written once per
decode step: that traffic is the floor, and GB/s below counts it alone. Each timing is a CUDA graph
of calls cycling through state slots totalling 512 MiB, far past the L2 (a real step streams 40
layers' weights between two visits of one layer's state). Every configuration is checked against
the plain-torch reference (`gdn_recurrent_update_ref`) before it is timed. Prints each batch's table
and best tile, then rows to paste into `GDN_UPDATE_CONFIGS`.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

from freetoken_core.kernels import gdn
from freetoken_core.kernels.gdn_ref import gdn_recurrent_update_ref

HK, HV, DK, DV = 16, 32, 128, 128  # Qwen3.6-35B-A3B's GDN layers
STATE_BYTES = HV * DK * DV * 4  # one request's fp32 state of one layer
CYCLE_BYTES = 512 << 20
BLOCK_V = (8, 16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
MAX_STATE_PER_THREAD = 128  # fp32 state elements each thread holds: more spills registers


def tiles() -> list[tuple[int, int]]:
    """(BV, warps) pairs whose [dk, BV] state block fits the registers of `warps` warps."""
    return [(bv, w) for bv in BLOCK_V for w in WARPS
            if 4 <= DK * bv // (32 * w) <= MAX_STATE_PER_THREAD]


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    torch.cuda.synchronize()
    return 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


class Case:
    """Inputs of one batch size: B requests x R rows, a pool of `cycle` slot groups of B slots each."""

    def __init__(self, B: int, R: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(B)
        dev, bf = "cuda", torch.bfloat16

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)

        self.B, self.R, T = B, R, B * R
        self.q, self.k, self.v = randn(T, HK, DK), randn(T, HK, DK), randn(T, HV, DV)
        self.a, self.b = randn(T, HV, scale=2.0), randn(T, HV, scale=2.0)
        self.A_log = torch.rand(HV, generator=g, device=dev).mul(16).add(0.01).log().to(bf)
        self.dt_bias = randn(HV)
        self.norm_w, self.z = (1 + 0.3 * torch.randn(DV, generator=g, device=dev)).to(bf), randn(T, HV, DV)
        self.cycle = max(2, CYCLE_BYTES // (B * STATE_BYTES))
        self.pool = 0.5 * torch.randn(self.cycle * B, HV, DK, DV, generator=g, device=dev)
        self.slots = [torch.arange(i * B, (i + 1) * B, device=dev, dtype=torch.int32) for i in range(self.cycle)]
        self.num_rows = torch.full((B,), R, device=dev, dtype=torch.int32)
        self.kw = dict(gating=(self.A_log, self.dt_bias), out_norm=(self.norm_w, self.z, 1e-6))

    def call(self, i: int, pool: torch.Tensor | None = None, **tile) -> torch.Tensor:
        return gdn.gdn_recurrent_update(self.q, self.k, self.v, self.a, self.b, self.pool if pool is None else pool,
                                        self.slots[i % self.cycle] if pool is None else self.slots[0],
                                        self.num_rows, self.R, True, **self.kw, **tile)

    def check(self, **tile) -> str | None:
        """None when the tile's outputs and state equal the reference's (bf16 / fp32 tolerances)."""
        pool, pool_ref = self.pool[: self.B].clone(), self.pool[: self.B].clone()
        o = self.call(0, pool, **tile)
        o_ref = gdn_recurrent_update_ref(self.q, self.k, self.v, self.a, self.b, pool_ref, self.slots[0],
                                         self.num_rows, self.R, True, **self.kw)
        try:
            torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(pool, pool_ref, atol=1e-4, rtol=1e-4)
        except AssertionError as e:
            return str(e).splitlines()[0]
        return None

    def time_us(self, **tile) -> float:
        """Microseconds per call in a CUDA graph of `cycle` calls over distinct slots."""
        for i in range(2):
            self.call(i, **tile)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(self.cycle):
                self.call(i, **tile)
        graph.replay()
        torch.cuda.synchronize()
        reps = max(3, 2000 // self.cycle)
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (reps * self.cycle) * 1e6


def run_batch(case: Case, candidates: list[tuple[int, int, int]], deadline: float) -> dict:
    """{(BV, warps, stages): us} of the candidates correct at this batch, while time is left."""
    results: dict[tuple[int, int, int], float] = {}

    def measure(bv: int, warps: int, stages: int) -> None:
        tile = dict(block_v=bv, num_warps=warps, num_stages=stages)
        try:
            err = case.check(**tile)
        except triton.runtime.errors.OutOfResources as e:
            print(f"  BV={bv:3d} warps={warps} stages={stages}: out of resources ({e})")
            return
        if err is not None:
            print(f"  BV={bv:3d} warps={warps} stages={stages}: WRONG at batch {case.B}, skipped ({err})")
            return
        results[(bv, warps, stages)] = case.time_us(**tile)

    for bv, warps, stages in candidates:
        if time.perf_counter() > deadline:
            print(f"  (time budget spent: {len(results)} of {len(candidates)} tiles measured at batch {case.B})")
            break
        measure(bv, warps, stages)
    # num_stages pipelines the row loop only (R > 1 rows per request); at R = 1 one try on the best tile
    top = sorted(results.items(), key=lambda kv: kv[1])[: 3 if case.R > 1 else 1]
    for (bv, warps, stages0), _ in top:
        for stages in ((1, 2) if case.R > 1 else (1,)):
            if stages != stages0 and (bv, warps, stages) not in results and time.perf_counter() < deadline:
                measure(bv, warps, stages)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,64", help="requests per decode step, comma-separated")
    p.add_argument("--rows", type=int, default=1, help="rows per request (speculative verify: k + 1)")
    p.add_argument("--budget-s", type=float, default=45.0,
                   help="stop starting new tiles after this many seconds of sweep")
    args = p.parse_args()
    assert torch.cuda.is_available(), "bench_gdn.py needs a GPU"
    start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s; Qwen3.6 GDN layer: Hk={HK} Hv={HV} "
          f"dk={DK} dv={DV}, bf16 activations, fp32 state, rows per request {args.rows}; "
          f"tiles {tiles()} (BV, warps)")
    cases = {B: Case(B, args.rows) for B in batches}
    # compile every tile first (on the first batch, checking it there): the kernels are the same at every batch
    candidates = []
    for bv, warps in tiles():
        try:
            err = cases[batches[0]].check(block_v=bv, num_warps=warps, num_stages=3)
        except triton.runtime.errors.OutOfResources as e:
            err = f"out of resources ({e})"
        if err is None:
            candidates.append((bv, warps, 3))
        else:
            print(f"  BV={bv:3d} warps={warps}: skipped ({err})")
    print(f"compiled and checked {len(candidates)} tiles in {time.perf_counter() - start:.0f} s")
    best_rows = []
    for n, B in enumerate(batches):
        case = cases[B]
        # an even share of the remaining budget per batch
        deadline = time.perf_counter() + (args.budget_s - (time.perf_counter() - start)) / (len(batches) - n)
        results = run_batch(case, candidates, deadline)
        current_tile = gdn._gdn_config(B, HV, DV, False)
        current_us = case.time_us(block_v=current_tile[0], num_warps=current_tile[1], num_stages=current_tile[2])
        gbytes = 2 * B * STATE_BYTES / 1e9  # state read + written
        print(f"\nbatch {B} ({B * HV} programs before the dv split; state traffic {gbytes * 1e3:.1f} MB per call)")
        print(f"  {'BV':>4} {'warps':>5} {'stages':>6} {'us':>8} {'GB/s':>7} {'of copy':>7}  norm")
        for (bv, warps, stages), us in sorted(results.items(), key=lambda kv: kv[1]):
            norm = "fused epilogue" if bv >= DV else "separate launch"
            gbs = gbytes / us * 1e6
            print(f"  {bv:4d} {warps:5d} {stages:6d} {us:8.2f} {gbs:7.0f} {gbs / bw:7.0%}  {norm}")
        print(f"  current table (BV={current_tile[0]}, warps={current_tile[1]}, stages={current_tile[2]}): "
              f"{current_us:.2f} us")
        if results:
            (bv, warps, stages), us = min(results.items(), key=lambda kv: kv[1])
            print(f"  best: BV={bv} warps={warps} stages={stages}: {us:.2f} us, {gbytes / us * 1e6:.0f} GB/s")
            best_rows.append((B, bv, warps, stages, us, gbytes / us * 1e6))
    print("\nGDN_UPDATE_CONFIGS rows for freetoken_core/kernels/gdn.py (max B * Hv, BV, num_warps, num_stages):")
    for n, (B, bv, warps, stages, us, gbs) in enumerate(best_rows):
        bound = "1 << 62" if n == len(best_rows) - 1 else str(B * HV)
        print(f"    ({bound}, {bv}, {warps}, {stages}),  # batch {B} of Qwen3.6: {us:.1f} us, {gbs:.0f} GB/s")
    print(f"(sweep took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
