"""Qwen3-MoE through the engine on CUDA (fused-MoE Triton kernels inside the decode and verify CUDA
graphs, the grouped GEMM in prefill): greedy tokens equal transformers fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from tests.models.moe_checkpoints import make_tiny_moe
from tests.models.moe_checkpoints import PROMPTS, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_cuda_moe_greedy_matches_transformers(tmp_path, speculative):
    path = make_tiny_moe(tmp_path, "per_expert", num_experts_per_tok=4, norm_topk_prob=True)
    expected = hf_greedy(path, PROMPTS, 10)
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, max_running_req=3, max_extend_tokens=16,
              num_pages=256, speculative=speculative, num_speculative_tokens=3)
    assert llm.scheduler.engine.graph_runner is not None  # decode ran in captured graphs
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_cuda_moe_prefill_graphs_match_transformers(tmp_path):
    """Prefill steps in captured graphs: the padding rows reach the routers and the fused-MoE kernels."""
    path = make_tiny_moe(tmp_path, "per_expert", num_experts_per_tok=4, norm_topk_prob=True)
    expected = hf_greedy(path, PROMPTS, 10)
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, max_running_req=3, max_extend_tokens=16,
              num_pages=256, prefill_graph_max_tokens=16)
    runner = llm.scheduler.engine.prefill_graph_runner
    assert runner is not None and runner.graphs
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected

