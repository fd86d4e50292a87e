"""The expert-slot budget: how many device slots each MoE layer gets, the decode-batch clamp, and the
check a rebuild must pass before anything is freed.

All three follow `EngineConfig.decode_rows()` (k + 1 with speculation): one decode step of b
requests routes b x rows_per_req x top_k (token, expert) pairs per layer, so a pool of S slots can
stage any step only while that product is <= S (or S covers every expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertShape:
    num_layers: int  # MoE layers
    num_experts: int
    top_k: int
    bytes_per_expert: int  # gate/up + down of one expert


@dataclass(frozen=True)
class SlotPlan:
    slots_per_layer: int
    max_running_req: int  # after the clamp
    clamped: bool


def slots_from_budget(shape: ExpertShape, slots: int | None = None, cache_gb: float | None = None,
                      cache_rate: float | None = None) -> int:
    """Per-layer slots from exactly one of: slots per layer, a GiB budget for all layers, or a share of
    all experts (FreeToken's `moe_cache_rate`, so peer runs can use equal budgets)."""
    given = [v is not None for v in (slots, cache_gb, cache_rate)]
    if sum(given) > 1:
        raise ValueError("set only one of moe_cache_slots, moe_cache_gb, moe_cache_rate")
    if slots is not None:
        n = int(slots)
    elif cache_gb is not None:
        n = int(cache_gb * (1 << 30) // (shape.bytes_per_expert * shape.num_layers))
    elif cache_rate is not None:
        if not 0.0 < cache_rate <= 1.0:
            raise ValueError(f"moe_cache_rate must be in (0, 1], got {cache_rate}")
        n = math.ceil(cache_rate * shape.num_experts)
    else:
        raise ValueError("offloaded experts need a budget: moe_cache_slots, moe_cache_gb or moe_cache_rate")
    return min(n, shape.num_experts)


def step_needs(batch: int, rows_per_req: int, top_k: int, num_experts: int) -> int:
    """The most distinct experts one decode step of `batch` requests can route to in a layer."""
    return min(num_experts, batch * rows_per_req * top_k)


def clamp_batch(slots: int, rows_per_req: int, top_k: int, num_experts: int, max_running_req: int) -> SlotPlan:
    """Lower max_running_req (and with it the captured graph sizes) until one step fits the pool."""
    if slots >= num_experts:
        return SlotPlan(slots, max_running_req, False)
    fit = slots // (rows_per_req * top_k)
    if fit < 1:
        raise ValueError(
            f"{slots} expert slots per layer cannot hold one decode step: a request routes up to "
            f"rows_per_req {rows_per_req} x top_k {top_k} = {rows_per_req * top_k} experts per layer; raise the "
            f"budget (moe_cache_slots / moe_cache_gb / moe_cache_rate) or lower num_speculative_tokens")
    bs = min(fit, max_running_req)
    return SlotPlan(slots, bs, bs < max_running_req)


def split_budget(free_bytes: int, kv_headroom_bytes: int, linear_state_bytes: int, shape: ExpertShape,
                 min_slots: int) -> int:
    """The startup split: K/V headroom and the GDN linear-state pool first, then equal slots per layer
    from what is left (at least `min_slots`, or a clear error)."""
    left = free_bytes - kv_headroom_bytes - linear_state_bytes
    slots = max(0, left) // (shape.bytes_per_expert * shape.num_layers)
    if slots < min_slots:
        raise ValueError(
            f"after {kv_headroom_bytes / 2**30:.2f} GiB of K/V headroom and {linear_state_bytes / 2**30:.2f} GiB of "
            f"linear state, {max(0, left) / 2**30:.2f} GiB hold {slots} expert slots per layer; one step needs "
            f"{min_slots}")
    return int(min(slots, shape.num_experts))


def check_rebuild(new_slots: int, rows_per_req: int, shape: ExpertShape, max_running_req: int,
                  free_bytes_after: int, kv_bytes: int) -> SlotPlan:
    """Validate a resize of the pools before anything is freed: every layer can stage one step and the
    K/V cache still fits beside the new pools. Raises ValueError otherwise."""
    plan = clamp_batch(new_slots, rows_per_req, shape.top_k, shape.num_experts, max_running_req)
    need = new_slots * shape.bytes_per_expert * shape.num_layers + kv_bytes
    if need > free_bytes_after:
        raise ValueError(f"{new_slots} slots per layer and the K/V cache need {need / 2**30:.2f} GiB; "
                         f"{free_bytes_after / 2**30:.2f} GiB are available")
    return plan
