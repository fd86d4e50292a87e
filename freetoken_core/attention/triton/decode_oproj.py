"""Batch-1 decode from the QKV row to the o_proj output in one launch (FREETOKEN_ATTN_OPROJ_FUSED).

Why: at batch 1 a Qwen3-MoE layer spends ~7 us (H200, benchmarks/RESULTS.md, thirteenth session) in
three launches between its QKV and o_proj GEMVs (q/k norm + rotary + K/V store, split-KV attention,
merge) that read a few hundred KB while HBM idles, and the o_proj GEMV (16.8 MB on Qwen3-30B-A3B)
starts streaming its weights only after them. Here one grid does all of it, a program per BLOCK_ROWS
rows of o_proj (at least one per attention split):

- programs [0, Hkv * S) first do attention, one per (KV head, split) as in `decode.py`'s split kernel.
  Each takes its group's query heads straight from the QKV row and applies the q RMSNorm and neox
  rotary itself (rounded where `kernels/qk_norm_rotary.py` rounds); the program whose share of the keys
  holds the new one also norms and rotates the new key and stores k/v into the paged cache (then a CTA
  barrier: its own key loop reads that slot back; no other split reads it). A KV head's output is final
  when its only split writes it, or when its last split to finish merges the partials (the split-K
  ticket of `decode.py`'s fused merge); that program rounds it to the model dtype into `o_buf` and
  releases one count on `flags[0]`. Their own o_proj rows they either load after that, or (SPREAD, where
  the grid has enough programs) hand over, one row each, to the programs after them.
- the other programs load their o_proj rows (the first PRE_K columns, by default all of them, two
  16-bit weights an int32 register; with SPREAD also one whole row of an attention program's block)
  *before* the PDL wait (weights: no earlier kernel writes them), so that the bytes stream while the QKV
  GEMV ends and attention runs.
- every program then spins until `flags[0]` counts every KV head, adds one to it itself (acquire:
  orders its `o_buf` reads after the releases), reads `o_buf` from L2 and stores its rows. The last to
  add resets the flag, so every launch (the next layer, the next graph replay) finds it zero.

The spin cannot deadlock on the GPU: the attention programs have the lowest program ids, so they are
dispatched first, and their attention waits on nothing but the previous kernel (the forward-progress
assumption of the decoupled look-back in CUB's single-pass scan); and since they spin too once their
attention is done, all of them must be resident at once: at most one per SM (the wrapper refuses more,
the backend then keeps the separate launches). The Triton interpreter runs programs
one after another, where a spin on a later program never ends: there the wrapper launches the kernel
twice, attention parts (PHASE 1) then o_proj parts (PHASE 2), the same code as the one launch.

Scope (the caller checks, `TritonBackend.fused_decode_oproj`): one request, one query row, q/k
RMSNorm (Llama or zero-centred rounding), whole-head neox rotary, head_dim a power of two, o_proj
without bias or tensor parallelism. Reference: `decode_attention_oproj_reference` (the unfused
kernels' references, in order).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...env import triton_interpreted
from ...kernels.pdl import pdl_launch
from ...kernels.pdl_jit import pdl_wait_then_release
from ...kernels.qk_norm_rotary import _normed
from ...kernels.qk_norm_rotary_ref import qk_norm_rotary_reference
from .decode import (
    LOG2E, _active_splits, _merge_partials, _split_keys, _split_ticket, _store_partial, attend_paged_keys,
)
from .reference import paged_attention_reference, store_kv_reference

# Launch tiles (benchmarks/decode_variants.py `tile:oproj:` variants sweep them), chosen from ptxas's register counts
# for sm_90 (compiled on the CPU, `cuobjdump --dump-resource-usage`): every program of the grid resident at once,
# the o_proj weights of the whole launch preloaded (packed, two 16-bit weights an int32), no spills. block_n: the
# attention's keys an iteration; spread (default 1): the attention programs hand their rows to the others where
# the grid has room (0: they load them after attention).
#   Qwen3-30B-A3B (o_proj 2048 x 4096, 32 / 4 heads of 128), H200, batch-1 step (RESULTS.md, thirty-seventh
#   session): 16 rows x 4096 at 8 warps, 64 keys a step (214 registers, one program an SM, 128 programs) 2.511 ms;
#   8 rows at 4 warps, 32 keys (218 registers, two an SM, 256 programs) 2.661 ms; both slower than the separate
#   launches (2.382 ms), hence the switch stays off.
DEFAULT_CONFIG = dict(block_rows=8, block_k=1024, pre_k=2048, num_warps=4, block_n=32)
CONFIGS: dict[tuple[int, int], dict[str, int]] = {  # (N, K) of o_proj -> tile
    (2048, 4096): dict(block_rows=16, block_k=1024, pre_k=4096, num_warps=8, block_n=64),
}


def oproj_config(n: int, k: int) -> dict[str, int]:
    return CONFIGS.get((n, k)) or DEFAULT_CONFIG


@triton.jit
def _rope_rows(src, mask, W, eps, cos, sin_signed, d, partner, dt: tl.constexpr,
               HEAD_DIM: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """rotary(norm(x)) of the heads at `src` ([rows, 1] pointers to each head's first feature), rounded
    as `qk_norm_rotary` rounds: norm(x) in the model dtype, then each rotary product, then the sum.
    The neox pair of feature d is `partner` ((d + D/2) mod D); `sin_signed` is -sin on the first half."""
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    ok = d < HEAD_DIM
    xn = _normed(x, W, d, ok, rstd, dt, ZERO_CENTERED)
    xpn = _normed(xp, W, partner, ok, rstd, dt, ZERO_CENTERED)
    # o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin: round(-a) == -round(a), and a - b == a + (-b)
    return ((xn * cos).to(dt).to(tl.float32) + (xpn * sin_signed).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _attention_program(
    QKV, QW, KW, CosSin, Pos, KCache, VCache, PageTable, TableRows, SeqLens, OutLoc,
    PartOut, PartLse, SplitCounters, OBuf, Flags,
    kv_head, split, num_splits, min_split, qk_scale, q_eps, k_eps,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_cs,
    stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, ZERO_CENTERED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq_len = tl.load(SeqLens)
    active = _active_splits(seq_len, num_splits, min_split)
    if split < active:
        dt = QKV.dtype.element_ty
        m = tl.arange(0, BLOCK_M)
        row_valid = m < GROUP
        h = kv_head * GROUP + m
        d = tl.arange(0, HEAD_DIM)
        HALF = HEAD_DIM // 2
        partner = (d + HALF) % HEAD_DIM
        pos = tl.load(Pos).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + d % HALF).to(tl.float32)[None, :]
        sin = tl.load(CosSin + pos * stride_cs + HALF + d % HALF).to(tl.float32)[None, :]
        sin_signed = tl.where(d < HALF, -sin, sin)
        q = _rope_rows(QKV + h[:, None] * HEAD_DIM, row_valid[:, None], QW, q_eps, cos, sin_signed, d, partner,
                       dt, HEAD_DIM, ZERO_CENTERED)
        chunk, start, end = _split_keys(seq_len, active, split, BLOCK_N)  # decode.py's split of the keys
        if (seq_len - 1) // chunk == split:  # the split whose keys hold the new one stores it first
            k_src = QKV + (NUM_HEADS + kv_head) * HEAD_DIM
            v_src = k_src + (NUM_HEADS // GROUP) * HEAD_DIM
            one = d[None, :] < HEAD_DIM
            k_new = _rope_rows(k_src + tl.zeros([1, 1], tl.int32), one, KW, k_eps, cos, sin_signed, d, partner,
                               dt, HEAD_DIM, ZERO_CENTERED)
            slot = tl.load(OutLoc).to(tl.int64)
            tl.store(KCache + slot * stride_ks + kv_head * stride_kh + d[None, :],
                     k_new.to(KCache.dtype.element_ty))
            v_new = tl.load(v_src + d)
            tl.store(VCache + slot * stride_vs + kv_head * stride_vh + d, v_new.to(VCache.dtype.element_ty))
            tl.debug_barrier()  # the key loop below reads the slot back (other threads of this program)
        table_row = tl.load(TableRows).to(tl.int64)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        d_valid = d < HEAD_DIM
        q_pos = tl.zeros([BLOCK_M], tl.int32) + (seq_len - 1)  # the causal mask also masks keys past `end`
        m_i, l_i, acc = attend_paged_keys(
            q, q_pos, m_i, l_i, acc, KCache, VCache, PageTable, table_row, stride_pt,
            stride_ks, stride_kh, stride_vs, stride_vh, kv_head, qk_scale, start, end, end, d, d_valid,
            BLOCK_N, PAGE_SIZE, DOT_PRECISION, True,
        )
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        mask = row_valid[:, None] & d_valid[None, :]
        o_ptrs = OBuf + h[:, None] * HEAD_DIM + d[None, :]
        if active == 1:
            tl.store(o_ptrs, out.to(dt).to(tl.float32), mask=mask)
            tl.debug_barrier()  # every thread's o stores come before the release
            tl.atomic_add(Flags, 1, sem="release", scope="gpu")
        else:
            t = tl.zeros([BLOCK_M], tl.int64)  # the one query row
            _store_partial(PartOut, PartLse, t, h, d, split, out, m_i, l_i, row_valid, mask,
                           stride_pot, stride_poh, stride_pos, stride_plt, stride_plh)
            counter = SplitCounters + kv_head
            if _split_ticket(counter) == active - 1:  # the KV head's last split merges, as decode.py's fused merge
                merged = _merge_partials(PartOut, PartLse, t, h, d, row_valid, mask, active,
                                         stride_pot, stride_poh, stride_pos, stride_plt, stride_plh)
                tl.store(o_ptrs, merged.to(dt).to(tl.float32), mask=mask)
                tl.atomic_xchg(counter, 0)  # ready for the next launch
                tl.debug_barrier()
                tl.atomic_add(Flags, 1, sem="release", scope="gpu")


@triton.jit
def _w_cols(w_rows, r_ok, k0, COLS: tl.constexpr, PACKED: tl.constexpr):
    """Columns [k0, k0 + COLS) of the program's weight rows, as loaded: with PACKED two 16-bit weights in each
    int32 (w_rows then points at the int32 view, k0 and COLS still count weights)."""
    if PACKED:
        c = k0 // 2 + tl.arange(0, COLS // 2)
    else:
        c = k0 + tl.arange(0, COLS)
    return tl.load(w_rows + c[None, :], mask=r_ok[:, None], other=0)


@triton.jit
def _dot_cols(w, OBuf, k0, COLS: tl.constexpr, PACKED: tl.constexpr, IS_BF16: tl.constexpr):
    """Row sums of w (from `_w_cols`) times o_buf[k0:k0 + COLS], in fp32. Packed: the even weight is the low
    half of each int32 (little-endian); both halves widen to fp32 exactly."""
    if PACKED:
        c = k0 + 2 * tl.arange(0, COLS // 2)
        x_even = tl.load(OBuf + c, cache_modifier=".cg")  # written by other SMs in this launch: from L2
        x_odd = tl.load(OBuf + c + 1, cache_modifier=".cg")
        if IS_BF16:  # a bf16's bits are the top half of its fp32
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        acc = tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
    else:
        x = tl.load(OBuf + k0 + tl.arange(0, COLS), cache_modifier=".cg")
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _oproj_rows(
    W, Y, OBuf, Flags, block, extra_row, num_pollers, N, stride_wn,
    NUM_KV_HEADS: tl.constexpr, K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    PRE_K: tl.constexpr, PACKED: tl.constexpr, WAIT: tl.constexpr, EXTRA: tl.constexpr,
):
    """BLOCK_ROWS rows of o_proj (block < 0: none) and, with EXTRA, one more whole row (extra_row < 0: none).
    Their first columns (PRE_K of the block, all of the extra row) load before anything else: with WAIT
    (programs without attention work) that is before the PDL wait, which only then runs here."""
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = (rows < N) & (block >= 0)
    w_rows = W + tl.maximum(rows, 0)[:, None].to(tl.int64) * stride_wn
    w_pre = _w_cols(w_rows, r_ok, 0, PRE_K, PACKED)  # weights: no earlier kernel writes them
    if EXTRA:
        e_row = tl.zeros([1], tl.int64) + extra_row
        e_ok = e_row >= 0
        w_e_row = W + tl.maximum(e_row, 0)[:, None] * stride_wn
        w_extra = _w_cols(w_e_row, e_ok, 0, K, PACKED)
    if WAIT:
        pdl_wait_then_release()
    # Wait until every KV head's output is in o_buf (the attention programs release them). The poll is a scalar
    # atomic, which one thread of the program issues: one L2 request a program an iteration, where a load
    # would be one a warp (a thousand warps polling one line would queue the releases behind them).
    ready = tl.atomic_add(Flags, 0, sem="relaxed", scope="gpu")
    while ready < NUM_KV_HEADS:
        ready = tl.atomic_add(Flags, 0, sem="relaxed", scope="gpu")
    # One RMW on the flag the releases went to: its acquire orders the o_buf reads after them, and the
    # count past NUM_KV_HEADS says how many programs are past the spin; the last leaves it zero.
    passed = tl.atomic_add(Flags, 1, sem="acq_rel", scope="gpu") - NUM_KV_HEADS
    if passed == num_pollers - 1:
        tl.atomic_xchg(Flags, 0)
    is_bf16 = Y.dtype.element_ty == tl.bfloat16
    acc = _dot_cols(w_pre, OBuf, 0, PRE_K, PACKED, is_bf16)
    for k0 in range(PRE_K, K, BLOCK_K):
        acc += _dot_cols(_w_cols(w_rows, r_ok, k0, BLOCK_K, PACKED), OBuf, k0, BLOCK_K, PACKED, is_bf16)
    tl.store(Y + rows, acc.to(Y.dtype.element_ty), mask=r_ok)
    if EXTRA:
        tl.store(Y + e_row, _dot_cols(w_extra, OBuf, 0, K, PACKED, is_bf16).to(Y.dtype.element_ty), mask=e_ok)


@triton.jit
def _decode_oproj_kernel(
    QKV, QW, KW, CosSin, Pos, KCache, VCache, PageTable, TableRows, SeqLens, OutLoc,
    PartOut, PartLse, SplitCounters, OBuf, Flags, W, Y,
    num_splits, min_split, N, qk_scale, q_eps, k_eps,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_cs,
    stride_pot, stride_poh, stride_pos, stride_plt, stride_plh, stride_wn,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, ZERO_CENTERED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr, PACKED: tl.constexpr,
    SPREAD: tl.constexpr, PHASE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # PHASE 0 (compiled): both parts in this one launch. Under the interpreter, which runs programs one after
    # another, a program would spin forever on attention programs after it: the wrapper launches PHASE 1
    # (attention only), then PHASE 2 (o_proj only), the same code either way.
    # SPREAD: the attention programs' row blocks go one row each to the first programs after them (whose
    # extra row loads before the PDL wait with their own block), so that no o_proj load waits for attention.
    pid = tl.program_id(0)
    num_attention = NUM_KV_HEADS * num_splits
    num_pollers = tl.num_programs(0) - num_attention if SPREAD else tl.num_programs(0)
    K: tl.constexpr = NUM_HEADS * HEAD_DIM
    if pid < num_attention:  # attention first, then (without SPREAD) its own o_proj rows, loaded after it
        if USE_PDL:  # q/k/v come from the QKV GEMV just before
            pdl_wait_then_release()
        if PHASE != 2:
            _attention_program(
                QKV, QW, KW, CosSin, Pos, KCache, VCache, PageTable, TableRows, SeqLens, OutLoc,
                PartOut, PartLse, SplitCounters, OBuf, Flags,
                pid // num_splits, pid % num_splits, num_splits, min_split, qk_scale, q_eps, k_eps,
                stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, stride_cs,
                stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
                NUM_HEADS, NUM_HEADS // NUM_KV_HEADS, BLOCK_M, HEAD_DIM, BLOCK_N, PAGE_SIZE, ZERO_CENTERED,
                DOT_PRECISION,
            )
        if PHASE != 1 and not SPREAD:
            _oproj_rows(W, Y, OBuf, Flags, pid, -1, num_pollers, N, stride_wn, NUM_KV_HEADS, K, BLOCK_ROWS,
                        BLOCK_K, PRE_K, PACKED, False, False)
    elif PHASE != 1:  # o_proj only: its rows stream before the PDL wait
        extra = pid - num_attention  # with SPREAD, row `extra` of the attention programs' blocks, if it is one
        extra = tl.where(extra < num_attention * BLOCK_ROWS, extra, -1)
        _oproj_rows(W, Y, OBuf, Flags, pid, extra, num_pollers, N, stride_wn, NUM_KV_HEADS, K, BLOCK_ROWS,
                    BLOCK_K, PRE_K, PACKED, USE_PDL, SPREAD)
    elif USE_PDL:
        pdl_wait_then_release()


@functools.cache
def _num_sms(device_index: int) -> int:  # asked on every eager launch: once per device
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def alloc_oproj_scratch(num_heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_buf, flags): the attention output row in fp32 (values already rounded to the model dtype) and
    the int32 flag, zero, which every launch leaves zero. Allocate outside graph capture."""
    return (torch.zeros(num_heads * head_dim, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def decode_attention_oproj(
    qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float, cos_sin_cache: torch.Tensor,
    zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    table_rows: torch.Tensor, seq_lens: torch.Tensor, out_loc: torch.Tensor, scale: float, o_weight: torch.Tensor,
    o_buf: torch.Tensor, flags: torch.Tensor, num_splits: int = 1, part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None, split_counters: torch.Tensor | None = None,
    min_split_tokens: int = 64, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """One decode row: qkv [1, (H + 2 Hkv) D] (the QKV projection's output) -> o_proj(attention) [1, N].

    Also stores the new k/v at out_loc [1] of the caches [pages, page_size, Hkv, D] (contiguous), as
    store_kv would. page_table [rows, pages]; table_rows, seq_lens [1] int32 (seq_lens counts the new
    key); cos_sin_cache [positions, D] ([cos | sin], whole-head rotary); o_weight [N, H D]. o_buf and
    flags: `alloc_oproj_scratch` (static for CUDA graphs). With num_splits > 1: part_out [>= 1, H, S, D]
    and part_lse [>= 1, H, S] fp32 (decode.alloc_partials) and split_counters [>= Hkv] int32, zero
    (decode.alloc_split_counters), all left as `decode_attention` leaves them."""
    head_dim = k_cache.shape[-1]
    hidden = o_weight.shape[0]
    k = num_heads * head_dim
    assert qkv.shape == (1, (num_heads + 2 * num_kv_heads) * head_dim) and qkv.stride(-1) == 1, (
        f"qkv {tuple(qkv.shape)} is not one row of {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} is not a power of two"
    assert cos_sin_cache.shape[-1] == head_dim, "the fused path takes whole-head rotary only"
    assert o_weight.shape[1] == k and o_weight.stride(1) == 1 and o_weight.dtype == qkv.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2] == num_kv_heads
    assert table_rows.shape[0] == 1 and o_buf.numel() >= k and flags.numel() >= 1
    cfg = config or oproj_config(hidden, k)
    block_rows, block_k, pre_k = cfg["block_rows"], min(cfg["block_k"], k), min(cfg["pre_k"], k)
    block_n = cfg.get("block_n", 32)
    assert pre_k & (pre_k - 1) == 0 and block_k & (block_k - 1) == 0 and (k - pre_k) % block_k == 0, (
        f"o_proj's {k} columns do not split into a first {pre_k} and steps of {block_k}")
    num_attention = num_kv_heads * num_splits
    if qkv.is_cuda:  # every attention program resident at once (they wait for each other): one an SM suffices
        sms = _num_sms(qkv.device.index or 0)
        assert num_attention <= sms, f"{num_kv_heads} x {num_splits} attention programs exceed the GPU's {sms} SMs"
    # a program per BLOCK_ROWS rows, and at least one per attention split (the extra ones' rows are past N)
    num_programs = max(triton.cdiv(hidden, block_rows), num_attention)
    # the attention programs' rows spread one a program over the programs after them, where there are enough
    spread = bool(cfg.get("spread", 1)) and num_attention * (block_rows + 1) <= num_programs
    if num_splits > 1:
        assert part_out is not None and part_lse is not None and split_counters is not None
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    else:  # never touched: any pointer of the right kind will do
        part_out, part_lse, split_counters = o_buf, o_buf, flags
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    # two 16-bit weights an int32 register until the spin ends: twice the columns in flight before it
    packed = o_weight.dtype in (torch.bfloat16, torch.float16)
    w = o_weight.view(torch.int32) if packed else o_weight
    y = torch.empty((1, hidden), dtype=qkv.dtype, device=qkv.device)
    kf = k_cache.view(-1, num_kv_heads, head_dim)
    vf = v_cache.view(-1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    for phase in ((1, 2) if triton_interpreted() else (0,)):
        _decode_oproj_kernel[(num_programs,)](
            qkv, q_weight, k_weight, cos_sin_cache, positions, kf, vf, page_table, table_rows, seq_lens, out_loc,
            part_out, part_lse, split_counters, o_buf, flags, w, y,
            num_splits, min_split_tokens, hidden, scale * LOG2E, float(q_eps), float(k_eps),
            kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1), page_table.stride(0), cos_sin_cache.stride(0),
            *po_strides, *pl_strides, w.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_M=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_N=block_n, PAGE_SIZE=k_cache.shape[1], ZERO_CENTERED=zero_centered,
            DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
            BLOCK_ROWS=block_rows, BLOCK_K=block_k, PRE_K=pre_k, PACKED=packed, SPREAD=spread, PHASE=phase,
            num_warps=cfg["num_warps"], num_stages=1, **pdl_launch(qkv),
        )
    return y


def decode_attention_oproj_reference(
    qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float, cos_sin_cache: torch.Tensor,
    zero_centered: bool, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    table_row: int, seq_len: int, out_loc: torch.Tensor, scale: float, o_weight: torch.Tensor,
) -> torch.Tensor:
    """The unfused kernels' references in order: q/k norm + rotary, store_kv, paged attention (output
    rounded to the model dtype), o_proj with fp32 accumulation."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.view(1, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    q, k = qk_norm_rotary_reference(positions, q, k, q_weight, k_weight, q_eps, k_eps, cos_sin_cache,
                                    head_dim, zero_centered=zero_centered)
    store_kv_reference(k, v, k_cache, v_cache, out_loc)
    o = paged_attention_reference(q, k_cache, v_cache, page_table, [table_row], [seq_len - 1], [1], scale)
    return (o.reshape(1, -1).float() @ o_weight.float().t()).to(qkv.dtype)
