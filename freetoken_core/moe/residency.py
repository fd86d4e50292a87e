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

    def describe(self) -> str:
        """The one log line that says why."""
        return (f"moe_strategy auto -> {'resident' if self.resident else 'offload'}: "
                f"{self.free_bytes / GiB:.1f} GiB free {'>=' if self.resident else '<'} "
                f"{self.need_bytes / GiB:.1f} GiB = dense weights {self.dense_bytes / GiB:.1f} + experts "
                f"{self.expert_bytes / GiB:.1f} + CUDA-graph pool {self.graph_pool_bytes / GiB:.2f} + prefill "
                f"workspace {self.workspace_bytes / GiB:.2f} + K/V reserve {self.kv_reserve_bytes / GiB:.1f} "
                f"({self.kv_reserve_tokens} tokens)")
