"""Prefix caching on gated-delta-net hybrids (Qwen3-Next, Qwen3.5-MoE wrapper; tiny random checkpoints): K/V
pages plus linear-state snapshots. Multi-turn chats sharing a ~64-token system prompt give the same tokens
with the cache on and off (page sizes 1 and 4, chunked prefill, overlap, speculation, pools small enough to
evict pages and snapshots); divergence-point and periodic snapshots; snapshot-slot accounting."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.kvcache.hybrid import HybridCacheManager, Kind
from tests.models.hybrid_checkpoints import VOCAB, make_tiny_hybrid
from tests.prefix_chat import assert_all_back, assert_later_turns_hit, random_traffic, run_chats, token_ids

STATE_GB = 0.01  # set, not the default share of these tiny K/V pools: the tests need slots enough for every turn
CHAT = dict(num_convs=4, num_turns=3, system_len=64, new_len=5, max_tokens=6, vocab=(3, VOCAB))


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    return make_tiny_hybrid(tmp_path_factory.mktemp(request.param), request.param)


def _snapshots_back(llm: LLM) -> None:
    cache = llm.scheduler.cache
    assert isinstance(cache, HybridCacheManager)
    assert_all_back(llm)
    total = llm.scheduler.stats().prefix_snapshot_slots_total
    assert cache.num_free_snapshots == cache.snapshots.num_slots == total > 0


def _snapshot_pages(path, page_size: int) -> tuple[int, float]:
    """(K/V pages one snapshot of this tiny model borrows, its bytes in GiB) at `page_size`."""
    cache = LLM(path, dtype="float32", page_size=page_size, num_pages=512, max_running_req=1).scheduler.cache
    return cache.snapshots.pages_per_snapshot, cache.snapshots.bytes_per_snapshot / 2**30


def _pair(path, **kw):
    # snapshots borrow these pages: 1,200 tokens' worth hold every conversation's K/V and a snapshot for each
    pages = 1200 // kw.get("page_size", 1)
    base = dict(dtype="float32", max_running_req=3, max_extend_tokens=16, num_pages=pages,
                prefix_cache_state_gb=STATE_GB) | kw
    off = run_chats(LLM(path, enable_prefix_caching=False, **base), **CHAT)
    llm = LLM(path, **base)
    on = run_chats(llm, **CHAT)
    assert token_ids(on) == token_ids(off)
    _snapshots_back(llm)
    return on, llm


@pytest.mark.parametrize("page_size,overlap", [(1, False), (4, True)])
def test_multi_turn_identical_and_hits(hybrid, page_size, overlap):
    on, llm = _pair(hybrid, page_size=page_size, overlap_schedule=overlap)
    assert_later_turns_hit(on, page_size)
    # the fourth conversation of turn 1 waited for a row: the third cut its prefill at the end of the
    # shared system prompt's pages (a divergence point) or hit its own... at least one later request hit
    assert all(o.num_cached_tokens > 0 for outs in on[1:] for o in outs)


def test_speculation_with_cached_prefixes(hybrid):
    on, llm = _pair(hybrid, page_size=4, speculative="ngram", num_speculative_tokens=3)
    assert all(o.num_cached_tokens > 0 for outs in on[1:] for o in outs)
    assert sum(o.spec_proposed for outs in on for o in outs) > 0


def test_small_pools_evict_pages_and_snapshots(hybrid):
    """Few pages and few snapshot slots: both get evicted mid-run; tokens unchanged, nothing leaks."""
    per_pages, per_gb = _snapshot_pages(hybrid, 4)
    on, llm = _pair(hybrid, page_size=4, num_pages=52 + 3 * per_pages, prefix_cache_state_gb=3.5 * per_gb)
    assert llm.scheduler.cache.reserved_pages == 3 * per_pages
    assert llm.scheduler.cache.prefix.evicted_pages > 0


@pytest.mark.parametrize("start,first_hit_turn", [("staggered", 1), ("together", 2)])
def test_fewer_slots_than_conversations_keep_the_shared_prefix(hybrid, start, first_hit_turn):
    """Two snapshot slots for six conversations taking turns, with a periodic snapshot every 8 tokens: each turn's
    end and each periodic snapshot would evict the shared system prompt's under plain LRU. Its snapshot (where the
    trie branches) is displaced only by its own kind, so every later turn hits it. Staggered: four rows, short
    prefill chunks, so later conversations of turn 1 match the first one's pages alone and snapshot where they part.
    Together: all six prefill turn 1 in one step, so no request ever matches just the system prompt; turn 2's
    requests snapshot where the trie branches on their path, and every turn from the third hits it."""
    per_pages, per_gb = _snapshot_pages(hybrid, 4)
    chat = dict(CHAT, num_convs=6, num_turns=4, system_len=62)
    base = dict(dtype="float32", page_size=4, num_pages=170)  # a few pages beyond the conversations' for snapshots
    base |= dict(max_running_req=4, max_extend_tokens=16) if start == "staggered" else \
        dict(max_running_req=6, max_extend_tokens=512)
    off = run_chats(LLM(hybrid, enable_prefix_caching=False, **base), **chat)
    llm = LLM(hybrid, prefix_cache_state_gb=2.5 * per_gb, prefix_cache_state_interval=8, **base)
    on = run_chats(llm, **chat)
    assert llm.scheduler.cache.reserved_pages == 2 * per_pages
    assert token_ids(on) == token_ids(off)
    hits = [[o.num_cached_tokens for o in outs] for outs in on]
    assert all(h >= 60 for turn in hits[first_hit_turn:] for h in turn), hits
    _snapshots_back(llm)


def test_divergence_point_snapshot(hybrid):
    """A shared system prompt, then different users, one at a time: the second request cuts its prefill at
    the end of the shared pages and snapshots there; the third takes the whole shared prefix."""
    system = [(7 * i) % (VOCAB - 3) + 3 for i in range(64)]
    users = [[10 + j] * 6 for j in range(3)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    off = LLM(hybrid, dtype="float32", page_size=4, num_pages=200, enable_prefix_caching=False)
    llm = LLM(hybrid, dtype="float32", page_size=4, num_pages=200, max_extend_tokens=48, prefix_cache_state_gb=STATE_GB)
    outs = [llm.generate([system + u], params)[0] for u in users]
    assert [o.token_ids for o in outs] == [off.generate([system + u], params)[0].token_ids for u in users]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 64]
    _snapshots_back(llm)


def test_periodic_snapshots(hybrid):
    """A long prompt prefilled in chunks leaves a periodic snapshot every `prefix_cache_state_interval`
    tokens: a request that shares only its first 30 tokens restarts from the one at 24."""
    first = [(5 * i) % (VOCAB - 3) + 3 for i in range(40)]
    second = first[:30] + [9] * 10
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    off = LLM(hybrid, dtype="float32", page_size=4, num_pages=200, enable_prefix_caching=False)
    llm = LLM(hybrid, dtype="float32", page_size=4, num_pages=200, max_extend_tokens=16,
              prefix_cache_state_interval=8, prefix_cache_state_gb=STATE_GB)
    a = llm.generate([first], params)[0]
    b = llm.generate([second], params)[0]
    assert b.num_cached_tokens == 24
    assert [a.token_ids, b.token_ids] == [o.token_ids for o in off.generate([first, second], params)]
    periodic = [n for n in llm.scheduler.cache.prefix.nodes() if n.snapshot >= 0 and n.snapshot_kind == Kind.PERIODIC]
    assert periodic
    _snapshots_back(llm)


def test_random_arrivals_and_aborts_keep_invariants(hybrid):
    """Random traffic with page and snapshot eviction: pages, tails and snapshot slots each have one owner after
    every step; all come back."""
    per_pages, per_gb = _snapshot_pages(hybrid, 2)
    llm = LLM(hybrid, dtype="float32", page_size=2, num_pages=48 + 2 * per_pages, max_running_req=4,
              max_extend_tokens=10, prefix_cache_state_gb=6.5 * per_gb, prefix_cache_state_interval=8)
    random_traffic(llm, (3, VOCAB))
    _snapshots_back(llm)
    assert llm.scheduler.cache.prefix.hit_tokens > 0


def test_requests_take_back_the_pages_snapshots_borrow(hybrid):
    """Snapshots hold K/V pages only while no request needs them: once chats have left snapshots in most of the pool,
    a request that needs nearly every page runs (the snapshots in its way dropped), with cache-off's tokens."""
    per_pages, per_gb = _snapshot_pages(hybrid, 4)
    base = dict(dtype="float32", page_size=4, num_pages=140, max_running_req=2, max_extend_tokens=64)
    llm = LLM(hybrid, prefix_cache_state_gb=1.5 * per_gb, **base)  # one reserved, the others borrowed
    off = LLM(hybrid, enable_prefix_caching=False, **base)
    chat = dict(CHAT, num_convs=4, num_turns=2)
    assert token_ids(run_chats(llm, **chat)) == token_ids(run_chats(off, **chat))
    cache = llm.scheduler.cache
    held = cache.snapshots.pages_in_use
    assert held >= 4 * per_pages and cache.reserved_pages == per_pages
    long = [(11 * i) % (VOCAB - 3) + 3 for i in range(500)]  # 125 pages of the 140, with its 8 new tokens
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert llm.generate([long], params)[0].token_ids == off.generate([long], params)[0].token_ids
    assert cache.snapshots.pages_in_use < held
    _snapshots_back(llm)
