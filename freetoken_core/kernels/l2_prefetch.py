"""L2 prefetch of weights read later in a batch-1 decode step (FREETOKEN_L2_PREFETCH, Hopper).

A batch-1 step has stretches that barely touch memory: attention's K/V store, split and merge over a few
hundred keys (7.4 us a layer on Qwen3-30B-A3B), the gated-delta-net conv and recurrence (8.2 us on Qwen3.6),
the MoE router's top-k. HBM idles there, and the weights read right after stream from HBM. The launch just
before such a stretch issues `cp.async.bulk.prefetch.L2` for a weight read after it (`l2_prefetch_share`: each
program its share, in pieces spread over its lanes; fire and forget: the copy engine fills L2 while the
latency-bound kernels run, nothing waits on it). Which launch prefetches what: models/blocks.py
`plan_l2_prefetch`, and the MoE gate/up GEMV its routes' down weights (kernels/moe_gemv.py).

A prefetch changes no value anywhere, only where the bytes come from, so results are bit-identical with and
without it. Hopper's bulk prefetch needs sm_90 and 16-byte aligned pieces; the interpreter has no inline PTX,
so on the CPU the kernels never take this branch. Off until measured on the GPU
(`benchmarks/decode_variants.py` with env:FREETOKEN_L2_PREFETCH=1).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..env import kernel_env, triton_interpreted

ALIGN = 16  # bytes: the bulk prefetch's address and size granularity
# At most this share of the L2 is asked for at once: what the next kernels read (K/V, states, activations)
# must still fit beside it.
MAX_L2_SHARE = 0.5
MIN_PIECE: tl.constexpr = tl.constexpr(4096)  # bytes: the smallest bulk prefetch a lane issues (l2_prefetch_share)


@functools.cache
def _l2_bytes(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    if props.major < 9:  # cp.async.bulk.prefetch.L2 is sm_90+
        return 0
    return int(getattr(props, "L2_cache_size", 0))


def _bytes_of(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """weight as one aligned block of bytes (uint8) a launch on `x` may prefetch, or None: the switch off, no
    weight, CPU or the interpreter, another device, not contiguous or not 16-byte aligned."""
    if weight is None or not kernel_env().l2_prefetch or not x.is_cuda or triton_interpreted():
        return None
    if weight.device != x.device or not weight.is_contiguous() or weight.data_ptr() % ALIGN:
        return None
    return weight.view(-1).view(torch.uint8)


def _budget(x: torch.Tensor) -> int:
    """The most bytes one launch asks for: MAX_L2_SHARE of the L2 (0 before Hopper)."""
    return int(MAX_L2_SHARE * _l2_bytes(x.device.index or 0)) // ALIGN * ALIGN


def prefetch_target(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The bytes a launch on `x` prefetches for `weight`, or None (see `_bytes_of`; also a weight over the budget)."""
    b = _bytes_of(weight, x)
    return b if b is not None and ALIGN <= b.numel() <= _budget(x) else None


def prefix_target(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """As `prefetch_target`, but a weight over the budget gives its first rows' bytes (as many as the budget holds)
    instead of None: the GEMV programs that read those rows find them in L2."""
    b = _bytes_of(weight, x)
    if b is None or b.numel() < ALIGN:
        return None
    budget = _budget(x)
    return b[:budget] if budget >= ALIGN else None


def expert_rows_target(w: torch.Tensor | None, x: torch.Tensor, routes: int) -> torch.Tensor | None:
    """As `prefetch_target` for stacked expert weights [E, ...] of which a launch prefetches `routes` experts' blocks
    (one each): the whole stack as bytes, or None (an expert's block not whole 16-byte pieces, or the routes'
    blocks together over the budget)."""
    b = _bytes_of(w, x)
    if b is None:
        return None
    expert = b.numel() // w.shape[0]
    return b if expert % ALIGN == 0 and routes * expert <= _budget(x) else None


def launch_args(target: torch.Tensor | None, fallback: torch.Tensor) -> dict:
    """Kernel arguments of a GEMV taking `l2_prefetch_share`: pf_ptr, pf_bytes and the PREFETCH constexpr."""
    if target is None:
        return dict(pf_ptr=fallback, pf_bytes=0, PREFETCH=False)
    return dict(pf_ptr=target, pf_bytes=target.numel() // ALIGN * ALIGN, PREFETCH=True)


@triton.jit
def l2_prefetch_share(pf_ptr, pf_bytes, pid, num_programs, LANES: tl.constexpr):
    """Program `pid` of `num_programs` prefetches its share of pf_ptr[0:pf_bytes] (uint8) into L2 with bulk
    prefetches from a LANES-wide vector (one element a thread, so no thread repeats another's): the share in
    pieces of at least MIN_PIECE bytes, one a lane (a GEMV program's ~20 KB share: a few lanes; one top-k
    program's whole next weight: every lane)."""
    share = (pf_bytes // num_programs + 15) // 16 * 16
    start = pid * share
    size = tl.minimum(share, pf_bytes - start)
    piece = tl.maximum((share // LANES + 15) // 16 * 16, MIN_PIECE)
    lanes = tl.arange(0, LANES)
    offs = lanes * piece
    sizes = tl.minimum(piece, size - offs)
    sizes = tl.where(sizes > 0, sizes, 0).to(tl.int32)
    ptrs = pf_ptr + start.to(tl.int64) + offs.to(tl.int64)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)
