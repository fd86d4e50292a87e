"""Triton kernels of gated-delta-net (GDN) layers that read and write per-request state by slot.

A GDN layer keeps a fixed-size state per request in two pools: the conv state [slots, C, K-1]
(the last K-1 inputs of its causal depthwise conv) and the recurrent state [slots, Hv, dk, dv]
(fp32 by default; a bf16 pool is loaded to fp32 and stored rounded). fla's ops take dense
per-sequence initial states and have no slot indices, and decode runs inside CUDA graphs, so
these kernels index the pools through `slot_ids` (device ints) themselves:

- `gdn_recurrent_update` (and `causal_conv1d.conv1d_update`, the conv's kernels): decode and
  speculative verify, R = rows_per_req rows per request (request-major). One program per (request,
  value head, dv block) keeps its [dk, BV] block of the state in registers and loops over the
  request's rows. With write_state=False the pools are untouched (verify over all k+1
  rows); with write_state=True the slot ends holding the state after the first num_rows[i] rows
  (decode: R = 1; after verify: a replay of the same inputs with num_rows = accepted counts). The
  replay costs one more pass over the state and needs no per-row state copies, which at batch 64
  with k = 4 would be ~20 GiB for Qwen3.6 (61 MiB of state per request).
- The layer's glue rides in the recurrence: with `gating=(A_log, dt_bias)` the kernel reads the raw
  a, b of in_proj_ba and computes beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) itself;
  with `out_norm=(w, z, eps)` it returns the gated output norm `w * rmsnorm(o) * silu(z)` per head,
  in its epilogue when one program holds a whole head (BV >= dv), else as one `gated_rmsnorm` launch.
  A batch-1 GDN layer is then conv + recurrence (+ norm) instead of ~25 torch launches.
- `gdn_decode_with_conv`: plain decode (R = 1, states written) with the conv update inside the recurrence's
  launch (FREETOKEN_GDN_FUSED_CONV); the conv state of the q/k channels, which several programs read, is
  written by the last of them to arrive (per-key-head counters, see `_gdn_rows_kernel`). The output norm
  can move into out_proj's GEMV instead (gdn_out_gemv.py, at one row).
- `gdn_varlen` (and `causal_conv1d.causal_conv1d_varlen`): prefill of concatenated sequences (cu_seqlens), with an
  `initial_zero` flag per request for a first chunk (slots are never cleared). The recurrence here
  is the plain token loop per (sequence, head, dv block): correct, not fast. On CUDA the model layer
  prefers fla-core's chunked kernel (`fla_available()`; kernels/gdn_fla.py gathers and scatters the
  states around it and checks it against this kernel first).

Every kernel computes in fp32 and rounds once at the store, like `gdn_ref.py` (the plain-torch
references and the CPU path). No host syncs; shapes come from the inputs only; per-request lengths
and counts are device tensors: all are safe inside CUDA graph capture. The decode-path kernels launch
with programmatic dependent launch where the device has it (kernels/pdl.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .causal_conv1d import _conv_decode_finish, _conv_decode_state, _store_conv_state
from .gdn_ref import (  # noqa: F401  (the references, beside their kernels)
    chunk_gated_delta_rule_ref, gated_rmsnorm_ref, gdn_decode_with_conv_ref, gdn_gating_ref, gdn_recurrent_update_ref,
    gdn_varlen_ref, l2norm, recurrent_gated_delta_rule_ref,
)
from .gated_rmsnorm import _gated_norm, gated_rmsnorm
from .jit_util import _and, _last_dim_contiguous
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release


@functools.cache
def fla_available() -> bool:
    """Whether fla-core's chunked gated-delta-rule kernel can run here: CUDA only, imported lazily.
    Never imported on CPU: installed, fla makes transformers' CPU path fail ("0 active drivers")."""
    if not torch.cuda.is_available():
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # not installed, or broken against this triton/torch
        return False
    return True


# Tiles of the decode / verify recurrence: rows (max B * Hv, BV, num_warps, num_stages); a launch of B
# requests takes the first row whose bound covers B * Hv (the programs before the dv split). BV is
# capped at dv; BV >= dv (one program per head) runs the gated output norm in the kernel's epilogue,
# smaller tiles pay a separate norm launch. Each program keeps a [dk, BV] fp32 block of the state in
# registers. Wider tiles win as the batch grows (at batch 64 the state traffic nears the memory bandwidth);
# `python benchmarks/bench_gdn.py` sweeps these tiles and prints rows to paste here.
GDN_UPDATE_CONFIGS: tuple[tuple[int, int, int, int], ...] = (
    # benchmarks/bench_gdn.py on the H200 (Qwen3.6: 32 value heads, fp32 state [128, 128] per head),
    # the layer's call with gates and output norm, in a CUDA graph over state slots past the L2:
    (255, 16, 1, 3),  # up to batch 7
    (511, 32, 1, 1),  # batch 8-15
    (1 << 62, 64, 4, 1),  # batch 16 and up
)
# Prefill's token loop: more programs win (the narrowest tile was fastest on an 8192-token sequence)
GDN_VARLEN_CONFIG: tuple[int, int, int] = (8, 1, 3)


def _gdn_config(requests: int, num_v_heads: int, dv: int, varlen: bool) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) of the recurrence (GDN_UPDATE_CONFIGS, GDN_VARLEN_CONFIG)."""
    if varlen:
        bv, warps, stages = GDN_VARLEN_CONFIG
    else:
        row = next((c for c in GDN_UPDATE_CONFIGS if requests * num_v_heads <= c[0]), GDN_UPDATE_CONFIGS[-1])
        bv, warps, stages = row[1:]
    return min(triton.next_power_of_2(dv), bv), warps, stages


# ------------------------------------------------------------------------------ gated delta rule


@triton.jit
def _load_qk(q_ptr, k_ptr, offs_k, mask_k, scale, USE_L2NORM: tl.constexpr):
    b_q = tl.load(q_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    return _norm_qk(b_q, b_k, scale, USE_L2NORM)


@triton.jit
def _norm_qk(b_q, b_k, scale, USE_L2NORM: tl.constexpr):
    if USE_L2NORM:  # transformers' l2norm: x * rsqrt(sum(x^2) + 1e-6)
        b_q = b_q * tl.math.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k * tl.math.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    return b_q * scale, b_k


@triton.jit
def _delta_step(S, b_q, b_k, b_v, b_g, b_beta):
    # S [BK, BV] fp32: decay, read k's current value, write the beta-scaled correction, read q
    S = S * tl.exp(b_g)
    delta = (b_v - tl.sum(S * b_k[:, None], axis=0)) * b_beta
    S = S + b_k[:, None] * delta[None, :]
    return tl.sum(S * b_q[:, None], axis=0), S


@triton.jit
def _softplus(x):
    # torch's F.softplus (beta 1, threshold 20): x past 20, else log1p(exp(x)), log1p written as
    # log(u) * y / (u - 1) with u = 1 + y (exact to an ulp also where 1 + y rounds away most of y)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    lp = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _gates(g_ptr, beta_ptr, A_log, dt_bias, i_h, BETA_DT: tl.constexpr, RAW_GATES: tl.constexpr):
    # RAW_GATES: g_ptr / beta_ptr point at a and b of in_proj_ba, and the gates are transformers'
    # beta = b.sigmoid() (rounded to b's dtype) and g = -exp(A_log) * softplus(a + dt_bias) in fp32
    if RAW_GATES:
        b_a = tl.load(g_ptr).to(tl.float32)
        b_b = tl.load(beta_ptr).to(tl.float32)
        a_log = tl.load(A_log + i_h).to(tl.float32)
        dt = tl.load(dt_bias + i_h).to(tl.float32)
        b_g = -tl.exp(a_log) * _softplus(b_a + dt)
        b_beta = (1.0 / (1.0 + tl.exp(-b_b))).to(BETA_DT).to(tl.float32)
    else:
        b_g = tl.load(g_ptr).to(tl.float32)
        b_beta = tl.load(beta_ptr).to(tl.float32)
    return b_g, b_beta


@triton.jit
def _gdn_rows_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, z, norm_w, state, slot_ids, num_rows, cu_seqlens, initial_zero,
    conv_w, conv_b, conv_state, conv_arrivals,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh, s_zt, s_zh, s_s0, s_s1, s_s2,
    s_cw0, s_c0, s_c1, s_c2, scale, eps,
    R: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_INITIAL_ZERO: tl.constexpr, USE_L2NORM: tl.constexpr, WRITE_STATE: tl.constexpr,
    RAW_GATES: tl.constexpr, OUT_NORM: tl.constexpr, USE_PDL: tl.constexpr,
    FUSED_CONV: tl.constexpr = False, HK: tl.constexpr = 1, K_CONV: tl.constexpr = 1, KP: tl.constexpr = 1,
    HAS_CONV_BIAS: tl.constexpr = False,
):
    # Program (request i, value head h, dv block): rows bos..eos-1 of request i in order.
    # VARLEN (prefill): rows from cu_seqlens, the final state stored after the loop.
    # else (decode / verify): rows i*R .. i*R+R-1; with WRITE_STATE the state after row num_rows[i]-1
    # is stored when the loop passes it (a masked store, so rows past num_rows never write).
    # OUT_NORM (BV >= DV: the program holds a whole head): o = gated_norm(o, z) before the store.
    # FUSED_CONV (plain decode only: R = 1, WRITE_STATE): q, k, v point at the conv *inputs* (views of
    # in_proj's row) and the program runs the conv of the channels it reads itself (see below).
    # PDL (kernels/pdl.py): decode and verify load their slot and state tile before the wait. Neither is written
    # by the kernel just before this one, the only one still running when this one starts (a PDL kernel lets its
    # dependents start only after its own wait, i.e. once the kernel before it has finished): slot_ids come from
    # the host, the state from this layer's launch of an earlier step. So the state's DRAM latency overlaps the
    # conv; the row counts (a verify replay's may be made on the device just before) load after the wait.
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // REP  # repeat_interleave: REP consecutive value heads share a key head
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    p_s = state + slot * s_s0 + i_h * s_s1 + offs_k[:, None] * s_s2 + offs_v[None, :]
    if VARLEN:
        if USE_PDL:
            pdl_wait_then_release()
        bos = tl.load(cu_seqlens + i_b).to(tl.int64)
        eos = tl.load(cu_seqlens + i_b + 1).to(tl.int64)
        load_mask = mask_s
        if HAS_INITIAL_ZERO:  # a fresh request ignores whatever its slot holds
            load_mask = _and(mask_s, tl.load(initial_zero + i_b) == 0)
        S = tl.load(p_s, mask=load_mask, other=0.0).to(tl.float32)
        n = eos - bos
    else:
        bos = i_b.to(tl.int64) * R
        eos = bos + R
        S = tl.load(p_s, mask=mask_s, other=0.0).to(tl.float32)
        if FUSED_CONV:  # the conv's state part too (its columns: see the loop); the inputs come after the wait
            p_cq = conv_state + slot * s_c0 + (i_hk * DK + offs_k) * s_c1
            p_ck = p_cq + HK * DK * s_c1
            p_cv = conv_state + slot * s_c0 + (2 * HK * DK + i_h * DV + offs_v) * s_c1
            cq_acc, cq_old, cq_w = _conv_decode_state(conv_w, p_cq, i_hk * DK + offs_k, mask_k, s_cw0, s_c2, K_CONV, KP)
            ck_acc, ck_old, ck_w = _conv_decode_state(conv_w, p_ck, (HK + i_hk) * DK + offs_k, mask_k, s_cw0, s_c2,
                                                      K_CONV, KP)
            cv_acc, cv_old, cv_w = _conv_decode_state(conv_w, p_cv, 2 * HK * DK + i_h * DV + offs_v, mask_v, s_cw0,
                                                      s_c2, K_CONV, KP)
        if USE_PDL:
            pdl_wait_then_release()
        n = tl.load(num_rows + i_b)
    for t in range(bos, eos):
        if FUSED_CONV:
            # Channels [q | k | v] of the conv: this program reads the q and k channels of its key head
            # and the v channels of its dv block. The v channels (and their state) are its own; the q/k
            # channels are read by all REP * cdiv(DV, BV) programs of the key head, and the slot's state
            # is updated in place. Whoever overwrites the q/k columns must do it after every one of those
            # programs has read the old ones, and programs of one grid are not ordered: a fixed writer
            # (e.g. i_v == 0) would race, and it cannot tell when the others are done without waiting
            # on them, which may deadlock (they need not be resident together; the interpreter runs
            # programs one by one). So the *last* program to arrive writes: each reads the old columns
            # (all of its threads: the barrier), then takes a ticket from the key head's counter in
            # conv_arrivals [slots, HK] (an acq_rel atomic: the reads above happen before it, the
            # stores below after every earlier ticket's reads); the ticket that completes a group of N
            # stores the new columns (all readers hold the same values) and takes N back off the
            # counter, so it is 0 again after the launch without a memset. Counting modulo N keeps this
            # exact when padded rows share the dummy slot 0 (m requests there: m * N tickets, m resets;
            # their outputs and slot 0's contents are garbage anyway, as in the unfused kernels).
            sty = conv_state.dtype.element_ty
            b_q, new_q = _conv_decode_finish(q + t * s_qt + i_hk * s_qh + offs_k, cq_acc, cq_old, cq_w, conv_b,
                                             i_hk * DK + offs_k, mask_k, sty, K_CONV, KP, HAS_CONV_BIAS)
            b_k, new_k = _conv_decode_finish(k + t * s_kt + i_hk * s_kh + offs_k, ck_acc, ck_old, ck_w, conv_b,
                                             (HK + i_hk) * DK + offs_k, mask_k, sty, K_CONV, KP, HAS_CONV_BIAS)
            b_v, new_v = _conv_decode_finish(v + t * s_vt + i_h * s_vh + offs_v, cv_acc, cv_old, cv_w, conv_b,
                                             2 * HK * DK + i_h * DV + offs_v, mask_v, sty, K_CONV, KP, HAS_CONV_BIAS)
            tl.debug_barrier()  # every thread of this program has read the old columns it needs
            readers = REP * ((DV + BV - 1) // BV)  # N: the programs of one key head
            p_arr = conv_arrivals + slot * HK + i_hk
            ticket = tl.atomic_add(p_arr, 1, sem="acq_rel", scope="gpu")
            last = ticket % readers == readers - 1
            tl.atomic_add(p_arr, -readers, mask=last, sem="acq_rel", scope="gpu")
            write = n > 0  # num_rows 0: the slot keeps its state, as in conv1d_update
            _store_conv_state(p_cv, new_v, mask_v, write, s_c2, K_CONV, KP)
            _store_conv_state(p_cq, new_q, mask_k, write & last, s_c2, K_CONV, KP)
            _store_conv_state(p_ck, new_k, mask_k, write & last, s_c2, K_CONV, KP)
            b_q, b_k = _norm_qk(b_q, b_k, scale, USE_L2NORM)
        else:
            b_q, b_k = _load_qk(q + t * s_qt + i_hk * s_qh, k + t * s_kt + i_hk * s_kh, offs_k, mask_k, scale,
                                USE_L2NORM)
            b_v = tl.load(v + t * s_vt + i_h * s_vh + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g, b_beta = _gates(g + t * s_gt + i_h * s_gh, beta + t * s_bt + i_h * s_bh, A_log, dt_bias, i_h,
                             beta.dtype.element_ty, RAW_GATES)
        b_o, S = _delta_step(S, b_q, b_k, b_v, b_g, b_beta)
        if OUT_NORM:  # o rounds to the model dtype first, as the unfused path stores it
            b_o = _gated_norm(b_o.to(o.dtype.element_ty).to(tl.float32), z + t * s_zt + i_h * s_zh, norm_w,
                              offs_v, mask_v, eps, DV, o.dtype.element_ty)
        tl.store(o + t * s_ot + i_h * s_oh + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if not VARLEN:
            if WRITE_STATE:
                tl.store(p_s, S.to(state.dtype.element_ty), mask=_and(mask_s, t - bos + 1 == n))
    if VARLEN:
        tl.store(p_s, S.to(state.dtype.element_ty), mask=mask_s)


def _launch_gdn(q, k, v, g, beta, state_pool, slot_ids, num_rows, cu_seqlens, initial_zero, rows_per_req,
                write_state, use_qk_l2norm, gating, out_norm, block_v, num_warps, num_stages, conv=None):
    # conv = (weight [C, K], bias [C] | None, conv_state_pool, arrivals): q, k, v are views of the conv input
    Hk, dk = q.shape[-2:]
    Hv, dv = v.shape[-2:]
    assert k.shape == q.shape and Hv % Hk == 0, f"q/k {tuple(q.shape)} vs v {tuple(v.shape)}"
    assert tuple(state_pool.shape[1:]) == (Hv, dk, dv) and state_pool.stride(-1) == 1, \
        f"state pool {tuple(state_pool.shape)} does not fit [slots, {Hv}, {dk}, {dv}]"
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    B = slot_ids.shape[0]
    varlen = cu_seqlens is not None
    BV, warps, stages = _gdn_config(B, Hv, dv, varlen)
    BV, warps, stages = block_v or BV, num_warps or warps, num_stages or stages
    grid = (B, Hv, triton.cdiv(dv, BV))
    if B == 0 or v.shape[0] == 0 and not varlen:
        return o
    if gating is not None:
        A_log, dt_bias = gating
        assert A_log.shape == (Hv,) and dt_bias.shape == (Hv,), f"A_log / dt_bias need [{Hv}]"
    else:
        A_log = dt_bias = g
    fused_norm = out_norm is not None and grid[2] == 1
    if out_norm is not None:
        norm_w, z, eps = out_norm
        assert z.shape == v.shape and z.stride(-1) == 1 and norm_w.shape == (dv,), \
            f"out_norm: z {tuple(z.shape)} (unit last stride) and weight [{dv}] for v {tuple(v.shape)}"
        assert norm_w.dtype == v.dtype, "the gated norm rounds w * rmsnorm(o) to o's dtype: w must have it too"
    else:
        norm_w, z, eps = v, v, 0.0
    conv_kw: dict = {}
    if conv is not None:
        conv_w, conv_b, conv_pool, arrivals = conv
        K = conv_w.shape[1]
        conv_kw = dict(FUSED_CONV=True, HK=Hk, K_CONV=K, KP=triton.next_power_of_2(max(K - 1, 1)),
                       HAS_CONV_BIAS=conv_b is not None)
        conv_args = (conv_w, conv_b if conv_b is not None else conv_w, conv_pool, arrivals,
                     conv_w.stride(0), *conv_pool.stride())
    else:
        conv_args = (v, v, v, slot_ids, 0, 0, 0, 0)
    _gdn_rows_kernel[grid](
        q, k, v, g, beta, A_log, dt_bias, o, z, norm_w, state_pool, slot_ids,
        num_rows if num_rows is not None else slot_ids, cu_seqlens if varlen else slot_ids,
        initial_zero if initial_zero is not None else slot_ids, *conv_args[:4],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), o.stride(0), o.stride(1), z.stride(0), z.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2), *conv_args[4:], dk ** -0.5, float(eps),
        R=rows_per_req, REP=Hv // Hk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BV,
        VARLEN=varlen, HAS_INITIAL_ZERO=initial_zero is not None, USE_L2NORM=use_qk_l2norm,
        WRITE_STATE=write_state, RAW_GATES=gating is not None, OUT_NORM=fused_norm,
        num_warps=warps, num_stages=stages, **conv_kw, **pdl_launch(v),
    )
    if out_norm is not None and not fused_norm:
        o = gated_rmsnorm(o, z, norm_w, eps)
    return o


def gdn_recurrent_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slot_ids: torch.Tensor, num_rows: torch.Tensor, rows_per_req: int,
    write_state: bool = True, use_qk_l2norm: bool = True,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Decode / verify recurrence (see `gdn_recurrent_update_ref`): q, k [B*R, Hk, dk];
    v [B*R, Hv, dv]; g, beta [B*R, Hv]; state_pool [slots, Hv, dk, dv]; slot_ids, num_rows [B]
    (device ints). Returns o [B*R, Hv, dv] in v's dtype; writes the pool only when write_state.
    gating = (A_log, dt_bias): g and beta are the raw a and b of in_proj_ba, gated in the kernel.
    out_norm = (weight, z, eps): returns gated_rmsnorm(o, z) instead of o (in the kernel's epilogue
    when its tile covers dv, else one more launch)."""
    B = slot_ids.shape[0]
    assert v.shape[0] == B * rows_per_req, f"{v.shape[0]} rows for {B} requests x {rows_per_req}"
    return _launch_gdn(q, k, v, g, beta, state_pool, slot_ids, num_rows, None, None, rows_per_req,
                       write_state, use_qk_l2norm, gating, out_norm, block_v, num_warps, num_stages)


def fuses_out_norm(requests: int, num_v_heads: int, dv: int) -> bool:
    """Whether `gdn_recurrent_update` of `requests` one-row requests (the table's tile) applies `out_norm`
    in its own epilogue; if not, it launches `gated_rmsnorm` after it (or the caller fuses the norm into
    the next kernel: gdn_out_gemv.py)."""
    return triton.cdiv(dv, _gdn_config(requests, num_v_heads, dv, False)[0]) == 1


def conv_arrival_counters(conv_state_pool: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """The zeroed [slots, Hk] int32 counters `gdn_decode_with_conv` needs (see `_gdn_rows_kernel`). Every
    launch leaves them at 0, so one buffer serves every call (and layer) on its device: allocate it once,
    outside CUDA-graph capture, and keep it."""
    return torch.zeros(conv_state_pool.shape[0], num_k_heads, dtype=torch.int32, device=conv_state_pool.device)


def gdn_decode_with_conv(
    x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, conv_state_pool: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor, num_rows: torch.Tensor,
    num_k_heads: int, conv_arrivals: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Plain decode (one row per request, states written) with the conv in the recurrence's launch: the
    same as `causal_conv1d.conv1d_update(x, conv_weight, conv_bias, conv_state_pool, slot_ids, num_rows, 1)`
    (SiLU) then `gdn_recurrent_update` over its [q | k | v] channels (see `gdn_decode_with_conv_ref`).
    x [B, C] (the conv input, a view of in_proj's rows is fine), C = 2 Hk dk + Hv dv; conv_weight [C, K]
    (unit stride along K); conv_state_pool [slots, C, K-1]; conv_arrivals from `conv_arrival_counters`
    (None: a fresh one, i.e. one more memset per call). Returns o [B, Hv, dv]. Verify (several rows,
    nothing written) and prefill keep the separate conv: verify saves the conv outputs for its replay."""
    B = slot_ids.shape[0]
    Hv, dk, dv = state_pool.shape[1:]
    Hk, key = num_k_heads, num_k_heads * dk
    C, K = conv_weight.shape
    assert x.dim() == 2 and x.shape == (B, C) and C == 2 * key + Hv * dv, \
        f"x {tuple(x.shape)} for {B} requests and {Hk} key heads of {dk} + {Hv} value heads of {dv} channels"
    assert conv_weight.stride(1) == 1 and tuple(conv_state_pool.shape[1:]) == (C, K - 1), \
        f"conv weight {tuple(conv_weight.shape)} (unit stride along K), conv state pool {tuple(conv_state_pool.shape)}"
    assert conv_bias is None or conv_bias.shape == (C,)
    if conv_arrivals is None:
        conv_arrivals = conv_arrival_counters(conv_state_pool, Hk)
    assert conv_arrivals.dtype == torch.int32 and conv_arrivals.is_contiguous() and \
        conv_arrivals.shape[0] >= conv_state_pool.shape[0] and conv_arrivals.shape[1] == Hk, \
        "conv_arrivals: the [slots, Hk] int32 counters of conv_arrival_counters"
    x = _last_dim_contiguous(x)
    q, k, v = x[:, :key].view(B, Hk, dk), x[:, key:2 * key].view(B, Hk, dk), x[:, 2 * key:].view(B, Hv, dv)
    return _launch_gdn(q, k, v, g, beta, state_pool, slot_ids, num_rows, None, None, 1, True, use_qk_l2norm,
                       gating, out_norm, block_v, num_warps, num_stages,
                       conv=(conv_weight, conv_bias, conv_state_pool, conv_arrivals))


def gdn_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
    initial_zero: torch.Tensor | None = None, use_qk_l2norm: bool = True,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """Prefill recurrence over concatenated sequences (see `gdn_varlen_ref`): reads each request's
    state from state_pool[slot_ids[i]] (zeros where initial_zero[i]), writes its final state back.
    gating / out_norm as in `gdn_recurrent_update`. A token loop per program: correct, not fast."""
    assert cu_seqlens.shape[0] == slot_ids.shape[0] + 1, "cu_seqlens needs B + 1 entries"
    return _launch_gdn(q, k, v, g, beta, state_pool, slot_ids, None, cu_seqlens, initial_zero, 1,
                       True, use_qk_l2norm, gating, out_norm, block_v, num_warps, num_stages)
