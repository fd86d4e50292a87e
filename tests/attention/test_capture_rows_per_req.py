"""Attention with 1 and 4 query rows per request over the paged cache, at the engine level.

CPU: the triton backend (interpreter) equals the eager torch reference for decode (1 row) and
verify (4 rows) batches. GPU: CUDA graphs captured for 1 and 4 rows replay what eager computes."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8, 9], [7, 7, 7], list(range(20, 31))]


def step_logits(llm: LLM, rows: int, graph: bool = False) -> torch.Tensor:
    """Prefill the prompts, then run one batch of `rows` rows per request; its fp32 logits."""
    sched, engine = llm.scheduler, llm.scheduler.engine
    for p in PROMPTS:
        sched.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
    while sched.waiting or any(r.seq_len - r.cached_len > 1 for r in sched.running):
        sched.step()
    sched.drain([])
    reqs = list(sched.running)
    for r in reqs:
        if rows > 1:
            r.widen_pending(rows - 1, [(r.seq_len * 7 + j) % 200 for j in range(rows - 1)])
        engine.cache.allocate(r, r.seq_len + rows - 1)
    phase = "verify" if rows > 1 else "decode"
    batch = engine.prepare_batch(phase, reqs, [rows] * len(reqs), rows_per_req=rows)
    if graph:
        runner = engine.verify_graph_runner if rows > 1 else engine.graph_runner
        assert runner is not None and runner.can_run(batch)
        engine.cache.flush()
        out = runner.replay(batch).clone()
    else:
        out = engine.forward_logits(batch, engine.forward_batch(batch))
    for r in reqs:
        r.num_pending, r.pending_ids = 0, []
    return out.float().cpu()


@pytest.mark.parametrize("rows", [1, 4])
def test_triton_rows_per_req_equals_torch_reference(tiny_model_factory, rows):
    path = tiny_model_factory(arch="llama")
    kw = dict(dtype="float32", page_size=4, num_pages=64, max_running_req=4)
    ref = step_logits(LLM(path, attention_backend="torch", **kw), rows)
    got = step_logits(LLM(path, attention_backend="triton", **kw), rows)
    assert got.shape == (len(PROMPTS) * rows, ref.shape[1])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_captured_graph_replays_eager(tiny_model_factory, rows):
    path = tiny_model_factory(arch="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, max_position_embeddings=1024)
    kw = dict(dtype="float32", device="cuda", page_size=16, max_running_req=4, max_seq_len=512, memory_fraction=0.1,
              attention_backend="triton", speculative="ngram", num_speculative_tokens=3)
    eager = step_logits(LLM(path, cuda_graph=False, **kw), rows)
    graph = step_logits(LLM(path, cuda_graph=True, **kw), rows)
    torch.testing.assert_close(graph, eager, atol=2e-4, rtol=2e-4)
