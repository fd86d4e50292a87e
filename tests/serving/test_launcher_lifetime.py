"""Defect 6 of issue 14: tritonserver's life is tied to the `freetoken-core serve` launcher's. A
launcher killed with SIGKILL (OOM killer, CI timeout) must not leave the server running in its own
session, holding its ports (and, on a GPU, its memory)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving_helpers import wait_for

pytestmark = pytest.mark.serving

psutil = pytest.importorskip("psutil")


def _port_free(port: int) -> bool:
    """Nothing listens there and a new server could bind it (SO_REUSEADDR, as tritonserver binds:
    the test's own closed connections may linger in TIME_WAIT, which is no one holding the port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def test_sigkilled_launcher_takes_tritonserver_down(smollm2_path: str, tmp_path: Path):
    from freetoken_core.serving.launcher import _http_ok, free_ports
    from freetoken_core.serving.tritonserver import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--model-path", smollm2_path, "--dtype", "float32",
           "--device", "cpu", "--max-running-req", "2", "--param", "num_pages=64", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--repo-dir", str(tmp_path / "repo")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server_procs: list = []
    try:
        assert wait_for(lambda: _http_ok(f"http://127.0.0.1:{http}/v2/models/ensemble/ready") or launcher.poll() is not None,
                        240, 0.5), (tmp_path / "launcher.log").read_text()[-3000:]
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
        server_procs = psutil.Process(launcher.pid).children(recursive=True)  # tritonserver and its stubs
        names = [p.name() for p in server_procs]
        assert "tritonserver" in names and sum("stub" in n for n in names) == 3, names  # tokenizer, freetoken, detokenizer
        assert not _port_free(http)

        t0 = time.monotonic()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        _, alive = psutil.wait_procs(server_procs, timeout=20)
        took = time.monotonic() - t0
        assert not alive, f"still running {took:.1f} s after the launcher died: {[p.name() for p in alive]}"
        assert wait_for(lambda: _port_free(http) and _port_free(grpc) and _port_free(metrics), 5), "ports still held"
        print(f"tritonserver and {len(server_procs) - 1} stubs exited {took:.1f} s after the launcher's SIGKILL")
    finally:
        for p in [launcher, *server_procs]:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 (already gone)
                pass
        log.close()
