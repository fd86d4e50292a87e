"""Gated-delta-net hybrids on CUDA: Triton GDN/conv kernels, decode and verify in CUDA graphs (the
states' slots and row counts in static buffers), greedy equal to transformers fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from tests.models.hybrid_checkpoints import MAX_NEW, PROMPTS, hf_greedy, make_tiny_hybrid

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_cuda_hybrid_greedy_matches_transformers(tmp_path, kind, speculative):
    path = make_tiny_hybrid(tmp_path, kind)
    expected = hf_greedy(path, kind, PROMPTS, MAX_NEW)
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, max_running_req=3, max_extend_tokens=7,
              num_pages=256, speculative=speculative, num_speculative_tokens=3)
    assert llm.scheduler.engine.graph_runner is not None
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed_prefill"])
def test_cuda_hybrid_prefill_graphs_match_transformers(tmp_path, kind, mixed):
    """Prefill steps in captured graphs: the GDN layers' varlen state step in static buffers, padding on
    the dummy state slot; chunks of 7 rows carry the states over."""
    path = make_tiny_hybrid(tmp_path, kind)
    expected = hf_greedy(path, kind, PROMPTS, MAX_NEW)
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, max_running_req=3, max_extend_tokens=7,
              num_pages=256, prefill_graph_max_tokens=16, mixed_prefill=mixed)
    runner = llm.scheduler.engine.prefill_graph_runner
    assert runner is not None and runner.graphs
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert llm.scheduler.cache.num_free_rows == 3
