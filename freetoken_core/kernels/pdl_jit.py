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


@triton.jit
def pdl_release_then_wait():
    """Let the next kernel's blocks start, then wait for the previous kernel. For a kernel whose successor
    waits before it reads anything but weights: the successor's blocks become resident (and load weights)
    while this one runs. Safe for deadlock: a kernel launches only when every block of the one before it has
    started, so each grid is wholly resident before the next one asks for room."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_enter(RELEASE_FIRST: tl.constexpr):
    """The PDL entry of a kernel with USE_PDL on: `pdl_release_then_wait` when RELEASE_FIRST, else
    `pdl_wait_then_release`."""
    if RELEASE_FIRST:
        pdl_release_then_wait()
    else:
        pdl_wait_then_release()
