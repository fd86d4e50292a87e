"""RMSNorm with an optional fused residual add (vLLM/sglang style).

`norm(x)` returns the normed x; `norm(x, residual)` adds first and returns `(normed, x + residual)`,
so a decoder layer carries the residual stream without an extra add per sublayer. CUDA tensors go
to the fused Triton kernels of `kernels/fused_ops.py` (one launch instead of ~7 in bf16); their
plain-torch reference (`kernels/fused_ops_ref.py`) is the CPU path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fused_ops_ref import rms_norm_torch, zero_centered_rms_norm_torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    if x.is_cuda:
        from ..kernels import fused_ops as triton_ops  # first CUDA use: CPU users never load Triton

        if triton_ops.use_fused(x):
            return triton_ops.rmsnorm(x, weight, eps, zero_centered)
    return (zero_centered_rms_norm_torch if zero_centered else rms_norm_torch)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): one launch on CUDA."""
    if x.is_cuda:
        from ..kernels import fused_ops as triton_ops

        if triton_ops.use_fused(x):
            return triton_ops.fused_add_rmsnorm(x, residual, weight, eps, zero_centered)
    x = x + residual
    return rms_norm(x, weight, eps, zero_centered), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5 RMSNorm: the checkpoint stores w - 1 (initialised at zero), and the product
    is taken in fp32 before rounding: `(rmsnorm(x) * (1 + w)).to(x.dtype)`. On CUDA the fused kernels'
    ZERO_CENTERED form (one launch, the residual add included), else plain torch."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps, zero_centered=True)
        return add_rms_norm(x, residual, self.weight, self.eps, zero_centered=True)
