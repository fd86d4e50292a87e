"""Which cache manager an engine gets, by cache kind: `plain` (no prefix cache), `radix` (the page trie of
kvcache/prefix_cache.py) or `hybrid` (the trie plus linear-state snapshots of kvcache/hybrid.py); and how many
linear-state snapshots have K/V pages reserved."""

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
from .snapshots import pages_per_snapshot

log = logging.getLogger(__name__)

def cache_kind(config: EngineConfig, linear: LinearStatePool | None, tensor_parallel: bool) -> str:
    if not config.enable_prefix_caching:
        return "plain"
    if linear is None:
        return "radix"
    if tensor_parallel:  # the workers' live states would need the snapshot copies too
        log.warning("prefix caching is off: hybrid (GDN) models do not cache prefixes with tensor_parallel_size > 1")
        return "plain"
    return "hybrid"


# The snapshot reserve by default: half of the K/V budget (LightLLM's default mamba_cache_ratio; SGLang gives its
# mamba pool 0.9x the full-attention K/V), at most 4 GiB, at least one snapshot. Beyond it snapshots borrow whatever
# pages requests leave (kvcache/snapshots.py); the reserve keeps snapshots alive while requests want every page
# (without one, a shared system prompt's snapshot never survives to be shared). A quarter did better on the
# tightest workload and worse on others (benchmarks/RESULTS.md, Prefix cache).
RESERVE_SHARE = 0.5
RESERVE_MAX_GB = 4.0


def plan_snapshots(config: EngineConfig, linear: LinearStatePool, budget_bytes: int,
                   bytes_per_page: int) -> tuple[int, int]:
    """(snapshots reserved, K/V pages) out of `budget_bytes`, the K/V pages' memory. Snapshots live in K/V pages
    (kvcache/snapshots.py): `prefix_cache_state_gb` of them are reserved for snapshots (requests never count on
    them) and snapshots borrow any other page no request needs. The budget is all pages, less one snapshot's staging
    buffer; an explicit `num_pages` (`budget_bytes` is their bytes) stays the requests' and the reserve comes on
    top."""
    per_snapshot = pages_per_snapshot(linear, bytes_per_page)
    fixed_pages = config.num_pages is not None
    pages = budget_bytes // bytes_per_page if fixed_pages else \
        max(2, (budget_bytes - per_snapshot * bytes_per_page) // bytes_per_page)
    snapshot_gb = per_snapshot * bytes_per_page / 2**30
    reserve_gb = config.prefix_cache_state_gb
    if reserve_gb is None:
        reserve_gb = max(snapshot_gb, min(RESERVE_MAX_GB, RESERVE_SHARE * pages * bytes_per_page / 2**30))
    reserved = int(reserve_gb / snapshot_gb)
    if fixed_pages:
        num_pages = pages + reserved * per_snapshot
    else:
        reserved = min(reserved, (pages - 2) // per_snapshot)  # a page is left for requests
        num_pages = pages
    log.info("prefix cache: %d K/V pages, of which %d linear-state snapshots of %d pages (%.2f MiB) have %.2f GiB "
             "reserved (prefix_cache_state_gb); beyond them snapshots borrow the pages requests do not need; a "
             "periodic snapshot every %d tokens", num_pages, reserved, per_snapshot, snapshot_gb * 2**10,
             reserved * snapshot_gb, config.prefix_cache_state_interval)
    return reserved, num_pages


def _plain(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    return CacheManager(num_pages, config.page_size, rows, max_seq_len, device)


def _radix(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    return CacheManager(num_pages, config.page_size, rows, max_seq_len, device, PrefixCache(config.page_size))


def _hybrid(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots) -> CacheManager:
    if (num_pages - 1) // pages_per_snapshot(linear, kv.shape.bytes_per_page()) < 1:
        log.warning("prefix caching is off: the K/V pages hold no linear-state snapshot")
        return _plain(config, num_pages, rows, max_seq_len, device, kv, linear, snapshots)
    return HybridCacheManager(num_pages, config.page_size, rows, max_seq_len, device, kv, linear, snapshots,
                              config.prefix_cache_state_interval)


CACHE_MANAGERS: dict[str, Callable[..., CacheManager]] = {"plain": _plain, "radix": _radix, "hybrid": _hybrid}


def make_cache_manager(kind: str, config: EngineConfig, num_pages: int, max_running_req: int, max_seq_len: int,
                       device: torch.device, kv: KVCache, linear: LinearStatePool | None,
                       snapshots: int = 0) -> CacheManager:
    return CACHE_MANAGERS[kind](config, num_pages, max_running_req, max_seq_len, device, kv, linear, snapshots)
