"""Prefill graphs (engine/prefill_graph.py): the static, padded step gives the eager prefill's logits and
tokens. On CPU the Triton backend runs under the interpreter and the runner's static steps run without
capture (`run_static`): the padding request, the static metadata and the sampled rows are what is checked;
tests/engine/test_gpu_engine.py captures and replays them on CUDA."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.core import Req
from freetoken_core.engine.prefill_graph import prefill_graph_buckets

PROMPTS = [[5, 17, 42, 99, 3], [7] * 13, list(range(20, 47)), [200, 201], list(range(90, 100))]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def test_buckets():
    assert prefill_graph_buckets(0) == []
    assert prefill_graph_buckets(10) == [10]
    assert prefill_graph_buckets(64) == [16, 32, 64]
    assert prefill_graph_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert prefill_graph_buckets(300) == [16, 32, 64, 96, 128, 192, 256, 300]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefill_graph_max_reqs"):
        EngineConfig(model_path="x", prefill_graph_max_reqs=0).validate()
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(model_path="x", prefill_graph_max_tokens=-1).validate()


def _llm(path, backend="triton", **kw):
    base = dict(dtype="float32", num_pages=128, max_running_req=3, max_extend_tokens=24, page_size=4)
    base.update(kw)
    return LLM(path, attention_backend=backend, **base)


def _with_static_prefill(llm, max_tokens, max_reqs):
    engine = llm.scheduler.engine
    engine.config.prefill_graph_max_tokens, engine.config.prefill_graph_max_reqs = max_tokens, max_reqs
    runner = engine.build_prefill_graphs()
    assert runner is not None and engine.prefill_graph_runner is runner
    return runner


def _count_static_steps(runner) -> list[tuple[int, int]]:
    """(requests, rows) of every prefill step the engine ran through the runner's static path."""
    calls = []
    run_static = runner.run_static
    runner.run_static = lambda batch: calls.append((batch.size, batch.num_tokens)) or run_static(batch)
    return calls


@pytest.mark.parametrize("page_size", [1, 4])
def test_static_prefill_steps_give_the_eager_tokens(tiny_model_factory, page_size):
    """Several prompts, fewer rows than prompts, chunks (max_extend_tokens 24 < the 27-token prompt):
    some steps run in a bucket with padding, some are too big for it and stay eager."""
    path = tiny_model_factory(arch="llama", tie=False)
    expected = [o.token_ids for o in _llm(path, page_size=page_size).generate(PROMPTS, PARAMS)]
    llm = _llm(path, page_size=page_size)
    runner = _with_static_prefill(llm, max_tokens=16, max_reqs=2)
    calls = _count_static_steps(runner)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert calls and all(n <= 2 and t <= 16 for n, t in calls)
    assert any(t < runner.bucket(t) for _, t in calls)  # padding rows ran
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.num_total_pages


def _prefill_batch(engine, prompts, chunk=None):
    reqs = []
    for i, p in enumerate(prompts):
        r = Req(uid=i, input_ids=list(p), sampling=SamplingParams())
        engine.cache.assign_row(r)
        engine.cache.allocate(r, len(p))
        reqs.append(r)
    lens = [len(p) for p in prompts] if chunk is None else chunk
    return engine.prepare_batch("prefill", reqs, lens), reqs


def test_static_step_logits_equal_the_eager_prefill(tiny_model_factory):
    """The sampled rows only: a request whose chunk does not end its prompt is not sampled."""
    path = tiny_model_factory(arch="llama", tie=False)
    llm = _llm(path)
    engine = llm.scheduler.engine
    prompts = [list(range(30, 41)), [9, 8, 7], list(range(60, 70))]
    batch, reqs = _prefill_batch(engine, prompts, chunk=[11, 3, 6])  # the third one stops after 6 of 10
    assert batch.sample_reqs == [0, 1]
    eager = engine.forward_logits(batch, engine.forward_batch(batch))
    for r in reqs:
        engine.cache.free(r)
    batch, reqs = _prefill_batch(engine, prompts, chunk=[11, 3, 6])
    runner = _with_static_prefill(llm, max_tokens=32, max_reqs=4)
    assert runner.buckets == [16, 24]  # capped by max_extend_tokens: no prefill step has more rows
    assert runner.can_run(batch) and runner.bucket(batch.num_tokens) == 24
    engine.cache.flush()  # the page-table rows of the new allocation (Engine.launch does this)
    got = runner.run_static(batch)
    assert got.shape == eager.shape == (2, engine.vocab_size)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_batches_past_the_limits_stay_eager(tiny_model_factory):
    path = tiny_model_factory(arch="llama", tie=False)
    llm = _llm(path, max_running_req=6)
    engine = llm.scheduler.engine
    runner = _with_static_prefill(llm, max_tokens=16, max_reqs=2)
    small, _ = _prefill_batch(engine, [[1, 2, 3], [4, 5]])
    assert runner.can_run(small)
    too_many, _ = _prefill_batch(engine, [[1], [2], [3]])
    assert not runner.can_run(too_many)


def test_moe_static_prefill_gives_the_eager_tokens(tmp_path):
    """Padding rows go through the routers and experts like real ones."""
    from tests.models.moe_checkpoints import make_tiny_moe

    path = make_tiny_moe(tmp_path, "per_expert", norm_topk_prob=True)
    expected = [o.token_ids for o in _llm(path).generate(PROMPTS, PARAMS)]
    llm = _llm(path)
    calls = _count_static_steps(_with_static_prefill(llm, max_tokens=32, max_reqs=3))
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert calls


def test_engines_that_cannot_capture_prefill_say_why(tiny_model_factory, caplog):
    path = tiny_model_factory(arch="llama", tie=False)
    llm = _llm(path, backend="torch")
    engine = llm.scheduler.engine
    engine.config.prefill_graph_max_tokens = 64
    with caplog.at_level("WARNING"):
        assert engine.build_prefill_graphs() is None
    assert "cannot capture prefill steps" in caplog.text
    assert engine.prefill_graph_runner is None


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_hybrid_static_prefill_matches_transformers(tmp_path, kind, mixed):
    """GDN layers in the static steps: the padding request and empty request slots run on the dummy state
    slot, so the requests' conv and recurrent states carry over chunks exactly; every slot comes back."""
    from tests.models.hybrid_checkpoints import MAX_NEW, PROMPTS as HYBRID_PROMPTS, hf_greedy, make_tiny_hybrid

    path = make_tiny_hybrid(tmp_path, kind)
    expected = hf_greedy(path, kind, HYBRID_PROMPTS, MAX_NEW)
    llm = LLM(path, attention_backend="triton", dtype="float32", page_size=4, max_running_req=3, max_extend_tokens=12,
              num_pages=256, mixed_prefill=mixed)
    assert llm.scheduler.engine.linear_pool is not None
    calls = _count_static_steps(_with_static_prefill(llm, max_tokens=12, max_reqs=2))
    outs = llm.generate(HYBRID_PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert calls and any(t < 12 for _, t in calls)
    assert llm.scheduler.cache.num_free_rows == 3
