"""One real tritonserver for the whole serving session: the model repository + SmolLM2 on CPU.

Started on free ports by the same launcher as `freetoken-core serve`, stopped at session end.
Its settings are small on purpose (fp32, 16 running requests, page size 16) and add the limits
the bad-input tests hit: max_seq_len 1024, max_tokens_limit 512, max_nonstream_tokens 64.
"""

from __future__ import annotations

import os
from pathlib import Path  # noqa: F401

import pytest

SERVER_PARAMS = {
    "dtype": "float32",
    "device": "cpu",
    "max_running_req": "16",
    "page_size": "16",
    "num_pages": "512",
    "max_seq_len": "1024",
    "max_tokens_limit": "512",
    "max_nonstream_tokens": "64",
    "cancel_check_interval_ms": "20",
    "metrics_interval_ms": "50",
}


@pytest.fixture(scope="session")
def triton_server(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("tritonclient.grpc")
    from tests.serving.serving_helpers import start_test_server

    handle = start_test_server({**SERVER_PARAMS, "model_path": smollm2_path}, tmp_path_factory.mktemp("triton"))
    yield handle
    handle.stop()
    if os.environ.get("FREETOKEN_KEEP_SERVER_LOG"):
        print(handle.log_tail(20000))


@pytest.fixture(scope="session")
def offline_llm(smollm2_path: str):
    """The offline engine with the server's settings: the reference every served text must equal."""
    from freetoken_core.llm import LLM

    return LLM(smollm2_path, dtype="float32", device="cpu", max_running_req=16, page_size=16, num_pages=512,
               max_seq_len=1024)
