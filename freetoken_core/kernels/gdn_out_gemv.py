"""The gated-delta-net (GDN) layer's tail at one row: the gated output norm inside out_proj's GEMV.

At batch 1 the recurrence's tile is a fraction of a head (kernels/gdn.py GDN_UPDATE_CONFIGS: BV 16 of
dv 128), so it cannot norm a head in its epilogue and pays a `gated_rmsnorm` launch before out_proj.
Here every program of the one-row GEMV (kernels/gemv.py `_gemv_kernel`) steps over K in tiles of
whole heads and norms them itself, `w * rmsnorm(o_head) * silu(z_head)`, before multiplying: every
program redundantly norms the (small, L2-resident) input row, which costs far less than a launch.
The rounding points are the unfused path's: the norm is rounded to the model dtype as the norm
kernel stores it, then the GEMV accumulates in fp32 (`gdn_ref.gdn_out_norm_gemv_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_rmsnorm import gated_norm_heads
from .gdn_ref import gdn_out_norm_gemv_ref  # noqa: F401  (the reference, beside its kernel)
from .gemv import _w_tile, gemv_config
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release

# Tiles per out_proj shape (N, K): block_n, heads (whole heads per K step), num_warps, num_stages. Not yet
# measured (FREETOKEN_GDN_OUT_NORM_GEMV is off until it is): shapes not listed take the plain GEMV's
# tile for (N, K) with its block_k cut to whole heads (Qwen3.6's 2048 x 4096: 4 rows, 8 heads of 128).
GDN_OUT_GEMV_CONFIGS: dict[tuple[int, int], dict[str, int]] = {}


def gdn_out_gemv_config(n: int, num_heads: int, dv: int) -> dict[str, int]:
    cfg = GDN_OUT_GEMV_CONFIGS.get((n, num_heads * dv))
    if cfg is not None:
        return cfg
    base = gemv_config(n, num_heads * dv)
    heads = 1 << (max(1, base["block_k"] // dv).bit_length() - 1)  # the most whole heads within block_k
    heads = min(triton.next_power_of_2(num_heads), heads)
    return dict(block_n=base["block_n"], heads=heads, num_warps=base["num_warps"], num_stages=base["num_stages"])


@triton.jit
def _normed_tile(o_ptr, z_ptr, nw, h0, H, s_zh, eps, DV: tl.constexpr, HEADS: tl.constexpr):
    # heads h0 .. h0+HEADS-1 of the row (heads past H read as 0), gated-normed as kernels/gated_rmsnorm.py
    # `gated_norm_heads` does, rounded to the model dtype (the unfused path stores the norm), and
    # flattened to the GEMV's K tile (row-major: element k of the tile is o[h0 + k // DV, k % DV])
    DT = o_ptr.dtype.element_ty
    heads = h0 + tl.arange(0, HEADS)
    offs_d = tl.arange(0, DV)
    mask = (heads < H)[:, None]
    x = tl.load(o_ptr + heads[:, None] * DV + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    zz = tl.load(z_ptr + heads[:, None] * s_zh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = gated_norm_heads(x, nw, zz, eps, DV, DT).to(DT).to(tl.float32)
    return tl.reshape(out, (HEADS * DV,))


@triton.jit
def _gdn_out_norm_gemv_kernel(o_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, N, H, s_zh, stride_wn, eps,
                              DV: tl.constexpr, HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                              EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    # y = W gated_norm(o, z) for one row: kernels/gemv.py `_gemv_kernel` with K tiles of HEADS whole heads
    # (BLOCK_K = HEADS * DV) normed in registers before the multiply
    K = H * DV
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    nw = tl.load(nw_ptr + tl.arange(0, DV)).to(tl.float32)  # a weight: no earlier kernel writes it
    acc = tl.zeros((BLOCK_N, HEADS * DV), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile loads before the wait: no earlier kernel writes weights
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, HEADS * DV, EVEN_K)
        pdl_wait_then_release()
        acc += w.to(tl.float32) * _normed_tile(o_ptr, z_ptr, nw, 0, H, s_zh, eps, DV, HEADS)[None, :]
        k_start = HEADS * DV
    for k0 in range(k_start, K, HEADS * DV):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, HEADS * DV, EVEN_K)
        acc += w.to(tl.float32) * _normed_tile(o_ptr, z_ptr, nw, k0 // DV, H, s_zh, eps, DV, HEADS)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def use_gdn_out_norm_gemv(o: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gdn_out_norm_gemv` takes this row: one CUDA row in half precision, the weight in its dtype
    with contiguous rows (the layer checks its switch and that the recurrence did not norm already)."""
    return (o.is_cuda and o.shape[0] == 1 and o.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == o.dtype and weight.stride(1) == 1)


def gdn_out_norm_gemv(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None, block_n: int | None = None, heads: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """One row: out_proj(gated_rmsnorm(o, z)) in one launch (see `gdn_out_norm_gemv_ref`). o [1, H, dv] or
    [1, H*dv], contiguous (the recurrence's un-normed output); z [1, H, dv] with a unit last stride (a view
    of in_proj's row); norm_weight [dv] in o's dtype; weight [N, H*dv] with contiguous rows; dv a power of
    two. heads: whole heads per K step (a power of two; H need not be a multiple). Returns [1, N]."""
    assert z.dim() == 3, f"z [1, H, dv], got {tuple(z.shape)}"
    H, dv = z.shape[-2:]
    n = weight.shape[0]
    assert o.shape[0] == 1 and z.shape[0] == 1, f"gdn_out_norm_gemv takes one row, got {o.shape[0]}"
    assert o.numel() == H * dv and o.is_contiguous(), f"o {tuple(o.shape)}: contiguous, {H} heads of {dv}"
    assert dv & (dv - 1) == 0, f"the head dim dv={dv} must be a power of two (each K tile holds whole heads)"
    assert z.stride(-1) == 1 and norm_weight.shape == (dv,) and norm_weight.dtype == o.dtype, \
        f"z {tuple(z.shape)} needs a unit last stride, the norm weight [{dv}] o's dtype"
    assert weight.shape[1] == H * dv and weight.stride(1) == 1, f"weight {tuple(weight.shape)} vs K = {H * dv}"
    cfg = gdn_out_gemv_config(n, H, dv)
    block_n, heads = block_n or cfg["block_n"], heads or cfg["heads"]
    assert heads & (heads - 1) == 0, f"heads={heads} per K step must be a power of two"
    y = torch.empty((1, n), dtype=o.dtype, device=o.device)
    _gdn_out_norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        o, z, norm_weight, weight, bias if bias is not None else weight, y, n, H, z.stride(-2), weight.stride(0),
        float(eps), DV=dv, HEADS=heads, HAS_BIAS=bias is not None, BLOCK_N=block_n, EVEN_K=H % heads == 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"], **pdl_launch(o),
    )
    return y
