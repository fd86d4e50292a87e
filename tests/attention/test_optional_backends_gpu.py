"""The optional backends on a GPU, each skipped without CUDA or without its package: greedy tokens of
an fp16 engine with attention_backend="flashinfer" or "fa" (eager; CUDA-graph decode where the backend
captures graphs, flashinfer does; n-gram speculation, whose rows_per_req > 1 verify steps run
through the backend's prefill/varlen path) equal the triton backend's.

fp16 kernels of two libraries may round differently, so a sequence is compared up to the first
token where the triton run's own top-2 log-probability gap is under GAP (a near-tie either side may
take); every token before that must be equal. A wrong mask, page walk, or graph buffer gives a
different token at a wide gap at once.

Neither package is on CI or on the GPU image; to run this there, carry the wheels and their
dependencies (docs/engine.md, "On CUDA", has the commands).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from freetoken_core import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PACKAGE = {"flashinfer": "flashinfer", "fa": "flash_attn"}

GAP = 0.02
PROMPTS = [[5, 17, 42, 99, 3], [7] * 40, list(range(20, 300)), [200, 201], list(range(900, 1000)) * 2]
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.conftest import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("fi"), arch="llama", hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
        max_position_embeddings=2048,
    )


def _run(path, backend: str, page_size: int, **kw):
    llm = LLM(path, dtype="float16", device="cuda", page_size=page_size, max_running_req=8, max_seq_len=1024,
              memory_fraction=0.2, attention_backend=backend, **kw)
    engine = llm.scheduler.engine
    assert engine.attn_backend.info.name == backend
    graphs = engine.graph_runner is not None
    outs = llm.generate(PROMPTS, PARAMS)
    del llm
    torch.cuda.empty_cache()
    return outs, graphs


def _agree_until_near_tie(got, ref) -> int:
    """Tokens compared (all equal) before the reference's first near-tie; fails on a difference."""
    compared = 0
    for g, r in zip(got, ref):
        for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids)):
            top = sorted(r.top_logprobs[i].values(), reverse=True)
            if len(top) > 1 and top[0] - top[1] < GAP:
                break
            assert a == b, f"token {i}: {a} vs triton's {b} (triton's top-2 gap {top[0] - top[1]:.3f})"
            compared += 1
    return compared


@pytest.mark.parametrize("backend,page_size", [("flashinfer", 1), ("flashinfer", 16), ("fa", 16), ("fa", 256)])
def test_backend_greedy_equals_triton(llama_dir, backend, page_size):
    if importlib.util.find_spec(PACKAGE[backend]) is None:
        pytest.skip(f"needs {PACKAGE[backend]}")
    if backend == "fa" and page_size % 256:
        from freetoken_core.attention.fa import import_flash_attn

        if import_flash_attn().version == 2:
            pytest.skip("flash-attn 2.x pages hold a multiple of 256 tokens")
    ref, _ = _run(llama_dir, "triton", page_size, cuda_graph=False)
    eager, graphs = _run(llama_dir, backend, page_size, cuda_graph=False)
    assert not graphs
    graph, graphs = _run(llama_dir, backend, page_size, cuda_graph=True)
    if backend == "flashinfer":
        assert graphs, "flashinfer decode graphs were not captured"
    spec, _ = _run(llama_dir, backend, page_size, cuda_graph=True, speculative="ngram", num_speculative_tokens=3)
    total = sum(len(r.token_ids) for r in ref)
    for name, outs in [("eager", eager), ("graph", graph), ("ngram", spec)]:
        compared = _agree_until_near_tie(outs, ref)
        assert compared >= total // 2, f"{backend} {name}: only {compared} of {total} tokens before a near-tie"
