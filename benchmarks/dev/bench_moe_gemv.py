"""Tile sweep of the MoE decode GEMVs (freetoken_core/kernels/moe_gemv.py) on a model's expert shape.

    python benchmarks/dev/bench_moe_gemv.py --shape qwen3-30b-a3b [--tokens 1,8] [--full]
    python benchmarks/dev/bench_moe_gemv.py --shape all

For each token count T it times `moe_gemv_gate_up` and `moe_gemv_down` (each program: BLOCK_N output
columns of one route, whole-K rows streamed in BLOCK_K steps; there is no split-K) over a grid of
(BLOCK_N, BLOCK_K, num_warps) at num_stages 2, then the best tile at other stage counts, and prints
the table's current config and the best one with achieved GB/s of the chosen experts' bytes, and a
`DECODE_CONFIGS` entry (kernels/fused_moe_configs.py) to paste.

Each timing is a CUDA graph of REPS calls cycling through routings that together touch every expert,
so the weights come from HBM as in a decode step, not from the L2 (8 experts of 6 MB fit in it).
Every configuration's output is checked against the plain-torch reference before it is timed.
Self-contained (no model, no other benchmark module); about 30-60 s per shape on an H200. Isolated timings
can mislead: inside the decode graph PDL launches each kernel early, so a tile of more programs than one wave
of the GPU pays there (2026-12-02: Qwen3.6's 8-warp gate/up tile). `decode_variants.py` measures a tile in the
graph; that decides the table.
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable

import torch
import triton

import bench_gemv  # noqa: E402  (its CUDA-graph timer)
from freetoken_core.kernels.moe_gemv import moe_gemv_down, moe_gemv_gate_up
from freetoken_core.kernels.fused_moe_configs import get_decode_config
from freetoken_core.kernels.fused_moe_ref import topk_softmax_ref

# name -> (experts E, hidden H, moe_intermediate I, top_k)
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    # 256 routed experts + the shared expert stacked after them: 9 routes a token, as the model runs them
    # (SharedExpertMoeBlock.fuse_shared_expert)
    "qwen3.6-35b-a3b": (256, 2048, 512, 9),
}
REPS = 64  # calls per graph
QUICK = dict(BLOCK_N=(2, 4, 8, 16), BLOCK_K=(128, 256, 512), num_warps=(4, 8))
FULL = dict(BLOCK_N=(1, 2, 4, 8, 16, 32), BLOCK_K=(64, 128, 256, 512, 1024), num_warps=(1, 2, 4, 8))
STAGES = (1, 3, 4)  # tried on the best num_stages-2 tile
TOL = dict(rtol=2e-2, atol=2e-2)
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU smoke test of this script sets cpu / float32)


def graph_time_us(fn: Callable[[int], object], reps: int = REPS) -> float:
    """fn(i) makes call i of a CUDA graph of `reps` calls; returns microseconds per call."""
    return bench_gemv.graph_time_us(fn, reps)


def routings(num_tokens: int, num_experts: int, top_k: int, count: int) -> list[torch.Tensor]:
    """`count` router-logit matrices [T, E] whose top-k walk through all experts (no ties: each row a
    permutation, so the kernel's and torch's top-k agree); consecutive calls read different weights."""
    assert num_experts % top_k == 0  # so a token's k experts never straddle two permutations
    g = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(num_experts, generator=g) for _ in range(count * num_tokens * top_k
                                                                           // num_experts + 1)])
    out, pos = [], 0
    for _ in range(count):
        rows = []
        for _ in range(num_tokens):
            chosen = order[pos: pos + top_k]
            pos += top_k
            rest = torch.tensor([e for e in torch.randperm(num_experts, generator=g).tolist()
                                 if e not in set(chosen.tolist())])
            rank = torch.cat([chosen, rest])  # chosen first, in this order
            logits = torch.empty(num_experts)
            logits[rank] = torch.linspace(4.0, -4.0, num_experts)
            rows.append(logits)
        out.append(torch.stack(rows).to(DEVICE, DTYPE))
    return out


def config_grid(full: bool) -> list[dict]:
    space = FULL if full else QUICK
    return [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=2)
            for n, k, w in itertools.product(space["BLOCK_N"], space["BLOCK_K"], space["num_warps"])]


class Problem:
    """One shape at one token count: weights, inputs, cycled routings and their reference outputs."""

    def __init__(self, shape: tuple[int, int, int, int], num_tokens: int) -> None:
        e, h, i, k = shape
        e = -(-e // k) * k  # a bank of whole k-expert routings (261 for 256 experts at k = 9): the cycle is even
        self.shape, self.num_tokens = shape, num_tokens
        g = torch.Generator().manual_seed(1)
        self.w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(DEVICE, DTYPE)
        self.w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(DEVICE, DTYPE)
        self.x = torch.randn(num_tokens, h, generator=g).to(DEVICE, DTYPE)
        count = max(2 * e // (num_tokens * k), 4)  # every expert at least twice per cycle
        self.logits = routings(num_tokens, e, k, count)
        self.routes = [topk_softmax_ref(lg, k, True) for lg in self.logits]
        self.acts = [self._act_ref(ids) for _, ids in self.routes]
        # bytes of the distinct experts each call reads (mean over the cycle)
        distinct = sum(torch.unique(ids).numel() for _, ids in self.routes) / len(self.routes)
        self.gate_up_bytes = distinct * 2 * i * h * 2
        self.down_bytes = distinct * h * i * 2

    def _act_ref(self, ids: torch.Tensor) -> torch.Tensor:
        k, inter = self.shape[3], self.shape[2]
        w = self.w13[ids.reshape(-1).long()].float()  # [T*k, 2I, H]
        h = torch.einsum("rnh,rh->rn", w, self.x.float().repeat_interleave(k, 0))
        return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]

    def down_ref(self, j: int) -> torch.Tensor:
        weights, ids = self.routes[j]
        w = self.w2[ids.reshape(-1).long()].float()  # [T*k, H, I]
        y = torch.einsum("rhi,ri->rh", w, self.acts[j]) * weights.reshape(-1, 1)
        return y.view(self.num_tokens, self.shape[3], -1).sum(1)

    def act_in(self, j: int) -> torch.Tensor:
        """The down GEMV's input: the reference act rounded to the model dtype, as the kernel's act."""
        return self.acts[j].to(DTYPE)

    def gate_up(self, cfg: dict) -> Callable[[int], object]:
        return lambda c: moe_gemv_gate_up(self.x, self.w13, self.routes[c % len(self.routes)][1], cfg)

    def down(self, cfg: dict) -> Callable[[int], object]:
        acts = [self.act_in(j) for j in range(len(self.routes))]
        return lambda c: moe_gemv_down(acts[c % len(acts)], self.w2, *self.routes[c % len(self.routes)], cfg)

    def check(self, kernel: str, cfg: dict) -> None:
        for j in range(2):
            if kernel == "gate_up":
                got, want = moe_gemv_gate_up(self.x, self.w13, self.routes[j][1], cfg), self.acts[j]
            else:
                got, want = moe_gemv_down(self.act_in(j), self.w2, *self.routes[j], cfg), self.down_ref(j)
            torch.testing.assert_close(got.float(), want, **TOL)


def sweep(p: Problem, kernel: str, full: bool) -> list[tuple[float, dict]]:
    make = p.gate_up if kernel == "gate_up" else p.down
    results = []

    def run(cfg: dict) -> None:
        try:
            p.check(kernel, cfg)
            results.append((graph_time_us(make(cfg)), cfg))
        except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:  # too large a tile for this GPU
            print(f"    skip {cfg}: {type(exc).__name__}")

    for cfg in config_grid(full):
        run(cfg)
    best = min(results, key=lambda r: r[0])[1]
    for s in STAGES:
        run(dict(best, num_stages=s))
    return sorted(results, key=lambda r: r[0])


def fmt(cfg: dict) -> str:
    return f"dict(BLOCK_N={cfg['BLOCK_N']}, BLOCK_K={cfg['BLOCK_K']}, num_warps={cfg['num_warps']}, " \
           f"num_stages={cfg['num_stages']})"


def bench_shape(name: str, tokens: list[int], full: bool) -> None:
    shape = SHAPES[name]
    e, h, i, k = shape
    table = get_decode_config(e, h, i, DTYPE)
    print(f"\n## {name}: E={e} H={h} I={i} top-{k}, bf16\n")
    print("| T | kernel | table config | us | GB/s | best config | us | GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    best_of: dict[int, dict[str, dict]] = {}
    for t in tokens:
        p = Problem(shape, t)
        best_of[t] = {}
        for kernel in ("gate_up", "down"):
            nbytes = p.gate_up_bytes if kernel == "gate_up" else p.down_bytes
            p.check(kernel, table[kernel])
            cur = graph_time_us((p.gate_up if kernel == "gate_up" else p.down)(table[kernel]))
            best_t, best_cfg = sweep(p, kernel, full)[0]
            best_of[t][kernel] = best_cfg
            print(f"| {t} | {kernel} | {fmt(table[kernel])} | {cur:.1f} | {nbytes / cur / 1e3:.0f} | "
                  f"{fmt(best_cfg)} | {best_t:.1f} | {nbytes / best_t / 1e3:.0f} |", flush=True)
    pick = best_of[1] if 1 in best_of else best_of[tokens[0]]
    print(f"\nDECODE_CONFIGS entry (the T = {1 if 1 in best_of else tokens[0]} winners):")
    print(f'    ({e}, {h}, {i}, "default"): {{"gate_up": {fmt(pick["gate_up"])},\n'
          f'        "down": {fmt(pick["down"])}}},')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=[*SHAPES, "all"])
    ap.add_argument("--tokens", default="1,8", help="comma-separated token counts (decode batch sizes)")
    ap.add_argument("--full", action="store_true", help="a larger tile grid (several minutes)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_gemv.py needs a CUDA device")
    tokens = [int(t) for t in args.tokens.split(",")]
    t0 = time.perf_counter()
    for name in SHAPES if args.shape == "all" else [args.shape]:
        bench_shape(name, tokens, args.full)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
