"""Speculative decoding (n-gram drafts, verify steps) end to end through LLM: greedy output identical
to non-speculative decoding, stops inside accepted runs, page accounting, acceptance counts.

`pipelined=True` forces overlap scheduling on CPU, which runs greedy requests through the
device-resident pipeline (spec/pipeline.py, eager here; one CUDA graph per step on the GPU) with the
host committing one step behind; `False` verifies synchronously.

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


def run(path, spec: bool, params, page_size=4, num_pages=400, k=3, pipelined=False, prompts=PROMPTS, **kw):
    if pipelined:
        kw["overlap_schedule"] = True
    llm = LLM(path, dtype="float32", page_size=page_size, num_pages=num_pages, max_running_req=4,
              speculative="ngram" if spec else None, num_speculative_tokens=k, **kw)
    if pipelined:
        assert llm.scheduler.spec.pipeline is not None
    outs = llm.generate(prompts, params)
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
    llm.scheduler.cache.check()
    return outs


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_speculation_is_token_identical(model_path, page_size, pipelined):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    base = run(model_path, False, params, page_size)
    spec = run(model_path, True, params, page_size, pipelined=pipelined)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert sum(o.spec_proposed for o in spec) > 0  # drafts were proposed and verified
    assert all(0 <= o.spec_accepted <= o.spec_proposed for o in spec)


@pytest.mark.parametrize("pipelined", [False, True])
def test_stops_inside_accepted_runs(model_path, pipelined):
    base = run(model_path, False, SamplingParams(max_tokens=30, ignore_eos=True))
    # stop token = a token in the middle of each output; length cap inside a run
    for i, o in enumerate(base):
        stop_tok = o.token_ids[7]
        p = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
        ref = run(model_path, False, p)[i]
        got = run(model_path, True, p, pipelined=pipelined)[i]
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
    for n in (1, 2, 5, 11):
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert [o.token_ids for o in run(model_path, True, p, pipelined=pipelined)] == [o.token_ids[:n] for o in base]


@pytest.mark.parametrize("pipelined", [False, True])
def test_eos_inside_accepted_run(model_path, pipelined):
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, speculative="ngram",
              num_speculative_tokens=4, overlap_schedule=pipelined or None)
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


def count_pipeline_launches(llm: LLM) -> dict[str, int]:
    pl = llm.scheduler.spec.pipeline
    counts = {"launch": 0}
    launch = pl.launch

    def counted():
        counts["launch"] += 1
        return launch()

    pl.launch = counted
    return counts


def test_pipeline_runs_greedy_steps_and_matches_the_synchronous_drafts(model_path):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    sync = run(model_path, True, params)
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, max_running_req=4,
              speculative="ngram", num_speculative_tokens=3, overlap_schedule=True)
    counts = count_pipeline_launches(llm)
    piped = llm.generate(PROMPTS, params)
    assert counts["launch"] >= 10
    assert not llm.scheduler.in_flight  # generate() leaves no step in flight
    # the device drafter follows the host drafter's rule: same drafts, same acceptance
    assert [(o.spec_accepted, o.spec_proposed) for o in piped] == [(o.spec_accepted, o.spec_proposed) for o in sync]
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


def test_stream_reports_acceptance_on_the_final_delta(model_path):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    whole = run(model_path, True, params)
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, max_running_req=4,
              speculative="ngram", num_speculative_tokens=3)
    final = {d.index: d for d in llm.stream(PROMPTS, params) if d.finished}
    assert [(final[i].spec_accepted, final[i].spec_proposed) for i in range(len(PROMPTS))] == \
        [(o.spec_accepted, o.spec_proposed) for o in whole]
    assert sum(d.spec_proposed for d in final.values()) > 0


def test_pipeline_with_more_requests_than_slots_and_mixed_sampling(model_path):
    """Requests join as others finish (the pipeline restarts around each prefill); a sampled
    request in the batch sends everyone through the synchronous path until it finishes."""
    prompts = PROMPTS * 3
    greedy = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    base = LLM(model_path, dtype="float32", page_size=4, num_pages=400, max_running_req=4).generate(prompts, greedy)
    params = list(greedy)
    params[5] = SamplingParams(max_tokens=12, temperature=0.9, seed=1, ignore_eos=True)
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, max_running_req=4,
              speculative="ngram", num_speculative_tokens=3, overlap_schedule=True)
    counts = count_pipeline_launches(llm)
    outs = llm.generate(prompts, params)
    assert counts["launch"] > 0
    for i, (a, b) in enumerate(zip(base, outs)):
        if i != 5:
            assert b.token_ids == a.token_ids, i
    assert len(outs[5].token_ids) == 12
    llm.scheduler.cache.check()
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


def test_pipeline_falls_back_when_pages_run_short(model_path):
    """A pool too small for two steps of look-ahead: the synchronous path takes over (retracting
    when it must), and the output is still exact."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    base = run(model_path, False, params, page_size=1, num_pages=400)
    tight = run(model_path, True, params, page_size=1, num_pages=90, pipelined=True)
    assert [o.token_ids for o in tight] == [o.token_ids for o in base]


def test_abort_while_a_pipelined_step_is_in_flight(model_path):
    from freetoken_core.config import EngineConfig
    from freetoken_core.scheduler.scheduler import Scheduler

    cfg = EngineConfig(model_path=str(model_path), dtype="float32", page_size=4, num_pages=400,
                       max_running_req=4, speculative="ngram", num_speculative_tokens=3, overlap_schedule=True)
    sched = Scheduler(cfg)
    uids = [sched.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in PROMPTS]
    finals: dict[int, list] = {u: [] for u in uids}
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    steps = 0
    while sched.has_work():
        for m in sched.step():
            tokens[m.uid].extend(m.next_tokens)
            if m.finished:
                finals[m.uid].append(m)
        steps += 1
        if steps == 6:
            assert sched.spec.busy  # a pipelined step is in flight
            sched.abort(uids[0])
    assert all(len(f) == 1 for f in finals.values())  # exactly one final message each
    assert finals[uids[0]][0].finish_reason == "abort"
    assert all(finals[u][0].finish_reason == "length" and len(tokens[u]) == 40 for u in uids[1:])
    sched.cache.check()
    assert sched.cache.num_free_pages == sched.cache.num_total_pages


def test_queued_requests_do_not_stop_the_pipeline_every_step(model_path):
    """With every row taken, waiting requests cannot be admitted: the scheduler must not drain the
    step in flight for a prefill that cannot happen. The pipeline restarts only when a request
    leaves (and its successor is admitted), not on every step."""
    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    llm = LLM(model_path, dtype="float32", page_size=4, num_pages=400, max_running_req=4,
              speculative="ngram", num_speculative_tokens=3, overlap_schedule=True)
    pl = llm.scheduler.spec.pipeline
    counts = count_pipeline_launches(llm)
    starts = []
    start = pl.start
    pl.start = lambda members: starts.append(len(members)) or start(members)
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert counts["launch"] > 3 * len(starts)
    assert len(starts) <= len(prompts) + 1
