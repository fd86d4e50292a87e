"""Expert-placement counters (slot hits and misses, bytes copied), per MoE layer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExpertStats:
    hits: int = 0  # routed experts already in a device slot
    misses: int = 0  # copied in (offload) or computed on the host (hybrid, cpu)
    bytes_copied: int = 0  # host -> device
    tokens: int = 0  # rows routed through the layer
    overflow: int = 0  # device cache: experts a step needed beyond the slots (never, under the clamp)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @classmethod
    def from_counters(cls, values: list[int]) -> "ExpertStats":
        """From a device cache's counters (kernels/expert_cache_ref.py COUNTERS order)."""
        return cls(*(int(v) for v in values))


def layer_stats(executors: list) -> list[ExpertStats]:
    """Each executor's stats; device caches sharing one counter tensor are read with one copy."""
    host: dict[int, list[list[int]]] = {}
    out = []
    for ex in executors:
        source = getattr(ex, "counters_source", None)
        if source is None:
            out.append(ex.stats)
            continue
        shared, row = source
        if id(shared) not in host:
            host[id(shared)] = shared.tolist()
        out.append(ExpertStats.from_counters(host[id(shared)][row]))
    return out


@dataclass
class MoeStats:
    layers: list[ExpertStats] = field(default_factory=list)

    def summary(self) -> dict[str, float | list[int]]:
        hits = sum(s.hits for s in self.layers)
        misses = sum(s.misses for s in self.layers)
        tokens = max((s.tokens for s in self.layers), default=0)
        copied = sum(s.bytes_copied for s in self.layers)
        return {
            "slot_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "bytes_copied_per_token": copied / tokens if tokens else 0.0,
            "misses_per_layer": [s.misses for s in self.layers],
        }
