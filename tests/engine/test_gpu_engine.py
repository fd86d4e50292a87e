"""GPU engine checks (skipped without CUDA): CUDA-graph decode, overlap scheduling, memory stability.

Run on the GPU host: python -m pytest -q tests/engine/test_gpu_engine.py
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 42, 99, 3], [7] * 40, list(range(20, 300)), [200, 201], list(range(900, 1000))]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.conftest import make_tiny_model

    # a Llama-shaped model big enough to exercise split-K decode and several pages
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu"), arch="llama", hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
        max_position_embeddings=2048,
    )


def hf_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            got = []
            for _ in range(n):
                nxt = int(model(ids).logits[0, -1].argmax())
                got.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]], device="cuda")], dim=1)
            outs.append(got)
    return outs


def test_graph_eager_and_transformers_agree_fp32(llama_dir):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = hf_greedy(llama_dir, PROMPTS, 24)
    kw = dict(dtype="float32", device="cuda", page_size=16, max_running_req=8, max_seq_len=1024, memory_fraction=0.2)
    eager = LLM(llama_dir, attention_backend="triton", cuda_graph=False, overlap_schedule=False, **kw)
    assert [o.token_ids for o in eager.generate(PROMPTS, params)] == expected
    del eager
    graph = LLM(llama_dir, attention_backend="triton", cuda_graph=True, overlap_schedule=True, **kw)
    assert graph.scheduler.engine.graph_runner is not None
    assert [o.token_ids for o in graph.generate(PROMPTS, params)] == expected
    torch_be = LLM(llama_dir, attention_backend="torch", cuda_graph=False, **kw)
    assert [o.token_ids for o in torch_be.generate(PROMPTS, params)] == expected


def test_no_memory_growth_over_1000_steps(llama_dir):
    llm = LLM(llama_dir, dtype="bfloat16", device="cuda", page_size=16, max_running_req=8, max_seq_len=2048,
              memory_fraction=0.2)
    params = SamplingParams(max_tokens=250, ignore_eos=True)
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=20, ignore_eos=True))  # warm up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    steps = 0
    for _ in range(4):  # 4 rounds x ~250 decode steps
        sched = llm.scheduler
        for p in PROMPTS[:4]:
            sched.add_request(p, params)
        while sched.has_work():
            sched.step()
            steps += 1
    torch.cuda.synchronize()
    assert steps >= 1000
    assert torch.cuda.memory_allocated() - before < 1 << 20
    assert sched.cache.num_free_pages == sched.cache.num_total_pages


def _count_replays(runner):
    calls = []
    replay = runner.replay
    runner.replay = lambda batch: calls.append((batch.size, batch.num_tokens)) or replay(batch)
    return calls


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed_prefill"])
def test_prefill_graphs_agree_with_transformers_fp32(llama_dir, mixed):
    """Captured prefill steps (engine/prefill_graph.py): prompts of 2-100 tokens run in buckets with padding,
    the 280-token one in chunks past the largest bucket (eager), in one run with overlap and decode graphs;
    mixed: with the decoders' rows inside (mixed_prefill), 8 request slots."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = hf_greedy(llama_dir, PROMPTS, 24)
    llm = LLM(llama_dir, dtype="float32", device="cuda", attention_backend="triton", page_size=16, max_running_req=8,
              max_seq_len=1024, memory_fraction=0.2, max_extend_tokens=256, prefill_graph_max_tokens=128,
              prefill_graph_max_reqs=2, mixed_prefill=mixed)
    runner = llm.scheduler.engine.prefill_graph_runner
    assert runner is not None and sorted(runner.graphs) == [16, 32, 64, 96, 128]
    assert runner.max_reqs == (8 if mixed else 2)
    calls = _count_replays(runner)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
    one = [o.token_ids for o in llm.generate(PROMPTS[1:2], params)]  # a lone arrival, as served load has them
    assert one == expected[1:2]
    assert calls and calls[-1] == (1, 40) and runner.bucket(40) == 64  # the lone arrival: a padded graph step


def test_prefill_graph_logits_equal_eager_bf16(llama_dir):
    from freetoken_core.core import Req

    llm = LLM(llama_dir, dtype="bfloat16", device="cuda", page_size=16, max_running_req=4, max_seq_len=1024,
              memory_fraction=0.2, prefill_graph_max_tokens=256)
    engine = llm.scheduler.engine
    runner = engine.prefill_graph_runner
    reqs = []
    for i, p in enumerate([list(range(3, 90)), [5, 6, 7], list(range(400, 440))]):
        r = Req(uid=i, input_ids=p, sampling=SamplingParams())
        engine.cache.assign_row(r)
        engine.cache.allocate(r, len(p))
        reqs.append(r)
    batch = engine.prepare_batch("prefill", reqs, [len(r.input_ids) for r in reqs])
    eager = engine.forward_logits(batch, engine.forward_batch(batch))
    batch = engine.prepare_batch("prefill", reqs, [len(r.input_ids) for r in reqs])
    engine.cache.flush()
    got = runner.replay(batch)
    torch.cuda.synchronize()
    assert got.shape == eager.shape
    tol = 0.05 * float(eager.abs().max())
    torch.testing.assert_close(got, eager, rtol=0.05, atol=tol)
    # the graph's greedy pick is the eager one, or ties with it within bf16 noise
    picked = eager.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
    assert (eager.max(-1).values - picked <= tol).all()
