"""Each Triton kernel against its plain-torch reference (CPU: under TRITON_INTERPRET=1, in fp32
and fp16 only; the interpreter's bf16 is wrong). Sizes stay tiny: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
from attn_cases import make_case

from freetoken_core.attention.triton import reference as ref
from freetoken_core.attention.triton.decode import (
    MAX_SPLITS, alloc_partials, alloc_split_counters, decode_attention, num_kv_splits,
)
from freetoken_core.attention.triton.extend import extend_attention
from freetoken_core.attention.triton.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
HEAD_DIM = 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_store_kv_matches_reference(dtype, page_size):
    c = make_case([3, 0, 9], [2, 5, 1], 6, 2, HEAD_DIM, page_size, dtype, DEVICE)
    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    store_kv(c.k_new, c.v_new, kc, vc, c.out_loc)
    rk, rv = c.k_cache.clone(), c.v_cache.clone()
    ref.store_kv_reference(c.k_new, c.v_new, rk, rv, c.out_loc)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    assert not torch.equal(kc, c.k_cache)  # the write happened


def test_store_kv_strided_input_and_cast():
    """k/v as views of a fused qkv projection (rows not contiguous), fp32 into an fp16 cache."""
    c = make_case([2, 4], [3, 2], 4, 2, HEAD_DIM, 4, torch.float16, DEVICE)
    t = c.k_new.shape[0]
    fused = torch.randn(t, 8, HEAD_DIM, device=DEVICE)  # [q heads | k heads | v heads]
    k, v = fused[:, 4:6], fused[:, 6:8]
    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    store_kv(k, v, kc, vc, c.out_loc.to(torch.int32))
    rk, rv = c.k_cache.clone(), c.v_cache.clone()
    ref.store_kv_reference(k, v, rk, rv, c.out_loc)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("rows_per_req", [1, 3])
@pytest.mark.parametrize("num_splits,fused_merge", [(1, True), (3, True), (3, False)])
def test_decode_matches_reference(dtype, page_size, group, rows_per_req, num_splits, fused_merge):
    """num_splits 1: the no-split kernel; 3 with fused_merge: one launch, the last split merges;
    3 without: the split kernel + the merge kernel. At 8 keys a split the shortest request (1-3 keys)
    uses one split (written directly), the longest all three."""
    num_kv_heads = 2
    prefix = [0, 5, 37]  # mixed lengths; the first request has no cached prefix at all
    c = make_case(prefix, [rows_per_req] * 3, num_kv_heads * group, num_kv_heads, HEAD_DIM, page_size, dtype, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    out = decode_attention(
        c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.seq_lens), 0.3,
        rows_per_req=rows_per_req, num_splits=num_splits, block_n=16, fused_merge=fused_merge, min_split_tokens=8,
    )
    expect = ref.paged_attention_reference(
        c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows, c.prefix_lens, c.extend_lens, 0.3
    )
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_fused_merge_reuses_static_buffers_and_leaves_counters_zero():
    """As in a CUDA graph: the same partials and tickets for launch after launch (layer after layer);
    each launch must reset its tickets, or the next would merge at the wrong split. The first request
    is shorter than the split count's shares (empty splits: -inf partials weigh nothing)."""
    c = make_case([1, 40, 23], [1, 1, 1], 6, 2, HEAD_DIM, 4, torch.float32, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    part_out, part_lse = alloc_partials(3, 6, 4, HEAD_DIM, c.q.device)
    counters = alloc_split_counters(3, 2, c.q.device)
    rows, seqs = c.ints(c.table_rows), c.ints(c.seq_lens)
    expect = ref.paged_attention_reference(c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows,
                                           c.prefix_lens, c.extend_lens, 0.3)
    unfused = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seqs, 0.3, num_splits=4, block_n=16,
                               fused_merge=False, min_split_tokens=1)
    for _ in range(3):
        out = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seqs, 0.3, num_splits=4,
                               part_out=part_out, part_lse=part_lse, split_counters=counters, block_n=16,
                               fused_merge=True, min_split_tokens=1)
        assert torch.equal(counters, torch.zeros_like(counters))
        torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out, unfused, atol=1e-6, rtol=1e-6)  # the same merge, another order


def test_decode_head_dim_not_power_of_two():
    c = make_case([6, 20], [1, 1], 4, 2, 24, 4, torch.float32, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    out = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.seq_lens),
                           0.2, num_splits=2, block_n=16, min_split_tokens=8)
    expect = ref.paged_attention_reference(c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows,
                                           c.prefix_lens, c.extend_lens, 0.2)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("group", [1, 3])
def test_extend_matches_reference(dtype, page_size, group):
    num_kv_heads = 2
    prefix, ext = [0, 7, 20], [9, 1, 18]  # fresh prompt, one-token chunk, long chunk over a prefix
    c = make_case(prefix, ext, num_kv_heads * group, num_kv_heads, HEAD_DIM, page_size, dtype, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    out = extend_attention(
        c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.prefix_lens),
        c.ints(c.extend_lens), c.ints(c.q_starts), max(ext), 0.3, block_m=16, block_n=16,
    )
    expect = ref.paged_attention_reference(
        c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows, c.prefix_lens, c.extend_lens, 0.3
    )
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_and_extend_agree_on_verify_rows():
    """A verify step (R rows per request) is also an extend of R tokens: both kernels must agree."""
    c = make_case([4, 13], [3, 3], 6, 2, HEAD_DIM, 4, torch.float32, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    a = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.seq_lens),
                         0.25, rows_per_req=3, num_splits=2, block_n=16, min_split_tokens=8)
    b = extend_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.prefix_lens),
                         c.ints(c.extend_lens), c.ints(c.q_starts), 3, 0.25, block_m=16, block_n=16)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fused_merge", [True, False])
def test_decode_uses_only_the_splits_a_request_needs(fused_merge):
    """A launch sized for 4 splits of 16 keys: a 5-key request runs in one program that writes its output
    directly, a 20-key one in two, a 64-key one in all four; the unused splits' partials are never read, so
    poisoning the scratch changes nothing."""
    c = make_case([4, 19, 63], [1, 1, 1], 6, 2, HEAD_DIM, 4, torch.float32, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    part_out, part_lse = alloc_partials(3, 6, 4, HEAD_DIM, c.q.device)
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    out = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.seq_lens), 0.3,
                           num_splits=4, part_out=part_out, part_lse=part_lse, block_n=16, fused_merge=fused_merge,
                           min_split_tokens=16)
    expect = ref.paged_attention_reference(c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows,
                                           c.prefix_lens, c.extend_lens, 0.3)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    written = ~torch.isnan(part_lse)  # [request, head, split]: the partials each request's splits wrote
    assert written[0].sum() == 0 and written[1, :, :2].all() and written[1, :, 2:].sum() == 0 and written[2].all()


def test_num_kv_splits_bounds():
    assert num_kv_splits(1, 8, 64, 132) == 1  # short context: never split
    assert num_kv_splits(1, 8, 4096, 132) > 1  # one long request: split to fill the GPU
    assert num_kv_splits(256, 8, 4096, 132) == 1  # a big batch fills it already
    assert num_kv_splits(1, 1, 10**6, 132) == MAX_SPLITS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: many programs racing for the tickets")
@pytest.mark.parametrize("batch_size,num_splits", [(1, 4), (8, 16), (64, 32)])
def test_gpu_fused_merge_under_contention_and_in_a_graph(batch_size, num_splits):
    """The in-kernel merge on real hardware: every (request, KV head) racing its splits, launch after
    launch on the same tickets (eagerly and replayed in a CUDA graph, PDL as configured), against the
    two-launch merge; bf16 Qwen3-30B-A3B heads (32 q / 4 KV, D 128)."""
    g = torch.Generator().manual_seed(batch_size)
    prefix = torch.randint(1, 3000, (batch_size,), generator=g).tolist()
    c = make_case(prefix, [1] * batch_size, 32, 4, 128, 16, torch.bfloat16, "cuda")
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    rows, seqs = c.ints(c.table_rows), c.ints(c.seq_lens)
    part_out, part_lse = alloc_partials(batch_size, 32, num_splits, 128, c.q.device)
    counters = alloc_split_counters(batch_size, 4, c.q.device)
    out = torch.empty_like(c.q)

    def fused() -> torch.Tensor:
        return decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seqs, 0.088, num_splits=num_splits,
                                part_out=part_out, part_lse=part_lse, split_counters=counters, out=out,
                                fused_merge=True)

    want = decode_attention(c.q, c.k_cache, c.v_cache, c.page_table, rows, seqs, 0.088, num_splits=num_splits,
                            fused_merge=False)
    for _ in range(20):
        torch.testing.assert_close(fused(), want, atol=1e-2, rtol=1e-2)
        assert int((fused() != want).sum()) <= want.numel() // 100  # only last-place flips of the merge order
    torch.cuda.synchronize()
    assert torch.equal(counters, torch.zeros_like(counters))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):  # eight layers' worth on the same tickets
            fused()
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=1e-2, rtol=1e-2)
    assert torch.equal(counters, torch.zeros_like(counters))


@pytest.mark.parametrize("group_rows", [True, False])
@pytest.mark.parametrize("group", [2, 4])
def test_extend_mixed_step_one_row_requests(group_rows, group):
    """A mixed step's rows: decoders of one row each (in front, as `mixed_prefill` puts them), a prompt over
    no prefix, a one-token chunk. group_rows: each one-row request runs in one program per KV head (its GROUP
    query heads as the block's rows); without it one program per query head. Both match the reference."""
    num_kv_heads = 2
    prefix, ext = [5, 30, 0, 17, 12, 3], [1, 1, 1, 1, 11, 1]
    c = make_case(prefix, ext, num_kv_heads * group, num_kv_heads, HEAD_DIM, 4, torch.float32, DEVICE)
    ref.store_kv_reference(c.k_new, c.v_new, c.k_cache, c.v_cache, c.out_loc)
    out = extend_attention(
        c.q, c.k_cache, c.v_cache, c.page_table, c.ints(c.table_rows), c.ints(c.prefix_lens),
        c.ints(c.extend_lens), c.ints(c.q_starts), 32, 0.3, block_m=16, block_n=16, group_rows=group_rows,
    )  # max_extend past the longest request, as a prefill graph's bucket sizes the grid
    expect = ref.paged_attention_reference(
        c.q, c.k_cache, c.v_cache, c.page_table, c.table_rows, c.prefix_lens, c.extend_lens, 0.3
    )
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
