"""Per-head q/k RMSNorm and neox rotary in one launch (Qwen3 / Qwen3-MoE / Qwen3-Next attention).

Unfused, the GPU path runs three kernels per attention layer after the QKV projection (q RMSNorm,
k RMSNorm, rotary); at batch-1 decode each costs a launch (~1.5-2.5 us) for a few hundred bytes of
work. Here one program takes BLOCK_H heads of one token (q heads first, then k heads), reduces
each head's sum of squares over its whole D, and writes rotary(norm(x)) directly.

Rounding points are those of the unfused path (`qk_norm_rotary_ref.py`, built from
`fused_ops_ref.py`): the normed head is rounded to the model dtype exactly where the RMSNorm kernel
stores it (Llama: x * rstd rounded, then * weight rounded; zero-centred: x * rstd * (1 + w) in fp32,
rounded once), then each rotary product and sum as `fused_ops.rotary` rounds them, with FMA
contraction off (`fused_ops._COMPILE`). q and k may be strided views of the fused QKV output (the
gated attention's q is a [T, H, 2D] slice). Outputs are new contiguous tensors sized from shapes,
no host syncs: CUDA-graph safe. It takes part in the PDL chain like the other fused ops (waits
first: q/k are activations).

With `kv_out` (FREETOKEN_ROTARY_STORE_KV, decode/verify steps of the Triton attention backend) the
k-head programs also write the paged K/V cache as `attention/triton/store_kv.py` would: k as it is
stored to the output (then converted to the cache dtype), v copied as is, at flat slot out_loc[t],
so the backend skips its store_kv launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import _cos_sin_row
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release
from .qk_norm_rotary_ref import qk_norm_rotary_reference  # noqa: F401  (the reference, beside its kernel)

# No FMA contraction, as `fused_ops._COMPILE` (and why): a fused product would skip a rounding of
# the unfused path (1-ulp flips in ~7% of bf16 rotary outputs on the H200).
_COMPILE = dict(enable_fp_fusion=False)
# Rows of heads per program once the grid is large enough (prefill): ~2k elements, as `rotary`.
_ELEMS_PER_PROGRAM = 2048
# Up to this many tokens, one head per program: decode grids stay wide (T * (H + Hkv) programs) and
# each head reduces in the same 1-row layout as the RMSNorm kernel.
_ONE_HEAD_MAX_TOKENS = 64


@triton.jit
def _normed(x, W, offs, ok, rstd, dt: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """norm(x) in fp32, rounded to `dt` where the unfused norm stores it."""
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)[None, :]
    xr = x.to(tl.float32) * rstd
    if ZERO_CENTERED:  # ZeroCenteredRMSNorm: one rounding of x * rstd * (1 + w)
        return (xr * (1.0 + w)).to(dt).to(tl.float32)
    return (xr.to(dt).to(tl.float32) * w).to(dt).to(tl.float32)  # LlamaRMSNorm: round, * weight, round


@triton.jit
def _store_out(dst, cdst, offs, val, mask, STORE_CACHE: tl.constexpr):
    """`val` (model dtype) to the output and, STORE_CACHE, to the cache row too: rounded to the model
    dtype first, then converted to the cache's, as store_kv converts the stored k."""
    tl.store(dst + offs, val, mask=mask)
    if STORE_CACHE:
        tl.store(cdst + offs, val.to(cdst.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rotate_heads(
    X, W, Out, cos, sin, t, h0, num_heads, stride_xt, stride_xh, eps, Cache, slot, stride_cslot, stride_chead,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, ZERO_CENTERED: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    src = X + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    dst = Out + (t * num_heads + heads[:, None].to(tl.int64)) * D
    cdst = Cache + slot * stride_cslot + heads[:, None].to(tl.int64) * stride_chead  # used with STORE_CACHE only
    dt = Out.dtype.element_ty
    # rstd over the whole head in one reduction, as the RMSNorm kernel computes it
    offs = tl.arange(0, BLOCK_D)
    full = tl.load(src + offs[None, :], mask=hmask[:, None] & (offs < D)[None, :], other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(full * full, axis=1) / D + eps)[:, None]
    # the halves again (L1 hits) so that each lane holds a rotation pair
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    m = hmask[:, None] & dm[None, :]
    x1 = _normed(tl.load(src + d[None, :], mask=m, other=0.0), W, d, dm, rstd, dt, ZERO_CENTERED)
    x2 = _normed(tl.load(src + HALF + d[None, :], mask=m, other=0.0), W, HALF + d, dm, rstd, dt, ZERO_CENTERED)
    # `fused_ops._rotate_heads`' rounding: each product, then the sum
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    _store_out(dst, cdst, d[None, :], o1.to(dt), m, STORE_CACHE)
    _store_out(dst, cdst, HALF + d[None, :], o2.to(dt), m, STORE_CACHE)
    if BLOCK_PASS > 0:  # partial rotary: the normed features past rot_dim pass through
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pok = p < D
        pm = hmask[:, None] & pok[None, :]
        xp = _normed(tl.load(src + p[None, :], mask=pm, other=0.0), W, p, pok, rstd, dt, ZERO_CENTERED)
        _store_out(dst, cdst, p[None, :], xp.to(dt), pm, STORE_CACHE)


@triton.jit
def _copy_v_heads(V, VCache, t, slot, h0, num_heads, stride_vt, stride_vh, stride_cslot, stride_chead,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # store_kv's v: copied as is, converted to the cache dtype
    heads = h0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    m = (heads < num_heads)[:, None] & (offs < D)[None, :]
    h64 = heads[:, None].to(tl.int64)
    v = tl.load(V + t * stride_vt + h64 * stride_vh + offs[None, :], mask=m)
    dst = VCache + slot * stride_cslot + h64 * stride_chead + offs[None, :]
    tl.store(dst, v.to(VCache.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rotary_kernel(
    Q, K, QW, KW, QOut, KOut, CosSin, Pos, V, KCache, VCache, OutLoc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, stride_vt, stride_vh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    num_q_heads, num_k_heads, num_q_blocks, q_eps, k_eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, ZERO_CENTERED: tl.constexpr, STORE_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # STORE_KV: V, KCache, VCache, OutLoc are read; otherwise they are placeholders
    if USE_PDL:  # freetoken_core/kernels/pdl.py: q/k/v come from the QKV GEMV just before
        pdl_wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin = _cos_sin_row(CosSin, Pos, t, stride_cs, HALF, BLOCK_HALF)
    if hb < num_q_blocks:
        _norm_rotate_heads(Q, QW, QOut, cos, sin, t, hb * BLOCK_H, num_q_heads, stride_qt, stride_qh, q_eps,
                           QOut, 0, 0, 0, D, HALF, BLOCK_H, BLOCK_D, BLOCK_HALF, BLOCK_PASS, ZERO_CENTERED, False)
    else:
        h0 = (hb - num_q_blocks) * BLOCK_H
        slot = 0
        if STORE_KV:
            slot = tl.load(OutLoc + t).to(tl.int64)
        _norm_rotate_heads(K, KW, KOut, cos, sin, t, h0, num_k_heads, stride_kt, stride_kh, k_eps,
                           KCache, slot, stride_kcs, stride_kch, D, HALF, BLOCK_H, BLOCK_D, BLOCK_HALF, BLOCK_PASS,
                           ZERO_CENTERED, STORE_KV)
        if STORE_KV:
            _copy_v_heads(V, VCache, t, slot, h0, num_k_heads, stride_vt, stride_vh, stride_vcs, stride_vch,
                          D, BLOCK_H, BLOCK_D)


def _num_warps(block: int) -> int:
    return max(1, min(block // 256, 16))  # as fused_ops: 1 warp for one 128-wide head


def _heads_per_program(num_tokens: int, num_heads: int, block_d: int) -> int:
    if num_tokens <= _ONE_HEAD_MAX_TOKENS:
        return 1
    return max(1, min(triton.next_power_of_2(num_heads), _ELEMS_PER_PROGRAM // block_d))


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    q_eps: float, k_eps: float, cos_sin_cache: torch.Tensor, rot_dim: int, zero_centered: bool = False,
    v: torch.Tensor | None = None, kv_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D], positions [T] -> (rotary(norm(q)), rotary(norm(k))), new contiguous
    tensors; see `qk_norm_rotary_reference`. q/k may be views with any token/head strides (the last
    dim contiguous); cos_sin_cache [max_positions, rot_dim] is RotaryEmbedding's [cos | sin] table.

    kv_out (k_cache, v_cache, out_loc), with v [T, Hkv, D]: also store_kv(k_out, v, k_cache, v_cache,
    out_loc) in the same launch: caches [pages, page_size, Hkv, D] (any dtype; values converted as
    store_kv converts them) at flat slots out_loc [T] (an `attention.base.KVStoreTarget`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and rot_dim % 2 == 0 and rot_dim <= head_dim
    assert (v is None) == (kv_out is None), "the fused K/V store needs both v and kv_out"
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    fused_store = kv_out is not None
    if fused_store:
        assert v is not None
        k_cache, v_cache, out_loc = kv_out
        _check_kv_out(k, v, k_cache, v_cache, out_loc)
        v = v if v.stride(-1) == 1 else v.contiguous()
    else:  # placeholders, never read (STORE_KV False)
        v, k_cache, v_cache, out_loc = k, k_out, k_out, positions
    half = rot_dim // 2
    block_d = triton.next_power_of_2(head_dim)
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(head_dim - rot_dim) if rot_dim < head_dim else 0
    block_h = _heads_per_program(num_tokens, max(num_q_heads, num_k_heads), block_d)
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_k_heads, block_h))
    _qk_norm_rotary_kernel[grid](
        q, k, q_weight, k_weight, q_out, k_out, cos_sin_cache, positions, v, k_cache, v_cache, out_loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), v.stride(0), v.stride(1),
        k_cache.stride(-3), k_cache.stride(-2), v_cache.stride(-3), v_cache.stride(-2),
        num_q_heads, num_k_heads, num_q_blocks, float(q_eps), float(k_eps),
        D=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        ZERO_CENTERED=zero_centered, STORE_KV=fused_store, num_warps=_num_warps(block_h * block_d), **_COMPILE,
        **pdl_launch(q),
    )
    return q_out, k_out


def _check_kv_out(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out_loc: torch.Tensor) -> None:
    """Shapes only (no host syncs). The slot stride addresses flat slots, as store_kv does: each cache
    must be [pages, page_size, Hkv, D] with its pages and slots evenly strided (KVCache's buffers are
    contiguous)."""
    assert v.shape == k.shape, f"v {tuple(v.shape)} does not match k {tuple(k.shape)}"
    assert out_loc.shape == (k.shape[0],), f"out_loc {tuple(out_loc.shape)} for {k.shape[0]} tokens"
    for cache in (k_cache, v_cache):
        assert cache.dim() == 4 and tuple(cache.shape[2:]) == tuple(k.shape[1:]), (
            f"cache {tuple(cache.shape)} does not hold [Hkv, D] = {tuple(k.shape[1:])} rows"
        )
        assert cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1), (
            "the cache's slots must be evenly strided (flat slot indexing)"
        )
