"""GPU checks of the Triton attention kernels (bf16, real head shapes) and a quick decode timing.

Used by test_triton_gpu.py (pytest, skipped without CUDA) and runnable alone where pytest is
missing: `python tests/attention/attn_gpu_checks.py` prints every error and timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_cases import make_case  # noqa: E402

from freetoken_core.attention.triton import reference as ref  # noqa: E402
from freetoken_core.attention.triton.decode import decode_attention, num_kv_splits  # noqa: E402
from freetoken_core.attention.triton.extend import extend_attention  # noqa: E402
from freetoken_core.attention.triton.store_kv import store_kv  # noqa: E402

H, HKV, D = 32, 8, 128  # Llama-3-8B attention
BF16_TOL = 3e-2


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def check_store_kv(dtype=torch.bfloat16, page_size=16) -> float:
    c = make_case([100, 0, 33], [1, 200, 5], H, HKV, D, page_size, dtype, "cuda")
    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    store_kv(c.k_new, c.v_new, kc, vc, c.out_loc)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    return max((kc.float() - c.k_cache.float()).abs().max().item(), (vc.float() - c.v_cache.float()).abs().max().item())


def check_decode(dtype=torch.bfloat16, page_size=16, rows_per_req=1, num_splits=None) -> float:
    prefix = [0, 17, 300, 1023, 2500, 4000, 64, 5]
    c = make_case(prefix, [rows_per_req] * len(prefix), H, HKV, D, page_size, dtype, "cuda", seed=1)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    splits = num_splits or num_kv_splits(len(prefix), HKV, max(c.seq_lens), _sms())
    out = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.seq_lens),
                           D**-0.5, rows_per_req=rows_per_req, num_splits=splits)
    expect = ref.paged_attention_reference(c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows,
                                           c.prefix_lens, c.extend_lens, D**-0.5)
    return (out.float() - expect.float()).abs().max().item()


def check_extend(dtype=torch.bfloat16, page_size=16) -> float:
    prefix, ext = [0, 300, 1000, 7], [512, 77, 300, 1]
    c = make_case(prefix, ext, H, HKV, D, page_size, dtype, "cuda", seed=2)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    out = extend_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.prefix_lens),
                           c.ints(c.extend_lens), c.ints(c.q_starts), max(ext), D**-0.5)
    expect = ref.paged_attention_reference(c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows,
                                           c.prefix_lens, c.extend_lens, D**-0.5)
    return (out.float() - expect.float()).abs().max().item()


def check_graph_replay(page_size=16) -> float:
    """Capture decode through TritonBackend in a CUDA graph at bs 8, replay with new lengths and
    rows (6 real requests padded to 8); compare with the eager path. Returns the max difference."""
    from freetoken_core.attention.base import AttnLayout
    from freetoken_core.attention.triton.backend import TritonBackend
    from freetoken_core.config import SamplingParams
    from freetoken_core.core import Batch, Req
    from freetoken_core.kvcache.manager import CacheManager
    from freetoken_core.kvcache.pool import KVCache, KVCacheShape

    dev = torch.device("cuda")
    max_seq = 4096
    mgr = CacheManager(2048, page_size, 8, max_seq, dev)
    kv = KVCache(KVCacheShape(1, HKV, D, page_size, torch.bfloat16), 2048, dev)
    torch.nn.init.normal_(kv.k[0])
    torch.nn.init.normal_(kv.v[0])
    tb = TritonBackend(AttnLayout(H, HKV, D, D**-0.5), kv, mgr.page_table)
    tb.init_capture_graph(max_seq, [8], rows_per_req=1)

    def mk(reqs, bs, real=True):
        n = len(reqs)
        loc = [mgr.slots(r, r.cached_len, r.cached_len + 1)[0] for r in reqs] if real else []
        loc += [0] * (bs - len(loc))  # padding rows write to the dummy page
        z = torch.zeros(bs, dtype=torch.int64, device=dev)
        return Batch("decode", reqs, [1] * n, [r.cached_len for r in reqs], z, z,
                     torch.tensor(loc, dtype=torch.int64, device=dev), z, [], padded_size=bs)

    dummy = [Req(-1 - i, [0], SamplingParams(), table_row=mgr.dummy_row) for i in range(8)]
    static_q = torch.randn(8, H, D, device=dev, dtype=torch.bfloat16)
    static_k = torch.randn(8, HKV, D, device=dev, dtype=torch.bfloat16)
    static_v = torch.randn(8, HKV, D, device=dev, dtype=torch.bfloat16)
    cap = mk(dummy, 8, real=False)
    static_loc = cap.out_loc
    tb.prepare_for_capture(cap)
    tb.forward(static_q, static_k, static_v, 0, cap)  # warm up (compile) outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = tb.forward(static_q, static_k, static_v, 0, cap)

    worst = 0.0
    reqs = []
    for i, n in enumerate([5, 900, 4000, 33, 1500, 2]):
        r = Req(i, list(range(n)), SamplingParams())
        mgr.assign_row(r)
        mgr.allocate(r, n + 3)
        r.cached_len = n  # pretend the prompt is cached (the cache holds random values)
        reqs.append(r)
    mgr.flush()
    for step in range(3):
        real = mk(reqs, 8)
        q = torch.randn(6, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(6, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(6, HKV, D, device=dev, dtype=torch.bfloat16)
        static_q[:6], static_k[:6], static_v[:6] = q, k, v
        static_loc.copy_(real.out_loc)
        tb.prepare_for_replay(real)
        graph.replay()
        got = static_out[:6].float().clone()
        eager_batch = Batch("decode", reqs, [1] * 6, real.prefix_lens, real.input_ids[:6], real.positions[:6],
                            real.out_loc[:6], real.sample_rows, [])
        tb.prepare_metadata(eager_batch)
        want = tb.forward(q, k, v, 0, eager_batch).float()
        worst = max(worst, (got - want).abs().max().item())
        for r in reqs:
            r.cached_len += 1
    return worst


def time_decode(batch_size=64, ctx=1024, page_size=16, dtype=torch.bfloat16) -> dict:
    import triton.testing

    c = make_case([ctx - 1] * batch_size, [1] * batch_size, H, HKV, D, page_size, dtype, "cuda", seed=3)
    seq = c.ints(c.seq_lens)
    rows = c.ints(c.table_rows)
    splits = num_kv_splits(batch_size, HKV, ctx, _sms())
    fn = lambda: decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seq, D**-0.5,  # noqa: E731
                                  num_splits=splits)
    ms = triton.testing.do_bench(fn, warmup=25, rep=200)
    kv_bytes = 2 * batch_size * ctx * HKV * D * c.k_cache.element_size()
    return {"bs": batch_size, "ctx": ctx, "page_size": page_size, "splits": splits, "ms": round(ms, 4),
            "GB/s": round(kv_bytes / ms / 1e6, 1), "kv_MB": round(kv_bytes / 1e6, 1)}


def time_decode_graph(batch_size=1, ctx=1024, page_size=16, dtype=torch.bfloat16) -> dict:
    """Decode timed through a CUDA graph replay: the GPU time without Python launch overhead."""
    import triton.testing

    from freetoken_core.attention.triton.decode import alloc_partials

    c = make_case([ctx - 1] * batch_size, [1] * batch_size, H, HKV, D, page_size, dtype, "cuda", seed=3)
    seq, rows = c.ints(c.seq_lens), c.ints(c.table_rows)
    splits = num_kv_splits(batch_size, HKV, ctx, _sms())
    po, pl = alloc_partials(batch_size, H, splits, D, torch.device("cuda"))
    out = torch.empty_like(c.q)
    fn = lambda: decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seq, D**-0.5,  # noqa: E731
                                  num_splits=splits, part_out=po, part_lse=pl, out=out)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=100) / 10
    kv_bytes = 2 * batch_size * ctx * HKV * D * c.k_cache.element_size()
    return {"bs": batch_size, "ctx": ctx, "splits": splits, "graph_ms": round(ms, 4),
            "GB/s": round(kv_bytes / ms / 1e6, 1)}


def time_extend(seq=8192, page_size=16, dtype=torch.bfloat16, **cfg) -> dict:
    import triton.testing

    c = make_case([0], [seq], H, HKV, D, page_size, dtype, "cuda", seed=4)
    args = (c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.prefix_lens),
            c.ints(c.extend_lens), c.ints(c.q_starts), seq, D**-0.5)
    ms = triton.testing.do_bench(lambda: extend_attention(*args, **cfg), warmup=10, rep=100)
    flops = 4 * H * D * seq * seq / 2  # causal: half of QK^T and PV
    return {"seq": seq, **cfg, "ms": round(ms, 3), "TFLOP/s": round(flops / ms / 1e9, 1)}


def main() -> None:
    torch.manual_seed(0)
    print("store_kv bf16 max err", check_store_kv())
    for ps in (1, 16):
        for dt in (torch.bfloat16, torch.float16):
            print(f"decode {dt} ps={ps} auto-split max err", check_decode(dt, ps))
        print(f"decode bf16 ps={ps} 1 split max err", check_decode(torch.bfloat16, ps, num_splits=1))
        print(f"decode bf16 ps={ps} 16 splits max err", check_decode(torch.bfloat16, ps, num_splits=16))
        print(f"verify bf16 ps={ps} R=4 max err", check_decode(torch.bfloat16, ps, rows_per_req=4))
        print(f"extend bf16 ps={ps} max err", check_extend(torch.bfloat16, ps))
    print("graph replay vs eager max diff", check_graph_replay())
    for bs, ctx, ps in [(64, 1024, 16), (64, 1024, 1), (1, 1024, 16), (1, 8192, 16), (128, 1024, 16)]:
        print("decode timing", time_decode(bs, ctx, ps))
    for bs, ctx in [(1, 1024), (1, 8192), (8, 1024), (64, 1024)]:
        print("decode timing (graph)", time_decode_graph(bs, ctx))
    print("extend timing", time_extend())
    if "--sweep" in sys.argv:
        for bm, bn, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                              (128, 32, 4, 2), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 3)]:
            try:
                print("extend sweep", time_extend(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
            except Exception as e:  # out of shared memory etc.
                print("extend sweep", bm, bn, w, st, "failed:", type(e).__name__, str(e)[:100])


if __name__ == "__main__":
    main()
