"""A tiny random Qwen3.5-MoE hybrid (vision-language checkpoint form, SmolLM2's tokenizer and
vocabulary) through the served ensemble: streamed text and tokens equal the offline engine's."""

from __future__ import annotations

import shutil

import pytest

from freetoken_core import SamplingParams
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.serving.conftest import SERVER_PARAMS
from tests.serving.test_triton_server import Stream, ensemble_inputs

pytest.importorskip("tritonclient.grpc")

PROMPTS = ["Gated delta networks keep a state.", "a b a b a b"]


@pytest.fixture(scope="module")
def hybrid_model(smollm2_path, tmp_path_factory):
    path = make_tiny_hybrid(tmp_path_factory.mktemp("hybrid"), "qwen3_5_moe", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        try:
            shutil.copy(f"{smollm2_path}/{name}", path / name)
        except FileNotFoundError:
            pass
    return path


@pytest.fixture(scope="module")
def hybrid_server(hybrid_model, tmp_path_factory):
    from freetoken_core.serving.launcher import start_server

    workdir = tmp_path_factory.mktemp("triton-hybrid")
    handle = start_server({**SERVER_PARAMS, "model_path": str(hybrid_model)}, repo_dir=workdir / "repo",
                          log_path=workdir / "tritonserver.log", ready_timeout=300)
    yield handle
    handle.stop()


def test_ensemble_streams_the_offline_hybrid_text(hybrid_server, hybrid_model):
    from freetoken_core.llm import LLM

    llm = LLM(str(hybrid_model), dtype="float32", device="cpu", max_running_req=16, page_size=16, num_pages=512,
              max_seq_len=1024)
    refs = [llm.generate([p], SamplingParams(max_tokens=20, ignore_eos=True))[0] for p in PROMPTS]
    s = Stream(hybrid_server.grpc_url)
    try:
        for i, p in enumerate(PROMPTS):
            s.client.async_stream_infer("ensemble", ensemble_inputs(p, 20, ignore_eos=True), request_id=f"h{i}",
                                        enable_empty_final_response=True)
        got = s.collect(len(PROMPTS))
    finally:
        s.close()
    for i, ref in enumerate(refs):
        g = got[f"h{i}"]
        assert g["error"] is None
        assert g["tokens"] == ref.token_ids
        assert g["text"].decode() == ref.text
