"""Plain-torch reference of `qk_norm_rotary.py`: per-head q/k RMSNorm, then neox rotary.

Built from the references of `fused_ops_ref.py` so the rounding points are the unfused path's:
- Llama RMSNorm (`rms_norm_torch`): fp32 statistics, x * rstd rounded to the model dtype, then
  * weight (rounded again);
- zero-centred RMSNorm (`zero_centered_rms_norm_torch`: Qwen3-Next / Qwen3.5, `layers/norm.py`
  ZeroCenteredRMSNorm, transformers' Qwen3NextRMSNorm): x * rstd * (1 + w) all in fp32, rounded once;
- rotary (`rotary_reference`): each product rounded, then the sum, on the first rot_dim features.
Plain torch only: CPU users never load Triton.
"""

from __future__ import annotations

import torch

from .fused_ops_ref import rms_norm_torch, rotary_reference, zero_centered_rms_norm_torch


def head_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    return zero_centered_rms_norm_torch(x, weight, eps) if zero_centered else rms_norm_torch(x, weight, eps)


def qk_norm_rotary_reference(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    q_eps: float, k_eps: float, cos_sin_cache: torch.Tensor, rot_dim: int, zero_centered: bool = False,
    v: torch.Tensor | None = None, kv_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] (strided views allowed) -> (rotary(norm(q)), rotary(norm(k))).
    kv_out (k_cache, v_cache, out_loc) with v: the new k and v also go to the paged caches at their flat
    slots, as the attention backend's store_kv writes them (`attention/triton/reference.store_kv_reference`)."""
    qn = head_norm_torch(q, q_weight, q_eps, zero_centered)
    kn = head_norm_torch(k, k_weight, k_eps, zero_centered)
    q_out, k_out = rotary_reference(positions, qn, kn, cos_sin_cache, rot_dim)
    if kv_out is not None:
        assert v is not None
        k_cache, v_cache, out_loc = kv_out
        for cache, rows in ((k_cache, k_out), (v_cache, v)):
            cache.view(-1, *cache.shape[2:])[out_loc.long()] = rows.to(cache.dtype)
    return q_out, k_out
