"""SiLU-and-mul: the gated MLP activation on a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] laid out [gate | up] -> silu(gate) * up, [..., I]. One fused Triton launch on
    CUDA (`triton_ops.silu_and_mul`), plain torch elsewhere."""
    if x.is_cuda:
        from . import triton_ops  # imported on first CUDA use: CPU users never load Triton

        if triton_ops.use_fused(x):
            return triton_ops.silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference (the model dtype rounds silu(gate), then the product)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
