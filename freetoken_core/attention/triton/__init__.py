"""Triton-language attention kernels (store_kv, paged decode, extend) and `TritonBackend`.

Without a GPU, Triton kernels run only under its interpreter, and Triton decides interpreted or
compiled when each `@triton.jit` function is defined, i.e. when these modules are imported. So on a
machine with no CUDA device the interpreter is turned on (`freetoken_core.env.configure_triton`)
before any kernel module loads, unless the user has set TRITON_INTERPRET themselves. The interpreter is exact in fp32 and fp16;
its bf16 arithmetic is wrong (see FACTS.md), so CPU runs of these kernels use fp32/fp16.
"""

from __future__ import annotations

from ...env import configure_triton, triton_interpreted

configure_triton()


def interpreter_on() -> bool:
    return triton_interpreted()
