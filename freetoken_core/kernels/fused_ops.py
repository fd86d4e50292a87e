"""Fused Triton-language kernels for the small per-layer ops of the GPU path.

In bf16, torch runs RMSNorm as ~7 elementwise kernels, rotary as ~10 and SiLU-and-mul as 2-3; at
batch 1 inside a CUDA graph a decode step is bound by those hundreds of tiny launches, not by the
weight reads. Each op here is one launch:

- `rmsnorm(x, w, eps)` and `fused_add_rmsnorm(x, residual, w, eps) -> (normed, x + residual)`:
  one program per row; `zero_centered=True` is the Qwen3-Next / Qwen3.5 norm (the checkpoint
  stores w - 1, the product is taken in fp32 and rounded once: `(rmsnorm(x) * (1 + w)).to(dtype)`).
- `silu_and_mul(x [T, 2I]) -> [T, I]`.
- `rotary(positions, q, k, cos_sin_cache, rot_dim)`: neox (rotate-half) rotary of q and k in
  one launch, partial rotary (rot_dim < head_dim) included.

Every kernel computes in fp32 and rounds to the model dtype at the same points as the plain-torch
code (which is the CPU path and the reference, `fused_ops_ref.py`), so bf16 results equal it up
to the last-ulp differences of fp32 reduction order and rsqrt/exp. No host syncs, outputs
allocated from shapes only: safe inside CUDA graphs. `FREETOKEN_FUSED_OPS=0` turns the dispatch off
(for A/B benchmarks and debugging).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..env import kernel_env
from .fused_ops_ref import (  # noqa: F401  (the references, beside their kernels)
    apply_rotary, fused_add_rmsnorm_reference, rmsnorm_reference, rotary_reference, silu_and_mul_reference,
    zero_centered_rms_norm_torch,
)
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release

ENABLED = kernel_env().fused_ops  # FREETOKEN_FUSED_OPS (freetoken_core/env.py)


def use_fused(x: torch.Tensor) -> bool:
    """Dispatch rule of the layers: fused kernels for CUDA tensors, plain torch elsewhere."""
    return ENABLED and x.is_cuda


def _num_warps(block: int) -> int:
    return max(1, min(block // 256, 16))


# No FMA contraction: after LLVM narrows `round(round(a*b) - round(c*d))` to bf16/fp16 ops it would fuse
# the first product into the subtraction and skip a rounding the torch reference does (seen on the
# H200: 1-ulp flips in ~7% of rotary outputs). These kernels are memory-bound; the FMAs buy nothing.
_COMPILE = dict(enable_fp_fusion=False)


# ----------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Out, ResOut,
    inner, stride_x0, stride_x1, stride_r0, stride_r1, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    # Rows of a [R0, R1, N] view (R1 = 1 for 2-D inputs): a [T, H, D] slice of a fused projection
    # (Qwen3's q/k norm) is normed in place of a copy.
    row = tl.program_id(0).to(tl.int64)
    i0, i1 = row // inner, row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + i0 * stride_x0 + i1 * stride_x1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + i0 * stride_r0 + i1 * stride_r1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # torch's x + residual rounding
        tl.store(ResOut + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * N + offs, rms_scaled(xf, rstd, w, X.dtype.element_ty, ZERO_CENTERED).to(Out.dtype.element_ty),
             mask=mask)


@triton.jit
def rms_scaled(xf, rstd, w, DT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The RMSNorm's output before its store, with the rounding points of the reference (xf: x in fp32
    holding values of the model dtype DT; w fp32): shared by every kernel that writes a normed row."""
    if ZERO_CENTERED:  # Qwen3NextRMSNorm: (x * rstd * (1 + w)) in fp32, rounded once
        return (xf * rstd) * (1.0 + w)
    return (xf * rstd).to(DT).to(tl.float32) * w  # LlamaRMSNorm: round, then * weight


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., N] as (tensor, inner, stride0, stride1) with rows = outer * inner, no copy for 2-D/3-D
    inputs whose last dim is contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() != 3:
        x = x.reshape(-1, x.shape[-1])
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


def _launch_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, res_out
    xv, inner, sx0, sx1 = _rows_view(x)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        rv, _, sr0, sr1 = _rows_view(residual)
    else:
        rv, sr0, sr1 = xv, 0, 0
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(rows,)](
        xv, rv, weight, out, res_out if res_out is not None else out,
        inner, sx0, sx1, sr0, sr1, float(eps),
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered,
        num_warps=_num_warps(block), **_COMPILE,
        **pdl_launch(x),
    )
    return out, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x [..., N] -> RMSNorm(x) * weight (zero_centered: * (1 + weight)), a new contiguous tensor of x's
    shape and dtype."""
    return _launch_rmsnorm(x, None, weight, eps, zero_centered)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), both new tensors; one read of x and residual."""
    out, res_out = _launch_rmsnorm(x, residual, weight, eps, zero_centered)
    assert res_out is not None
    return out, res_out




# ----------------------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, I, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu(gate) to the model dtype before the product
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * I + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] laid out [gate | up] -> silu(gate) * up, [..., I] (new contiguous tensor)."""
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out, x2.stride(0), inter, BLOCK=block, num_warps=_num_warps(block), **_COMPILE, **pdl_launch(x2),
    )
    return out




# ----------------------------------------------------------------------------------------- rotary


@triton.jit
def _cos_sin_row(CosSin, Pos, t, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's cos and sin as [1, BLOCK_HALF] fp32 rows (cache row = [cos (rot_dim / 2) | sin (rot_dim / 2)]
    in the model dtype)."""
    pos = tl.load(Pos + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    cos = tl.load(CosSin + pos * stride_cs + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotate_heads(
    X, Out, cos, sin, t, h0, num_heads, stride_xt, stride_xh,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    d = tl.arange(0, BLOCK_HALF)
    m = hmask[:, None] & (d < HALF)[None, :]
    src = X + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    dst = Out + (t * num_heads + heads[:, None].to(tl.int64)) * D
    x1 = tl.load(src + d[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    dt = Out.dtype.element_ty
    # Same rounding points as `apply_rotary` in the model dtype: each product, then the sum.
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    tl.store(dst + d[None, :], o1.to(dt), mask=m)
    tl.store(dst + HALF + d[None, :], o2.to(dt), mask=m)
    if BLOCK_PASS > 0:  # partial rotary: features past rot_dim pass through
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pm = hmask[:, None] & (p < D)[None, :]
        tl.store(dst + p[None, :], tl.load(src + p[None, :], mask=pm), mask=pm)


@triton.jit
def _rotary_kernel(
    Q, K, QOut, KOut, CosSin, Pos,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_k_heads, num_q_blocks,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # freetoken_core/kernels/pdl.py
        pdl_wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cos, sin = _cos_sin_row(CosSin, Pos, t, stride_cs, HALF, BLOCK_HALF)
    if hb < num_q_blocks:
        _rotate_heads(Q, QOut, cos, sin, t, hb * BLOCK_H, num_q_heads, stride_qt, stride_qh,
                      D, HALF, BLOCK_H, BLOCK_HALF, BLOCK_PASS)
    else:
        _rotate_heads(K, KOut, cos, sin, t, (hb - num_q_blocks) * BLOCK_H, num_k_heads, stride_kt, stride_kh,
                      D, HALF, BLOCK_H, BLOCK_HALF, BLOCK_PASS)


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
           rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated (q, k), new contiguous tensors.

    cos_sin_cache [max_positions, rot_dim] holds [cos | sin] of each position (RotaryEmbedding's
    table); q and k may be strided views of a fused qkv projection.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q, k = _heads_view(q), _heads_view(k)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = rot_dim // 2
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(head_dim - rot_dim) if rot_dim < head_dim else 0
    # ~2k elements per program: all heads of a token for small models, a few programs for large ones
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 2048 // (2 * block_half)))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        q, k, q_out, k_out, cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_k_heads, num_q_blocks,
        D=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=block_pass,
        num_warps=_num_warps(block_h * 2 * block_half), **_COMPILE, **pdl_launch(q),
    )
    return q_out, k_out
