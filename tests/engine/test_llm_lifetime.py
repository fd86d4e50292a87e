"""The caller's EngineConfig stays as given (what the engine decided is `engine.resolved`), and
`LLM.close()` / `with LLM(...)` free the engine: a stream still open ends, and another LLM starts."""

from __future__ import annotations

import dataclasses

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.scheduler.scheduler import Scheduler

KW = dict(dtype="float32", page_size=4, num_pages=100, max_running_req=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lifetime"), arch="llama")


def test_engine_config_is_not_changed_by_the_engine(model_path):
    config = EngineConfig(model_path=str(model_path), speculative="ngram", num_speculative_tokens=3, **KW)
    before = dataclasses.asdict(config)
    sched = Scheduler(config)
    try:
        assert dataclasses.asdict(config) == before
        resolved = sched.engine.resolved
        assert resolved.decode_rows_per_req == 4  # k + 1 rows under speculation; the field stays 1
        assert config.decode_rows_per_req == 1
        assert resolved.max_req_len == resolved.max_seq_len - 3
        assert (resolved.max_running_req, resolved.num_pages, resolved.cuda_graph) == (2, 100, False)  # CPU
        with pytest.raises(dataclasses.FrozenInstanceError):
            resolved.max_running_req = 1  # type: ignore[misc]
    finally:
        sched.close()
    llm = LLM(str(model_path), **KW)
    try:
        assert dataclasses.asdict(llm.config) == {**before, "speculative": None, "num_speculative_tokens": 4}
    finally:
        llm.close()


def test_close_ends_an_open_stream_and_a_new_llm_starts(model_path):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    with LLM(str(model_path), **KW) as llm:
        stream = llm.stream([[1, 2, 3], [4, 5]], params)
        first = next(stream)
        llm.close()
        rest = list(stream)  # ends at once: no step runs on the freed engine
        assert llm.scheduler.engine.model is None and llm.scheduler.engine.kv_cache is None
    finals = [d for d in [first, *rest] if d.finished]
    assert sorted(d.index for d in finals) == [0, 1]
    assert all(d.finish_reason == "abort" for d in finals)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2]], params)
    with LLM(str(model_path), **KW) as again:
        out = again.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
