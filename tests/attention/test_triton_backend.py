"""TritonBackend against TorchNativeBackend on the same steps: chunked prefill over a cached
prefix, decode, speculative verify, and the CUDA-graph metadata path (capture on the dummy row,
replay of a smaller real batch padded to the captured size). On CPU the kernels run under the
Triton interpreter in fp32."""

from __future__ import annotations

import pytest
import torch
from attn_cases import manager_batch

from freetoken_core.attention.base import AttnLayout
from freetoken_core.attention.torch_native import TorchNativeBackend
from freetoken_core.attention.triton.backend import TritonBackend
from freetoken_core.config import SamplingParams
from freetoken_core.core import Batch, Req
from freetoken_core.kvcache.manager import CacheManager
from freetoken_core.kvcache.pool import KVCache, KVCacheShape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_LAYERS, H, HKV, D = 2, 6, 2, 16


class Pair:
    """Two backends, each with its own cache, sharing one CacheManager's page table."""

    def __init__(self, page_size: int, max_seq_len: int = 64, dtype: torch.dtype = torch.float32) -> None:
        self.mgr = CacheManager(num_pages=96, page_size=page_size, max_running_req=4, max_seq_len=max_seq_len,
                                device=DEVICE)
        shape = KVCacheShape(NUM_LAYERS, HKV, D, page_size, dtype)
        layout = AttnLayout(H, HKV, D, D**-0.5)
        self.triton = TritonBackend(layout, KVCache(shape, 96, DEVICE), self.mgr.page_table)
        self.torch = TorchNativeBackend(layout, KVCache(shape, 96, DEVICE), self.mgr.page_table)
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(0)

    def batch(self, phase, reqs, extend_lens, rows_per_req=1) -> Batch:
        return manager_batch(self.mgr, phase, reqs, extend_lens, rows_per_req, DEVICE)

    def qkv(self, t: int):
        return [torch.randn(t, n, D, generator=self.gen).to(self.dtype).to(DEVICE) for n in (H, HKV, HKV)]

    def run_both(self, batch: Batch, tol: float = 2e-5) -> None:
        self.triton.prepare_metadata(batch)
        md_triton = batch.attn_metadata
        self.torch.prepare_metadata(batch)
        md_torch = batch.attn_metadata
        for layer in range(NUM_LAYERS):
            q, k, v = self.qkv(batch.num_tokens)
            batch.attn_metadata = md_triton
            a = self.triton.forward(q, k, v, layer, batch)
            batch.attn_metadata = md_torch
            b = self.torch.forward(q, k, v, layer, batch)
            assert a.shape == (batch.num_tokens, H * D)
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)

    def commit(self, reqs, extend_lens) -> None:
        for r, e in zip(reqs, extend_lens):
            r.cached_len += e

    def caches_equal(self) -> None:
        for layer in range(NUM_LAYERS):
            for x, y in zip(self.triton.kv_cache.layer(layer), self.torch.kv_cache.layer(layer)):
                assert torch.equal(x, y)


def new_req(uid: int, prompt_len: int, mgr: CacheManager) -> Req:
    r = Req(uid, list(range(prompt_len)), SamplingParams())
    mgr.assign_row(r)
    return r


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_decode_verify_match_torch(page_size):
    p = Pair(page_size)
    a, b, c = (new_req(i, n, p.mgr) for i, n in enumerate([13, 6, 21]))
    for reqs, ext in [([a, b, c], [8, 6, 10]), ([a, c], [5, 11])]:  # chunk 2 reads chunk 1 from the cache
        p.run_both(p.batch("prefill", reqs, ext))
        p.commit(reqs, ext)
    for _ in range(2):
        p.run_both(p.batch("decode", [a, b, c], [1, 1, 1]))
        p.commit([a, b, c], [1, 1, 1])
    p.run_both(p.batch("verify", [a, b, c], [3, 3, 3], rows_per_req=3))
    p.caches_equal()


def test_fp16_prefill_and_decode_match_torch():
    p = Pair(4, dtype=torch.float16)
    a, b = new_req(0, 9, p.mgr), new_req(1, 3, p.mgr)
    p.run_both(p.batch("prefill", [a, b], [9, 3]), tol=4e-3)
    p.commit([a, b], [9, 3])
    p.run_both(p.batch("decode", [a, b], [1, 1]), tol=4e-3)


@pytest.mark.parametrize("rows_per_req", [1, 2])
def test_graph_metadata_capture_then_padded_replay(rows_per_req):
    """Capture metadata for bs 4 on the dummy row; replay a real batch of 3 padded to 4. The grid
    (split count from max_seq_len) is fixed; lengths and rows come from the static buffers."""
    p = Pair(4, max_seq_len=512)
    tb = p.triton
    tb.num_sms = 64  # as on a large GPU: small graph batches then split the KV length
    tb.init_capture_graph(512, [1, 2, 4], rows_per_req=rows_per_req)
    phase = "decode" if rows_per_req == 1 else "verify"

    dummy = [Req(100 + i, [0], SamplingParams(), table_row=p.mgr.dummy_row) for i in range(4)]
    cap = Batch(phase, dummy, [rows_per_req] * 4, [0] * 4,
                input_ids=torch.zeros(4 * rows_per_req, dtype=torch.int64, device=DEVICE),
                positions=torch.zeros(4 * rows_per_req, dtype=torch.int64, device=DEVICE),
                out_loc=torch.zeros(4 * rows_per_req, dtype=torch.int64, device=DEVICE),  # the dummy page
                sample_rows=torch.zeros(0, dtype=torch.int64), sample_reqs=[], rows_per_req=rows_per_req)
    tb.prepare_for_capture(cap)
    captured = cap.attn_metadata
    assert captured.num_splits > 1  # max_seq_len 512 on this small batch: the split path is in the graph
    q, k, v = p.qkv(4 * rows_per_req)
    tb.forward(q, k, v, 0, cap)  # what a capture would record

    reqs = [new_req(i, n, p.mgr) for i, n in enumerate([5, 17, 2])]
    ext = [r.prompt_len for r in reqs]
    pre = p.batch("prefill", reqs, ext)
    p.run_both(pre)
    p.commit(reqs, ext)

    real = p.batch(phase, reqs, [rows_per_req] * 3, rows_per_req=rows_per_req)
    real.padded_size = 4
    tb.prepare_for_replay(real)
    assert real.attn_metadata is captured
    assert captured.seq_lens.tolist() == [r.cached_len + rows_per_req for r in reqs] + [rows_per_req]
    assert captured.table_rows.tolist() == [r.table_row for r in reqs] + [p.mgr.dummy_row]

    q, k, v = p.qkv(3 * rows_per_req)
    pad = 4 * rows_per_req - 3 * rows_per_req
    qp = torch.cat([q, torch.zeros(pad, H, D, device=DEVICE)])
    kp = torch.cat([k, torch.zeros(pad, HKV, D, device=DEVICE)])
    vp = torch.cat([v, torch.zeros(pad, HKV, D, device=DEVICE)])
    padded = Batch(phase, reqs, real.extend_lens, real.prefix_lens, real.input_ids, real.positions,
                   torch.cat([real.out_loc, torch.zeros(pad, dtype=torch.int64, device=DEVICE)]),
                   real.sample_rows, [], rows_per_req=rows_per_req, attn_metadata=captured, padded_size=4)
    got = tb.forward(qp, kp, vp, 0, padded)[: 3 * rows_per_req]
    p.torch.prepare_metadata(real)
    expect = p.torch.forward(q, k, v, 0, real)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


def test_replay_of_uncaptured_size_is_refused():
    p = Pair(4)
    p.triton.init_capture_graph(64, [2], rows_per_req=1)
    r = new_req(0, 3, p.mgr)
    r.cached_len = 3
    batch = p.batch("decode", [r], [1])
    batch.padded_size = 1
    with pytest.raises(RuntimeError, match="no graph was captured"):
        p.triton.prepare_for_replay(batch)
