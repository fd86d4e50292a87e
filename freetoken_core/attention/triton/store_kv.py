"""Write the new K and V rows of a step into the paged cache: one launch for both tensors.

One program per new token copies its Hkv * D keys and values to flat slot `out_loc[t]`
(reference: `reference.store_kv_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.pdl import pdl_launch
from ...kernels.pdl_jit import pdl_wait_then_release


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, OutLoc,
    stride_kt, stride_vt, stride_kcs, stride_vcs,
    ROW: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    t = tl.program_id(0)
    slot = tl.load(OutLoc + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(KCache + slot * stride_kcs + offs, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vcs + offs, v.to(VCache.dtype.element_ty), mask=mask)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] with each token's Hkv * D values contiguous (a q/k/v split of a fused projection
    already is; anything else is copied)."""
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor
) -> None:
    """k/v [T, Hkv, D] -> caches [pages, page_size, Hkv, D] at flat slots out_loc [T] (int32/int64)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, out_loc,
        k.stride(0), v.stride(0), k_cache.stride(1), v_cache.stride(1),
        ROW=row, BLOCK=triton.next_power_of_2(row), **pdl_launch(k),
    )
