"""Weight-only block-FP8 GEMVs for decode (one row) and speculative verify (up to 16 rows), and the RMSNorm-fused
one-row GEMV: the FP8 counterparts of `gemv.gemv`, `gemv.rows_gemm` and `norm_gemv.norm_gemv`, same tiles, same
PDL chain, same call sites.

Weights are the checkpoints' block-FP8 format (kernels/fp8_ref.py): `weight` float8_e4m3fn [N, K] with contiguous
rows and `scale_inv` [ceil(N/GN), ceil(K/GK)] (fp32 or bf16), element (n, k) of the real weight being
`weight[n, k] * scale_inv[n // GN, k // GK]`, (GN, GK) = `block` (128, 128 in the releases). Trailing partial
blocks work. Activations stay in their dtype (bf16 on the GPU): no launch quantizes them.

Each program owns BLOCK_N output rows (BLOCK_N divides GN, so all of them share one row of scales) and streams
its FP8 rows once, converted to fp32 in registers and accumulated in fp32; the block scale multiplies the input
row's BLOCK_K slice (a scalar, or one scale per column where BLOCK_K spans several blocks) instead of each weight.
The scales are weights too: the first tile's load before the PDL wait. References: `fp8_gemm_ref.py`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .fp8_gemm_ref import fp8_gemv_reference, fp8_norm_gemv_reference  # noqa: F401  (beside their kernels)
from .fp8_ref import DEFAULT_BLOCK, FP8_DTYPE, block_scale_shape
from .gemv import ROWS_GEMM_MAX_ROWS, _gemv_in_tile, _w_tile, default_config
from .norm_gemv import _norm_gemv_tile, norm_gemv_config
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release
from ..env import triton_interpreted

# FP8 tiles per weight shape (N, K), to be set by measurement on the GPU as gemv.GEMV_CONFIGS; shapes not listed
# take the bf16 kernel's defaults with BLOCK_N fitted to the scale block (`fp8_tile`).
FP8_GEMV_CONFIGS: dict[tuple[int, int], dict[str, int]] = {}
FP8_ROWS_GEMM_CONFIG = dict(block_n=16, block_k=128, num_warps=4, num_stages=3)
# Under the interpreter a program costs its Python overhead whatever its tile: few wide programs (CPU tests)
_INTERPRETER_ROWS_CONFIG = dict(FP8_ROWS_GEMM_CONFIG, block_n=128)


def pow2_divisor(value: int, *others: int) -> int:
    """The largest power of two dividing `value` and every one of `others` (tile sizes that stay in one block)."""
    g = math.gcd(value, *others)
    return g & -g


def check_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """The layout every FP8 kernel assumes: e4m3 [..., N, K] with contiguous rows and its block-scale grid."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 kernels take float8_e4m3fn weights, got {weight.dtype}")
    if weight.stride(-1) != 1 or scale_inv.stride(-1) != 1:
        raise ValueError("FP8 weights and scales need contiguous rows")
    expected = block_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} with block "
                         f"{tuple(block)} (expected {expected})")


def fp8_tile(cfg: dict[str, int], block: tuple[int, int], row_offset: int = 0) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a GEMV tile: BLOCK_N shrunk to divide the scale block's rows (and `row_offset`, the up
    rows' start of a gate/up weight), so a program's rows share one scale row."""
    block_n = pow2_divisor(cfg["block_n"], block[0], *([row_offset] if row_offset else []))
    block_k = cfg["block_k"] if cfg["block_k"] > block[1] else pow2_divisor(cfg["block_k"], block[1])
    return block_n, block_k


@triton.jit
def k_scales(s_row, k0, K, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The block scales of columns k0 .. k0 + BLOCK_K of one scale row, in fp32: a scalar where the step lies in one
    block (BLOCK_K divides GROUP_K), else one per column (a gather of few distinct values, L1 hits)."""
    # one return (the frontend checks every return's type, dead constexpr branches included)
    if BLOCK_K <= GROUP_K:
        s = tl.load(s_row + k0 // GROUP_K).to(tl.float32)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            s = tl.load(s_row + offs_k // GROUP_K).to(tl.float32)
        else:
            s = tl.load(s_row + offs_k // GROUP_K, mask=offs_k < K, other=0.0).to(tl.float32)
    return s


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, g_ptr, N, K, stride_wn, stride_sn, stride_gh,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                     HAS_GATE: tl.constexpr = False, GATE_D: tl.constexpr = 1):
    # gemv._gemv_kernel with FP8 rows: y[n] = sum_k w[n, k] * (x[k] * s[n // GN, k // GK])
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    s_row = s_ptr + ((pid * BLOCK_N) // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile and its scales load before the wait: no earlier kernel writes them
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        s = k_scales(s_row, 0, K, GROUP_K, BLOCK_K, EVEN_K)
        pdl_wait_then_release()
        x = _gemv_in_tile(x_ptr, g_ptr, 0, K, stride_gh, HAS_GATE, GATE_D, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * (x * s)[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        s = k_scales(s_row, k0, K, GROUP_K, BLOCK_K, EVEN_K)
        x = _gemv_in_tile(x_ptr, g_ptr, k0, K, stride_gh, HAS_GATE, GATE_D, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * (x * s)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_rows_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                          GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # gemv._rows_gemm_kernel with FP8 rows: the tile converts exactly to x's dtype for tl.dot, and each step's
    # product (BLOCK_K divides GK: one block of scales) is scaled once into the fp32 accumulator
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    s_row = s_ptr + ((pid * BLOCK_N) // GROUP_N) * stride_sn
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # the first weight tile and its scale load before the wait
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        s = tl.load(s_row).to(tl.float32)
        pdl_wait_then_release()
        x = _w_tile(x_ptr, offs_m, m_ok, 0, K, stride_xm, BLOCK_K, EVEN_K)
        acc += tl.dot(x, tl.trans(w.to(dt)), input_precision=PRECISION) * s
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        s = tl.load(s_row + k0 // GROUP_K).to(tl.float32)
        x = _w_tile(x_ptr, offs_m, m_ok, k0, K, stride_xm, BLOCK_K, EVEN_K)
        acc += tl.dot(x, tl.trans(w.to(dt)), input_precision=PRECISION) * s
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_rows(w_ptr, s_row, offs_n, n_ok, k0, K, stride_wn, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr):
    # one FP8 tile dequantized to fp32 (its block scales applied): the input of norm_gemv's tile step
    w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K).to(tl.float32)
    s = k_scales(s_row, k0, K, GROUP_K, BLOCK_K, EVEN_K)
    if BLOCK_K <= GROUP_K:
        w = w * s
    else:
        w = w * s[None, :]
    return w


@triton.jit
def _fp8_or_tail_rows(w_ptr, s_row, t_ptr, offs_n, n_ok, offs_t, t_ok, in_tail, k0, K, stride_wn, stride_tn,
                      GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_TAIL: tl.constexpr):
    # a program's fp32 tile: FP8 rows of the body, or (HAS_TAIL, a program past the body's) dense tail rows
    if HAS_TAIL:
        if in_tail:
            w = _w_tile(t_ptr, offs_t, t_ok, k0, K, stride_tn, BLOCK_K, EVEN_K).to(tl.float32)
        else:
            w = _fp8_rows(w_ptr, s_row, offs_n, n_ok, k0, K, stride_wn, GROUP_K, BLOCK_K, EVEN_K)
    else:
        w = _fp8_rows(w_ptr, s_row, offs_n, n_ok, k0, K, stride_wn, GROUP_K, BLOCK_K, EVEN_K)
    return w


@triton.jit
def _fp8_norm_gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, s_ptr, b_ptr, y_ptr, h_ptr, t_ptr, N, K, stride_wn, stride_sn,
                          up_offset, eps, n_tail, stride_tn, body_programs, GROUP_N: tl.constexpr,
                          GROUP_K: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, ZERO_CENTERED: tl.constexpr = False,
                          HAS_TAIL: tl.constexpr = False):
    # norm_gemv._norm_gemv_kernel (no router outputs) with FP8 rows: the tiles are dequantized in registers and go
    # through the same norm/accumulate step. GATED: the up rows start at row up_offset (BLOCK_N divides it, so the
    # up rows of a program share one scale row too). HAS_TAIL: the programs after the body's `body_programs` own
    # n_tail more output rows (after the N body rows) of a dense weight t [n_tail, K]: a projection whose last rows
    # the checkpoint keeps in full precision (the GDN in_proj's b and a) in the same launch.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    in_tail = pid >= body_programs
    offs_t = (pid - body_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = (offs_t >= 0) & (offs_t < n_tail)
    s_row = s_ptr + ((pid * BLOCK_N) // GROUP_N) * stride_sn
    s_row_up = s_ptr + ((up_offset + pid * BLOCK_N) // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # as in _fp8_gemv_kernel: the first weight tile(s) and scales load before the wait
        w = _fp8_or_tail_rows(w_ptr, s_row, t_ptr, offs_n, n_ok, offs_t, t_ok, in_tail, 0, K, stride_wn, stride_tn,
                              GROUP_K, BLOCK_K, EVEN_K, HAS_TAIL)
        wu = w
        if GATED:
            wu = _fp8_rows(w_ptr, s_row_up, offs_n + up_offset, n_ok, 0, K, stride_wn, GROUP_K, BLOCK_K, EVEN_K)
        pdl_wait_then_release()
        acc, acc_up, ss = _norm_gemv_tile(0, x_ptr, r_ptr, g_ptr, h_ptr, w, wu, acc, acc_up, ss, pid, K,
                                          NORM, HAS_RESIDUAL, GATED, BLOCK_K, ZERO_CENTERED)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _fp8_or_tail_rows(w_ptr, s_row, t_ptr, offs_n, n_ok, offs_t, t_ok, in_tail, k0, K, stride_wn, stride_tn,
                              GROUP_K, BLOCK_K, EVEN_K, HAS_TAIL)
        wu = w
        if GATED:
            wu = _fp8_rows(w_ptr, s_row_up, offs_n + up_offset, n_ok, k0, K, stride_wn, GROUP_K, BLOCK_K, EVEN_K)
        acc, acc_up, ss = _norm_gemv_tile(k0, x_ptr, r_ptr, g_ptr, h_ptr, w, wu, acc, acc_up, ss, pid, K,
                                          NORM, HAS_RESIDUAL, GATED, BLOCK_K, ZERO_CENTERED)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    else:
        rstd = 1.0
    y = tl.sum(acc, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, axis=1) * rstd
        if HAS_BIAS:
            up += tl.load(b_ptr + up_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)  # the unfused path's rounding points, as norm_gemv
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32) * up
    if HAS_TAIL:
        out = tl.where(in_tail, N + offs_t, offs_n)
        tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=tl.where(in_tail, t_ok, n_ok))
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def _check_rows(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    check_fp8_weight(weight, scale_inv, block)
    if weight.dim() != 2 or x.dim() != 2 or weight.shape[1] != x.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not make a [M, K] x [N, K] product")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
             block: tuple[int, int] = DEFAULT_BLOCK, gate: torch.Tensor | None = None, block_n: int | None = None,
             block_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None) -> torch.Tensor:
    """x [1, K] (bf16 / fp16 / fp32), weight float8_e4m3fn [N, K], scale_inv [ceil(N/GN), ceil(K/GK)], bias [N]
    -> [1, N] in x's dtype: `gemv.gemv` for a block-FP8 weight. gate: as `gemv.gemv` (the gated attention's
    o_proj, y = W (x * sigmoid(gate)))."""
    _check_rows(x, weight, scale_inv, block)
    assert x.shape[0] == 1, f"fp8_gemv takes one row, got {x.shape[0]}"
    n, k = weight.shape
    cfg = {**(FP8_GEMV_CONFIGS.get((n, k)) or default_config(k)),
           **{key: v for key, v in dict(block_n=block_n, block_k=block_k).items() if v}}
    bn, bk = fp8_tile(cfg, block)
    gate_args: dict = {}
    stride_gh = 0
    if gate is not None:
        assert gate.dtype == x.dtype and gate.numel() == k and gate.shape[0] == 1 and gate.stride(-1) == 1
        assert gate.dim() in (2, 3)
        stride_gh = gate.stride(1) if gate.dim() == 3 else gate.shape[-1]
        gate_args = dict(HAS_GATE=True, GATE_D=gate.shape[-1])
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, scale_inv, bias if bias is not None else x, y, gate if gate is not None else x, n, k,
        weight.stride(0), scale_inv.stride(0), stride_gh, GROUP_N=block[0], GROUP_K=block[1],
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"], **gate_args,
        **pdl_launch(x),
    )
    return y


def fp8_rows_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                  block: tuple[int, int] = DEFAULT_BLOCK, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] with M <= 16, block-FP8 weight [N, K] + scale_inv, bias [N] -> [M, N] in x's dtype:
    `gemv.rows_gemm` for a block-FP8 weight (speculative verify steps)."""
    _check_rows(x, weight, scale_inv, block)
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= ROWS_GEMM_MAX_ROWS, f"fp8_rows_gemm takes 1..{ROWS_GEMM_MAX_ROWS} rows, got {m}"
    cfg = _INTERPRETER_ROWS_CONFIG if triton_interpreted() else FP8_ROWS_GEMM_CONFIG
    bn = pow2_divisor(block_n or cfg["block_n"], block[0])
    bk = pow2_divisor(block_k or cfg["block_k"], block[1])  # one block of scales a step
    assert bn >= 16 and bk >= 16, f"block {block} leaves tiles under tl.dot's 16"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_rows_gemm_kernel[(triton.cdiv(n, bn),)](
        x, weight, scale_inv, bias if bias is not None else x, y, m, n, k, x.stride(0), weight.stride(0),
        scale_inv.stride(0), y.stride(0), GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=ROWS_GEMM_MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"], **pdl_launch(x),
    )
    return y


def fp8_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                  weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                  zero_centered: bool = False, block: tuple[int, int] = DEFAULT_BLOCK, block_n: int | None = None,
                  block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_gemv.norm_gemv` for a block-FP8 weight: one row, (W RMSNorm(h) [+ b], h) with h = x + residual, in one
    launch; gated: W is [gate | up] (2I rows, the scale grid of that [2I, K] matrix) and the output silu(gate) * up.
    tail: a dense [T, K] weight (x's dtype) whose T output rows follow W's, computed in the same launch (no bias)."""
    _check_rows(x, weight, scale_inv, block)
    assert x.shape[0] == 1, f"fp8_norm_gemv takes one row, got {x.shape[0]}"
    assert norm_weight is None or norm_weight.shape == (x.shape[1],)
    k = x.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    n_tail = 0 if tail is None else tail.shape[0]
    if tail is not None:
        assert not gated and bias is None and tail.shape[1] == k and tail.stride(1) == 1 and tail.dtype == x.dtype
    cfg = {**norm_gemv_config(n, k), **{key: v for key, v in dict(block_n=block_n, block_k=block_k).items() if v}}
    bn, bk = fp8_tile(cfg, block, n if gated else 0)
    y = torch.empty((1, n + n_tail), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        h = torch.empty_like(x)
    else:
        h = x
    body_programs = triton.cdiv(n, bn)
    _fp8_norm_gemv_kernel[(body_programs + triton.cdiv(n_tail, bn),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight, scale_inv,
        bias if bias is not None else x, y, h, tail if tail is not None else x, n, k, weight.stride(0),
        scale_inv.stride(0), n, float(eps), n_tail, tail.stride(0) if tail is not None else 0, body_programs,
        GROUP_N=block[0], GROUP_K=block[1], NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        ZERO_CENTERED=zero_centered, HAS_TAIL=tail is not None, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"], **pdl_launch(x),
    )
    return y, h
