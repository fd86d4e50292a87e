"""Place a loaded MoE model's routed experts by strategy: build each layer's executor from the
experts' host weights and attach it to the layer (`StackedExperts.executor`).

The weights were loaded on the host (`load_model(expert_device="cpu")`); on a CUDA machine they are
pinned once here so that host -> device copies and the CPU executor read the same bank. `offload`
picks its executor here (`offload_executor`): the device-side cache when its copy kernel passes the
self-check on the first layer's bank, else the host-driven slot pool.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from . import create_executor
from .budget import ExpertShape, clamp_batch, slots_from_budget

log = logging.getLogger(__name__)


def moe_layout(config: Any, dtype: torch.dtype) -> ExpertShape | None:
    """The expert shape of an HF config (text part of a VL config), or None for a dense model."""
    cfg = getattr(config, "text_config", None) or config
    n = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    inter = getattr(cfg, "moe_intermediate_size", None)
    if not n or not inter:
        return None
    from ..models.qwen3_moe import is_sparse_layer

    types = getattr(cfg, "model_type", "")
    sparse = [i for i in range(cfg.num_hidden_layers) if types.startswith("qwen3_5") or is_sparse_layer(cfg, i)]
    elem = torch.empty((), dtype=dtype).element_size()
    return ExpertShape(len(sparse), int(n), int(cfg.num_experts_per_tok), 3 * cfg.hidden_size * inter * elem)


def expert_bytes(shape: ExpertShape) -> int:
    return shape.num_layers * shape.num_experts * shape.bytes_per_expert


def moe_blocks(model: torch.nn.Module) -> list:
    from ..layers.moe import SparseMoeBlock

    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def place_experts(model: torch.nn.Module, strategy: str, config: Any, device: torch.device) -> tuple[list, int]:
    """-> (one executor per MoE layer, the largest batch one step may hold: the decode-batch clamp)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"moe_strategy {strategy!r} needs a MoE model")
    first = blocks[0].experts
    shape = ExpertShape(len(blocks), first.num_experts, blocks[0].top_k,
                        (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * first.gate_up_proj.element_size())
    max_bs = config.max_running_req
    slots = 0
    if strategy in ("offload", "hybrid"):
        slots = slots_from_budget(shape, config.moe_cache_slots, config.moe_cache_gb, config.moe_cache_rate)
        if strategy == "offload":  # every routed expert of a step must be resident at once
            max_bs = clamp_batch(slots, config.decode_rows(), shape.top_k, shape.num_experts, max_bs).max_running_req
    t0 = time.perf_counter()
    banks = []
    for block in blocks:
        ex = block.experts
        w13, w2 = ex.gate_up_proj.data, ex.down_proj.data
        if device.type == "cuda" and not w13.is_pinned():
            w13, w2 = w13.pin_memory(), w2.pin_memory()
            ex.gate_up_proj.data, ex.down_proj.data = w13, w2
        banks.append((w13, w2))
    built = time.perf_counter() - t0
    name = offload_executor(config, device, *banks[0]) if strategy == "offload" else strategy
    counters = None
    if name == "offload_device":  # one [layers, 5] tensor: the stats read all layers at once
        from ..kernels.expert_cache_ref import COUNTERS

        counters = torch.zeros(len(blocks), len(COUNTERS), dtype=torch.int64, device=device)
    executors = []
    for i, (block, (w13, w2)) in enumerate(zip(blocks, banks)):
        executor = create_executor(name, w13=w13, w2=w2, slots=slots, device=device,
                                   threads=config.moe_cpu_threads, counters=None if counters is None else (counters, i))
        block.experts.executor = executor
        executors.append(executor)
    log.info("experts placed (%s, executor %s): %d MoE layers x %d experts, %d device slots per layer, host banks "
             "%.2f GiB pinned in %.1f s", strategy, name, shape.num_layers, shape.num_experts, slots,
             expert_bytes(shape) / 2**30, built)
    return executors, max_bs


def offload_executor(config: Any, device: torch.device, w13: torch.Tensor, w2: torch.Tensor) -> str:
    """`offload_device` (device tables + copy kernels, graph-safe) or `offload` (host-driven ExpertSlotPool,
    no graphs), by `moe_device_cache`: auto (device on CUDA when kernel B passes its self-check on the first
    layer's bank), on (device wherever, CPU too: the kernels under Triton's interpreter), off."""
    mode = getattr(config, "moe_device_cache", "auto")
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return "offload"
    from . import device_cache

    reason = device_cache.copy_self_check(w13, w2, device)
    if reason is not None:
        log.warning("device-side expert cache unavailable (%s): offloaded experts fall back to the host-driven "
                    "slot pool, decoding without CUDA graphs", reason)
        return "offload"
    return "offload_device"


def graph_safe(executors: list) -> bool:
    """Whether every expert executor may run inside a CUDA graph (no host reads on the decode path)."""
    return all(getattr(ex, "graph_safe", False) for ex in executors)
