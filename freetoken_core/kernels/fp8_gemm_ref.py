"""Plain-torch references of the block-FP8 linear kernels (`fp8_gemv.py`, `fp8_gemm.py`): the weight dequantized
block-wise in fp32 (fp8_ref.py), then the bf16 kernels' references; and vLLM/SGLang's per-token, per-group
activation quantization for the w8a8 GEMM. No Triton import."""

from __future__ import annotations

import torch

from .fp8_ref import DEFAULT_BLOCK, FP8_DTYPE, FP8_MAX, dequantize_block_fp8
from .gemv_ref import gemv_reference, norm_gemv_reference

ACT_QUANT_EPS = 1e-10  # floor of a group's amax: an all-zero group gets a tiny scale instead of 0 / 0


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                       bias: torch.Tensor | None = None, block: tuple[int, int] = DEFAULT_BLOCK,
                       gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (the dequantized weight [N, K]).T (+ bias) with fp32 accumulation, in x's dtype: the reference of
    the weight-only kernels (fp8_gemv, fp8_rows_gemm, fp8_gemm_weight_only)."""
    return gemv_reference(x, dequantize_block_fp8(weight, scale_inv, block), bias, gate)


def fp8_norm_gemv_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                            eps: float, weight: torch.Tensor, scale_inv: torch.Tensor,
                            bias: torch.Tensor | None = None, gated: bool = False, zero_centered: bool = False,
                            block: tuple[int, int] = DEFAULT_BLOCK,
                            tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tail: dense rows after the FP8 ones (kernels/fp8_gemv.py `fp8_norm_gemv`)."""
    w = dequantize_block_fp8(weight, scale_inv, block)
    if tail is not None:
        w = torch.cat([w, tail.to(w.dtype)])
    return norm_gemv_reference(x, residual, norm_weight, eps, w, bias, gated, zero_centered)


def per_token_group_quant_fp8_reference(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/group)]) with x ~= q * scale per group of `group`
    columns: scale = max(amax, eps) / 448, q = round-to-nearest-even(clamp(x / scale, +-448)) (vLLM's
    `per_token_group_quant_fp8`, row-major scales)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1).clamp_min(ACT_QUANT_EPS)
    # a tensor divisor: CUDA torch turns `/ python_float` into a multiply by the (inexact) reciprocal, 1 ulp off
    # the IEEE division the kernel does
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def dequantize_tokens_fp8(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The fp32 activations that a per-token-group quantized [M, K] stands for."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, :q.shape[1]]


def w8a8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                        bias: torch.Tensor | None = None, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """The w8a8 GEMM: x quantized per token and K-block group (`per_token_group_quant_fp8_reference`), times the
    dequantized weight, fp32 accumulation, in x's dtype."""
    q, scale = per_token_group_quant_fp8_reference(x, block[1])
    y = dequantize_tokens_fp8(q, scale, block[1]) @ dequantize_block_fp8(weight, scale_inv, block).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
