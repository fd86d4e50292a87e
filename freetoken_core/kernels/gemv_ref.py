"""Plain-torch references of `gemv.py` (fp32 accumulation, like the kernels)."""

from __future__ import annotations

import torch

from .fused_ops_ref import rms_norm_torch, silu_and_mul_torch, zero_centered_rms_norm_torch


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """gate: the gated attention's input row x * sigmoid(gate), as the unfused torch ops compute it (each
    rounded to x's dtype)."""
    if gate is not None:
        x = x * torch.sigmoid(gate.reshape(x.shape))
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def norm_gemv_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None,
                        gated: bool = False, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path: (fused-add) RMSNorm (zero_centered: Qwen3-Next's), the linear layer, SiLU-and-mul
    when gated."""
    h = x if residual is None else x + residual
    norm = zero_centered_rms_norm_torch if zero_centered else rms_norm_torch
    y = gemv_reference(h if norm_weight is None else norm(h, norm_weight, eps), weight, bias)
    return (silu_and_mul_torch(y) if gated else y), h
