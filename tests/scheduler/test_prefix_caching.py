"""Prefix caching end to end on tiny random models (dense llama, Qwen3-MoE): multi-turn conversations that
share a system prompt give the same tokens with the cache on and off, through chunked and mixed prefill,
overlap scheduling, page sizes 1 and 4, fewer rows than conversations, speculation, eviction mid-run,
retraction and aborts; later turns take the earlier turns' pages; every page comes back."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams
from tests.conftest import TINY_VOCAB, make_tiny_model
from tests.prefix_chat import assert_all_back, assert_later_turns_hit, random_traffic, run_chats, token_ids

CHAT = dict(num_convs=4, num_turns=3, system_len=21, new_len=5, max_tokens=7, vocab=(3, TINY_VOCAB))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefix"), arch="llama")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests.models.moe_checkpoints import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("prefix_moe"), "per_expert")


def _pair(path, **kw) -> tuple[list, LLM]:
    """Turns with the cache off (the reference) and on."""
    base = dict(dtype="float32", max_running_req=3, max_extend_tokens=16, num_pages=200) | kw
    off = run_chats(LLM(path, enable_prefix_caching=False, **base), **CHAT)
    on_llm = LLM(path, **base)
    on = run_chats(on_llm, **CHAT)
    assert token_ids(on) == token_ids(off)
    assert all(o.num_cached_tokens == 0 for outs in off for o in outs)
    assert_all_back(on_llm)
    return on, on_llm


@pytest.mark.parametrize("page_size,overlap,mixed", [(1, False, False), (4, True, False), (4, False, True)])
def test_multi_turn_identical_and_hits(llama, page_size, overlap, mixed):
    on, llm = _pair(llama, page_size=page_size, overlap_schedule=overlap, mixed_prefill=mixed)
    assert_later_turns_hit(on, page_size)
    # the first turn's later conversations share the system prompt with the first one's... only once it
    # finished: with 3 rows for 4 conversations the fourth is admitted after one finished
    assert on[0][3].num_cached_tokens >= CHAT["system_len"] // page_size * page_size


@pytest.mark.parametrize("overlap", [False, True])
def test_speculation_with_cached_prefixes(llama, overlap):
    on, llm = _pair(llama, page_size=4, speculative="ngram", num_speculative_tokens=3, overlap_schedule=overlap)
    assert_later_turns_hit(on, 4)
    assert sum(o.spec_proposed for outs in on for o in outs) > 0  # the verify path really ran


def test_eviction_and_retraction_mid_run(llama):
    """A pool that cannot keep every conversation: cached pages are evicted while requests run, and
    decoders get retracted; the tokens do not change."""
    on, llm = _pair(llama, page_size=2, num_pages=70, max_running_req=4)
    assert llm.scheduler.cache.prefix.evicted_pages > 0


def test_moe_multi_turn_identical(moe):
    on, llm = _pair(moe, page_size=4, overlap_schedule=True)
    assert_later_turns_hit(on, 4)


def test_seeded_sampling_identical(llama):
    base = dict(dtype="float32", page_size=4, max_running_req=3, num_pages=200)
    off = run_chats(LLM(llama, enable_prefix_caching=False, **base), **CHAT, sampled=True)
    on = run_chats(LLM(llama, **base), **CHAT, sampled=True)
    assert token_ids(on) == token_ids(off)


def test_abort_mid_prefill_of_a_shared_prefix(llama):
    """A request aborted while its prompt is half prefilled caches what it wrote; the next request with the
    same prompt takes those pages and still produces the uncached tokens."""
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = LLM(llama, dtype="float32", page_size=4, num_pages=64, enable_prefix_caching=False).generate(
        [prompt], params)[0].token_ids
    llm = LLM(llama, dtype="float32", page_size=4, num_pages=64, max_extend_tokens=12)
    sched = llm.scheduler
    uid = sched.add_request(prompt, params)
    sched.step()
    sched.step()
    assert 0 < sched._by_uid[uid].cached_len < len(prompt)
    sched.abort(uid)
    while sched.has_work():
        sched.step()
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == want
    assert out.num_cached_tokens == 24
    assert_all_back(llm)


def test_cache_off_keeps_nothing(llama):
    llm = LLM(llama, dtype="float32", page_size=4, num_pages=64, enable_prefix_caching=False)
    llm.generate([list(range(3, 30))], SamplingParams(max_tokens=4))
    assert llm.scheduler.cache.prefix is None and llm.scheduler.cache.num_cached_pages == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_random_arrivals_and_aborts_keep_invariants(llama, overlap):
    """Random arrivals over shared prefixes and random aborts in a pool that evicts and retracts; the cache's
    ownership checks after every step, free + evictable == the pool at the end."""
    llm = LLM(llama, dtype="float32", page_size=2, num_pages=48, max_running_req=4, max_extend_tokens=10,
              overlap_schedule=overlap)
    random_traffic(llm, (3, TINY_VOCAB))
    assert llm.scheduler.cache.prefix.hit_tokens > 0 and llm.scheduler.cache.prefix.evicted_pages > 0
