"""The fused batch-1 decode + o_proj launch (attention/triton/decode_oproj.py, FREETOKEN_ATTN_OPROJ_FUSED) against
the launches it replaces, at Qwen3-30B-A3B's attention shape, inside a CUDA graph with PDL as in the model.

    PYTHONPATH=$PWD python3 benchmarks/bench_decode_oproj.py [--lens 17,144,272] [--max-seq-len 288]
        [--page-size 1] [--tiles 8/1024/4096/4/32,16/1024/4096/8/64]

One call of the graph is one layer's chain: the QKV GEMV with its RMSNorm (`norm_gemv`, so the fused launch
overlaps its tail as in the model), then either
  unfused: q/k norm + rotary storing K/V, split-KV decode attention (+ its merge launch), the o_proj GEMV; or
  fused:   the one launch, with each tile of --tiles (rows / block_k / pre_k / warps / keys an attention step).
The weights and K/V caches cycle through LAYERS copies (more bytes than the L2 holds), so they come from HBM.
The split count comes from --max-seq-len as the engine's graphs take it. Every tile's output is checked
against the unfused chain's before it is timed. Prints microseconds a layer, and what the difference comes to
over the 30B's 48 layers. An isolated chain: `decode_variants.py env:FREETOKEN_ATTN_OPROJ_FUSED=1` measures
the whole decode step, which decides.
"""

from __future__ import annotations

import argparse

import torch

import bench_gemv  # noqa: E402  (its CUDA-graph timer)
from freetoken_core.attention.triton.decode import alloc_partials, alloc_split_counters, decode_attention, num_kv_splits
from freetoken_core.attention.triton.decode_oproj import alloc_oproj_scratch, decode_attention_oproj, oproj_config
from freetoken_core.kernels.gemv import gemv
from freetoken_core.kernels.norm_gemv import norm_gemv
from freetoken_core.kernels.qk_norm_rotary import qk_norm_rotary
from freetoken_core.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS_OF_30B = 32, 4, 128, 2048, 48
LAYERS = 16  # weight copies cycled: 16 x 38 MB
REPS = 64
EPS = 1e-6
DEVICE, DTYPE = "cuda", torch.bfloat16  # (a CPU smoke run of the checks sets cpu / float32)


class Chain:
    def __init__(self, max_seq_len: int, page_size: int) -> None:
        dev, dt = DEVICE, DTYPE
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

        qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.w_qkv = [rand(qkv_rows, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(LAYERS)]
        self.w_o = [rand(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5) for _ in range(LAYERS)]
        self.x, self.residual, self.norm_w = rand(1, HIDDEN), rand(1, HIDDEN), 1.0 + rand(HIDDEN, scale=0.1)
        self.q_w, self.k_w = 1.0 + rand(HEAD_DIM, scale=0.1), 1.0 + rand(HEAD_DIM, scale=0.1)
        pages = -(-max_seq_len // page_size) + 1
        self.k_cache = [rand(pages, page_size, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.v_cache = [rand(pages, page_size, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
        self.page_table = torch.arange(1, pages + 1, dtype=torch.int32, device=dev).clamp(max=pages - 1)[None].repeat(2, 1)
        self.page_size = page_size
        self.table_rows = torch.zeros(1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out_loc = torch.zeros(1, dtype=torch.int64, device=dev)
        params = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0}
        self.rope = RotaryEmbedding(HEAD_DIM, max_seq_len + 1, params, dt).to(dev)
        sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 132
        self.splits = num_kv_splits(1, KV_HEADS, max_seq_len, sms)
        self.part_out, self.part_lse = alloc_partials(1, HEADS, self.splits, HEAD_DIM, dev)
        self.counters = alloc_split_counters(1, KV_HEADS, dev)
        self.o_buf, self.flags = alloc_oproj_scratch(HEADS, HEAD_DIM, dev)

    def set_length(self, n: int) -> None:
        self.seq_lens.fill_(n)
        self.positions.fill_(n - 1)
        self.out_loc.fill_(int(self.page_table[0, (n - 1) // self.page_size]) * self.page_size + (n - 1) % self.page_size)

    def qkv(self, i: int) -> torch.Tensor:
        return norm_gemv(self.x, self.residual, self.norm_w, EPS, self.w_qkv[i % LAYERS])[0]

    def unfused(self, i: int) -> torch.Tensor:
        qkv, layer = self.qkv(i), i % LAYERS
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k = qk_norm_rotary(self.positions, q.view(1, HEADS, HEAD_DIM), k.view(1, KV_HEADS, HEAD_DIM), self.q_w,
                              self.k_w, EPS, EPS, self.rope.cos_sin_cache, HEAD_DIM, v=v.view(1, KV_HEADS, HEAD_DIM),
                              kv_out=(self.k_cache[layer], self.v_cache[layer], self.out_loc))
        multi = self.splits > 1
        o = decode_attention(q, self.k_cache[layer], self.v_cache[layer], self.page_table, self.table_rows,
                             self.seq_lens, HEAD_DIM ** -0.5, num_splits=self.splits,
                             part_out=self.part_out if multi else None, part_lse=self.part_lse if multi else None,
                             split_counters=self.counters if multi else None)
        return gemv(o.view(1, -1), self.w_o[i % LAYERS])

    def fused(self, i: int, tile: dict) -> torch.Tensor:
        qkv, layer = self.qkv(i), i % LAYERS
        multi = self.splits > 1
        return decode_attention_oproj(
            qkv, self.positions, HEADS, KV_HEADS, self.q_w, self.k_w, EPS, EPS, self.rope.cos_sin_cache, False,
            self.k_cache[layer], self.v_cache[layer], self.page_table, self.table_rows, self.seq_lens, self.out_loc,
            HEAD_DIM ** -0.5, self.w_o[layer], self.o_buf, self.flags, num_splits=self.splits,
            part_out=self.part_out if multi else None, part_lse=self.part_lse if multi else None,
            split_counters=self.counters if multi else None, config=tile)


def parse_tile(spec: str) -> dict:
    nums = [int(v) for v in spec.split("/")]
    return dict(zip(("block_rows", "block_k", "pre_k", "num_warps", "block_n"), nums))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="17,144,272")
    ap.add_argument("--max-seq-len", type=int, default=288, help="prompt + new tokens + 16, as bench_decode sizes it")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tiles", default="", help="comma-separated rows/block_k/pre_k/warps[/block_n]; "
                                                "the table's tile is always run")
    args = ap.parse_args()
    chain = Chain(args.max_seq_len, args.page_size)
    tiles = {"table": oproj_config(HIDDEN, HEADS * HEAD_DIM)}
    tiles.update({t: parse_tile(t) for t in args.tiles.split(",") if t})
    print(f"Qwen3-30B-A3B attention, page size {args.page_size}, {chain.splits} splits (max_seq_len "
          f"{args.max_seq_len}), {LAYERS} weight copies, us a layer (QKV GEMV included)")
    print("| keys | unfused | " + " | ".join(f"fused {n}" for n in tiles) + " | best saving over 48 layers |")
    print("|---|---|" + "---|" * len(tiles) + "---|")
    for n in (int(v) for v in args.lens.split(",")):
        chain.set_length(n)
        want = chain.unfused(0).float()
        row = [bench_gemv.graph_time_us(chain.unfused, REPS)]
        for tile in tiles.values():
            got = chain.fused(0, tile).float()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            row.append(bench_gemv.graph_time_us(lambda i, tile=tile: chain.fused(i, tile), REPS))
        saving = (row[0] - min(row[1:])) * LAYERS_OF_30B / 1000
        print(f"| {n} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {saving:.3f} ms a step |", flush=True)


if __name__ == "__main__":
    main()
