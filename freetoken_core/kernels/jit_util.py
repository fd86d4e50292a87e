"""Small helpers shared by the Triton kernel modules (gdn.py, causal_conv1d.py, gated_rmsnorm.py, fused_moe.py,
moe_gemv.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _and(mask, cond):
    # mask & cond for a scalar cond: the interpreter turns `block & scalar bool` into ints
    return tl.where(cond, mask, False)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # slices of a fused projection keep unit stride along the head dim; anything else is copied
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """Round fp32 `v` to the model dtype and back: the rounding points of the eager torch path."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """SiLU(gate) * up in fp32, rounded where torch's eager SiLU-and-mul rounds (each input, SiLU's output)."""
    gate = round_to(gate, dtype)
    return round_to(gate / (1.0 + tl.exp(-gate)), dtype) * round_to(up, dtype)
