"""`mixed_prefill`: decoders run their next row inside the prefill step. Greedy tokens stay those of
separate steps (dense, MoE and hybrid models, chunks, page pressure, overlap, prefill graphs), and an
arriving prompt no longer costs the running requests a step."""

from __future__ import annotations

import itertools

import pytest

from freetoken_core import LLM, SamplingParams

from test_scheduler import make_sched, tokens_while_prompts_arrive

PROMPTS = [[5, 17, 42, 99, 3], [7] * 11, list(range(20, 57)), [200, 201], [9, 8, 7, 6, 5, 4, 3]]
# different lengths: requests finish at different steps, so prompts arrive while others decode
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 14, 7)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("mixed"), arch="llama")


def _record_batches(llm: LLM) -> list[tuple[str, list[int]]]:
    """(phase, extend_lens) of every batch the engine builds."""
    seen = []
    engine = llm.scheduler.engine
    prepare = engine.prepare_batch

    def recording(phase, reqs, extend_lens, *a, **kw):
        seen.append((phase, list(extend_lens)))
        return prepare(phase, reqs, extend_lens, *a, **kw)

    engine.prepare_batch = recording
    return seen


def _record_retractions(sched) -> list[int]:
    """The uid of every request the scheduler retracts, in order."""
    retracted: list[int] = []
    retract = sched.retract
    sched.retract = lambda req: retracted.append(req.uid) or retract(req)
    return retracted


def _mixed_steps(batches) -> int:
    return sum(1 for phase, lens in batches if phase == "prefill" and lens and lens[0] == 1 and max(lens) > 1)


@pytest.mark.parametrize("page_size,overlap", [(1, False), (4, True)])
@pytest.mark.parametrize("max_extend", [8, 64])
def test_mixed_steps_give_the_separate_steps_tokens(model_path, page_size, overlap, max_extend):
    kw = dict(dtype="float32", page_size=page_size, num_pages=400, max_running_req=3,
              max_extend_tokens=max_extend, overlap_schedule=overlap)
    expected = [o.token_ids for o in LLM(model_path, **kw).generate(PROMPTS, PARAMS)]
    llm = LLM(model_path, mixed_prefill=True, **kw)
    batches = _record_batches(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert _mixed_steps(batches) > 0
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.num_total_pages
    cache.check()


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_under_page_pressure(model_path, overlap):
    """Decoders that would need retraction do not ride along; the decode step retracts them as before (with
    overlap scheduling, a prompt admitted while the step before runs leaves room for its tokens in flight)."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    base = LLM(model_path, dtype="float32", page_size=1, num_pages=1000)
    expected = [o.token_ids for o in base.generate(PROMPTS, params)]
    tight = LLM(model_path, dtype="float32", page_size=1, num_pages=71, max_running_req=5, mixed_prefill=True,
                overlap_schedule=overlap)
    retracted = _record_retractions(tight.scheduler)
    assert [o.token_ids for o in tight.generate(PROMPTS, params)] == expected
    assert retracted  # the pool was tight enough to retract
    assert tight.scheduler.cache.num_free_pages == tight.scheduler.cache.num_total_pages
    tight.scheduler.cache.check()


def test_an_arriving_prompt_costs_the_running_request_no_step(model_path):
    sched = make_sched(model_path, max_running_req=8, max_extend_tokens=16, mixed_prefill=True)
    assert tokens_while_prompts_arrive(sched) == 10  # a token every step (separate steps: every other step)


def test_speculation_runs_without_riders(model_path):
    kw = dict(dtype="float32", page_size=4, num_pages=400, max_running_req=3, speculative="ngram",
              num_speculative_tokens=3)
    expected = [o.token_ids for o in LLM(model_path, **kw).generate(PROMPTS, PARAMS)]
    llm = LLM(model_path, mixed_prefill=True, **kw)
    batches = _record_batches(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert _mixed_steps(batches) == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_moe_matches_transformers(tmp_path, overlap):
    from tests.models.moe_checkpoints import hf_greedy, make_tiny_moe

    path = make_tiny_moe(tmp_path, "per_expert", norm_topk_prob=True)
    expected = hf_greedy(path, PROMPTS, 10)
    llm = LLM(path, dtype="float32", page_size=4, num_pages=300, max_running_req=3, max_extend_tokens=16,
              mixed_prefill=True, overlap_schedule=overlap)
    batches = _record_batches(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert _mixed_steps(batches) > 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_mixed_hybrid_matches_transformers(tmp_path, kind, overlap):
    """GDN layers: a rider is a one-token sequence of the varlen state step, from its own state slot (with
    overlap scheduling, its input token gathered from the step still running)."""
    from tests.models.hybrid_checkpoints import MAX_NEW, PROMPTS as HYBRID_PROMPTS, hf_greedy, make_tiny_hybrid

    path = make_tiny_hybrid(tmp_path, kind)
    expected = hf_greedy(path, kind, HYBRID_PROMPTS, MAX_NEW)
    llm = LLM(path, dtype="float32", page_size=4, max_running_req=3, max_extend_tokens=7, num_pages=256,
              mixed_prefill=True, overlap_schedule=overlap)
    batches = _record_batches(llm)
    outs = llm.generate(HYBRID_PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert _mixed_steps(batches) > 0
    assert llm.scheduler.cache.num_free_rows == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_in_static_prefill_graphs(model_path, overlap):
    """The prefill graphs' request slots cover every running request when steps are mixed (with overlap
    scheduling, the riders' inputs gathered into the static buffers)."""
    kw = dict(dtype="float32", page_size=4, num_pages=400, max_running_req=3, max_extend_tokens=16,
              attention_backend="triton", overlap_schedule=overlap)
    expected = [o.token_ids for o in LLM(model_path, **kw).generate(PROMPTS, PARAMS)]
    llm = LLM(model_path, mixed_prefill=True, **kw)
    engine = llm.scheduler.engine
    engine.config.prefill_graph_max_tokens = 16
    runner = engine.build_prefill_graphs()
    assert runner.max_reqs == 3
    steps = []
    run_static = runner.run_static
    runner.run_static = lambda batch: steps.append(list(batch.extend_lens)) or run_static(batch)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert any(lens[0] == 1 and max(lens) > 1 for lens in steps)


def _record_reads(llm: LLM) -> list[tuple[str, int, set[int]]]:
    """("launch" | "read", step number, uids of the step) for every step the engine launches and every read of
    its tokens back on the host, in order."""
    events: list[tuple[str, int, set[int]]] = []
    engine = llm.scheduler.engine
    launch = engine.launch
    numbers = itertools.count()

    def recording(batch, *a, **kw):
        step = launch(batch, *a, **kw)
        n, uids = next(numbers), {r.uid for r in batch.reqs}
        events.append(("launch", n, uids))
        result = step.result
        step.result = lambda: events.append(("read", n, uids)) or result()
        return step

    engine.launch = recording
    return events


@pytest.mark.parametrize("mixed", [True, False])
def test_prefill_steps_queue_behind_the_running_step(model_path, mixed):
    """Overlap scheduling: a step that carries an arriving prompt (with the decoders riding in it, or on its own)
    is launched while the running step's tokens are still on the device, and so is the step after a request's
    last token went in flight: no step waits for its predecessor to be read back while a request runs in both
    (the device would idle while the host plans it). Greedy tokens stay those of unoverlapped steps."""
    kw = dict(dtype="float32", page_size=4, num_pages=400, max_running_req=3, max_extend_tokens=64,
              mixed_prefill=mixed)
    expected = [o.token_ids for o in LLM(model_path, overlap_schedule=False, **kw).generate(PROMPTS, PARAMS)]
    llm = LLM(model_path, overlap_schedule=True, **kw)
    events = _record_reads(llm)
    batches = _record_batches(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert (_mixed_steps(batches) > 0) == mixed
    assert sum(1 for phase, _ in batches[1:] if phase == "prefill") >= 2  # prompts arrived while others decoded
    launches = [(i, n, uids) for i, (kind, n, uids) in enumerate(events) if kind == "launch"]
    for (i_prev, n_prev, uids_prev), (i, _, uids) in zip(launches, launches[1:]):
        if uids_prev & uids:
            assert ("read", n_prev, uids_prev) not in events[i_prev:i], f"step {n_prev + 1} waited for step {n_prev}"
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.num_total_pages
    cache.check()


# pools of 60 pages; mixed and separate steps; 1-7 aborts; seeds 3 and 14 retract
@pytest.mark.parametrize("seed,retracts", [(3, True), (7, False), (14, True), (15, False)])
def test_overlapped_steps_with_arrivals_aborts_and_retraction(model_path, seed, retracts):
    """Random arrivals and aborts over an overlapped scheduler (prefill and mixed steps launched behind the step in
    flight), some pools tight enough to retract: every request that is not aborted gets the tokens it gets alone,
    and every page comes back."""
    import random

    from freetoken_core.config import EngineConfig
    from freetoken_core.scheduler.scheduler import Scheduler

    rng = random.Random(seed)
    sched = Scheduler(EngineConfig(
        model_path=str(model_path), dtype="float32", page_size=rng.choice([1, 4]), num_pages=rng.choice([60, 400]),
        max_running_req=rng.choice([2, 4]), max_extend_tokens=rng.choice([8, 64]), mixed_prefill=rng.random() < 0.7,
        overlap_schedule=True))
    plan = [(rng.randrange(40), [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 20),
             rng.randrange(30) if rng.random() < 0.25 else None) for _ in range(12)]  # arrival, prompt, max, abort
    retracted = _record_retractions(sched)
    uids: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    finished: set[int] = set()
    aborted: set[int] = set()
    step = 0
    while step <= 40 or sched.has_work():
        for i, (arrival, prompt, max_tokens, abort_after) in enumerate(plan):
            if arrival == step:
                uids[i] = sched.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            if abort_after is not None and step == arrival + abort_after and uids[i] not in finished:
                assert sched.abort(uids[i])
                aborted.add(i)
        for m in sched.step():
            tokens.setdefault(m.uid, []).extend(m.next_tokens)
            if m.finished:
                finished.add(m.uid)
        step += 1
        assert step < 3000
    assert finished == set(uids.values()) and aborted
    assert bool(retracted) == retracts
    solo = LLM(model_path, dtype="float32", page_size=4, num_pages=400)
    for i, (_, prompt, max_tokens, _) in enumerate(plan):
        if i not in aborted:
            alone = solo.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids
            assert tokens[uids[i]] == alone, f"request {i}"
    assert sched.cache.num_free_pages == sched.cache.num_total_pages
    sched.cache.check()
