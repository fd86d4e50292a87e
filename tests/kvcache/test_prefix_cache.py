"""The prefix cache (kvcache/prefix_cache.py) inside the CacheManager: matches in whole pages, shared pages
locked and never freed or handed out twice, LRU eviction of unlocked leaves, and the accounting invariant
(free pages + evictable cached pages == the pool) under random arrivals, aborts and evictions."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_core.config import SamplingParams
from freetoken_core.core import Req
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.prefix_cache import PrefixCache


def make_cm(num_pages: int = 32, page_size: int = 4, rows: int = 4, max_seq_len: int = 64) -> CacheManager:
    return CacheManager(num_pages + 1, page_size, rows, max_seq_len, torch.device("cpu"), PrefixCache(page_size))


def admit(cm: CacheManager, tokens: list[int]) -> Req:
    """What the scheduler does at admission: a row, the cached prefix, pages for the rest."""
    req = Req(uid=len(tokens), input_ids=list(tokens), sampling=SamplingParams())
    cm.assign_row(req)
    req.cached_len = cm.attach_prefix(req, req.seq_len - 1)
    cm.allocate(req, req.seq_len)
    return req


def finish(cm: CacheManager, req: Req, written: int | None = None) -> None:
    cm.free(req, req.seq_len - 1 if written is None else written)


def test_match_is_whole_pages_and_leaves_one_token():
    cm = make_cm(page_size=4)
    a = admit(cm, list(range(10)))
    assert a.cached_len == 0
    finish(cm, a)  # 9 tokens written: 2 full pages cached, the third freed
    assert cm.num_cached_pages == 2
    b = admit(cm, list(range(10)) + [50, 51])
    assert b.cached_len == 8
    assert cm.pages_of(b)[:2] == [n.page for n in cm._locked[b.table_row]]
    c = admit(cm, list(range(8)))  # 8 tokens: at most 7 may be cached, so one page
    assert c.cached_len == 4
    cm.check()
    finish(cm, b)
    finish(cm, c)
    cm.check()
    assert cm.num_free_pages == cm.num_total_pages


def test_shared_page_never_freed_by_rollback():
    cm = make_cm(page_size=2)
    finish(cm, admit(cm, [1, 2, 3, 4, 5]))
    b = admit(cm, [1, 2, 3, 4, 9, 9])
    assert b.cached_len == 4
    with pytest.raises(AssertionError, match="shared page"):
        cm.rollback_tail(b, 2)
    cm.rollback_tail(b, 5)  # its own pages may go
    cm.check()


def test_locked_pages_survive_eviction_and_lru_order():
    cm = make_cm(num_pages=8, page_size=2)
    old = admit(cm, [1, 2, 3, 4, 5])
    finish(cm, old)  # pages of [1,2],[3,4] cached
    mid = admit(cm, [7, 8, 9, 10, 11])
    finish(cm, mid)  # [7,8],[9,10] cached, more recently
    holder = admit(cm, [7, 8, 9, 10, 0])  # locks the newer chain
    assert holder.cached_len == 4
    big = admit(cm, list(range(20, 29)))  # 5 pages: the 3 free + the 2 of the older chain evicted
    assert cm.prefix.match([1, 2, 3, 4, 5]).nodes == []
    assert len(cm.prefix.match([7, 8, 9, 10, 11]).nodes) == 2
    with pytest.raises(MemoryError):
        cm.allocate(big, 12)  # only locked pages left: they are never evicted
    cm.check()
    finish(cm, holder)
    finish(cm, big)
    cm.check()
    assert cm.num_free_pages == cm.num_total_pages


def test_duplicate_prefill_keeps_one_copy():
    cm = make_cm(page_size=2)
    a, b = admit(cm, [1, 2, 3, 4, 5]), admit(cm, [1, 2, 3, 4, 6])  # both miss: computed twice
    finish(cm, a)
    before = cm.pool.num_free
    finish(cm, b)  # its pages duplicate the cached ones: freed, not cached twice
    assert cm.num_cached_pages == 2 and cm.pool.num_free == before + 3
    cm.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_arrivals_aborts_evictions_keep_invariants(page_size):
    """Random requests over a few shared prefixes: admitted, grown, rolled back, finished or aborted at any
    point, with the pool small enough that eviction runs; every step the accounting holds."""
    rng = random.Random(page_size)
    cm = make_cm(num_pages=40, page_size=page_size, rows=4, max_seq_len=48)
    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: list[Req] = []
    for step in range(600):
        op = rng.random()
        if op < 0.35 and cm.num_free_rows:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 20)] + [rng.randrange(100) for _ in range(rng.randrange(1, 8))]
            req = Req(uid=step, input_ids=tokens, sampling=SamplingParams())
            cm.assign_row(req)
            req.cached_len = cm.attach_prefix(req, req.seq_len - 1)
            if cm.pages_needed(req, req.seq_len) > cm.num_free_pages:
                cm.free(req)  # not admitted: row and prefix back
            else:
                cm.allocate(req, req.seq_len)
                req.cached_len = req.seq_len
                live.append(req)
        elif op < 0.6 and live:
            req = rng.choice(live)  # decode a token (or give up when the pool is dry)
            if req.seq_len < 40 and cm.pages_needed(req, req.seq_len + 1) <= cm.num_free_pages:
                req.output_ids.append(rng.randrange(100))
                cm.allocate(req, req.seq_len)
                req.cached_len = req.seq_len
        elif op < 0.7 and live:
            req = rng.choice(live)  # speculative rows past the sequence, then rolled back
            want = min(req.seq_len + 3, 48)
            if cm.pages_needed(req, want) <= cm.num_free_pages:
                cm.allocate(req, want)
                cm.rollback_tail(req, req.seq_len)
        elif live:
            req = live.pop(rng.randrange(len(live)))
            written = req.seq_len - 1 if rng.random() < 0.7 else rng.randrange(req.seq_len)  # finish / abort
            cm.free(req, max(written, 0))
        cm.check()
        private = sum(len(cm.pages_of(r)) - len(cm._locked[r.table_row]) for r in live)
        assert cm.pool.num_free + cm.num_cached_pages + private == cm.num_total_pages
    for req in live:
        cm.free(req, req.seq_len - 1)
    cm.check()
    assert cm.num_free_pages == cm.num_total_pages
    assert cm.prefix.num_unreferenced == cm.num_cached_pages > 0
