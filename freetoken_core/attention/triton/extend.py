"""Extend (prefill) attention over the paged cache: variable-length requests in one launch.

Request b contributes extend_lens[b] query rows (contiguous from q_starts[b]) at positions
prefix_lens[b] + i; row i attends causally to keys [0, prefix_lens[b] + i]: the cached prefix and
the new tokens, all read through the page table (store_kv has written the new K/V first).

One program per (request, query head, block of BLOCK_M rows); blocks past a request's length
exit at once. A block only walks keys up to its own last row (causal), and only
the blocks of keys that overlap its own rows pay for the causal mask.

A request of one row (a decoder riding in a mixed step, `mixed_prefill`, or a one-token chunk) is
attended as the decode kernel does it: the program of the first query head of each KV head takes
the GROUP query heads that share it as its block's rows (the others exit), so the request's keys
are read once per KV head instead of once per query head. Why: one-row requests through the prefill
path made a mixed step's attention several times a decode step's (the mixed-attention row of
benchmarks/RESULTS.md).

Reference: `reference.paged_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import LOG2E, attend_paged_keys


@triton.jit
def _extend_kernel(
    Q, KCache, VCache, Out, PageTable, TableRows, PrefixLens, ExtendLens, QStarts,
    qk_scale,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.num_programs(2) - 1 - tl.program_id(2)  # longest (last) blocks start first: shorter tail
    ext = tl.load(ExtendLens + b)
    if mb * BLOCK_M >= ext:
        return
    # one row: the GROUP query heads of this KV head are the block's rows (in the first head's program)
    one_row = ext == 1
    if not GROUP_ROWS:
        one_row = ext < 0
    if one_row & (h % GROUP != 0):
        return
    r = tl.arange(0, BLOCK_M)
    i = tl.where(one_row, 0, mb * BLOCK_M + r)  # the rows' offsets in the request
    heads = tl.where(one_row, h + r, h)
    i_valid = tl.where(one_row, r < GROUP, i < ext)
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(QStarts + b).to(tl.int64)
    table_row = tl.load(TableRows + b).to(tl.int64)
    kv_head = h // GROUP

    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    rows = q_start + i
    q = tl.load(Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=i_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = prefix + i
    kv_end = prefix + tl.minimum((mb + 1) * BLOCK_M, ext)  # keys the block's last row can see

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys before the block's first row are visible to every row: no causal mask there.
    full_end = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_paged_keys(
        q, q_pos, m_i, l_i, acc, KCache, VCache, PageTable, table_row, stride_pt,
        stride_ks, stride_kh, stride_vs, stride_vh, kv_head, qk_scale, 0, full_end, kv_end, d, d_valid,
        BLOCK_N, PAGE_SIZE, DOT_PRECISION, False,
    )
    m_i, l_i, acc = attend_paged_keys(
        q, q_pos, m_i, l_i, acc, KCache, VCache, PageTable, table_row, stride_pt,
        stride_ks, stride_kh, stride_vs, stride_vh, kv_head, qk_scale, full_end, kv_end, kv_end, d, d_valid,
        BLOCK_N, PAGE_SIZE, DOT_PRECISION, True,
    )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(Out + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=i_valid[:, None] & d_valid[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    max_extend: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_rows: bool = True,
) -> torch.Tensor:
    """q [T, H, D]; caches [pages, page_size, Hkv, D] (contiguous); table_rows, prefix_lens,
    extend_lens, q_starts [B] int32; max_extend = max(extend_lens) (sizes the grid).
    group_rows: one-row requests take a KV head's query heads in one program (False: one program a
    query head, as longer requests; for benchmarks). Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(-1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch_size = table_rows.shape[0]
    if batch_size == 0 or num_tokens == 0:
        return out
    on_gpu = q.is_cuda
    block_m = block_m or (64 if on_gpu else 16)
    block_n = block_n or (64 if on_gpu else 16)
    block_d = max(16, triton.next_power_of_2(head_dim))
    kf = k_cache.view(-1, num_kv_heads, head_dim)
    vf = v_cache.view(-1, num_kv_heads, head_dim)
    grid = (batch_size, num_heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q, kf, vf, out, page_table, table_rows, prefix_lens, extend_lens, q_starts,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        GROUP_ROWS=group_rows and 1 < num_heads // num_kv_heads <= block_m,
        # 64x64 tiles with 4 warps and 3 stages ran more than twice as fast as 8 warps with 2 (long causal prompt, H200)
        num_warps=num_warps or 4, num_stages=num_stages or (3 if on_gpu and block_d <= 128 else 2),
    )
    return out
