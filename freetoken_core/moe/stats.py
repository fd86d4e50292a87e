"""Expert-placement counters (slot hits and misses, bytes copied), per MoE layer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExpertStats:
    hits: int = 0  # routed experts already in a device slot
    misses: int = 0  # copied in (offload) or computed on the host (hybrid, cpu)
    bytes_copied: int = 0  # host -> device
    tokens: int = 0  # rows routed through the layer

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


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
