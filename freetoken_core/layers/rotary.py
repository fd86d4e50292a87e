"""Rotary position embedding (neox / rotate-half layout, as transformers' Llama/Qwen use).

cos/sin for every position up to `max_positions` are computed once (in fp32, then rounded to the
model dtype exactly as transformers does) and gathered by each row's absolute position, so a batch
of many requests at different offsets costs one index_select.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..kernels.fused_ops_ref import apply_rotary


def default_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config, from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any], dtype: torch.dtype,
                 config: Any = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        rope_type = params["rope_type"]
        scaling = 1.0  # multiplies cos/sin (yarn's attention factor)
        if rope_type == "default":
            inv_freq = default_inv_freq(self.rot_dim, base)
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(
                default_inv_freq(self.rot_dim, base), float(params["factor"]), float(params["low_freq_factor"]),
                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            inv_freq = default_inv_freq(self.rot_dim, base) / float(params["factor"])
        elif rope_type == "yarn" and config is not None:
            # Static (position-independent) frequencies: transformers' formula is a pure function of the config.
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
        else:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, llama3, linear, yarn")
        self._inv_freq, self._scaling = inv_freq.float().cpu(), scaling
        cos_sin = self._table(max_positions, dtype).to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_positions, rot_dim]

    def _table(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        # Built on the CPU (bit-identical to transformers' CPU tables), then moved to the model's
        # device: the loader constructs models under `with torch.device(device)`.
        t = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = t[:, None] * self._inv_freq[None, :]  # same fp32 product as transformers
        return torch.cat([freqs.cos() * self._scaling, freqs.sin() * self._scaling], dim=-1).to(dtype)

    @property
    def max_positions(self) -> int:
        return self.cos_sin_cache.shape[0]

    def ensure_positions(self, n: int) -> None:
        """Grow the table to cover positions < n. Call before capturing CUDA graphs: a position
        past the table is an index error (a device assert on CUDA), never a silent wrap."""
        if n > self.max_positions:
            c = self.cos_sin_cache
            self.cos_sin_cache = self._table(n, c.dtype).to(c.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated q, k (new tensors)."""
        if q.is_cuda:
            from ..kernels import fused_ops as triton_ops  # first CUDA use: CPU users never load Triton

            if triton_ops.use_fused(q):  # one launch for q and k instead of ~10 per step
                return triton_ops.rotary(positions, q, k, self.cos_sin_cache, self.rot_dim)
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2]
        return apply_rotary(q, cos, sin, self.rot_dim), apply_rotary(k, cos, sin, self.rot_dim)
