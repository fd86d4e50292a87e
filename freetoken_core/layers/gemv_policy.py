"""Which CUDA inputs of a layer's weight go to the Triton GEMV (kernels/gemv.py) instead of cuBLAS.

Shared by `Linear` and `ParallelLMHead`, so neither imports the other to set it. No Triton here:
CPU users never load it.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

# One-row CUDA inputs of weights at least this large go to the Triton GEMV (kernels/gemv.py);
# smaller ones stay on cuBLAS unless the engine lowers the bar (`use_gemv_for_all_sizes`).
GEMV_MIN_ELEMENTS = 1 << 24


class GemvRouted:
    """A layer whose one-row CUDA inputs may run on the Triton GEMV; `takes_rows_gemm` layers also
    send 2..16 rows to its multi-row variant once the engine asks (`rows_gemm`)."""

    takes_rows_gemm: ClassVar[bool] = False

    def init_gemv_policy(self) -> None:
        self.gemv_min_elements = GEMV_MIN_ELEMENTS  # see use_gemv_for_all_sizes
        self.rows_gemm = False  # 2..16 rows on the Triton kernel too (use_gemv_for_all_sizes(rows=True))


def use_gemv_for_all_sizes(model: nn.Module, rows: bool = False) -> int:
    """Send one-row inputs of every half-precision weight to the Triton GEMV, however small; with
    `rows`, also inputs of 2..16 rows to its multi-row variant (`triton_gemv.rows_gemm`), for
    weights under `triton_gemv.ROWS_GEMM_MAX_ELEMENTS` (larger ones are faster on cuBLAS).

    On their own, small GEMVs are no faster than cuBLAS's. But the Triton kernels of a decode step
    chain through programmatic dependent launch (freetoken_core/kernels/pdl.py), and each cuBLAS call
    breaks that chain (SmolLM2-135M batch 1 on the H200: benchmarks/RESULTS.md).

    Without PDL (before Hopper, or FREETOKEN_PDL=0) small GEMVs measured no faster, so the engine
    calls this only where PDL is in use. Under speculative decoding it passes `rows=True`: a verify
    step scores k + 1 rows per request, and cuBLAS there broke the PDL chain the same way. The LM
    head takes one-row logits only (2..16 rows stay on cuBLAS). Returns the number of layers changed."""
    n = 0
    for m in model.modules():
        if isinstance(m, GemvRouted):
            m.gemv_min_elements = 0
            if m.takes_rows_gemm:
                m.rows_gemm = rows
            n += 1
    return n
