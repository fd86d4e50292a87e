"""A tiny random Qwen3-MoE (SmolLM2's tokenizer and vocabulary) through the served ensemble: the
streamed text and tokens equal the offline engine's, byte for byte."""

from __future__ import annotations

import shutil

import pytest

from freetoken_core import SamplingParams
from tests.models.moe_checkpoints import make_tiny_moe
from tests.serving.conftest import SERVER_PARAMS
from tests.serving.test_triton_server import Stream, ensemble_inputs

pytest.importorskip("tritonclient.grpc")

PROMPTS = ["Tell me about mixtures of experts.", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def moe_model(smollm2_path, tmp_path_factory):
    """Vocabulary 49152 so that SmolLM2's tokenizer and chat template serve it."""
    path = make_tiny_moe(tmp_path_factory.mktemp("moe"), "per_expert", vocab_size=49152, num_hidden_layers=2,
                         norm_topk_prob=True, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        src = f"{smollm2_path}/{name}"
        try:
            shutil.copy(src, path / name)
        except FileNotFoundError:
            pass
    return path


@pytest.fixture(scope="module")
def moe_server(moe_model, tmp_path_factory):
    from freetoken_core.serving.launcher import start_server

    workdir = tmp_path_factory.mktemp("triton-moe")
    handle = start_server({**SERVER_PARAMS, "model_path": str(moe_model)}, repo_dir=workdir / "repo",
                          log_path=workdir / "tritonserver.log", ready_timeout=300)
    yield handle
    handle.stop()


def test_ensemble_streams_the_offline_moe_text(moe_server, moe_model):
    from freetoken_core.llm import LLM

    llm = LLM(str(moe_model), dtype="float32", device="cpu", max_running_req=16, page_size=16, num_pages=512,
              max_seq_len=1024)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    refs = [llm.generate([p], params)[0] for p in PROMPTS]
    s = Stream(moe_server.grpc_url)
    try:
        for i, p in enumerate(PROMPTS):
            s.client.async_stream_infer("ensemble", ensemble_inputs(p, 24, ignore_eos=True), request_id=f"m{i}",
                                        enable_empty_final_response=True)
        got = s.collect(len(PROMPTS))
    finally:
        s.close()
    for i, ref in enumerate(refs):
        g = got[f"m{i}"]
        assert g["error"] is None
        assert g["tokens"] == ref.token_ids
        assert g["text"].decode() == ref.text
