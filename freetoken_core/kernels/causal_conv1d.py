"""Triton kernels of the causal depthwise conv1d of gated-delta-net (GDN) layers, reading and writing
each request's conv state [slots, C, K-1] (its last K-1 inputs) by slot, as `gdn.py` does the
recurrent state (see its docstring for the slot pools, the verify/replay scheme and graph safety).

- `conv1d_update`: decode and speculative verify, R = rows_per_req rows per request (request-major),
  one program per (request, channel block); with write_state the slot ends holding the last K-1
  inputs after num_rows[i] rows, without it the pool is untouched.
- `causal_conv1d_varlen`: prefill of concatenated sequences (cu_seqlens), `initial_zero` per request.

fp32 math rounded once at the store, like `causal_conv1d_ref.py` (the CPU path and the references).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .causal_conv1d_ref import causal_conv1d_varlen_ref, conv1d_update_ref  # noqa: F401  (the references)
from .jit_util import _and, _last_dim_contiguous
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release


def _check_activation(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r} (silu/swish or None)")


@triton.jit
def _conv_tap(x, state, x_row, st_col, from_x, from_state, slot, offs_c, mask_c, s_xt, s_s0, s_s1, s_s2):
    # one input of the extended sequence [state (K-1 columns) | rows]: a row of x or a state column
    xv = tl.load(x + x_row * s_xt + offs_c, mask=_and(mask_c, from_x), other=0.0).to(tl.float32)
    sv = tl.load(state + slot * s_s0 + offs_c * s_s1 + st_col * s_s2, mask=_and(mask_c, from_state),
                 other=0.0).to(tl.float32)
    return tl.where(from_x, xv, sv)


@triton.jit
def _conv_finish(acc, b_ptr, offs_c, mask_c, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _conv_write_state(x, state, slot, first_row, n, use_state, offs_c, mask_c, s_xt, s_s0, s_s1, s_s2,
                      write_ok, K: tl.constexpr, KP: tl.constexpr):
    # After n rows the state is xx[n : n+K-1] of xx = [old state | rows from first_row]: column i
    # comes from row first_row + n + i - (K-1) or, when n + i < K-1, from old column n + i.
    offs_i = tl.arange(0, KP)
    m = n + offs_i
    mask_i = offs_i < K - 1
    from_x = m >= K - 1
    mask_x = mask_c[:, None] & (mask_i & from_x)[None, :]
    mask_st = mask_c[:, None] & _and(mask_i & (m < K - 1), use_state)[None, :]
    xv = tl.load(x + (first_row + m - (K - 1))[None, :] * s_xt + offs_c[:, None], mask=mask_x, other=0.0)
    p_st = state + slot * s_s0 + offs_c[:, None] * s_s1
    sv = tl.load(p_st + m[None, :] * s_s2, mask=mask_st, other=0.0)
    new = tl.where(from_x[None, :], xv.to(state.dtype.element_ty), sv)
    # every thread of the program has read the old columns before any overwrites them
    tl.debug_barrier()
    tl.store(p_st + offs_i[None, :] * s_s2, new, mask=_and(mask_c[:, None] & mask_i[None, :], write_ok))


@triton.jit
def _conv_update_kernel(
    x, w, b, y, state, slot_ids, num_rows, C, s_xt, s_yt, s_w0, s_s0, s_s1, s_s2,
    R: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, WRITE_STATE: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (request i, channel block): rows i*R .. i*R+R-1 against xx = [state | rows];
    # row r's output is b + sum_j w_j xx[r + j].
    # PDL (kernels/pdl.py): the slot (from the host) and, for one row (R = 1, decode), the taps that read the
    # state (written by this layer's launch of an earlier step, never by the kernel just before this one: see
    # gdn.py's _gdn_rows_kernel) load before the wait, so their DRAM latency overlaps in_proj's GEMV; x (in_proj's
    # output) and the row counts after it.
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    first_row = i_b.to(tl.int64) * R
    offs_c = i_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    if R == 1:
        acc, w_last = _conv_state_taps(w, state + slot * s_s0 + offs_c * s_s1, offs_c, mask_c, s_w0, s_s2, K)
        if USE_PDL:
            pdl_wait_then_release()
        acc += tl.load(x + first_row * s_xt + offs_c, mask=mask_c, other=0.0).to(tl.float32) * w_last
        acc = _conv_finish(acc, b, offs_c, mask_c, HAS_BIAS, SILU)
        tl.store(y + first_row * s_yt + offs_c, acc.to(y.dtype.element_ty), mask=mask_c)
    else:
        if USE_PDL:
            pdl_wait_then_release()
        for r in range(0, R):
            acc = tl.zeros((BC,), dtype=tl.float32)
            for j in tl.static_range(K):
                m = r + j
                xx = _conv_tap(x, state, first_row + m - (K - 1), m, m >= K - 1, m < K - 1, slot, offs_c, mask_c,
                               s_xt, s_s0, s_s1, s_s2)
                acc += xx * tl.load(w + offs_c * s_w0 + j, mask=mask_c, other=0.0).to(tl.float32)
            acc = _conv_finish(acc, b, offs_c, mask_c, HAS_BIAS, SILU)
            tl.store(y + (first_row + r) * s_yt + offs_c, acc.to(y.dtype.element_ty), mask=mask_c)
    if WRITE_STATE:
        n = tl.load(num_rows + i_b)
        _conv_write_state(x, state, slot, first_row, n, True, offs_c, mask_c, s_xt, s_s0, s_s1, s_s2,
                          n > 0, K, KP)


@triton.jit
def _conv_varlen_kernel(
    x, w, b, y, state, slot_ids, cu_seqlens, seq_idx, initial_zero, T, C, s_xt, s_yt, s_w0, s_s0, s_s1, s_s2,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INITIAL_ZERO: tl.constexpr, SILU: tl.constexpr,
):
    # Program (token block, channel block): tokens of any sequences; seq_idx says whose each is.
    # Token t at position p = t - bos reads xx[p .. p+K-1] of xx = [state | its sequence's rows]:
    # source token t - (K-1) + j, or, before bos, state column (t - (K-1) + j) - bos + (K-1).
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_c = i_c * BC + tl.arange(0, BC)
    mask_t, mask_c = offs_t < T, offs_c < C
    seq = tl.load(seq_idx + offs_t, mask=mask_t, other=0)
    bos = tl.load(cu_seqlens + seq, mask=mask_t, other=0).to(tl.int64)
    slot = tl.load(slot_ids + seq, mask=mask_t, other=0).to(tl.int64)
    use_state = mask_t
    if HAS_INITIAL_ZERO:
        use_state = use_state & (tl.load(initial_zero + seq, mask=mask_t, other=1) == 0)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        src = offs_t.to(tl.int64) - (K - 1) + j
        from_x = src >= bos
        xv = tl.load(x + src[:, None] * s_xt + offs_c[None, :], mask=(mask_t & from_x)[:, None] & mask_c[None, :],
                     other=0.0).to(tl.float32)
        p_st = state + slot[:, None] * s_s0 + offs_c[None, :] * s_s1 + (src - bos + (K - 1))[:, None] * s_s2
        sv = tl.load(p_st, mask=(use_state & (src < bos))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        acc += tl.where(from_x[:, None], xv, sv) * tl.load(w + offs_c * s_w0 + j, mask=mask_c, other=0.0
                                                           ).to(tl.float32)[None, :]
    acc = _conv_finish(acc, b, offs_c[None, :], mask_c[None, :], HAS_BIAS, SILU)
    tl.store(y + offs_t[:, None] * s_yt + offs_c[None, :], acc.to(y.dtype.element_ty),
             mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_varlen_state_kernel(
    x, state, slot_ids, cu_seqlens, initial_zero, C, s_xt, s_s0, s_s1, s_s2,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, HAS_INITIAL_ZERO: tl.constexpr,
):
    # Program (sequence, channel block): the last K-1 inputs of [state | rows]; a second launch
    # because the conv kernel's programs read the old state of the sequences they touch
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_b).to(tl.int64)
    n = tl.load(cu_seqlens + i_b + 1).to(tl.int64) - bos
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    use_state = True
    if HAS_INITIAL_ZERO:
        use_state = tl.load(initial_zero + i_b) == 0
    offs_c = i_c * BC + tl.arange(0, BC)
    _conv_write_state(x, state, slot, bos, n, use_state, offs_c, offs_c < C, s_xt, s_s0, s_s1, s_s2, True,
                      K, KP)


def _conv_checks(x, weight, conv_state_pool):
    C, K = weight.shape
    assert x.shape[-1] == C and tuple(conv_state_pool.shape[1:]) == (C, K - 1), \
        f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv state pool {tuple(conv_state_pool.shape)}"
    return _last_dim_contiguous(x), C, K


# Tile sizes of the conv kernels (module constants so benchmarks can sweep them)
_CONV_BC, _CONV_BT = 64, 16


def conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor, num_rows: torch.Tensor, rows_per_req: int, write_state: bool = True,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode / verify conv (see `conv1d_update_ref`): x [B*R, C], weight [C, K], conv_state_pool
    [slots, C, K-1]. Returns y [B*R, C] in x's dtype; writes the pool only when write_state."""
    x, C, K = _conv_checks(x, weight, conv_state_pool)
    B = slot_ids.shape[0]
    assert x.shape[0] == B * rows_per_req, f"{x.shape[0]} rows for {B} requests x {rows_per_req}"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    _conv_update_kernel[(B, triton.cdiv(C, _CONV_BC))](
        x, weight, bias if bias is not None else weight, y, conv_state_pool, slot_ids, num_rows, C,
        x.stride(0), y.stride(0), weight.stride(0), *conv_state_pool.stride(),
        R=rows_per_req, K=K, KP=triton.next_power_of_2(max(K - 1, 1)), BC=_CONV_BC,
        HAS_BIAS=bias is not None, SILU=_check_activation(activation), WRITE_STATE=write_state, num_warps=1,
        **pdl_launch(x),
    )
    return y


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor, slot_ids: torch.Tensor, initial_zero: torch.Tensor | None = None,
    activation: str | None = "silu", seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill conv over concatenated sequences (see `causal_conv1d_varlen_ref`). seq_idx [T] (the
    request of each row) is derived from cu_seqlens on the device when not given."""
    x, C, K = _conv_checks(x, weight, conv_state_pool)
    T, B = x.shape[0], slot_ids.shape[0]
    assert cu_seqlens.shape[0] == B + 1, "cu_seqlens needs B + 1 entries"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    if seq_idx is None:  # row t belongs to the last i with cu_seqlens[i] <= t
        rows = torch.arange(T, device=x.device, dtype=cu_seqlens.dtype)
        seq_idx = torch.searchsorted(cu_seqlens, rows, right=True) - 1
    has_iz = initial_zero is not None
    iz = initial_zero if has_iz else slot_ids
    silu = _check_activation(activation)
    if T > 0:
        _conv_varlen_kernel[(triton.cdiv(T, _CONV_BT), triton.cdiv(C, _CONV_BC))](
            x, weight, bias if bias is not None else weight, y, conv_state_pool, slot_ids, cu_seqlens, seq_idx, iz,
            T, C, x.stride(0), y.stride(0), weight.stride(0), *conv_state_pool.stride(),
            K=K, BT=_CONV_BT, BC=_CONV_BC, HAS_BIAS=bias is not None, HAS_INITIAL_ZERO=has_iz, SILU=silu,
            num_warps=4,
        )
    _conv_varlen_state_kernel[(B, triton.cdiv(C, _CONV_BC))](
        x, conv_state_pool, slot_ids, cu_seqlens, iz, C, x.stride(0), *conv_state_pool.stride(),
        K=K, KP=triton.next_power_of_2(max(K - 1, 1)), BC=_CONV_BC, HAS_INITIAL_ZERO=has_iz, num_warps=1,
    )
    return y


# ------------------------------------------------------ the decode conv inside the GDN recurrence


@triton.jit
def _conv_state_taps(conv_w, p_cs, ch, mask, s_cw0, s_c2, K: tl.constexpr):
    # One row's conv for the channels `ch` of one slot (p_cs: their state column 0), the part that reads no
    # input (a PDL kernel runs it before its wait): the old state columns 0..K-2 times their taps, summed in
    # that order in fp32, and the last tap's weight (the input's).
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for j in tl.static_range(K - 1):
        tap = tl.load(p_cs + j * s_c2, mask=mask, other=0.0).to(tl.float32)
        acc += tap * tl.load(conv_w + ch * s_cw0 + j, mask=mask, other=0.0).to(tl.float32)
    return acc, tl.load(conv_w + ch * s_cw0 + (K - 1), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _conv_decode_state(conv_w, p_cs, ch, mask, s_cw0, s_c2, K: tl.constexpr, KP: tl.constexpr):
    # causal_conv1d._conv_update_kernel at one row (R = 1) for gdn.py's fused conv, before its PDL wait:
    # `_conv_state_taps`, and the old columns 1..K-2 (the next state's start). `_conv_decode_finish` adds the input.
    acc, w_last = _conv_state_taps(conv_w, p_cs, ch, mask, s_cw0, s_c2, K)
    offs_i = tl.arange(0, KP)
    shifted = tl.load(p_cs[:, None] + (offs_i + 1)[None, :] * s_c2,
                      mask=mask[:, None] & (offs_i + 1 < K - 1)[None, :], other=0.0)
    return acc, shifted, w_last


@triton.jit
def _conv_decode_finish(x_ptr, acc, shifted, w_last, conv_b, ch, mask, state_ty: tl.constexpr, K: tl.constexpr,
                        KP: tl.constexpr, HAS_BIAS: tl.constexpr):
    # ... then the input x (the last tap) + bias, SiLU, rounded to x's dtype as conv1d_update stores it. Also
    # returns the slot's next state [old columns 1..K-2 | x] in the pool's dtype, for the caller to store once
    # every reader has read.
    xv = tl.load(x_ptr, mask=mask, other=0.0)
    acc += xv.to(tl.float32) * w_last
    if HAS_BIAS:
        acc += tl.load(conv_b + ch, mask=mask, other=0.0).to(tl.float32)
    acc = acc / (1.0 + tl.exp(-acc))
    offs_i = tl.arange(0, KP)
    new = tl.where((offs_i == K - 2)[None, :], xv[:, None].to(state_ty), shifted)
    return acc.to(xv.dtype).to(tl.float32), new


@triton.jit
def _store_conv_state(p_cs, new, mask, ok, s_c2, K: tl.constexpr, KP: tl.constexpr):
    offs_i = tl.arange(0, KP)
    tl.store(p_cs[:, None] + offs_i[None, :] * s_c2, new, mask=_and(mask[:, None] & (offs_i < K - 1)[None, :], ok))
