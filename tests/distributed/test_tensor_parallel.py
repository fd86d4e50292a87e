"""Tensor parallelism over two CPU processes (gloo): greedy tokens equal transformers fp32 for tiny
random Llama, Qwen3 and Qwen3-MoE checkpoints whose heads split over 2 ranks, with speculation on and
off; models that do not split are refused clearly; a killed worker fails the next step with a clear
error instead of a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.distributed.group import TensorParallelError
from tests.models.moe_checkpoints import PROMPTS, hf_greedy, make_tiny_moe

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def tp_llm(path, **kw):
    return LLM(path, dtype="float32", page_size=4, num_pages=200, max_running_req=3, tensor_parallel_size=2, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("tp")
    paths = {
        "llama": make_tiny_model(root, arch="llama"),  # 4 heads / 2 KV heads: one KV head per rank
        "qwen3-kv1": make_tiny_model(root, arch="qwen3", num_key_value_heads=1, seed=1),  # replicated KV head
        "qwen3moe": make_tiny_moe(root, "per_expert", norm_topk_prob=True),
    }
    return {name: (path, hf_greedy(path, PROMPTS, PARAMS.max_tokens)) for name, path in paths.items()}


@pytest.mark.parametrize("name", ["llama", "qwen3-kv1", "qwen3moe"])
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_tp2_greedy_matches_transformers(checkpoints, name, speculative):
    path, expected = checkpoints[name]
    llm = tp_llm(path, speculative=speculative, num_speculative_tokens=3)
    try:
        assert llm.scheduler.engine.tp is not None
        layer = llm.scheduler.engine.model.model.layers[0]
        assert layer.self_attn.num_heads == 2  # this rank's share of the 4 heads
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == expected
        assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages
    finally:
        llm.scheduler.engine.close()


def test_a_closed_tp_llm_lets_another_start_in_this_process(checkpoints):
    path, expected = checkpoints["llama"]
    for _ in range(2):  # the second needs the first's process group gone
        with tp_llm(path) as llm:
            workers = llm.scheduler.engine.tp.procs
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
            with pytest.raises(RuntimeError, match="still open in this process: close it first"):
                tp_llm(path)
        assert not torch.distributed.is_initialized()
        assert not any(p.is_alive() for p in workers)


def test_heads_that_do_not_split_are_refused(tmp_path):
    from tests.conftest import make_tiny_model

    path = make_tiny_model(tmp_path, arch="llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads=3 does not split over tensor_parallel_size=2"):
        tp_llm(path)


def test_a_killed_worker_is_a_clear_error_not_a_hang(checkpoints):
    path, _ = checkpoints["llama"]
    llm = tp_llm(path)
    engine = llm.scheduler.engine
    try:
        worker = engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code -9\)"):
            llm.generate(PROMPTS[:1], PARAMS)
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()


def test_backend_choice_is_checked():
    from freetoken_core.config import EngineConfig
    from freetoken_core.distributed.group import backend_for

    with pytest.raises(ValueError, match="tensor_parallel_backend must be auto, nccl or gloo"):
        EngineConfig(model_path="x", tensor_parallel_backend="mpi").validate()
    assert backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="'nccl' needs CUDA"):
        backend_for(torch.device("cpu"), "nccl")
    assert backend_for(torch.device("cuda"), "auto") == "nccl"
    assert backend_for(torch.device("cuda"), "gloo") == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "qwen3moe"])
def test_tp2_on_one_gpu_over_gloo_matches_transformers(checkpoints, name):
    """The sharded CUDA path (sharded GEMVs and MoE kernels, vocab-parallel LM head) on a one-GPU
    machine: both ranks on the GPU(s) there are, collectives through host memory (gloo)."""
    path, expected = checkpoints[name]
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, num_pages=200, max_running_req=3,
              tensor_parallel_size=2, tensor_parallel_backend="gloo", memory_fraction=0.1)
    try:
        assert llm.scheduler.engine.tp.backend == "gloo"
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    finally:
        llm.scheduler.engine.close()
