"""Tiny random checkpoints of the MoE and hybrid families (Qwen3-MoE; Qwen3.5-MoE in its
vision-language checkpoint form), with SmolLM2's tokenizer and vocabulary, through the served
ensemble: the streamed text and tokens equal the offline engine's, byte for byte."""

from __future__ import annotations

import pytest

from freetoken_core import SamplingParams
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.models.moe_checkpoints import make_tiny_moe
from tests.serving.conftest import SERVER_PARAMS
from tests.serving.serving_helpers import serve_checkpoint
from tests.serving.test_triton_server import Stream, ensemble_inputs

pytest.importorskip("tritonclient.grpc")

PROMPTS = ["Tell me about mixtures of experts.", "a b a b a b"]
def _moe(root):
    return make_tiny_moe(root, "per_expert", vocab_size=49152, num_hidden_layers=2, norm_topk_prob=True,
                         bos_token_id=1, eos_token_id=2)


MAKERS = {
    "qwen3_moe": _moe,
    "qwen3_5_moe": lambda root: make_tiny_hybrid(root, "qwen3_5_moe", vocab_size=49152),
    "qwen3_moe_offload": _moe,  # experts in host banks, 5 device slots of 8 per layer
}
EXTRA_PARAMS = {"qwen3_moe_offload": {"moe_strategy": "offload", "moe_cache_slots": "5"}}


@pytest.fixture(scope="module", params=list(MAKERS))
def family_model(request, smollm2_path, tmp_path_factory):
    """Vocabulary 49152 so that SmolLM2's tokenizer (and chat template) serve it."""
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    params = {**SERVER_PARAMS, **EXTRA_PARAMS.get(request.param, {})}
    handle = serve_checkpoint(path, smollm2_path, tmp_path_factory.mktemp(f"triton-{request.param}"), params)
    yield path, handle, request.param
    handle.stop()


def test_ensemble_streams_the_offline_text(family_model):
    from freetoken_core.llm import LLM

    path, server, kind = family_model
    llm = LLM(str(path), dtype="float32", device="cpu", max_running_req=16, page_size=16, num_pages=512,
              max_seq_len=1024)
    refs = [llm.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0] for p in PROMPTS]
    s = Stream(server.grpc_url)
    try:
        for i, p in enumerate(PROMPTS):
            s.client.async_stream_infer("ensemble", ensemble_inputs(p, 20, ignore_eos=True), request_id=f"r{i}",
                                        enable_empty_final_response=True)
        got = s.collect(len(PROMPTS))
    finally:
        s.close()
    for i, ref in enumerate(refs):
        g = got[f"r{i}"]
        assert g["error"] is None
        assert g["tokens"] == ref.token_ids
        assert g["text"].decode() == ref.text
    if kind == "qwen3_moe_offload":  # the expert-slot gauges on /metrics
        from tests.serving.serving_helpers import metric, scrape_metrics, wait_for

        def gauges():
            m = scrape_metrics(server.metrics_url)
            try:
                return metric(m, "freetoken_moe_slot_hit_ratio"), metric(m, "freetoken_moe_layer_misses", layer="1")
            except KeyError:  # not pushed yet (the gauges go out on the metrics timer)
                return 0.0, 0.0

        # the gauges are a snapshot the engine pushes on its stats timer: one taken after the prefill alone
        # has misses and no hits yet, so wait for a push that has seen decode steps too
        wait_for(lambda: gauges()[0] > 0 and gauges()[1] > 0, timeout=10)
        hit, misses = gauges()
        assert 0.0 < hit < 1.0 and misses > 0
