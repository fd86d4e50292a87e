"""The gated-delta-net output norm `w * rmsnorm(x) * silu(z)` per head, as a Triton kernel (reference:
`gdn_ref.gated_rmsnorm_ref`). `_gated_norm` is the one-head form the recurrence kernel (gdn.py) applies in
its epilogue when one program holds a whole head; `gated_rmsnorm` is the launch it takes otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_ref import gated_rmsnorm_ref  # noqa: F401  (the reference, beside its kernel)
from .jit_util import _last_dim_contiguous
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release


@triton.jit
def _gated_norm(x, z_ptr, w_ptr, offs, mask, eps, D: tl.constexpr, DT: tl.constexpr):
    # transformers' Qwen3NextRMSNormGated on one head, x fp32 holding values of the model dtype DT:
    # normed in fp32 and rounded, times w in DT, times silu(z) in fp32, rounded once more (the caller)
    x = tl.where(mask, x, 0.0)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (w * (x * rstd).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return h * (z / (1.0 + tl.exp(-z)))


@triton.jit
def _gated_rmsnorm_kernel(
    X, Z, W, Out, num_heads, s_xt, s_xh, s_zt, s_zh, eps,
    D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (row t, block of BH heads): Out[t, h] = gated_norm(X[t, h], Z[t, h]), Out contiguous
    if USE_PDL:
        pdl_wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    offs = tl.arange(0, BD)
    mask = (heads < num_heads)[:, None] & (offs < D)[None, :]
    x = tl.load(X + t * s_xt + heads[:, None] * s_xh + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.where(mask, x, 0.0)
    DT = Out.dtype.element_ty
    w = tl.load(W + offs, mask=offs < D, other=0.0).to(tl.float32)
    zz = tl.load(Z + t * s_zt + heads[:, None] * s_zh + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + (t * num_heads + heads[:, None]) * D + offs[None, :], gated_norm_heads(x, w, zz, eps, D, DT).to(DT),
             mask=mask)


@triton.jit
def gated_norm_heads(x, w, z, eps, D: tl.constexpr, DT: tl.constexpr):
    """[heads, D] rows of one token (x, z fp32 holding values of the model dtype DT; padding lanes 0; w [D]
    fp32) -> w * rmsnorm(x) * silu(z) per head in fp32, with the reference's rounding before the last
    (the caller rounds to DT): `_gated_rmsnorm_kernel`, and gdn_out_gemv.py's K tiles."""
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    h = (w[None, :] * (x * rstd[:, None]).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return h * (z / (1.0 + tl.exp(-z)))


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head `w * rmsnorm(x) * silu(z)` (see `gated_rmsnorm_ref`) in one launch: x, z [T, H, D]
    (strided views with a unit last stride are fine; [N, D] is taken as [N, 1, D]), weight [D].
    Returns a contiguous tensor of x's shape."""
    if x.dim() == 2:
        return gated_rmsnorm(x[:, None], z[:, None], weight, eps).view(x.shape)
    T, H, D = x.shape
    assert z.shape == x.shape and weight.shape == (D,), \
        f"x {tuple(x.shape)}, z {tuple(z.shape)}, w {tuple(weight.shape)}"
    assert weight.dtype == x.dtype, "the norm rounds w * rmsnorm(x) to x's dtype: w must have it too"
    x, z = _last_dim_contiguous(x), _last_dim_contiguous(z)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bd = triton.next_power_of_2(D)
    bh = max(1, min(triton.next_power_of_2(H), 2048 // bd))  # ~2k elements per program
    _gated_rmsnorm_kernel[(T, triton.cdiv(H, bh))](
        x, z, weight, out, H, x.stride(0), x.stride(1), z.stride(0), z.stride(1), float(eps),
        D=D, BD=bd, BH=bh, num_warps=max(1, min(bh * bd // 256, 8)), **pdl_launch(x),
    )
    return out
