"""The decode fast path of Engine.prepare_batch builds what the general path builds for one row per request:
committed last tokens, placeholders for tokens still being sampled (overlap scheduling), slots across pages."""

from __future__ import annotations

import torch

from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.scheduler.decode import allocate_decode
from freetoken_core.scheduler.scheduler import Scheduler


def test_decode_batch_equals_the_general_path(tiny_model_factory):
    path = tiny_model_factory(arch="llama", tie=False)
    sched = Scheduler(EngineConfig(model_path=str(path), dtype="float32", num_pages=64, page_size=4,
                                   max_running_req=4, overlap_schedule=True))
    for p in ([5, 17, 42], [7] * 9, list(range(20, 34))):
        sched.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(6):  # prefill, then decode steps with one step always in flight
        sched.step()
    reqs = list(sched.running)
    assert any(r.inflight for r in reqs) and all(r.num_output for r in reqs)
    for with_inflight in (True, False):
        if not with_inflight:
            sched.drain([])  # every token committed: the fast path reads them from output_ids
            assert not any(r.inflight for r in reqs)
        engine = sched.engine
        allocate_decode(reqs, sched.cache, lambda r: r.seq_len + r.inflight)  # the pages of this step's rows
        fast = engine.prepare_batch("decode", reqs, [1] * len(reqs))
        general = engine.prepare_batch("prefill", reqs, [1] * len(reqs))
        for name in ("input_ids", "positions", "out_loc", "sample_rows"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        assert fast.prefix_lens == general.prefix_lens and fast.sample_reqs == general.sample_reqs
        assert fast.extend_lens == [1] * len(reqs) and fast.phase == "decode"
