"""A decoder layer's pre-norm projection: RMSNorm (with the residual add), a linear layer, and for the
gated MLP SiLU-and-mul, as one call; `norm_linear_normed` also returns the normed row (the MoE router,
whose experts take that row).

On one CUDA row of a large half-precision weight (batch-1 decode) this is one Triton launch
(`kernels/norm_gemv.py`) instead of two or three: the GEMV programs read the whole input row
anyway, so they norm it on the fly. Everywhere else it is exactly the unfused sequence. (A
multi-row version for speculative verify steps was measured slower than the separate RMSNorm and
`rows_gemm`, benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import torch

from ..env import kernel_env
from .activation import silu_and_mul
from .linear import Linear, MergedLinear
from .norm import RMSNorm, ZeroCenteredRMSNorm

FUSED = kernel_env().norm_gemv  # FREETOKEN_NORM_GEMV=0: separate norm / GEMV / SiLU kernels (A/B)


def norm_linear(norm: RMSNorm | ZeroCenteredRMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (linear(norm(x + residual)), x + residual); x itself is the residual when residual is None.
    gated: `linear` is a [gate | up] MergedLinear and the output is silu(gate) * up."""
    if gated and not (isinstance(linear, MergedLinear) and len(linear.out_sizes) == 2
                      and linear.out_sizes[0] == linear.out_sizes[1]):
        raise ValueError("gated norm_linear needs a [gate | up] MergedLinear of two equal halves")
    if linear.fp8_block is not None and fuses_fp8_norm_gemv(norm, x, residual, gated):
        from ..kernels.fp8_gemv import fp8_norm_gemv  # FP8 held: Triton (under the interpreter on CPU)

        return fp8_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.weight_scale_inv, linear.bias,
                             zero_centered=type(norm) is ZeroCenteredRMSNorm, block=linear.fp8_block,
                             tail=getattr(linear, "weight_tail", None))
    if FUSED and x.is_cuda and type(norm) in (RMSNorm, ZeroCenteredRMSNorm):  # the two norms the kernel implements
        from ..kernels import gemv as triton_gemv, norm_gemv as triton_norm_gemv  # first CUDA use only

        # not for the gated MLP: there the fused kernel measured slower than the three it would
        # replace (benchmarks/dev/bench_gemv.py --fused: 64 vs 61 us on the 8B gate_up)
        if (not gated and triton_gemv.use_gemv(x, linear.weight, linear.gemv_min_elements)
                and norm.weight.dtype == x.dtype and (residual is None or residual.stride(-1) == 1)):
            return triton_norm_gemv.norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, gated,
                                         zero_centered=type(norm) is ZeroCenteredRMSNorm)
    if residual is None:
        residual, h = x, norm(x)
    else:
        h, residual = norm(x, residual)
    y = linear(h)
    return (silu_and_mul(y) if gated else y), residual


def fuses_fp8_norm_gemv(norm: RMSNorm | ZeroCenteredRMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                        gated: bool) -> bool:
    """One row into an FP8-held projection: the norm runs in `fp8_norm_gemv`'s launch, on any device (the FP8
    kernels are the only FP8 path; not the gated MLP, as in half precision)."""
    return (FUSED and not gated and x.dim() == 2 and x.shape[0] == 1 and type(norm) in (RMSNorm, ZeroCenteredRMSNorm)
            and norm.weight.dtype == x.dtype and x.stride(-1) == 1
            and (residual is None or residual.stride(-1) == 1))


def norm_linear_normed(norm: RMSNorm | ZeroCenteredRMSNorm, linear: Linear, x: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (linear(h), h, x + residual) with h = norm(x + residual): the post-attention norm and the MoE
    router in one launch on one CUDA row (`kernels/norm_gemv.py` norm_gemv_normed; batch-1 decode), else the
    unfused sequence."""
    if fuses_norm_gemv_normed(norm, linear, x, residual):
        from ..kernels import norm_gemv as triton_norm_gemv

        y, h, residual = triton_norm_gemv.norm_gemv_normed(x, residual, norm.weight, norm.eps, linear.weight,
                                                      zero_centered=type(norm) is ZeroCenteredRMSNorm)
        return y, h, residual
    h, residual = norm(x, residual)
    return linear(h), h, residual


def fuses_norm_gemv_normed(norm: RMSNorm | ZeroCenteredRMSNorm, linear: Linear, x: torch.Tensor,
                           residual: torch.Tensor) -> bool:
    """Whether `norm_linear_normed` runs as one launch here: one CUDA half-precision row, a norm the kernel
    implements, a replicated linear layer without bias (small weights too: the launch replaces the norm's)."""
    if not (FUSED and x.is_cuda and type(norm) in (RMSNorm, ZeroCenteredRMSNorm) and linear.bias is None
            and linear.parallel is None and norm.weight.dtype == x.dtype and residual.stride(-1) == 1):
        return False
    from ..kernels import gemv as triton_gemv  # first CUDA use: CPU users never load Triton

    return triton_gemv.use_gemv(x, linear.weight, 0)
