"""The kernel side of kernels/pdl.py, for the Triton kernel modules only (it imports Triton,
which CPU users never load)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait_then_release():
    """Wait until the previous kernel has finished and its writes are visible, then let the next
    kernel's blocks start. Call first thing in a kernel launched with PDL (USE_PDL), or, in a
    GEMV, right after loading weights, which no earlier kernel writes."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
