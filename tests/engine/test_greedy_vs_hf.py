"""Engine greedy output is token-identical to transformers (fp32, same weights), alone and batched."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [7] * 11, list(range(20, 57)), [200, 201], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13]]
MAX_NEW = 12


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


CASES = [
    dict(arch="llama", tie=False),
    dict(arch="llama", tie=True),
    dict(arch="llama", tie=False, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    dict(arch="qwen2", tie=True),
    dict(arch="qwen3", tie=False, head_dim=32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['arch']}-{'tied' if c['tie'] else 'untied'}{'-rope' if 'rope_scaling' in c else ''}")
def test_greedy_matches_transformers(tiny_model_factory, case):
    path = tiny_model_factory(**case)
    expected = [hf_greedy(path, p, MAX_NEW) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    # one at a time, big pages
    llm = LLM(path, dtype="float32", page_size=16, max_running_req=4, num_pages=64)
    alone = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert alone == expected
    # all together: chunked prefill with a tiny budget, page size 1 and 4, fewer rows than prompts
    for page_size, overlap in ((1, False), (4, True)):
        llm = LLM(path, dtype="float32", page_size=page_size, max_running_req=3, max_extend_tokens=7, num_pages=256,
                  overlap_schedule=overlap)
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == expected
        assert all(o.finish_reason == "length" for o in outs)
        assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
        llm.scheduler.cache.check()


def test_num_pages_counts_usable_pages(tiny_model_factory):
    """num_pages=64 gives 64 pages to requests (the dummy page of graph padding is extra), as the
    metrics' total-pages gauge reports them."""
    llm = LLM(tiny_model_factory(arch="llama"), dtype="float32", page_size=4, max_running_req=2, num_pages=64)
    cache = llm.scheduler.cache
    assert cache.num_total_pages == 64 == cache.num_free_pages
    assert llm.scheduler.engine.kv_cache.num_pages == 65
