"""RMSNorm with an optional fused residual add (vLLM/sglang style).

`norm(x)` returns the normed x; `norm(x, residual)` adds first and returns `(normed, x + residual)`,
so a decoder layer carries the residual stream without an extra add per sublayer. CUDA tensors go
to the fused Triton kernels of `kernels/fused_ops.py` (one launch instead of ~7 in bf16); their
plain-torch reference (`kernels/fused_ops_ref.py`) is the CPU path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fused_ops_ref import rms_norm_torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from ..kernels import fused_ops as triton_ops  # first CUDA use: CPU users never load Triton

        if triton_ops.use_fused(x):
            return triton_ops.rmsnorm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


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
        if x.is_cuda:
            from ..kernels import fused_ops as triton_ops

            if triton_ops.use_fused(x):
                return triton_ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5 RMSNorm: the checkpoint stores w - 1 (initialised at zero), and the product
    is taken in fp32 before rounding: `(rmsnorm(x) * (1 + w)).to(x.dtype)`. Plain torch everywhere:
    its rounding differs from the Llama kernel's, so it never takes the fused RMSNorm path."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
