"""SiLU-and-mul: the gated MLP activation on a fused [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.fused_ops_ref import silu_and_mul_torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] laid out [gate | up] -> silu(gate) * up, [..., I]. One fused Triton launch on
    CUDA (`kernels/fused_ops.py`), plain torch elsewhere."""
    if x.is_cuda:
        from ..kernels import fused_ops as triton_ops  # first CUDA use: CPU users never load Triton

        if triton_ops.use_fused(x):
            return triton_ops.silu_and_mul(x)
    return silu_and_mul_torch(x)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
