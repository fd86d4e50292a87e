"""Which cache manager an engine gets, by cache kind: `plain` (no prefix cache), `radix` (the page trie of
kvcache/prefix_cache.py) or `hybrid` (the trie plus linear-state snapshots of kvcache/hybrid.py); and the
snapshot pool's size, taken out of the memory budget the K/V pages share."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..config import EngineConfig
from .hybrid import HybridCacheManager
from .linear_state import LinearStatePool
from .manager import CacheManager
from .pool import KVCache
from .prefix_cache import PrefixCache

log = logging.getLogger(__name__)

# The default snapshot budget: half of the memory budget (LightLLM's default mamba_cache_ratio; SGLang gives its mamba
# pool 0.9x the full-attention K/V), plus whatever the K/V pages cannot use: a hybrid's K/V is small (a quarter of its
# layers attend) while a conversation's snapshot is tens of MiB, so a cap at the pages every row can fill left a
# 64-chat run of Qwen3.6's shape at most six slots (benchmarks/RESULTS.md, Prefix cache).
STATE_SHARE = 0.5


def cache_kind(config: EngineConfig, linear: LinearStatePool | None, tensor_parallel: bool) -> str:
    if not config.enable_prefix_caching:
        return "plain"
    if linear is None:
        return "radix"
    if tensor_parallel:  # the workers' live states would need the snapshot copies too
        log.warning("prefix caching is off: hybrid (GDN) models do not cache prefixes with tensor_parallel_size > 1")
        return "plain"
    return "hybrid"


def plan_snapshots(config: EngineConfig, linear: LinearStatePool, budget_bytes: int, max_pages: int,
                   bytes_per_page: int) -> tuple[int, int]:
    """(snapshot slots, K/V pages) out of `budget_bytes`, the memory the K/V pages would otherwise have (an explicit
    `num_pages`: those pages' bytes). K/V pages take (1 - STATE_SHARE) of it, never more than `max_pages` (every row
    at full length), and the snapshots the rest; an explicit `num_pages` keeps its pages and the snapshots come on
    top (STATE_SHARE of the pages' bytes); an explicit `prefix_cache_state_gb` is taken out of the budget."""
    per_slot = LinearStatePool.bytes_per_slot(linear.specs, linear.conv[0].dtype, linear.recurrent[0].dtype)
    fixed_pages = config.num_pages is not None
    if config.prefix_cache_state_gb is not None:
        state_bytes = config.prefix_cache_state_gb * 2**30
    elif fixed_pages:
        state_bytes = STATE_SHARE * budget_bytes
    else:
        state_bytes = budget_bytes - min(max_pages * bytes_per_page, (1 - STATE_SHARE) * budget_bytes)
    slots = int(state_bytes // per_slot)
    num_pages = budget_bytes // bytes_per_page
    if not fixed_pages:
        num_pages = max(2, min(max_pages, int((budget_bytes - slots * per_slot) // bytes_per_page)))
    if slots < config.max_running_req:
        log.warning("prefix cache: %d linear-state snapshot slots for max_running_req=%d: with more conversations "
                    "than slots most of their turns miss (raise prefix_cache_state_gb)", slots, config.max_running_req)
    log.info("prefix cache: %d linear-state snapshot slots of %.2f MiB (%.2f GiB, prefix_cache_state_gb) beside %d "
             "K/V pages, a periodic snapshot every %d tokens", slots, per_slot / 2**20, slots * per_slot / 2**30,
             num_pages, config.prefix_cache_state_interval)
    return slots, num_pages


def _plain(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    return CacheManager(num_pages, config.page_size, rows, max_seq_len, device)


def _radix(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    return CacheManager(num_pages, config.page_size, rows, max_seq_len, device, PrefixCache(config.page_size))


def _hybrid(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    if snapshots < 1:
        log.warning("prefix caching is off: the snapshot budget holds no linear-state snapshot")
        return _plain(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots)
    return HybridCacheManager(num_pages, config.page_size, rows, max_seq_len, device, kv, linear, snapshots,
                              config.prefix_cache_state_interval)


CACHE_MANAGERS: dict[str, Callable[..., CacheManager]] = {"plain": _plain, "radix": _radix, "hybrid": _hybrid}


def make_cache_manager(kind: str, config: EngineConfig, num_pages: int, max_running_req: int, max_seq_len: int,
                       device: torch.device, kv: KVCache, linear: LinearStatePool | None,
                       snapshots: int = 0) -> CacheManager:
    return CACHE_MANAGERS[kind](config, num_pages, max_running_req, max_seq_len, device, kv, linear, snapshots)
