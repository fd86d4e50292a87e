"""`moe_strategy=auto`: experts resident whenever the device holds them beside everything else a served model needs.

The decision is plain arithmetic on bytes (the engine measures them: engine/memory_plan.py): the dense weights, the
routed experts, the CUDA-graph pool, the prefill workspace and a K/V reserve of at least `max_running_req` x 4,096
tokens must fit the device's free memory. `memory_fraction` is not in it: that is the K/V cache's share of what is
left once the model is loaded, not a limit on the model.
"""

from __future__ import annotations

from dataclasses import dataclass

# The K/V reserve: every running request can hold this many tokens (or max_seq_len, if shorter)
KV_RESERVE_TOKENS_PER_REQ = 4096

GiB = 1 << 30


@dataclass(frozen=True)
class ResidencyPlan:
    free_bytes: int  # the device's free memory before the model loads
    dense_bytes: int  # every weight but the routed experts (real bytes: FP8 + scales where held in FP8)
    expert_bytes: int  # the routed experts, all layers
    graph_pool_bytes: int
    workspace_bytes: int  # one prefill step's activations
    kv_reserve_bytes: int  # K/V (+ linear state on hybrids) of the reserve below
    kv_reserve_tokens: int

    @property
    def need_bytes(self) -> int:
        return (self.dense_bytes + self.expert_bytes + self.graph_pool_bytes + self.workspace_bytes
                + self.kv_reserve_bytes)

    @property
    def resident(self) -> bool:
        return self.need_bytes <= self.free_bytes

    @property
    def expert_budget_bytes(self) -> int:
        """What the device holds for routed experts beside everything else: the offload cache's budget when
        auto offloads and no budget was given (0 when even the rest does not fit)."""
        return max(0, self.free_bytes - (self.need_bytes - self.expert_bytes))

    def describe(self) -> str:
        """The one log line that says why."""
        return (f"moe_strategy auto -> {'resident' if self.resident else 'offload'}: "
                f"{self.free_bytes / GiB:.1f} GiB free {'>=' if self.resident else '<'} "
                f"{self.need_bytes / GiB:.1f} GiB = dense weights {self.dense_bytes / GiB:.1f} + experts "
                f"{self.expert_bytes / GiB:.1f} + CUDA-graph pool {self.graph_pool_bytes / GiB:.2f} + prefill "
                f"workspace {self.workspace_bytes / GiB:.2f} + K/V reserve {self.kv_reserve_bytes / GiB:.1f} "
                f"({self.kv_reserve_tokens} tokens)")


def auto_strategy(plan: ResidencyPlan, budget_given: bool) -> tuple[str, float | None]:
    """-> ("resident" | "offload", the moe_cache_gb an offload gets when none of moe_cache_slots / moe_cache_gb /
    moe_cache_rate was given: whatever the device holds beside the rest). MemoryError when not even that fits."""
    if plan.resident:
        return "resident", None
    if budget_given:
        return "offload", None
    if plan.expert_budget_bytes <= 0:
        raise MemoryError(f"the model does not fit this device even with every routed expert offloaded ("
                          f"{plan.describe()}): lower max_running_req or max_seq_len, or use a larger device")
    return "offload", plan.expert_budget_bytes / GiB
