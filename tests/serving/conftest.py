"""One real tritonserver for the whole serving session: the model repository + SmolLM2 on CPU.

Started on free ports by the same launcher as `freetoken-core serve`, stopped at session end.
Its settings are small on purpose (fp32, 16 running requests, page size 16) and add two limits
the bad-input tests hit: max_seq_len 1024 and max_tokens_limit 512.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

SERVER_PARAMS = {
    "dtype": "float32",
    "device": "cpu",
    "max_running_req": "16",
    "page_size": "16",
    "num_pages": "512",
    "max_seq_len": "1024",
    "max_tokens_limit": "512",
    "cancel_check_interval_ms": "20",
    "metrics_interval_ms": "50",
}


@pytest.fixture(scope="session")
def triton_server(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("tritonclient.grpc")
    from freetoken_core.serving.launcher import start_server
    from freetoken_core.serving.tritonserver import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")
    workdir = tmp_path_factory.mktemp("triton")
    log_path = workdir / "tritonserver.log"
    handle = start_server({**SERVER_PARAMS, "model_path": smollm2_path}, repo_dir=workdir / "repo",
                          log_path=log_path, ready_timeout=300)
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


def scrape_metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels kept verbatim)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of all series of `name` whose labels include the given ones."""
    total, found = 0.0, False
    for key, v in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{val}"' in key for k, val in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not found")
    return total


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    return last


__all__ = ["scrape_metrics", "metric", "wait_for", "Path"]
