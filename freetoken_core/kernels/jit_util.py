"""Small helpers shared by the Triton kernel modules (gdn.py, causal_conv1d.py, gated_rmsnorm.py)."""

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
