"""Presence / frequency / repetition penalties (vLLM's semantics) against a plain-torch reference: the device
tables, the sampler, and whole generations (plain, overlap-scheduled, speculative, batched with unpenalized
requests, after retraction) against transformers' logits penalized by the reference."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.core import Req
from freetoken_core.engine.penalties import PenaltyState, apply_penalties_reference
from freetoken_core.engine.sampler import Sampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 50


def _req(uid: int, prompt: list[int], output: list[int], **penalties: float) -> Req:
    return Req(uid=uid, input_ids=prompt, sampling=SamplingParams(**penalties), output_ids=list(output))


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference_over_steps(device):
    """Rows with each penalty alone, all three, none; logits of both signs; the counts follow sampled tokens."""
    torch.manual_seed(0)
    reqs = [
        _req(0, [1, 2, 3, 3], [4, 4, 5], repetition_penalty=1.7),
        _req(1, [6, 7], [7, 8, 8, 8], frequency_penalty=0.6),
        _req(2, [9], [10, 10, 11], presence_penalty=-1.2),
        _req(3, [1, 2], [2, 3], presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=0.8),
        _req(4, [5, 6], [7], temperature=0.0),  # no penalties: left alone
    ]
    state = PenaltyState(VOCAB, torch.device(device))
    for step in range(4):
        logits = torch.randn(len(reqs), VOCAB, device=device) * 3
        batch = state.prepare(reqs)
        got = batch.apply(logits)
        p = [r.sampling for r in reqs]
        want = apply_penalties_reference(logits.cpu(), [r.input_ids for r in reqs], [r.output_ids for r in reqs],
                                         [x.presence_penalty for x in p], [x.frequency_penalty for x in p],
                                         [x.repetition_penalty for x in p])
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[4], logits[4])
        assert not torch.equal(got.cpu(), logits.cpu())
        tokens = torch.randint(0, VOCAB, (len(reqs),), device=device)
        tokens[1] = 8  # a repeated token's count grows
        batch.record(tokens)
        for r, t in zip(reqs, tokens.tolist()):
            r.output_ids.append(t)
    assert set(state.slot_of) == {0, 1, 2, 3}


def test_slots_grow_and_refill_after_release():
    state = PenaltyState(VOCAB, torch.device("cpu"))
    reqs = [_req(i, [i % VOCAB], [i % 7] * 3, frequency_penalty=1.0) for i in range(20)]  # past the first capacity
    batch = state.prepare(reqs)
    logits = torch.zeros(20, VOCAB)
    out = batch.apply(logits)
    for i in range(20):
        assert out[i, i % 7].item() == -3.0
    state.release(3)
    reqs[3].output_ids.append(3 % 7)  # e.g. retracted, then resumed with one more committed token
    out = state.prepare(reqs[3:4]).apply(torch.zeros(1, VOCAB))
    assert out[0, 3].item() == -4.0
    assert len(state.slot_of) == 20


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_applies_penalties_before_temperature_and_keeps_raw_logprobs(device):
    """Greedy rows pick the penalized argmax; sampled rows draw from the penalized distribution; logprobs are
    the model's (raw) ones; the sampled token is counted."""
    dev = torch.device(device)
    logits = torch.full((2, VOCAB), -5.0, device=dev)
    logits[:, 1] = 4.0  # in the prompt: divided by 100 -> 0.04
    logits[:, 2] = 1.0
    reqs = [_req(0, [1], [], repetition_penalty=100.0, logprobs=0),
            _req(1, [1], [], repetition_penalty=100.0, temperature=0.01, top_k=1)]
    state = PenaltyState(VOCAB, dev)
    sampler = Sampler(dev)
    out = sampler.sample(logits, [r.sampling for r in reqs], [None, None], state.prepare(reqs)).to_host_async().wait()
    assert out.tokens == [2, 2]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0].cpu(), -1)[2].item(), abs=1e-5)
    assert state.output_counts[state.slot_of[0], 2].item() == 1
    # the min_tokens ban comes with the penalties: a banned token stays banned under any penalty
    out = sampler.sample(logits.clone(), [r.sampling for r in reqs], [None, None], state.prepare(reqs),
                         banned={0: [2], 1: [2]}).to_host_async().wait()
    assert 2 not in out.tokens


def test_penalty_limits_are_named():
    for field, bad, limit in (("presence_penalty", 2.5, "[-2.0, 2.0]"), ("frequency_penalty", -3, "[-2.0, 2.0]"),
                              ("repetition_penalty", 0.0, "(0, ")):
        with pytest.raises(ValueError, match=rf"{field} must be in {limit}".replace("[", r"\[").replace("(", r"\(")):
            SamplingParams(**{field: bad}).validate()
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number"):
        SamplingParams(repetition_penalty=float("nan")).validate()
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e6).validate()


def _hf_penalized_greedy(model_dir, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """transformers' logits, penalized by the reference, argmax: the generation the engine must produce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[:, -1]
            logits = apply_penalties_reference(logits, [prompt], [out], [p.presence_penalty],
                                               [p.frequency_penalty], [p.repetition_penalty])
            out.append(int(logits[0].argmax()))
    return out


PROMPTS = [[5, 17, 42, 99, 3, 17, 17], [7] * 9, list(range(20, 45))]
PENALIZED = [SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=1.5),
             SamplingParams(max_tokens=14, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
             SamplingParams(max_tokens=14, ignore_eos=True)]  # unpenalized, batched with the others


@pytest.mark.parametrize("engine_kwargs", [
    dict(page_size=4, num_pages=256),
    dict(page_size=1, num_pages=256, overlap_schedule=True, max_extend_tokens=8),
    dict(page_size=4, num_pages=256, speculative="ngram", num_speculative_tokens=3),
    dict(page_size=1, num_pages=40, max_running_req=3),  # few pages: requests are retracted and resume
], ids=["plain", "overlap", "ngram", "retract"])
def test_generation_matches_penalized_reference(tiny_model_factory, engine_kwargs, caplog):
    path = tiny_model_factory(arch="llama")
    expected = [_hf_penalized_greedy(path, pr, 14, p) for pr, p in zip(PROMPTS, PENALIZED)]
    plain = [_hf_penalized_greedy(path, pr, 14, SamplingParams()) for pr in PROMPTS[:2]]
    assert expected[:2] != plain  # the penalties change these generations
    llm = LLM(path, dtype="float32", **engine_kwargs)
    with caplog.at_level("INFO", logger="freetoken_core"):
        outs = llm.generate(PROMPTS, PENALIZED)
    assert ("retracting request" in caplog.text) == (engine_kwargs["num_pages"] == 40)
    assert [o.token_ids for o in outs] == expected
    if "speculative" in engine_kwargs:  # penalized requests run without drafts; the other one drafts
        assert [o.spec_proposed > 0 for o in outs] == [False, False, True]
    assert llm.scheduler.engine.penalties.slot_of == {}  # every slot back
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
