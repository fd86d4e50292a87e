"""One-row GEMV (y = x W^T for a single row x) as one Triton launch, for batch-1 decode.

A batch-1 decode step reads every weight once, so each linear layer is a bandwidth problem.
cuBLAS's tile choices for one row leave bandwidth unused on the projections of an 8B model
(H200, weights cycled through far more memory than the L2, benchmarks/bench_gemv.py): QKV 76%,
O 64%, down 90% of the copy bandwidth, plus a split-K reduce kernel for O and down. This kernel
gives each program BLOCK_N output rows of W and the whole K, multiplies in fp32 registers and
reduces once at the end: QKV 84%, O 74%, down 96% there (gate_up is at ~99% either way).

Only one-row inputs of large half-precision weights go here (`use_gemv`); everything else stays
on cuBLAS, where the tensor-core tiles of a [16, K] x [K, N] product are as good or better.
`gemv_reference` is the plain-torch reference (fp32 accumulation).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # kernels then run only under the interpreter (CPU tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ENABLED = os.environ.get("FREETOKEN_GEMV", "1") != "0"  # 0: cuBLAS everywhere (A/B, debugging)
# Below 32 MB of weight the difference is lost in launch latency (1B-model layers measured slower).
MIN_WEIGHT_ELEMENTS = 1 << 24


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + offs_k)
        else:
            k_ok = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def default_config(k: int) -> dict[str, int]:
    """From the bench_gemv.py sweep on the H200 (Llama-3-8B shapes): 16 rows of W per program and
    long K steps with 8 warps were best for O and down and within a few % elsewhere."""
    return dict(block_n=16, block_k=1024 if k >= 4096 else 256, num_warps=8, num_stages=2)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Dispatch rule of `Linear`: one CUDA row, half precision, a weight large enough to be
    bandwidth-bound, and the row-contiguous layouts the kernel assumes."""
    return (
        ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        and weight.numel() >= MIN_WEIGHT_ELEMENTS and weight.stride(1) == 1 and x.stride(1) == 1
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [1, K], weight [N, K] (contiguous rows), bias [N] -> [1, N] in x's dtype."""
    k = x.shape[1]
    n = weight.shape[0]
    assert x.shape[0] == 1, f"gemv takes one row, got {x.shape[0]}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    cfg = default_config(k)
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return y


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
