"""Launch configurations of the fused-MoE kernels (`fused_moe.py`, `moe_gemv.py`), per weight shape and
batch size.

Plain Python (no Triton import), like vLLM's per-device JSON files but a dict in the repo. Keys are
(E, H, I, dtype name) with the dtype name as torch spells it ("bfloat16", "float16", "float32") or
"default" for any dtype; each value maps a token count T to a grouped-GEMM config, and a lookup takes
the bucket nearest to T (vLLM's rule).

A grouped config holds the tile of both GEMMs: BLOCK_SIZE_M (rows of one expert's group: also the
alignment of `moe_align_block_size`, so it must be shared by both), BLOCK_SIZE_N, BLOCK_SIZE_K,
GROUP_SIZE_M, num_warps, num_stages. The first GEMM computes SiLU(gate) * up in one pass, so its
BLOCK_SIZE_N counts output (act) columns and each program multiplies 2 * BLOCK_SIZE_N weight rows; an
optional "down" dict overrides N/K/GROUP/warps/stages for the second GEMM.

ENTRIES ARE TO BE SET BY MEASUREMENT ON THE H200 (benchmarks/dev/bench_moe_gemv.py). The one shape below is
seeded from vLLM's tuned H200 table for E=128, N=768 (its unfused kernel; BLOCK_SIZE_N halved for our
gated first GEMM, which keeps its grid and its work per program the same), not swept here; it was checked
no slower than `default_grouped_config` up to T = 512 and faster at T = 2048 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from typing import Any

from ..env import triton_interpreted

Config = dict[str, Any]

# T at or below this goes to the decode path (per-route GEMVs reading only the chosen experts); above
# it, the grouped GEMM: the decode path was faster up to T = 8 on Qwen3-30B-A3B, keeps the PDL chain and
# needs 2 launches instead of 5 (to be confirmed by benchmarks/dev/bench_moe_gemv.py).
DECODE_MAX_TOKENS = 8


def _seed(m: int, n: int, k: int, group: int, warps: int, stages: int) -> Config:
    return dict(BLOCK_SIZE_M=m, BLOCK_SIZE_N=n // 2, BLOCK_SIZE_K=k, GROUP_SIZE_M=group, num_warps=warps,
                num_stages=stages, down=dict(BLOCK_SIZE_N=n))


GROUPED_CONFIGS: dict[tuple[int, int, int, str], dict[int, Config]] = {
    # Qwen3-30B-A3B (128 experts, hidden 2048, moe_intermediate 768): seeded, see the module docstring
    (128, 2048, 768, "default"): {
        1: _seed(16, 64, 64, 1, 4, 5),
        8: _seed(16, 64, 128, 1, 4, 3),
        16: _seed(16, 64, 256, 1, 4, 2),
        32: _seed(16, 64, 128, 16, 4, 2),
        64: _seed(16, 256, 128, 1, 8, 2),
        128: _seed(16, 128, 128, 1, 4, 2),
        256: _seed(32, 256, 128, 16, 4, 2),
        512: _seed(64, 128, 64, 1, 4, 3),
        1024: _seed(128, 256, 64, 16, 8, 4),
        2048: _seed(128, 256, 64, 1, 8, 4),
        4096: _seed(128, 256, 64, 16, 8, 4),
    },
}

# Decode path: (E, H, I, dtype name) -> {"gate_up": ..., "down": ...}, each with BLOCK_N (output
# columns per program), BLOCK_K, num_warps, num_stages; "down" may say how it covers the routes
# (`down_routes`), and a route loop with one K chunk a route how many routes load before the PDL wait
# ("early", default 1; kernels/moe_gemv.py). To be set by
# measurement on the H200 (benchmarks/dev/bench_moe_gemv.py --shape all prints the entries;
# a tile measured inside the decode graph decides: benchmarks/dev/ab_decode.py).
DECODE_CONFIGS: dict[tuple[int, int, int, str], dict[str, Config]] = {
    # the best tiles of a benchmarks/dev/bench_moe_gemv.py sweep (T = 1, k = 8, inside a CUDA graph)
    (128, 2048, 768, "default"): {"gate_up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=2),
                                  "down": dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=2)},
    # Qwen3.6-35B-A3B (256 experts of 512, the shared expert stacked as a 9th route): chosen inside the batch-1
    # decode graph, where the route loop (9 routes pad to 16 lanes in the all-routes tile) with 4 routes loaded
    # early was fastest (Qwen3.6 decode-tile row of benchmarks/RESULTS.md).
    (256, 2048, 512, "default"): {"gate_up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=2),
                                  "down": dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3, routes="loop",
                                               early=4)},
}


# Block-FP8 experts run w8a8 (kernels/fp8_moe.py): the best tiles of a `benchmarks/bench_fp8.py --tiles` sweep on
# Qwen3-30B-A3B's experts at 64 and 8,192 tokens (H100; RESULTS, "Block-FP8"), for every expert shape; below
# FP8_LARGE_TOKENS the few-rows tile (an expert's group holds a handful of routes)
FP8_LARGE_TOKENS = 512
FP8_GROUPED_FEW_CONFIG: Config = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                                      num_stages=4, down=dict(BLOCK_SIZE_N=128))
FP8_GROUPED_LARGE_CONFIG: Config = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8,
                                        num_warps=4, num_stages=3, down=dict(BLOCK_SIZE_N=128))


def fp8_grouped_config(num_tokens: int) -> Config:
    """The w8a8 FP8 grouped GEMM's tile for T = num_tokens (the interpreter's small tiles on CPU)."""
    if triton_interpreted():
        return default_grouped_config(num_tokens)
    return FP8_GROUPED_FEW_CONFIG if num_tokens < FP8_LARGE_TOKENS else FP8_GROUPED_LARGE_CONFIG


def down_routes(tile: Config, top_k: int) -> str:
    """How the down GEMV covers a token's k routes: "tile" (all routes' rows in one [k, N, K] tile, k padded
    to a power of two) or "loop" (one route's rows at a time, pipelined). The tile's "routes" entry, else
    "tile" where k is a power of two (nothing padded; faster on Qwen3-30B-A3B) and "loop" where it is not."""
    return tile.get("routes") or ("tile" if top_k & (top_k - 1) == 0 else "loop")


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> "bfloat16" (the table's spelling), without importing torch here."""
    return str(dtype).removeprefix("torch.")


def _lookup(table: dict, e: int, h: int, i: int, dtype: Any) -> Any:
    return table.get((e, h, i, dtype_name(dtype))) or table.get((e, h, i, "default"))


def default_grouped_config(num_tokens: int) -> Config:
    """Shape-agnostic defaults: small M tiles while most experts see few rows (each expert's group is
    padded to BLOCK_SIZE_M), larger tiles and L2-friendly grouping once the groups fill up."""
    if triton_interpreted():  # CPU tests: small tiles keep the interpreter fast; 16 is tl.dot's minimum
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=1, num_warps=4, num_stages=1)
    if num_tokens <= 32:
        return dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3,
                    down=dict(BLOCK_SIZE_N=64))
    if num_tokens <= 256:
        return dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=4, num_stages=3,
                    down=dict(BLOCK_SIZE_N=128))
    return dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=8, num_stages=3,
                down=dict(BLOCK_SIZE_N=128))


def get_config(num_experts: int, hidden: int, inter: int, num_tokens: int, dtype: Any) -> Config:
    """The grouped-GEMM config for T = num_tokens: the table's nearest bucket, else the defaults."""
    buckets = None if triton_interpreted() else _lookup(GROUPED_CONFIGS, num_experts, hidden, inter, dtype)
    if not buckets:
        return default_grouped_config(num_tokens)
    return buckets[min(buckets, key=lambda t: abs(t - num_tokens))]


def down_config(config: Config) -> Config:
    """The second GEMM's config: the first's with its "down" overrides (BLOCK_SIZE_M stays shared)."""
    down = {k: v for k, v in config.items() if k != "down"}
    down.update(config.get("down", {}))
    if down["BLOCK_SIZE_M"] != config["BLOCK_SIZE_M"]:
        raise ValueError("the down GEMM must use the gate/up GEMM's BLOCK_SIZE_M (the alignment block)")
    return down


def get_decode_config(num_experts: int, hidden: int, inter: int, dtype: Any) -> dict[str, Config]:
    """The decode path's GEMV tiles: each program owns BLOCK_N output columns of one route and streams
    that expert's rows over the whole K in BLOCK_K steps, reducing once at the end (as kernels/gemv.py)."""
    found = None if triton_interpreted() else _lookup(DECODE_CONFIGS, num_experts, hidden, inter, dtype)
    if not found and not triton_interpreted():
        # A program's work depends on (H, I) only, not on how many experts the stack holds: a shared expert
        # stacked after the routed ones (E + 1 experts) keeps the routed shape's measured tile.
        found = next((tiles for (_, h, i, name), tiles in DECODE_CONFIGS.items()
                      if (h, i) == (hidden, inter) and name in (dtype_name(dtype), "default")), None)
    if found:
        return found
    if triton_interpreted():
        tile = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
        return {"gate_up": tile, "down": tile}
    # the Qwen3-30B-A3B measurement above: small BLOCK_N gives many programs, each streaming whole rows
    return {"gate_up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=2),
            "down": dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=2)}
