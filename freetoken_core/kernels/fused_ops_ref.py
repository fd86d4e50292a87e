"""Plain-torch references of `fused_ops.py` (RMSNorm and its zero-centred form, add + RMSNorm, SiLU-and-mul, rotary).

They are also the CPU path of the layers (`layers/norm.py`, `activation.py`, `rotary.py`), so
they import nothing but torch: CPU users never load Triton. Each computes in the model dtype with
the rounding points transformers' Llama/Qwen modules use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Computes in fp32 and rounds like transformers' LlamaRMSNorm."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused CPU/CUDA kernel, same math
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def zero_centered_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNorm (Qwen3-Next / Qwen3.5): the checkpoint stores w - 1; normed and scaled by
    (1 + w) in fp32, rounded once."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] laid out [gate | up] -> silu(gate) * up (the model dtype rounds silu(gate), then
    the product)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin on the first rot_dim features (cos/sin are the half-size tables)."""
    xr = x[..., :rot_dim]
    x1, x2 = xr.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rot_dim < x.shape[-1]:
        out = torch.cat([out, x[..., rot_dim:]], dim=-1)
    return out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    return (zero_centered_rms_norm_torch if zero_centered else rms_norm_torch)(x, weight, eps)


def fused_add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rmsnorm_reference(s, weight, eps, zero_centered), s


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_torch(x)


def rotary_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     rot_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin_cache [max_positions, rot_dim] holds [cos | sin] of each position."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2]
    return apply_rotary(q, cos, sin, rot_dim), apply_rotary(k, cos, sin, rot_dim)
