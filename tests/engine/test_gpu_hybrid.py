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
