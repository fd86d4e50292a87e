"""The OpenAI frontend as a process: `serve`'s options for it, the API key, several workers on one port, and that it
dies with its parent. Each test starts a frontend of its own in front of the session's server."""

from __future__ import annotations

import re

import pytest

from serving_helpers import wait_for
from tests.serving.test_openai_api import CHAT, MODEL, PROMPT, _frontend, _get

pytestmark = pytest.mark.serving

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def test_api_key(triton_server, tmp_path):
    from freetoken_core.serving.openai.process import stop_frontend

    proc, port = _frontend(triton_server, tmp_path, api_key="s3cret")
    try:
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3).choices[0].message.content
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200  # probes need no key
    finally:
        stop_frontend(proc)


def test_the_frontend_dies_with_its_parent(triton_server, tmp_path):
    """A parent killed with SIGKILL (no cleanup runs) takes the frontend with it (lifetime.py)."""
    import os
    import signal
    import subprocess
    import sys

    from freetoken_core.serving.launch.server import free_ports

    port = free_ports(1)[0]
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from freetoken_core.serving.openai.process import FrontendOptions, start_frontend\n"
        f"p = start_frontend({triton_server.grpc_url!r}, Path({str(triton_server.repo_dir)!r}), "
        f"FrontendOptions(port={port}, host='127.0.0.1'))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def gone() -> bool:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return True
            return False

        assert wait_for(gone, 15)
    finally:
        parent.kill()


def test_serve_options_of_the_frontend(monkeypatch):
    import argparse

    from freetoken_core.serving.launch.serve import add_serve_args
    from freetoken_core.serving.openai.process import (API_KEY_ENV, DEFAULT_OPENAI_PORT, default_workers,
                                                       frontend_options)

    p = argparse.ArgumentParser()
    add_serve_args(p)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    opts = frontend_options(p.parse_args([]))
    assert opts is not None and opts.port == DEFAULT_OPENAI_PORT and opts.api_key is None
    assert frontend_options(p.parse_args(["--no-openai"])) is None
    monkeypatch.setenv(API_KEY_ENV, "k")
    opts = frontend_options(p.parse_args(["--openai-port", "9100", "--served-model-name", "m"]))
    assert (opts.port, opts.served_model_name, opts.api_key) == (9100, "m", "k")
    assert opts.workers == default_workers() and frontend_options(p.parse_args(["--openai-workers", "3"])).workers == 3
    assert [default_workers(cpus) for cpus in (1, 2, 3, 8, 16, 64)] == [1, 1, 1, 4, 8, 8]
    with pytest.raises(ValueError, match="--openai-workers must be from 1 to 64, got 0"):
        frontend_options(p.parse_args(["--openai-workers", "0"]))


def test_several_frontend_workers_answer_on_one_port(triton_server, tmp_path):
    """--openai-workers 2: uvicorn's workers (each its own app and gRPC channel) all answer on the one port, and they
    go when the frontend stops."""
    from freetoken_core.serving.openai.process import stop_frontend

    proc, port = _frontend(triton_server, tmp_path, workers=2)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        texts = {c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
                 for _ in range(4)}
        assert len(texts) == 1
        log = (tmp_path / "frontend.log").read_text()
        assert len(set(re.findall(r"serving model '[^']+' \(pid (\d+)\)", log))) == 2, log
    finally:
        stop_frontend(proc)
