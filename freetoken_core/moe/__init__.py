"""Where a MoE model's routed experts live and run: the expert executors, by strategy.

- `resident`: every expert on the device (the stacked weights of layers/moe.py; no executor).
- `offload`: experts in (pinned) host banks, a per-layer pool of device slots caching the ones in use
  (LRU), missing experts copied in before the layer runs: by device-side tables and copy kernels inside
  the decode CUDA graphs (`device_cache.py`, executor `offload_device`, on CUDA after a startup
  self-check), else host-driven without graphs (`slot_pool.py`, executor `offload`).
- `cpu`: experts computed on the host's cores from the host banks (`cpu_executor.py`).
- `hybrid`: cache hits on the device slots, misses on the host.
`auto` is resident when the experts fit the device beside everything else (`residency.py`), else offload. The budget split, the
decode-batch clamp and the rebuild check are in `budget.py`. Executors are registered factories.
"""

from __future__ import annotations

from typing import Any, Callable

MOE_STRATEGIES = ("auto", "resident", "offload", "cpu", "hybrid")

_EXECUTORS: dict[str, Callable[..., Any]] = {}


def register_executor(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        _EXECUTORS[name] = factory
        return factory

    return deco


def create_executor(name: str, **kwargs: Any) -> Any:
    if name not in _EXECUTORS:
        from . import cpu_executor, device_cache, slot_pool  # noqa: F401  (register the built-in executors)
    if name not in _EXECUTORS:
        raise ValueError(f"unknown MoE executor {name!r}; known: {', '.join(sorted(_EXECUTORS))}")
    return _EXECUTORS[name](**kwargs)
