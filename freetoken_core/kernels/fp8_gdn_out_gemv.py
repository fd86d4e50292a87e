"""`gdn_out_gemv.gdn_out_norm_gemv` for a block-FP8 out_proj: the GDN layer's gated output norm inside out_proj's
one-row GEMV, the weight float8_e4m3fn [N, H*dv] with scale_inv [ceil(N/GN), ceil(H*dv/GK)] (fp8_gemv.py's format).
Same K tiles of whole heads, normed in registers; the block scales multiply the normed tile, as in `fp8_gemv`.
Reference: `gdn_ref.gdn_out_norm_gemv_ref` on the dequantized weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_gemv import check_fp8_weight, k_scales, pow2_divisor
from .fp8_ref import DEFAULT_BLOCK
from .gdn_out_gemv import _normed_tile, gdn_out_gemv_config
from .gemv import _w_tile
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release


@triton.jit
def _fp8_gdn_out_norm_gemv_kernel(o_ptr, z_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, H, s_zh, stride_wn, stride_sn,
                                  eps, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, DV: tl.constexpr,
                                  HEADS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                                  EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    K = H * DV
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    s_row = s_ptr + ((pid * BLOCK_N) // GROUP_N) * stride_sn
    nw = tl.load(nw_ptr + tl.arange(0, DV)).to(tl.float32)  # a weight: no earlier kernel writes it
    acc = tl.zeros((BLOCK_N, HEADS * DV), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile and its scales load before the wait
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, HEADS * DV, EVEN_K)
        s = k_scales(s_row, 0, K, GROUP_K, HEADS * DV, EVEN_K)
        pdl_wait_then_release()
        acc += w.to(tl.float32) * (_normed_tile(o_ptr, z_ptr, nw, 0, H, s_zh, eps, DV, HEADS) * s)[None, :]
        k_start = HEADS * DV
    for k0 in range(k_start, K, HEADS * DV):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, HEADS * DV, EVEN_K)
        s = k_scales(s_row, k0, K, GROUP_K, HEADS * DV, EVEN_K)
        acc += w.to(tl.float32) * (_normed_tile(o_ptr, z_ptr, nw, k0 // DV, H, s_zh, eps, DV, HEADS) * s)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def fp8_gdn_out_norm_gemv(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                          block: tuple[int, int] = DEFAULT_BLOCK, block_n: int | None = None, heads: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """One row: out_proj(gated_rmsnorm(o, z)) for a block-FP8 out_proj, in one launch. Arguments as
    `gdn_out_gemv.gdn_out_norm_gemv` (o [1, H*dv] contiguous, z [1, H, dv] with a unit last stride, dv a power of
    two), plus the weight's scale_inv and block. Returns [1, N] in o's dtype."""
    H, dv = z.shape[-2:]
    n = weight.shape[0]
    check_fp8_weight(weight, scale_inv, block)
    if o.shape[0] != 1 or o.numel() != H * dv or not o.is_contiguous() or z.stride(-1) != 1 or dv & (dv - 1):
        raise ValueError(f"fp8_gdn_out_norm_gemv takes one contiguous row o {tuple(o.shape)} of {H} heads of a power-of-"
                         f"two dv {dv} and z {tuple(z.shape)} with a unit last stride")
    if weight.shape[1] != H * dv or norm_weight.shape != (dv,):
        raise ValueError(f"weight {tuple(weight.shape)} / norm weight {tuple(norm_weight.shape)} do not fit {H} x {dv}")
    cfg = gdn_out_gemv_config(n, H, dv)
    heads = heads or cfg["heads"]
    bn = pow2_divisor(block_n or cfg["block_n"], block[0])
    if heads & (heads - 1) or (heads * dv < block[1] and block[1] % (heads * dv)):
        raise ValueError(f"heads={heads} per K step must be a power of two whose {heads * dv} columns tile the "
                         f"scale block {block[1]}")
    y = torch.empty((1, n), dtype=o.dtype, device=o.device)
    _fp8_gdn_out_norm_gemv_kernel[(triton.cdiv(n, bn),)](
        o, z, norm_weight, weight, scale_inv, bias if bias is not None else o, y, n, H, z.stride(-2), weight.stride(0),
        scale_inv.stride(0), float(eps), GROUP_N=block[0], GROUP_K=block[1], DV=dv, HEADS=heads,
        HAS_BIAS=bias is not None, BLOCK_N=bn, EVEN_K=H % heads == 0, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"], **pdl_launch(o),
    )
    return y
