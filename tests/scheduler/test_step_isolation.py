"""A request whose sampling settings cannot run (one that bypassed SamplingParams.validate) fails alone: its
step-mates finish with exactly their solo greedy tokens, and its pages come back (issue 52)."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import SamplingParams
from freetoken_core.engine.sampler import Sampler
from tests.scheduler.test_scheduler import PROMPTS, drain, make_sched

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("isolation"), arch="llama")


@pytest.fixture(scope="module")
def solo(model_path):
    """Each prompt's greedy tokens, run alone."""
    out = []
    for prompt in PROMPTS[:3]:
        sched = make_sched(model_path)
        uid = sched.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        out.append([t for m in drain(sched)[uid] for t in m.next_tokens])
    return out


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.next_tokens]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("steps_before", [0, 2])  # broken before its prefill step, or in a decode step
def test_unbuildable_sampling_fails_only_its_request(model_path, solo, overlap, steps_before):
    sched = make_sched(model_path, overlap_schedule=overlap)
    total = sched.cache.num_total_pages
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True) for _ in range(3)]
    uids = [sched.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    out: dict[int, list] = {}
    for _ in range(steps_before):
        for m in sched.step():
            out.setdefault(m.uid, []).append(m)
    # what the probe sent past validation: an int64 overflow in the step's top_k tensor
    params[1].top_k, params[1].temperature = 10**23, 1.0
    for uid, msgs in drain(sched).items():
        out.setdefault(uid, []).extend(msgs)
    bad = out[uids[1]]
    assert bad[-1].finished and bad[-1].finish_reason == "error" and "top_k" in bad[-1].error, bad[-1]
    assert sum(m.finished for m in bad) == 1
    for i in (0, 2):
        assert _tokens(out[uids[i]]) == solo[i] and out[uids[i]][-1].error is None
    assert sched.cache.num_free_pages == total and not sched.running
    # the engine serves on
    uid = sched.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert _tokens(drain(sched)[uid]) == solo[0]


def test_tiny_temperature_samples_greedily(model_path, solo):
    sched = make_sched(model_path)
    uid = sched.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1e-40))
    assert _tokens(drain(sched)[uid]) == solo[0]


def test_sampler_marks_failed_rows_and_samples_the_rest():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=10**23), SamplingParams(logprobs=2),
              SamplingParams(temperature=0.5, top_p=1e-50)]  # a top_p that float32 rounds to 0 keeps the top token
    out = Sampler(torch.device("cpu")).sample(logits, params, [None] * 4)
    assert list(out.failed) == [1] and "top_k" in out.failed[1]
    best = logits.argmax(dim=-1)
    assert out.tokens[[0, 2, 3]].tolist() == best[[0, 2, 3]].tolist()
    assert out.top_n == [0, 0, 2, 0]


def test_unbuildable_sampling_in_a_verify_step_fails_only_its_request(tmp_path_factory):
    """Speculative verify samples through its own path (spec/verify.py): the same isolation holds there."""
    from freetoken_core.config import EngineConfig
    from freetoken_core.scheduler.scheduler import Scheduler
    from tests.conftest import make_tiny_model

    # the first prompt holds 200 distinct ids: its first token is found in it, so the first decode step has drafts
    # and verifies (the second request with it)
    prompts = [list(range(200)), [40, 41, 42, 40, 41, 42, 40, 41, 42, 40]]
    # test_speculative's model that copies: the n-gram drafts come, and every decode step verifies
    path = make_tiny_model(tmp_path_factory.mktemp("isolation-spec"), arch="llama", seed=3)

    def spec_sched() -> Scheduler:
        return Scheduler(EngineConfig(model_path=str(path), dtype="float32", page_size=4, num_pages=200,
                                      speculative="ngram", num_speculative_tokens=3))

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ref_sched = spec_sched()
    ref_uid = ref_sched.add_request(prompts[0], params.copy())
    ref = _tokens(drain(ref_sched)[ref_uid])
    sched = spec_sched()
    good = sched.add_request(prompts[0], params.copy())
    bad_params = params.copy(temperature=1.0, seed=1)  # sampled: verified by rejection sampling
    bad = sched.add_request(prompts[1], bad_params)
    out: dict[int, list] = {}
    for m in sched.step():  # the prefill step; the next ones verify drafts
        out.setdefault(m.uid, []).append(m)
    bad_params.top_k = 10**23
    for uid, msgs in drain(sched).items():
        out.setdefault(uid, []).extend(msgs)
    assert out[bad][-1].finish_reason == "error" and "top_k" in out[bad][-1].error
    assert _tokens(out[good]) == ref and out[good][-1].error is None and out[good][-1].spec_proposed > 0
    assert sched.cache.num_free_pages == sched.cache.num_total_pages
