"""Gated-delta-net hybrids (Qwen3-Next, Qwen3.5-MoE in its vision-language checkpoint form) against
transformers fp32 on the same tiny random checkpoints: greedy tokens through the engine (prompts
over two prefill chunks, fewer rows than prompts, page sizes 1 and 4, speculation on and off), slot
accounting, and `hide_target_state`."""

from __future__ import annotations

import pytest
import torch
from tests.models.hybrid_checkpoints import MAX_NEW, PROMPTS, hf_greedy, make_tiny_hybrid

from freetoken_core import LLM, SamplingParams
from freetoken_core.core import Context, set_context
from freetoken_core.kvcache.linear_state import LinearStatePool, LinearStateStep

@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    path = make_tiny_hybrid(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, path, hf_greedy(path, request.param, PROMPTS, MAX_NEW)


def _all_free(llm: LLM) -> None:
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.num_total_pages
    assert cache.num_free_rows == llm.scheduler.engine.resolved.max_running_req  # every state slot back


def test_greedy_alone_matches_transformers(hybrid):
    kind, path, expected = hybrid
    llm = LLM(path, dtype="float32", page_size=16, max_running_req=4, num_pages=64)
    assert llm.scheduler.engine.linear_pool is not None
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    _all_free(llm)


@pytest.mark.parametrize("page_size,overlap", [(1, False), (4, True)])
def test_greedy_batched_chunked_matches_transformers(hybrid, page_size, overlap):
    """Prompts of up to 37 tokens under a 7-token prefill budget: states carried over several chunks."""
    kind, path, expected = hybrid
    llm = LLM(path, dtype="float32", page_size=page_size, max_running_req=3, max_extend_tokens=7, num_pages=256,
              overlap_schedule=overlap)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    _all_free(llm)
    llm.scheduler.cache.check()


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_speculation_is_token_identical(hybrid, pipelined):
    """pipelined: overlap_schedule forced on (CPU), so greedy verify steps chain device-resident
    (spec/pipeline.py) and the accepted rows' state replay runs from the device's counts."""
    kind, path, expected = hybrid
    llm = LLM(path, dtype="float32", page_size=4, max_running_req=3, num_pages=400, speculative="ngram",
              num_speculative_tokens=3, overlap_schedule=pipelined or None)
    assert (llm.scheduler.spec.pipeline is not None) == pipelined
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.spec_proposed for o in outs) > 0
    _all_free(llm)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("stop_inside", [False, True])
def test_every_accepted_count_leaves_the_accepted_state(hybrid, stop_inside, pipelined, monkeypatch):
    """An oracle drafter proposes the true greedy continuation with its first wrong token at a
    position that cycles through 0..k (and sometimes none wrong): verify steps accept every count
    1..k+1, and the GDN states must then hold exactly the accepted prefix, or the next tokens differ.
    With stop_inside, a stop token lands inside an accepted run."""
    kind, path, _ = hybrid
    n_new, k = 24, 3
    plain = LLM(path, dtype="float32", page_size=4, max_running_req=3, num_pages=400)
    want = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=n_new, ignore_eos=True))]
    params = SamplingParams(max_tokens=n_new, ignore_eos=True)
    if stop_inside:  # stop at the 14th token of the second prompt: mid-run for the oracle's long accepts
        params = SamplingParams(max_tokens=n_new, ignore_eos=True, stop_token_ids=[want[1][13]])
        want = [w[: w.index(want[1][13]) + 1] if want[1][13] in w else w for w in want]
    llm = LLM(path, dtype="float32", page_size=4, max_running_req=3, num_pages=400, speculative="ngram",
              num_speculative_tokens=k, overlap_schedule=pipelined or None)
    calls = [0]

    def continuation(i: int, done: int) -> list[int]:
        cont = list(want[i][done: done + k])
        wrong_at = calls[0] % (k + 2)  # k + 1: all right
        calls[0] += 1
        if wrong_at < len(cont):
            cont[wrong_at] = (cont[wrong_at] + 1) % 256
        return cont

    def oracle(decoders):  # the synchronous path's drafter (host)
        drafts = {}
        for req in decoders:
            cont = continuation(PROMPTS.index(list(req.input_ids)), len(req.output_ids))
            if cont:
                drafts[req.uid] = cont
        return drafts

    def oracle_device(hist, lens, max_drafts, k_, min_ngram, max_ngram):  # the pipeline's (device rows)
        drafts = torch.zeros((hist.shape[0], k_), dtype=torch.int64)
        num = torch.zeros(hist.shape[0], dtype=torch.int64)
        for b in range(hist.shape[0]):
            tokens = hist[b, : int(lens[b])].tolist()
            match = [i for i, p in enumerate(PROMPTS) if tokens[: len(p)] == p]
            if not match:  # an idle padding slot
                continue
            cont = continuation(match[0], len(tokens) - len(PROMPTS[match[0]]))[: max(0, int(max_drafts[b]))]
            drafts[b, : len(cont)] = torch.tensor(cont, dtype=torch.int64)
            num[b] = len(cont)
        return drafts, num

    llm.scheduler.spec.propose = oracle
    if pipelined:
        import freetoken_core.spec.pipeline as pipeline_module

        monkeypatch.setattr(pipeline_module, "propose_device", oracle_device)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec_accepted for o in outs) >= 8  # long accepted runs really happened
    _all_free(llm)


def test_slots_come_back_after_abort_and_stop(hybrid):
    kind, path, expected = hybrid
    llm = LLM(path, dtype="float32", page_size=4, max_running_req=2, num_pages=128)
    sched = llm.scheduler
    a = sched.add_request(PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add_request(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))  # waits for a row (and slot)
    for _ in range(4):
        sched.step()
    sched.abort(a.uid if hasattr(a, "uid") else a)
    while sched.has_work():
        sched.step()
    _all_free(llm)
    # a fresh request in a reused slot starts from zeros: same tokens as alone
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.token_ids == expected[0]


def test_hide_target_state_uses_the_drafts_pool_and_refuses_without_one(hybrid):
    kind, path, _ = hybrid
    llm = LLM(path, dtype="float32", page_size=4, max_running_req=2, num_pages=64)
    engine = llm.scheduler.engine
    llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, ignore_eos=True))  # the target's slots hold states
    pool = engine.linear_pool
    before = [t.clone() for t in pool.conv + pool.recurrent]
    req = engine.cache  # a batch of one prefill row in the first request row
    from freetoken_core.config import SamplingParams as SP
    from freetoken_core.core import Req

    r = Req(uid=99, input_ids=[5, 6, 7], sampling=SP())
    req.assign_row(r)
    req.allocate(r, 3)
    batch = engine.prepare_batch("prefill", [r], [3])
    with pytest.raises(RuntimeError, match="hide_target_state"):
        engine.forward_batch(batch, hide_target_state=True)
    draft_pool = LinearStatePool(pool.specs, pool.num_slots, pool.conv[0].dtype, pool.recurrent[0].dtype, pool.device)
    target_step = engine.linear_state_step(batch)
    draft_step = LinearStateStep(draft_pool, target_step.slot_ids, varlen=True, cu_seqlens=target_step.cu_seqlens,
                                 initial_zero=target_step.initial_zero, is_target=False)
    engine.forward_batch(batch, hide_target_state=True, linear_state=draft_step)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.conv + pool.recurrent))  # byte-identical
    assert any(t.abs().sum() > 0 for t in draft_pool.recurrent)  # the draft's own pool took the writes
    req.free(r)
    set_context(None)
    assert isinstance(engine.ctx, Context)


def test_bf16_linear_state_option(hybrid):
    """linear_state_dtype=bfloat16 halves the pool; a one-chunk prefill computes in fp32 and only
    stores the state rounded, so the first token is the fp32 one; later ones may drift."""
    kind, path, expected = hybrid
    llm = LLM(path, dtype="float32", page_size=16, max_running_req=4, num_pages=64, linear_state_dtype="bfloat16")
    pool = llm.scheduler.engine.linear_pool
    assert all(t.dtype == torch.bfloat16 for t in pool.recurrent)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids[0] for o in outs] == [e[0] for e in expected]
    assert all(len(o.token_ids) == MAX_NEW for o in outs)
    _all_free(llm)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_greedy_with_the_shared_expert_stacked_matches_transformers(kind, tmp_path):
    """FREETOKEN_FUSED_SHARED_EXPERT's layer form on a real checkpoint whose shared expert has the routed
    experts' size (as Qwen3.6's and Qwen3-Next's do): stacked after loading (the engine does it on CUDA;
    here the references run it), the same greedy tokens as transformers."""
    path = make_tiny_hybrid(tmp_path, kind, shared_expert_intermediate_size=32)
    expected = hf_greedy(path, kind, PROMPTS, MAX_NEW)
    llm = LLM(path, dtype="float32", page_size=16, max_running_req=4, num_pages=64)
    blocks = [m for m in llm.scheduler.engine.model.modules() if hasattr(m, "fuse_shared_expert")]
    assert blocks and all(b.fuse_shared_expert() for b in blocks)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == expected
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected  # batched, prefill chunks
