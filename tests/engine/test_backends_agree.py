"""Engine greedy output with the Triton-language backend (interpreter on CPU) equals the torch backend."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [7, 7, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.mark.parametrize("page_size", [1, 4])
def test_triton_backend_greedy_equals_torch(tiny_model_factory, page_size):
    path = tiny_model_factory(arch="llama", tie=False)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    kw = dict(dtype="float32", page_size=page_size, num_pages=64, max_running_req=3, max_extend_tokens=6)
    ref = LLM(path, attention_backend="torch", **kw).generate(PROMPTS, params)
    llm = LLM(path, attention_backend="triton", **kw)
    assert llm.scheduler.engine.attn_backend.info.name == "triton"
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
