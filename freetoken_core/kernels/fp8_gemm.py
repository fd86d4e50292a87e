"""Block-FP8 GEMMs for prefill and large batches (many rows), two ways, both with fp32 accumulation:

- w8a8 (vLLM/SGLang block-FP8 style): the activations are quantized per token and per GK-column group by
  `per_token_group_quant_fp8` (one small launch), then `tl.dot` runs on FP8 operands (Hopper's FP8 tensor cores)
  and each K step's product is scaled by its token's activation scale and the weight block's scale.
- weight-only: the FP8 weight tile converts (exactly) to the activations' dtype and `tl.dot` runs in bf16; each
  K step's product is scaled by the weight block's scale. No quantization launch, no activation rounding.

`fp8_linear` dispatches any row count: the GEMVs of `fp8_gemv.py` up to 16 rows, then w8a8 for 16-bit activations
(twice as fast as weight-only already at 64 rows, `benchmarks/bench_fp8.py --tiles`) and weight-only for fp32 ones
(the reference math the CPU tests hold to transformers). Weight format as
`fp8_gemv.py`: float8_e4m3fn [N, K] with contiguous rows, scale_inv [ceil(N/GN), ceil(K/GK)]. The weight tile is
loaded [BLOCK_K, BLOCK_N] from K-contiguous rows (the K-major B operand Hopper's FP8 wgmma needs). BLOCK_K divides
GK and BLOCK_N divides GN, so one scale per weight tile and K step. References: `fp8_gemm_ref.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fp8_gemm_ref import (  # noqa: F401  (the references, beside their kernels)
    ACT_QUANT_EPS, fp8_gemv_reference, per_token_group_quant_fp8_reference, w8a8_gemm_reference,
)
from .fp8_gemv import check_fp8_weight, fp8_gemv, fp8_rows_gemm, pow2_divisor
from .gemv import ROWS_GEMM_MAX_ROWS
from .fp8_ref import DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX
from ..env import triton_interpreted

_E4M3_MAX = tl.constexpr(FP8_MAX)
# GEMM tiles: the best of `benchmarks/bench_fp8.py --tiles` on Qwen3-30B-A3B's attention shapes at 64 and 8,192 rows
# (H100; RESULTS, "Block-FP8"); from FEW_ROWS rows torch's block-scaled GEMM where it runs
FP8_GEMM_CONFIG = dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, GROUP_SIZE_M=8, num_warps=8,
                       num_stages=4)
FP8_GEMM_FEW_ROWS_CONFIG = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4,
                                num_stages=4)
FEW_ROWS = 256  # below it FP8_GEMM_FEW_ROWS_CONFIG, and the Triton GEMM rather than torch's block-scaled one
_INTERPRETER_CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32, GROUP_SIZE_M=2, num_warps=4,
                           num_stages=1)


@triton.jit
def round_to_e4m3(v):
    """fp32 v with |v| <= 448 rounded to the nearest float8_e4m3fn value (ties to even), still in fp32: the cast
    to FP8 after it is exact. Done by hand because Triton 3.6's interpreter rounds fp32 -> fp8 wrongly (a mantissa
    that rounds up past 7 loses its carry into the exponent: 1.998 -> 1.0); on the GPU it gives what the hardware
    conversion (cvt.rn.satfinite) gives."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3's subnormals share 2^-6's spacing
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = 12582912.0  # 2^23 + 2^22: adding it rounds 0 <= y < 2^22 to an integer, ties to even
    r = ((tl.abs(v) / ulp + magic) - magic) * ulp
    # the sign bit put back (a tiny negative rounds to -0, as torch's cast; `-r` would give +0 here)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _per_token_group_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, eps,
                                  GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (row, group): scale = max(amax, eps) / 448, q = rne(clamp(x / scale))
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    ok = (offs < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn), as torch's: Triton's `/` is a few ulp off on the GPU
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), eps), _E4M3_MAX)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.zeros_like(x) + scale), -_E4M3_MAX), _E4M3_MAX)
    tl.store(q_ptr + row * stride_qm + offs, round_to_e4m3(y).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = DEFAULT_BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous rows) -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/group)]) as
    `per_token_group_quant_fp8_reference` gives them: one launch, one program per (row, group)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows"
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _per_token_group_quant_kernel[(m, groups)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                                   ACT_QUANT_EPS, GROUP=group, BLOCK=triton.next_power_of_2(group),
                                                   num_warps=1 if group <= 128 else 4)
    return q, scale


@triton.jit
def grouped_pid(pid, num_pid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """(pid_m, pid_n) in grouped order: GROUP_SIZE_M row blocks run together and share their weight tiles in L2."""
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    return first_pid_m + ((pid % num_pid_in_group) % group_size_m), (pid % num_pid_in_group) // group_size_m


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_wn,
                     stride_wsn, stride_cm, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, A_FP8: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                     BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    # C = A @ W.T. A_FP8: A holds FP8 values with a_s [M, ceil(K/GK)] (per_token_group_quant_fp8); else A is in
    # the output's dtype and the weight tile is converted to it
    pid_m, pid_n = grouped_pid(tl.program_id(0), tl.cdiv(M, BLOCK_SIZE_M), tl.cdiv(N, BLOCK_SIZE_N), GROUP_SIZE_M)
    # rows and columns past the ends wrap instead of masking the loads: computed, never stored
    offs_m = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64) % M
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)).to(tl.int64) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] + offs_n[None, :] * stride_wn  # [K, N], K contiguous
    w_s_row = w_s_ptr + ((pid_n * BLOCK_SIZE_N) // GROUP_N) * stride_wsn
    a_s_rows = a_s_ptr + offs_m * stride_asm
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        w_s = tl.load(w_s_row + k0 // GROUP_K).to(tl.float32)
        if A_FP8:
            a_s = tl.load(a_s_rows + k0 // GROUP_K)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s)
        else:
            acc += tl.dot(a, w.to(a_ptr.dtype.element_ty), input_precision=PRECISION) * w_s
        a_ptrs += BLOCK_SIZE_K
        w_ptrs += BLOCK_SIZE_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n).to(tl.float32)[None, :]
    rows = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def gemm_tile(config: dict | None, block: tuple[int, int], rows: int = FEW_ROWS) -> dict:
    """A GEMM config (given, else the default for `rows`) with BLOCK_SIZE_N / BLOCK_SIZE_K fitted into the scale
    block (one scale per tile and step)."""
    if config is None:
        config = (_INTERPRETER_CONFIG if triton_interpreted()
                  else FP8_GEMM_FEW_ROWS_CONFIG if rows < FEW_ROWS else FP8_GEMM_CONFIG)
    cfg = dict(config)
    cfg["BLOCK_SIZE_N"] = pow2_divisor(cfg["BLOCK_SIZE_N"], block[0])
    cfg["BLOCK_SIZE_K"] = pow2_divisor(cfg["BLOCK_SIZE_K"], block[1])
    if min(cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]) < 16:
        raise ValueError(f"tile {cfg} is under tl.dot's 16 (scale block {block})")
    return cfg


def _launch_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, scale_inv: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, block: tuple[int, int],
                 config: dict | None) -> torch.Tensor:
    check_fp8_weight(weight, scale_inv, block)
    m, k = a.shape
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or a.stride(1) != 1:
        raise ValueError(f"x {tuple(a.shape)} and weight {tuple(weight.shape)} do not make a [M, K] x [N, K] product")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    cfg = gemm_tile(config, block, m)
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    _fp8_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        a, a_scale if a_scale is not None else scale_inv, weight, scale_inv, bias if bias is not None else scale_inv,
        c, m, n, k, a.stride(0), a_scale.stride(0) if a_scale is not None else 0, weight.stride(0),
        scale_inv.stride(0), c.stride(0), GROUP_N=block[0], GROUP_K=block[1], A_FP8=a_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], EVEN_K=k % bk == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return c


def fp8_gemm_w8a8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                  block: tuple[int, int] = DEFAULT_BLOCK, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32) -> [M, N] in x's dtype: x quantized per token and GK-column group, FP8 x FP8
    tensor-core GEMM, the two scales applied per K step (`w8a8_gemm_reference`). Two launches."""
    q, a_scale = per_token_group_quant_fp8(x, block[1])
    return _launch_gemm(q, a_scale, weight, scale_inv, bias, x.dtype, block, config)


def fp8_gemm_weight_only(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None, block: tuple[int, int] = DEFAULT_BLOCK,
                         config: dict | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: the FP8 weight tiles converted to x's dtype in registers, a GEMM in that
    dtype, the weight scales applied per K step (`fp8_gemv_reference`). One launch."""
    return _launch_gemm(x, None, weight, scale_inv, bias, x.dtype, block, config)


def quantizes_activations(dtype: torch.dtype) -> bool:
    """Whether the many-row FP8 GEMMs (dense and experts) run w8a8 for activations of `dtype`: bf16 / fp16 yes
    (faster from 64 rows), fp32 no (the weight-only math the CPU tests hold to transformers)."""
    return dtype != torch.float32


def block_scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether torch's block-scaled GEMM (`F.scaled_mm` with 1 x 128 activation and 128 x 128 weight scales: cuBLAS
    on Hopper) takes this product: faster than `fp8_gemm_w8a8` at prefill sizes (RESULTS, "Block-FP8")."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and tuple(block) == (128, 128)
            and hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(x.device) == (9, 0)
            and weight.shape[0] % 128 == 0 and weight.shape[1] % 128 == 0)


def fp8_block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_gemm_w8a8` by torch's block-scaled GEMM (`block_scaled_mm_supported` must hold): x quantized per token
    and 128 columns (`per_token_group_quant_fp8`, rows padded to a multiple of 4 as cuBLAS asks), scales fp32 with
    the activations' token-major and the weight's K blocks padded to a multiple of 4."""
    m = x.shape[0]
    pad = -m % 4
    q, a_scale = per_token_group_quant_fp8(F.pad(x, (0, 0, 0, pad)) if pad else x, 128)
    w_scale = scale_inv.float()
    if w_scale.shape[1] % 4:
        w_scale = F.pad(w_scale, (0, -w_scale.shape[1] % 4))
    y = F.scaled_mm(q, weight.t(), a_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128, w_scale.t(),
                    F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    y = y[:m] if pad else y
    return y if bias is None else y + bias


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """x [M, K] @ the block-FP8 weight [N, K] (+ bias) -> [M, N] in x's dtype, by the row count: one row `fp8_gemv`,
    up to 16 `fp8_rows_gemm` (decode and verify steps, in the PDL chain, weight-only), then for bf16 / fp16 x w8a8
    (torch's block-scaled GEMM from FEW_ROWS rows where it runs, else `fp8_gemm_w8a8`) and for fp32 x the weight-only
    GEMM."""
    m = x.shape[0]
    if m == 1:
        return fp8_gemv(x, weight, scale_inv, bias, block)
    if 2 <= m <= ROWS_GEMM_MAX_ROWS:
        return fp8_rows_gemm(x, weight, scale_inv, bias, block)
    if not quantizes_activations(x.dtype):
        return fp8_gemm_weight_only(x, weight, scale_inv, bias, block)
    if m >= FEW_ROWS and block_scaled_mm_supported(x, weight, block):
        return fp8_block_scaled_mm(x, weight, scale_inv, bias)
    return fp8_gemm_w8a8(x, weight, scale_inv, bias, block)
