"""One-row GEMV (y = x W^T for a single row x) as one Triton launch, for batch-1 decode.

A batch-1 decode step reads every weight once, so each linear layer is a bandwidth problem.
cuBLAS's tile choices for one row leave bandwidth unused on the projections of an 8B model
(H200, weights cycled through far more memory than the L2, benchmarks/bench_gemv.py): QKV 76%,
O 64%, down 90% of the copy bandwidth, plus a split-K reduce kernel for O and down. This kernel
gives each program BLOCK_N output rows of W and the whole K, multiplies in fp32 registers and
reduces once at the end: QKV 84%, O 74%, down 96% there (gate_up is at ~99% either way).

Only one-row half-precision inputs go here (`use_gemv`). By default the weight must also be large
(layers/gemv_policy.py GEMV_MIN_ELEMENTS); where programmatic dependent launch chains the kernels
(freetoken_core/kernels/pdl.py), the engine sends small weights here too. Everything else stays on cuBLAS,
where the tensor-core tiles of a [16, K] x [K, N] product are as good or better.

`norm_gemv.py` adds the RMSNorm (and residual add) of the input row to this kernel, replacing a launch
per layer. `gemv_ref.py` holds the plain-torch references (fp32 accumulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
try:  # the gated GEMV has not yet run on the GPU's Triton 3.6: never let a missing module take every GEMV
    # down with it
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    libdevice = None

from ..env import kernel_env, triton_interpreted
from .gemv_ref import gemv_reference  # noqa: F401  (the reference, beside its kernel)
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release

ENABLED = kernel_env().gemv  # FREETOKEN_GEMV=0: cuBLAS everywhere (A/B, debugging)
# The size rule itself lives in layers/gemv_policy.py (GEMV_MIN_ELEMENTS, per layer), which must not import Triton.
# The gated GEMV's sigmoid takes CUDA's expf (libdevice) when compiled; the interpreter has no libdevice.
_LIBDEVICE_EXP = tl.constexpr(not triton_interpreted() and libdevice is not None)


@triton.jit
def _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        mask = n_ok[:, None]
    else:
        mask = n_ok[:, None] & (offs_k < K)[None, :]
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _x_tile(x_ptr, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        x = tl.load(x_ptr + offs_k)
    else:
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    return x


@triton.jit
def _sigmoid_like_torch(g):
    # torch's CUDA sigmoid in fp32: 1 / (1 + expf(-g)) with CUDA's expf and IEEE division. Triton's own
    # exp (ex2.approx) and `/` (div.full) are a few ulp off: enough to flip a rounding to bf16 now and then.
    if _LIBDEVICE_EXP:
        e = libdevice.exp(-g)
    else:  # the interpreter: numpy's exp
        e = tl.exp(-g)
    return tl.math.div_rn(tl.zeros_like(e) + 1.0, 1.0 + e)


@triton.jit
def _gated_x_tile(x_ptr, g_ptr, k0, K, stride_gh, GATE_D: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # x * sigmoid(gate) rounded as the unfused torch ops round it: sigmoid in fp32, rounded to x's dtype,
    # then the product (exact in fp32 for two half-precision factors) rounded again. Gate element k is
    # lane k % GATE_D of head k // GATE_D (heads stride_gh apart: a slice of the QKV output, no copy).
    offs_k = k0 + tl.arange(0, BLOCK_K)
    g_offs = (offs_k // GATE_D) * stride_gh + offs_k % GATE_D
    if EVEN_K:
        g = tl.load(g_ptr + g_offs)
    else:
        g = tl.load(g_ptr + g_offs, mask=offs_k < K, other=0.0)
    dt = x_ptr.dtype.element_ty
    s = _sigmoid_like_torch(g.to(tl.float32)).to(dt).to(tl.float32)
    return (_x_tile(x_ptr, k0, K, BLOCK_K, EVEN_K).to(tl.float32) * s).to(dt)


@triton.jit
def _gemv_in_tile(x_ptr, g_ptr, k0, K, stride_gh, HAS_GATE: tl.constexpr, GATE_D: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    if HAS_GATE:
        return _gated_x_tile(x_ptr, g_ptr, k0, K, stride_gh, GATE_D, BLOCK_K, EVEN_K).to(tl.float32)
    return _x_tile(x_ptr, k0, K, BLOCK_K, EVEN_K).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, N, K, stride_wn, stride_gh,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 USE_PDL: tl.constexpr, HAS_GATE: tl.constexpr = False, GATE_D: tl.constexpr = 1):
    # HAS_GATE (the gated attention's o_proj): the input row is x * sigmoid(gate), computed as it loads
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile loads before the wait: no earlier kernel writes weights
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        pdl_wait_then_release()  # x and the gate are activations: read after it
        acc += w.to(tl.float32) * _gemv_in_tile(x_ptr, g_ptr, 0, K, stride_gh, HAS_GATE, GATE_D, BLOCK_K,
                                                EVEN_K)[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _gemv_in_tile(x_ptr, g_ptr, k0, K, stride_gh, HAS_GATE, GATE_D, BLOCK_K,
                                                EVEN_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _rows_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # a few rows (speculative verify steps: k + 1 per request): like _gemv_kernel, each program owns
    # BLOCK_N outputs and streams its weight rows once, now for up to BLOCK_M input rows (tl.dot)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile loads before the wait: no earlier kernel writes weights
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        pdl_wait_then_release()
        x = _w_tile(x_ptr, offs_m, m_ok, 0, K, stride_xm, BLOCK_K, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        x = _w_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# Tiles per weight shape (N, K) where the defaults leave bandwidth unused (with N/16 programs a weight of
# few output rows fills the SMs only once), chosen by `bench_gemv.py` sweeps (GEMV row of benchmarks/RESULTS.md).
# Shapes not listed keep the defaults their own sweeps chose.
_ROUTER_TILE = dict(block_n=2, block_k=2048, num_warps=8, num_stages=2)
_LM_HEAD_TILE = dict(block_n=4, block_k=1024, num_warps=4, num_stages=2)
GEMV_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (2048, 4096): dict(block_n=4, block_k=1024, num_warps=8, num_stages=4),
    (128, 2048): _ROUTER_TILE,
    (256, 2048): _ROUTER_TILE,
    (257, 2048): _ROUTER_TILE,
    (248320, 2048): _LM_HEAD_TILE,
    (151936, 2048): _LM_HEAD_TILE,
}


def gemv_config(n: int, k: int) -> dict[str, int]:
    return GEMV_CONFIGS.get((n, k)) or default_config(k)



def default_config(k: int) -> dict[str, int]:
    """From the bench_gemv.py sweep on the H200 (Llama-3-8B shapes): 16 rows of W per program and
    long K steps with 8 warps were best for O and down and within a few % elsewhere."""
    return dict(block_n=16, block_k=1024 if k >= 4096 else 256, num_warps=8, num_stages=2)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, min_elements: int) -> bool:
    """Dispatch rule of `Linear`: one CUDA row, half precision, a weight of at least `min_elements`
    (the layer's `gemv_min_elements`), and the row-contiguous layouts the kernel assumes."""
    return (
        ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        and weight.numel() >= min_elements and weight.stride(1) == 1 and x.stride(1) == 1
    )


ROWS_GEMM_MAX_ROWS = 16  # tl.dot's smallest M tile: more rows go to cuBLAS
# rows_gemm's launch configuration: the best sum over SmolLM2's four projections at 9 rows in
# `bench_gemv.py --shape smollm2-135m --rows 9` on the H200 (benchmarks can override it)
ROWS_GEMM_CONFIG = dict(block_n=16, block_k=256, num_warps=4, num_stages=3)
# Larger weights stay on cuBLAS: the kernel beat it only on small weights, and on larger ones the PDL
# chain it keeps did not pay for its slower matmuls (a whole 8B verify step was slower with it).
ROWS_GEMM_MAX_ELEMENTS = 4 << 20


def use_rows_gemm(x: torch.Tensor, weight: torch.Tensor, min_elements: int) -> bool:
    """Dispatch rule of `Linear` for 2..16 CUDA rows: as `use_gemv`, for a layer whose size bar the
    engine lowered to 0 (`use_gemv_for_all_sizes(model, rows=True)`: speculation in the PDL chain)."""
    return (
        ENABLED and x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= ROWS_GEMM_MAX_ROWS and min_elements == 0
        and weight.numel() < ROWS_GEMM_MAX_ELEMENTS
        and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
        and weight.stride(1) == 1 and x.stride(1) == 1
    )


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] with M <= 16, weight [N, K] (contiguous rows), bias [N] -> [M, N] in x's dtype."""
    cfg = ROWS_GEMM_CONFIG
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    num_warps, num_stages = num_warps or cfg["num_warps"], num_stages or cfg["num_stages"]
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= ROWS_GEMM_MAX_ROWS, f"rows_gemm takes 1..{ROWS_GEMM_MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rows_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=ROWS_GEMM_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 exact, not tf32
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x),
    )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
         gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K], weight [N, K] (contiguous rows), bias [N] -> [1, N] in x's dtype.

    gate (the gated attention's o_proj, FREETOKEN_ATTN_GATE_GEMV): y = W (x * sigmoid(gate)) in this one
    launch instead of a gate copy, a sigmoid and a multiply, rounded as those torch ops round (see
    `gemv_reference`). gate has x's dtype and K elements: [1, K], or heads [1, H, D] with any head stride
    (the strided gate half of the QKV output) and D contiguous."""
    k = x.shape[1]
    n = weight.shape[0]
    assert x.shape[0] == 1, f"gemv takes one row, got {x.shape[0]}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    cfg = gemv_config(n, k)
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    gate_args: dict = {}
    stride_gh = 0
    if gate is not None:
        assert gate.dtype == x.dtype and gate.numel() == k and gate.shape[0] == 1 and gate.stride(-1) == 1, (
            f"gate {tuple(gate.shape)} {gate.dtype} does not fit the row {tuple(x.shape)} {x.dtype}"
        )
        assert gate.dim() in (2, 3)
        head = gate.shape[-1]
        stride_gh = gate.stride(1) if gate.dim() == 3 else head  # [1, K]: one head of K
        gate_args = dict(HAS_GATE=True, GATE_D=head)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, gate if gate is not None else x, n, k, weight.stride(0),
        stride_gh, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"], **gate_args,
        **pdl_launch(x),
    )
    return y
