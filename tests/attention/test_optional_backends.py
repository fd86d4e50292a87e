"""flashinfer and fa backends: what can be checked without their packages (neither is installed on
CI or on the GPU host): a clear refusal naming the package, and flashinfer's page CSR built from
our page table."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from freetoken_core.attention import AttnLayout, create_backend
from freetoken_core.attention.flashinfer import paged_kv_csr
from freetoken_core.config import SamplingParams
from freetoken_core.core import Batch, Req
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import KVCache, KVCacheShape


def _cache() -> tuple[KVCache, torch.Tensor]:
    mgr = CacheManager(16, 4, 2, 32, torch.device("cpu"))
    return KVCache(KVCacheShape(1, 2, 16, 4, torch.float32), 16, torch.device("cpu")), mgr.page_table


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed")
def test_flashinfer_missing_is_refused_by_name():
    kv, table = _cache()
    with pytest.raises(ImportError, match="`flashinfer`"):
        create_backend("flashinfer", AttnLayout(4, 2, 16, 0.25), kv, table)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed")
def test_fa_missing_is_refused_by_name():
    kv, table = _cache()
    with pytest.raises(ImportError, match="`flash_attn`"):
        create_backend("fa", AttnLayout(4, 2, 16, 0.25), kv, table)


def test_flashinfer_page_csr_follows_page_table():
    page_size = 4
    mgr = CacheManager(32, page_size, 3, 64, torch.device("cpu"))
    reqs = []
    for uid, n in enumerate([9, 4, 1]):
        r = Req(uid, list(range(n)), SamplingParams())
        mgr.assign_row(r)
        reqs.append(r)
    mgr.allocate(reqs[1], 30)  # another request takes pages in between: non-contiguous pages
    for r in reqs:
        mgr.allocate(r, r.prompt_len)
    mgr.flush()
    batch = Batch("prefill", reqs, [r.prompt_len for r in reqs], [0, 0, 0],
                  input_ids=torch.zeros(14, dtype=torch.int64), positions=torch.zeros(14, dtype=torch.int64),
                  out_loc=torch.zeros(14, dtype=torch.int64), sample_rows=torch.zeros(0, dtype=torch.int64),
                  sample_reqs=[])
    indptr, indices, last = paged_kv_csr(batch, mgr.page_table, page_size)
    pages = [mgr.pages_of(r)[: (r.prompt_len + page_size - 1) // page_size] for r in reqs]
    assert indptr.tolist() == [0, 3, 4, 5]
    assert indices.tolist() == [p for ps in pages for p in ps]
    assert last.tolist() == [1, 4, 1]  # 9 = 4 + 4 + 1; 4 fills its page; 1
