"""Programmatic dependent launch (PDL) for the decode-path Triton kernels (Hopper and newer).

Host side only (no Triton import); the kernel side is `pdl_jit.py`.

A batch-1 decode step is ~270 kernels back to back, and each one pays its launch and ramp-up:
its thread blocks start only after the previous kernel has finished. Launched with PDL, a kernel's
blocks may start as soon as every block of the previous kernel has started (they call
`gdc_launch_dependents`), and wait in `gdc_wait` until that kernel has finished and its writes are
visible. Before that wait a kernel may only read what no earlier kernel writes: the GEMVs start
streaming their weights there. Graph capture keeps these edges (CUDA >= 12.3).

Every kernel that takes `USE_PDL` waits (`pdl_jit.pdl_wait_then_release`) before reading or
writing activations, so mixing it with
kernels launched the ordinary way (cuBLAS, torch) is safe: those keep full stream order.
`FREETOKEN_PDL=0` launches everything the ordinary way (A/B, debugging).
"""

from __future__ import annotations

import functools

import torch

from ..env import kernel_env, triton_interpreted

ENABLED = kernel_env().pdl  # FREETOKEN_PDL (freetoken_core/env.py)


@functools.cache
def _device_supports(index: int) -> bool:
    if triton_interpreted() or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:  # gdc_wait / launch_pdl arrived in Triton 3.3; older installs launch the ordinary way
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def device_uses_pdl(device: torch.device) -> bool:
    """Whether the decode kernels on `device` launch with PDL."""
    return ENABLED and device.type == "cuda" and _device_supports(device.index or 0)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL (pass as the USE_PDL constexpr)."""
    return device_uses_pdl(t.device)


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking USE_PDL: `kernel[grid](..., **pdl_launch(x))`."""
    on = use_pdl(t)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}
