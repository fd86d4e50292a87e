"""Speculative verify bookkeeping: a step widened by 3 rows commits 1..4 tokens; the request keeps
exactly the pages of its committed tokens and the next step hands out no page twice."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.config import SamplingParams
from freetoken_core.core import Req
from freetoken_core.kvcache.manager import CacheManager, pages_for


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("committed", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt_len", [5, 8])
def test_widen_commit_rollback(page_size, committed, prompt_len):
    cm = CacheManager(num_pages=64, page_size=page_size, max_running_req=4, max_seq_len=64, device=torch.device("cpu"))
    req = Req(uid=0, input_ids=list(range(prompt_len)), sampling=SamplingParams())
    other = Req(uid=1, input_ids=[1, 2, 3], sampling=SamplingParams())
    cm.assign_row(req)
    cm.assign_row(other)
    cm.allocate(req, req.seq_len)
    cm.allocate(other, 3)
    req.cached_len = req.seq_len - 1  # decode-ready: last token not yet in the cache
    before = cm.pages_of(req)
    L = req.seq_len

    req.widen_pending(3, [7, 8, 9])
    assert req.token_slice(L - 1, L + 3) == [prompt_len - 1, 7, 8, 9]
    cm.allocate(req, L + 3)  # rows write positions L-1 .. L+2
    widened = cm.pages_of(req)
    assert widened[: len(before)] == before
    slots = cm.slots(req, L - 1, L + 3)
    assert len(set(slots)) == 4

    req.output_ids.extend([7, 8, 9, 10][:committed])
    req.commit_pending(committed)
    cm.rollback_tail(req, req.seq_len)
    assert req.seq_len == L + committed and req.cached_len == req.seq_len - 1
    assert cm.pages_of(req) == widened[: pages_for(req.seq_len, page_size)]
    cm.check()
    # freed pages are free exactly once; the next decode step allocates without doubling up
    cm.allocate(req, req.seq_len)
    cm.allocate(other, 20)
    cm.check()
    assert not set(cm.pages_of(req)) & set(cm.pages_of(other))
    cm.free(req)
    cm.free(other)
    assert cm.num_free_pages == cm.num_total_pages
    cm.check()
