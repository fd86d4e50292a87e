"""Paged decode attention (flash-decoding): a few query rows per request against its whole cache.

Layout: request b owns query rows b * R .. b * R + R - 1 (R = rows_per_req: 1 for decode, k + 1
for speculative verify). Row r sits at position seq_len - R + r and attends causally to keys
[0, seq_len - R + r]. The new rows' K/V must already be in the cache (store_kv runs first).

Kernel 1 runs one program per (request, KV head, split): it stacks the R x G query rows of the KV
head's G query heads into one tile (GQA: the keys are read once for all of them), walks its share
of the request's keys through the page table, and writes a normalised partial output plus its
log-sum-exp (base 2). With one split, kernel 1 writes the final output directly (the no-split
variant: one program per (request, KV head), no partials). A split's share is computed in the
kernel from the request's own length, so the grid depends only on (batch size, KV heads, number
of splits): CUDA graphs replay it for any lengths.

The split count is an upper bound: each request uses only as many splits as its length needs
(`active = min(num_splits, cdiv(seq_len, min_split_tokens))`, worked out in the kernel; by default one
split per BLOCK_N keys), so a request far shorter than the graph's capture-time length runs no empty
splits and its merge reads only the partials it wrote; a request of one block writes its output
directly and its merge program exits at once.

Merging the splits: by default kernel 2 merges them (a second launch). With `fused_merge`
(FREETOKEN_DECODE_FUSED_MERGE=1; off: measured within the noise of the merge launch, benchmarks/RESULTS.md)
kernel 1 merges them, by
the split that finishes last: each split, after storing its partial, takes a ticket from a
per-(request, KV head) counter (a CTA barrier, then one acq_rel atomic: CUTLASS's split-K semaphore
pattern); the split that draws active - 1 reads the active partials back from L2 (.cg), writes the
output and resets the counter to 0 for the next launch (the next layer, the next graph replay). So
decode attention is then one launch at any length while the split count stays the host's capture-time
constant. The counters ([B * Hkv] int32, zero) are static graph buffers (backend.py) or allocated here.

Reference: `reference.paged_attention_reference` with extend_lens = [R] * B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...env import kernel_env
from ...kernels.pdl import pdl_launch
from ...kernels.pdl_jit import pdl_wait_then_release

FUSED_MERGE = kernel_env().decode_fused_merge  # FREETOKEN_DECODE_FUSED_MERGE (freetoken_core/env.py)
LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in merging than it gains
MAX_SPLITS = 32


@triton.jit
def attend_paged_keys(
    q, q_pos, m_i, l_i, acc, KCache, VCache, PageTable, table_row, stride_pt,
    stride_ks, stride_kh, stride_vs, stride_vh, kv_head, qk_scale, lo, hi, kv_end, d, d_valid,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Online-softmax update over keys [lo, hi) of one request, read through its page-table row."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_valid = pos < kv_end
        page = tl.load(PageTable + table_row * stride_pt + pos // PAGE_SIZE, mask=p_valid, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = p_valid[:, None] & d_valid[None, :]
        k = tl.load(KCache + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            allowed = (pos[None, :] <= q_pos[:, None]) & p_valid[None, :]
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VCache + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_partials(PartOut, PartLse, t, h, d, row_valid, mask, num_splits,
                    stride_pot, stride_poh, stride_pos, stride_plt, stride_plh):
    """Online log-sum-exp merge of the first `num_splits` partials of the tile's rows (the request's
    active splits), read from L2 (.cg: other SMs wrote them during this launch, and L1 is not coherent)."""
    m_run = tl.full(row_valid.shape, -1.0e30, tl.float32)  # finite: an empty split (-inf) weighs 0, never NaN
    l_run = tl.zeros(row_valid.shape, tl.float32)
    acc = tl.zeros(mask.shape, tl.float32)
    for s in range(num_splits):
        lse = tl.load(PartLse + t * stride_plt + h * stride_plh + s, mask=row_valid, other=float("-inf"),
                      cache_modifier=".cg")
        part = tl.load(PartOut + t[:, None] * stride_pot + h[:, None] * stride_poh + s * stride_pos + d[None, :],
                       mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, lse)
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_run = l_run * alpha + w
        m_run = m_new
    return acc / tl.where(l_run > 0, l_run, 1.0)[:, None]  # split 0 holds key 0: l_run > 0 on valid rows


@triton.jit
def _active_splits(seq_len, num_splits, min_split):
    """How many of the launch's splits a request of seq_len keys uses: no split shorter than min_split keys."""
    return tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len, min_split)), 1)


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, PageTable, TableRows, SeqLens,
    Out, PartOut, PartLse,
    qk_scale, num_splits, min_split, SplitCounters,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pt,
    stride_ot, stride_oh,
    stride_pot, stride_poh, stride_pos,
    stride_plt, stride_plh,
    ROWS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DIRECT: tl.constexpr, FUSED_MERGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b)
    active = _active_splits(seq_len, num_splits, min_split)
    if split >= active:  # this request is too short for so many splits
        return
    table_row = tl.load(TableRows + b).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(seq_len, active), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    m = tl.arange(0, BLOCK_M)
    r = m // GROUP  # query row of the request
    row_valid = m < ROWS * GROUP
    t = (b * ROWS + r).to(tl.int64)
    h = kv_head * GROUP + m % GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        Q + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :], other=0.0,
    )
    kv_len = seq_len - ROWS + r + 1  # causal limit of each row

    # Finite start value: a row whose keys are all masked in a block keeps alpha = 1, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # row r sees keys [0, kv_len[r]): position kv_len - 1 is its own
    m_i, l_i, acc = attend_paged_keys(
        q, kv_len - 1, m_i, l_i, acc, KCache, VCache, PageTable, table_row, stride_pt,
        stride_ks, stride_kh, stride_vs, stride_vh, kv_head, qk_scale, start, end, end, d, d_valid,
        BLOCK_N, PAGE_SIZE, DOT_PRECISION, True,
    )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if DIRECT or active == 1:
        tl.store(Out + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=store_mask)
    else:
        tl.store(PartOut + t[:, None] * stride_pot + h[:, None] * stride_poh + split * stride_pos + d[None, :],
                 out, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(PartLse + t * stride_plt + h * stride_plh + split, lse, mask=row_valid)
        if FUSED_MERGE:
            counter = SplitCounters + b * tl.num_programs(1) + kv_head
            tl.debug_barrier()  # every thread's partial stores come before the release below
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == active - 1:  # the last split of this (request, KV head) to finish merges
                merged = _merge_partials(PartOut, PartLse, t, h, d, row_valid, store_mask, active,
                                         stride_pot, stride_poh, stride_pos, stride_plt, stride_plh)
                tl.store(Out + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                         merged.to(Out.dtype.element_ty), mask=store_mask)
                tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _decode_merge_kernel(
    PartOut, PartLse, Out, SeqLens, num_splits, min_split,
    stride_pot, stride_poh, stride_pos,
    stride_plt, stride_plh,
    stride_ot, stride_oh,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    active = _active_splits(tl.load(SeqLens + t // ROWS), num_splits, min_split)
    if active == 1:  # the split kernel wrote this row's output itself
        return
    s = tl.arange(0, BLOCK_S)
    s_valid = s < active
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    lse = tl.load(PartLse + t * stride_plt + h * stride_plh + s, mask=s_valid, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds key 0, so the max is finite
    w = tl.where(s_valid, w, 0.0)
    part = tl.load(
        PartOut + t * stride_pot + h * stride_poh + s[:, None] * stride_pos + d[None, :],
        mask=s_valid[:, None] & d_valid[None, :], other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_valid)


def num_kv_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Enough splits to give every SM about two programs, never splits shorter than
    MIN_SPLIT_TOKENS keys, at most MAX_SPLITS."""
    by_len = triton.cdiv(max(max_kv_len, 1), MIN_SPLIT_TOKENS)
    by_occupancy = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def alloc_split_counters(batch_size: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The fused merge's per-(request, KV head) tickets: zero, and left zero by every launch."""
    return torch.zeros(batch_size * num_kv_heads, dtype=torch.int32, device=device)


def alloc_partials(num_rows: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device):
    """fp32 scratch for the split partials: out [T, H, S, D] and lse [T, H, S]."""
    return (
        torch.empty(num_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
        torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=device),
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    rows_per_req: int = 1,
    num_splits: int = 1,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    split_counters: torch.Tensor | None = None,
    fused_merge: bool | None = None,
    min_split_tokens: int | None = None,
) -> torch.Tensor:
    """q [B * R, H, D]; caches [pages, page_size, Hkv, D] (contiguous); page_table [rows, pages_per_row]
    int32; table_rows, seq_lens [B] int32 (seq_lens count the R new rows). Returns [B * R, H, D].

    With num_splits > 1, part_out/part_lse (see `alloc_partials`, at least [B * R, H, num_splits])
    may be passed in so that a CUDA graph owns them; otherwise they are allocated here. So may
    split_counters (`alloc_split_counters`, at least [B * Hkv], zero) for the fused merge (fused_merge
    None: FREETOKEN_DECODE_FUSED_MERGE), which needs no second launch. num_splits is the most any request
    uses: each uses at most one split per min_split_tokens of its keys (None: block_n; one split: no
    partials, no merge)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch_size = table_rows.shape[0]
    assert num_rows == batch_size * rows_per_req, f"q has {num_rows} rows, expected {batch_size} x {rows_per_req}"
    assert num_heads % num_kv_heads == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.stride(-1) == 1
    group = num_heads // num_kv_heads
    page_size = k_cache.shape[1]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch_size == 0:
        return out
    direct = num_splits == 1
    if not direct and part_out is None:
        part_out, part_lse = alloc_partials(num_rows, num_heads, num_splits, head_dim, q.device)
    fused = not direct and (FUSED_MERGE if fused_merge is None else fused_merge)
    if fused and split_counters is None:
        split_counters = alloc_split_counters(batch_size, num_kv_heads, q.device)
    if not fused:  # never touched: any int32 pointer will do
        split_counters = table_rows
    if direct:  # the partial pointers are never touched: pass the output as a stand-in
        part_out, part_lse = out, out
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(rows_per_req * group))
    min_split_tokens = min_split_tokens or block_n
    kf = k_cache.view(-1, num_kv_heads, head_dim)
    vf = v_cache.view(-1, num_kv_heads, head_dim)
    _decode_split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, kf, vf, page_table, table_rows, seq_lens,
        out, part_out, part_lse,
        scale * LOG2E, num_splits, min_split_tokens, split_counters,
        q.stride(0), q.stride(1),
        kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        *po_strides, *pl_strides,
        ROWS=rows_per_req, GROUP=group, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DIRECT=direct, FUSED_MERGE=fused,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2, **pdl_launch(q),
    )
    if not direct and not fused:
        _decode_merge_kernel[(num_rows, num_heads)](
            part_out, part_lse, out, seq_lens, num_splits, min_split_tokens,
            *po_strides, *pl_strides,
            out.stride(0), out.stride(1),
            ROWS=rows_per_req, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4, **pdl_launch(q),
        )
    return out
