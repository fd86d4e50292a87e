"""A tensor-parallel worker (rank >= 1): its shard of the model, its shard of the K/V cache, and a
loop that runs whatever step plan rank 0 broadcasts, until rank 0 sends None."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..lifetime import watch_parent
from ..parallel import TPInfo, set_tp_info

log = logging.getLogger(__name__)


def worker_main(rank: int, world_size: int, init_method: str, config_dict: dict, device_name: str) -> None:
    from ..attention import create_backend
    from ..config import EngineConfig
    from ..core import Context, set_context
    from ..kvcache.manager import CacheManager
    from ..kvcache.pool import KVCache, KVCacheShape
    from ..models.loader import load_model
    from .group import COLLECTIVE_TIMEOUT_S, backend_for, rank_device

    watch_parent(f"tensor-parallel rank {rank}")  # rank 0's process is gone: no plan will come
    device = rank_device(torch.device(device_name), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = EngineConfig(**config_dict)
    dist.init_process_group(backend_for(device, config.tensor_parallel_backend), init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    set_tp_info(TPInfo(rank, world_size, None))
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)  # rank 0's sizes: dtype, pages, sequence length
    init = box[0]
    if init is None:  # rank 0 failed to build its shard and stopped the group
        dist.destroy_process_group()
        return
    model = load_model(config.model_path, init["dtype"], device, progress=False, load_format=config.load_format,
                       quantization=config.quantization)
    if hasattr(model, "ensure_positions"):
        model.ensure_positions(init["max_seq_len"])
    layout = model.attn_layout()
    shape = KVCacheShape(model.num_kv_layers, layout.num_kv_heads, layout.head_dim, config.page_size, init["dtype"])
    kv = KVCache(shape, init["num_pages"], device)
    cache = CacheManager(init["num_pages"], config.page_size, init["max_running_req"], init["max_seq_len"], device)
    backend = create_backend(init["attention_backend"], layout, kv, cache.page_table)
    ctx = Context(kv_cache=kv, attn_backend=backend)
    dist.barrier()
    while True:
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
        if plan is None:
            break
        with torch.inference_mode():
            for row, pages in zip(plan.table_rows, plan.pages):
                if pages:
                    cache.page_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32, device=device)
            batch = plan.batch(device)
            with ctx.override(batch=batch) as c:
                set_context(c)
                try:
                    backend.prepare_metadata(batch)
                    hidden = model.forward(batch.input_ids, batch.positions)
                    if plan.sample_rows:  # the LM head gathers every rank's vocabulary share
                        rows = hidden if len(plan.sample_rows) == hidden.shape[0] else hidden[batch.sample_rows]
                        model.lm_head.logits(rows)
                finally:
                    set_context(None)
    dist.destroy_process_group()
