"""GDN prefill on CUDA through fla-core's chunked gated-delta-rule kernel, with our slot pools.

`gdn.gdn_varlen` runs the prefill recurrence as a token loop per (sequence, head): exact, but an
8192-token prompt takes ~10 ms per GDN layer on the H200, most of a Qwen3.6 prefill (issue 15).
fla-core (pure Triton; the `gpu` extra) computes the same recurrence chunk by chunk with tensor-core
matmuls (the WY form). It takes dense per-sequence initial states and has no slot indices, so
`fla_gdn_varlen` gathers the requests' states from the pool (zeros for a first chunk), runs fla over
the concatenated sequences (cu_seqlens), and scatters the final states back.

Used only where it was checked: `gdn_prefill` (what the GDN layer calls on CUDA) takes fla's path
when fla imports (`gdn.fla_available`, CUDA only: never on CPU, where installing fla breaks
transformers' GDN models), the `FREETOKEN_FLA_PREFILL` switch is on, and a self-check on this device,
dtype and head layout agreed with our own kernel (outputs and final states, relative error below
SELF_CHECK_TOL). Otherwise it runs `gdn.gdn_varlen`, and says once in the log why.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..env import kernel_env
from . import gdn
from .gdn_ref import gdn_gating_ref

log = logging.getLogger(__name__)

SELF_CHECK_TOL = 2e-2  # relative L2 error of fla's output and final state against our kernel's
# Steps of fewer rows stay on our kernel: its cost is per token, fla's has a fixed part (several launches,
# a host sync to plan chunks) that only long prefills amortise. Not tuned on a GPU yet.
FLA_MIN_ROWS = 512


def fla_gdn_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
    initial_zero: torch.Tensor | None, gating: tuple[torch.Tensor, torch.Tensor],
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """`gdn.gdn_varlen` with raw gates (gating=(A_log, dt_bias)) and q/k L2 norm, through fla-core.
    q, k [T, Hk, dk]; v [T, Hv, dv]; a, b [T, Hv]; returns o [T, Hv, dv] (out-normed if asked)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g, beta = gdn_gating_ref(a, b, *gating)  # g fp32 (log decay), beta = sigmoid(b) in b's dtype
    state = state_pool[slot_ids].float()  # [B, Hv, dk, dv]: a gather (a copy), so zeroing it is safe
    if initial_zero is not None:
        state.masked_fill_(initial_zero.view(-1, 1, 1, 1).bool(), 0.0)
    o, final = chunk_gated_delta_rule(
        q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g[None], beta.contiguous()[None],
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.long(),
    )
    state_pool[slot_ids] = final.to(state_pool.dtype)
    o = o[0]
    if out_norm is not None:
        w, z, eps = out_norm
        o = gdn.gated_rmsnorm(o, z, w, eps)
    return o


@functools.cache
def _fla_agrees(device: str, dtype: torch.dtype, state_dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int) -> bool:
    """Run fla and our kernel on the same small random prefill (three sequences: a first chunk, one
    that continues a state, one of a single token) and compare outputs and final states."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    lens = [150, 37, 1]
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, hv, dv)
    a, b = rand(t, hv), rand(t, hv)
    gating = (torch.rand(hv, generator=gen).to(device=device, dtype=dtype),
              torch.rand(hv, generator=gen).to(device=device, dtype=dtype))
    pool = (torch.randn(4, hv, dk, dv, generator=gen) * 0.1).to(device=device, dtype=state_dtype)
    slots = torch.tensor([3, 1, 2], device=device, dtype=torch.int32)
    zero = torch.tensor([True, False, False], device=device)
    ours_pool, fla_pool = pool.clone(), pool.clone()
    ours = gdn.gdn_varlen(q, k, v, a, b, cu, ours_pool, slots, zero, gating=gating)
    theirs = fla_gdn_varlen(q, k, v, a, b, cu, fla_pool, slots, zero, gating)

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-12))

    err_o, err_s = rel(theirs, ours), rel(fla_pool[slots], ours_pool[slots])
    ok = err_o < SELF_CHECK_TOL and err_s < SELF_CHECK_TOL
    log.info("GDN prefill self-check of fla-core (%s, Hk %d Hv %d, dk %d dv %d): relative error output %.1e, "
             "state %.1e: %s", dtype, hk, hv, dk, dv, err_o, err_s,
             "using fla-core's chunked kernel" if ok else "NOT using it (our token-loop kernel instead)")
    return ok


@functools.cache
def _say_once(message: str) -> None:
    log.info("%s", message)


def fla_prefill_usable(q: torch.Tensor, v: torch.Tensor, state_pool: torch.Tensor) -> bool:
    if not kernel_env().fla_prefill:
        _say_once("GDN prefill: FREETOKEN_FLA_PREFILL=0, so the token-loop Triton kernel (slower)")
        return False
    if not gdn.fla_available():
        _say_once("GDN prefill: fla-core is not installed (the `gpu` extra has it), so the token-loop Triton "
                  "kernel: correct, slower on long prompts")
        return False
    try:
        return _fla_agrees(str(v.device), v.dtype, state_pool.dtype, q.shape[-2], v.shape[-2], q.shape[-1],
                           v.shape[-1])
    except Exception as e:  # noqa: BLE001  an fla that does not run here (API, triton version): ours instead
        _say_once(f"GDN prefill: fla-core failed its self-check ({type(e).__name__}: {e}); the token-loop kernel")
        return False


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    cu_seqlens: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
    initial_zero: torch.Tensor | None = None,
    gating: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The GDN layer's prefill on CUDA: fla-core's chunked kernel where usable and the step has at least
    FLA_MIN_ROWS rows, else `gdn.gdn_varlen`."""
    capturing = v.is_cuda and torch.cuda.is_current_stream_capturing()  # fla syncs: never inside a graph
    if (gating is not None and v.shape[0] >= FLA_MIN_ROWS and not capturing
            and fla_prefill_usable(q, v, state_pool)):
        return fla_gdn_varlen(q, k, v, a, b, cu_seqlens, state_pool, slot_ids, initial_zero, gating, out_norm)
    return gdn.gdn_varlen(q, k, v, a, b, cu_seqlens, state_pool, slot_ids, initial_zero, gating=gating,
                          out_norm=out_norm)
