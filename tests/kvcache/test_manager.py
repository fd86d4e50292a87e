import random

import pytest
import torch

from freetoken_core.config import SamplingParams
from freetoken_core.core import Req
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import DUMMY_PAGE, PagePool


def make_req(uid: int, n: int = 5) -> Req:
    return Req(uid=uid, input_ids=list(range(n)), sampling=SamplingParams())


def test_pool_never_hands_out_a_page_twice():
    pool = PagePool(10)
    a = pool.alloc(4)
    b = pool.alloc(5)
    assert DUMMY_PAGE not in a + b
    assert len(set(a + b)) == 9
    with pytest.raises(MemoryError, match="out of pages"):
        pool.alloc(1)
    pool.free(a)
    with pytest.raises(AssertionError, match="freed but not allocated"):
        pool.free(a[:1])
    pool.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocate_slots_rollback_free(page_size):
    cm = CacheManager(num_pages=40, page_size=page_size, max_running_req=4, max_seq_len=64, device=torch.device("cpu"))
    r = make_req(0)
    cm.assign_row(r)
    cm.allocate(r, 10)
    pages = cm.pages_of(r)
    assert len(pages) == (10 + page_size - 1) // page_size
    slots = cm.slots(r, 0, 10)
    assert slots == [pages[p // page_size] * page_size + p % page_size for p in range(10)]
    assert len(set(slots)) == 10
    cm.flush()
    assert cm.page_table[r.table_row, : len(pages)].tolist() == pages
    cm.rollback_tail(r, 3)
    assert cm.pages_of(r) == pages[: (3 + page_size - 1) // page_size]
    cm.flush()
    assert cm.page_table[r.table_row, len(cm.pages_of(r)) : len(pages)].tolist() == [DUMMY_PAGE] * (len(pages) - len(cm.pages_of(r)))
    cm.check()
    cm.free(r)
    assert r.table_row == -1 and cm.num_free_pages == cm.num_total_pages
    cm.check()


def test_random_alloc_free_keeps_accounting():
    rng = random.Random(0)
    cm = CacheManager(num_pages=64, page_size=4, max_running_req=8, max_seq_len=64, device=torch.device("cpu"))
    live: list[Req] = []
    for step in range(500):
        if live and rng.random() < 0.3:
            cm.free(live.pop(rng.randrange(len(live))))
        elif cm.num_free_rows and rng.random() < 0.5:
            r = make_req(step)
            cm.assign_row(r)
            live.append(r)
        elif live:
            r = rng.choice(live)
            n = min(64, len(cm.pages_of(r)) * 4 + rng.randint(1, 9))
            if cm.pages_needed(r, n) <= cm.num_free_pages:
                cm.allocate(r, n)
        cm.check()
    for r in live:
        cm.free(r)
    cm.check()
    assert cm.num_free_pages == cm.num_total_pages


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_flush_keeps_the_last_write_of_each_entry(device):
    """Rollback then re-allocate (a speculative step), and free then a new request in the same row,
    all before one flush: the device table must equal the host mirror. A CUDA index_put with
    duplicate indices keeps an arbitrary value, so each entry may be written once per flush."""
    cm = CacheManager(num_pages=64, page_size=1, max_running_req=2, max_seq_len=32, device=torch.device(device))
    a = make_req(0)
    cm.assign_row(a)
    cm.allocate(a, 8)
    cm.flush()
    for _ in range(20):
        cm.allocate(a, 12)  # widened rows
        cm.rollback_tail(a, 9)  # kept one
        cm.allocate(a, 12)  # the next step widens again: same entries, new pages
    cm.free(a)
    b = make_req(1)
    cm.assign_row(b)  # the same row, new pages, same flush window
    cm.allocate(b, 10)
    cm.flush()
    assert torch.equal(cm.page_table.cpu(), cm._table_cpu)
    cm.check()
