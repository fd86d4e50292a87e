"""Scheduler behaviour on a tiny random model: accounting, aborts, retraction, sampling, limits."""

from __future__ import annotations

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.scheduler.scheduler import Scheduler

PROMPTS = [[5, 17, 42, 99, 3], [7] * 11, list(range(20, 57)), [200, 201], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sched"), arch="llama")


def make_sched(path, **kw) -> Scheduler:
    kw.setdefault("num_pages", 200)
    kw.setdefault("page_size", 4)
    return Scheduler(EngineConfig(model_path=str(path), dtype="float32", **kw))


def drain(sched: Scheduler, max_steps: int = 10_000) -> dict[int, list]:
    out: dict[int, list] = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return out
        for m in sched.step():
            out.setdefault(m.uid, []).append(m)
    raise AssertionError("scheduler did not finish")


def test_mixed_finish_abort_length_frees_every_page(model_path):
    sched = make_sched(model_path, max_running_req=3, max_extend_tokens=8)
    total = sched.cache.num_total_pages
    uids = [sched.add_request(p, SamplingParams(max_tokens=6 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    # abort one while waiting, one while running
    sched.abort(uids[4])
    msgs: dict[int, list] = {}
    for _ in range(3):
        for m in sched.step():
            msgs.setdefault(m.uid, []).append(m)
    running = [r.uid for r in sched.running]
    assert running
    sched.abort(running[0])
    for uid, ms in drain(sched).items():
        msgs.setdefault(uid, []).extend(ms)
    finals = {uid: [m for m in ms if m.finished] for uid, ms in msgs.items()}
    for uid in uids:
        assert len(finals.get(uid, [])) == 1, f"request {uid} must end with exactly one final message"
    assert finals[uids[4]][0].finish_reason == "abort"
    assert finals[running[0]][0].finish_reason == "abort"
    for uid in set(uids) - {uids[4], running[0]}:
        assert finals[uid][0].finish_reason == "length"
        assert finals[uid][0].num_output_tokens == 6 + uids.index(uid)
    assert sched.cache.num_free_pages == total
    sched.cache.check()
    assert not sched.running and not sched.waiting


def test_retraction_under_page_pressure_keeps_greedy_output(model_path):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = LLM(model_path, dtype="float32", page_size=1, num_pages=1000)
    expected = [o.token_ids for o in roomy.generate(PROMPTS, params)]
    # 70 usable token slots: the five requests need ~170 at full length, so decodes must retract
    tight = LLM(model_path, dtype="float32", page_size=1, num_pages=71, max_running_req=5)
    got = [o.token_ids for o in tight.generate(PROMPTS, params)]
    assert got == expected
    assert tight.scheduler.cache.num_free_pages == tight.scheduler.cache.num_total_pages


def tokens_while_prompts_arrive(sched: Scheduler, steps: int = 10) -> int:
    """A running request's tokens over `steps` steps that each bring a new 14-token prompt."""
    first = sched.add_request([1, 2, 3], SamplingParams(max_tokens=steps + 2, ignore_eos=True))
    sched.step()  # prefill of the first request
    got = 0
    for i in range(steps):
        sched.add_request([4 + i] * 14, SamplingParams(max_tokens=1, ignore_eos=True))
        for m in sched.step():
            if m.uid == first:
                got += len(m.next_tokens)
    return got


def test_decode_not_starved_by_stream_of_prompts(model_path):
    got = tokens_while_prompts_arrive(make_sched(model_path, max_running_req=8, max_extend_tokens=16))
    # at least every other step decodes the running request
    assert got >= 5


def test_commit_tokens_stops_at_first_finishing_token(model_path):
    sched = make_sched(model_path)
    uid = sched.add_request([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[77]))
    req = sched.waiting[0]
    sched.step()  # prefill (commits one token)
    n0 = req.num_output
    taken = sched._commit_tokens(req, [10, 11, 77, 12, 13])
    assert taken == 3 and req.finished and req.finish_reason == "stop" and req.stop_reason == 77
    assert req.output_ids[n0:] == [10, 11, 77]
    assert sched.cache.num_free_pages == sched.cache.num_total_pages
    uid2 = sched.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    req2 = sched.waiting[0]
    sched.step()
    assert sched._commit_tokens(req2, [10, 11, 12]) == 2 and req2.finish_reason == "length"
    assert uid != uid2


def test_min_tokens_and_ignore_eos(model_path):
    llm = LLM(model_path, dtype="float32", num_pages=200)
    probe = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    eos = probe[2]  # make the third generated token the "EOS"
    llm.scheduler.eos_token_ids = {eos}
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8))[0]
    assert stopped.token_ids == probe[:3] and stopped.finish_reason == "stop"
    ignored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert ignored.token_ids == probe and ignored.finish_reason == "length"
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, min_tokens=5))[0]
    assert eos not in held.token_ids[:5] and len(held.token_ids) >= 5


def test_seeded_sampling_independent_of_batch(model_path):
    llm = LLM(model_path, dtype="float32", num_pages=400, max_running_req=8)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    batch = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[4]], others[:2] + [p] + others[2:])
    assert batch[2].token_ids == alone
    again = llm.generate([PROMPTS[1]], p)[0].token_ids
    assert again == alone
    different = llm.generate([PROMPTS[1]], p.copy(seed=99))[0].token_ids
    assert different != alone


def test_logprobs(model_path):
    llm = LLM(model_path, dtype="float32", num_pages=200)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5 and len(out.top_logprobs) == 5
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert lp <= 0 and len(top) == 3
        assert max(top, key=top.get) == tok and top[tok] == pytest.approx(lp)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 300, SamplingParams(), "limit"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=-3), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=10_000), "max_tokens"),
        ([1, 2], SamplingParams(top_p=2.0), "top_p"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 999_999], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(model_path, prompt, params, match):
    llm = _shared_llm(model_path)
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].num_output_tokens >= 1
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


_LLMS: dict = {}


def _shared_llm(path):
    if path not in _LLMS:
        _LLMS[path] = LLM(path, dtype="float32", num_pages=200)
    return _LLMS[path]


def test_unknown_model_path_is_clear_error(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError), match="does not exist|config.json"):
        LLM(tmp_path / "nope", dtype="float32")


def test_stream_yields_next_tokens(model_path):
    llm = _shared_llm(model_path)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], params)[0].token_ids
    deltas = list(llm.stream([PROMPTS[2]], params))
    assert [t for d in deltas for t in d.next_tokens] == full
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    # abandoning a stream early frees the request's pages
    it = llm.stream([PROMPTS[2]], params)
    next(it)
    it.close()
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


def test_overlap_schedule_same_tokens_and_accounting(model_path):
    """Overlap scheduling (step N+1 launched before N's tokens are committed) runs on CPU too:
    outputs, finish reasons, stop tokens, retraction and page accounting must not change."""
    params = [SamplingParams(max_tokens=9 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    params[1] = SamplingParams(max_tokens=20, min_tokens=2)
    base = LLM(model_path, dtype="float32", page_size=1, num_pages=1000, overlap_schedule=False)
    expected = base.generate(PROMPTS, params)
    stop_tok = expected[2].token_ids[4]
    params[2] = SamplingParams(max_tokens=15, stop_token_ids=[stop_tok], ignore_eos=True)
    expected = base.generate(PROMPTS, params)
    for num_pages in (1000, 71):  # 71: tight enough to retract
        llm = LLM(model_path, dtype="float32", page_size=1, num_pages=num_pages, max_running_req=5, overlap_schedule=True)
        got = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
        assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
        llm.scheduler.cache.check()


def test_max_seq_len_past_model_positions(model_path):
    """The tiny model declares 256 positions; an engine configured for 400 still decodes past 256."""
    llm = LLM(model_path, dtype="float32", num_pages=200, page_size=4, max_seq_len=400)
    out = llm.generate([[3] * 250], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.num_output_tokens == 40 and out.finish_reason == "length"
