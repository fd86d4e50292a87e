"""Speculative decoding (n-gram drafts, verify steps) end to end through LLM: greedy output identical
to non-speculative decoding, stops inside accepted runs, page accounting, acceptance counts.

On the H200 (CUDA graphs, overlap scheduling, triton backend) the greedy test also holds in fp32:
checked there with the same model and prompts."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams

# repetitive prompts: the n-gram drafter finds continuations in them
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 40, 41, 42, 40, 41, 42, 40],
    list(range(60, 80)) + list(range(60, 70)),
    [200, 201],
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.conftest import make_tiny_model

    # a model that copies: strong diagonal-ish structure makes drafts get accepted sometimes
    return make_tiny_model(tmp_path_factory.mktemp("spec"), arch="llama", seed=3)


def run(path, spec: bool, params, page_size=4, num_pages=400, k=3, **kw):
    llm = LLM(path, dtype="float32", page_size=page_size, num_pages=num_pages, max_running_req=4,
              speculative="ngram" if spec else None, num_speculative_tokens=k, **kw)
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
    llm.scheduler.cache.check()
    return outs


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_speculation_is_token_identical(model_path, page_size):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    base = run(model_path, False, params, page_size)
    spec = run(model_path, True, params, page_size)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert sum(o.spec_proposed for o in spec) > 0  # drafts were proposed and verified
    assert all(0 <= o.spec_accepted <= o.spec_proposed for o in spec)


def test_stops_inside_accepted_runs(model_path):
    base = run(model_path, False, SamplingParams(max_tokens=30, ignore_eos=True))
    # stop token = a token in the middle of each output; length cap inside a run
    for i, o in enumerate(base):
        stop_tok = o.token_ids[7]
        p = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
        ref = run(model_path, False, p)[i]
        got = run(model_path, True, p)[i]
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
    for n in (1, 2, 5, 11):
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert [o.token_ids for o in run(model_path, True, p)] == [o.token_ids[:n] for o in base]


def test_eos_inside_accepted_run(model_path):
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, speculative="ngram",
              num_speculative_tokens=4)
    base = LLM(model_path, dtype="float32", page_size=4, num_pages=400)
    ref = base.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    eos = ref[0].token_ids[9]
    llm.scheduler.eos_token_ids = {eos}
    base.scheduler.eos_token_ids = {eos}
    p = SamplingParams(max_tokens=30, min_tokens=3)
    assert [o.token_ids for o in llm.generate(PROMPTS, p)] == [o.token_ids for o in base.generate(PROMPTS, p)]


def test_seeded_sampling_with_speculation_is_reproducible(model_path):
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    a = run(model_path, True, p)
    b = run(model_path, True, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.logprobs) == len(o.token_ids) == 20 for o in a)
    assert all(max(t, key=t.get) is not None for o in a for t in o.top_logprobs)


def test_greedy_logprobs_match_without_speculation(model_path):
    p = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    base = run(model_path, False, p)
    spec = run(model_path, True, p)
    for a, b in zip(base, spec):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
