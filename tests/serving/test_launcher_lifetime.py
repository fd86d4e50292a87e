"""The served processes live and die together (issue 52): a SIGKILLed launcher takes tritonserver, every
stub and the engine process with it, ends the streams in flight and leaves no files; a killed engine
process turns readiness false at once and `serve` restarts it, until its restarts are spent."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serving_helpers import metric, scrape_metrics, wait_for

pytestmark = pytest.mark.serving

psutil = pytest.importorskip("psutil")
grpcclient = pytest.importorskip("tritonclient.grpc")


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


class Launcher:
    """`freetoken-core serve` as a user starts it, in a subprocess."""

    def __init__(self, smollm2_path: str, tmp_path: Path, *extra: str) -> None:
        from freetoken_core.serving.launch.server import free_ports
        from freetoken_core.serving.launch.tritonserver import find_tritonserver

        try:
            find_tritonserver()
        except RuntimeError as e:
            pytest.skip(f"no tritonserver: {e}")
        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        cmd = [sys.executable, "-m", "freetoken_core.cli", "serve", "--model-path", smollm2_path, "--dtype", "float32",
               "--device", "cpu", "--max-running-req", "8", "--param", "num_pages=256", "--host", "127.0.0.1",
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
               "--openai-port", str(self.openai), *extra]
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.log_path = tmp_path / "launcher.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.tree: list = []

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def ready(self) -> bool:
        from freetoken_core.serving.launch.supervisor import http_status

        # the OpenAI frontend starts last: once it answers, the whole tree is up
        return (http_status(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=1.0) == 200
                and http_status(f"http://127.0.0.1:{self.openai}/health", timeout=1.0) == 200)

    def running(self) -> float:
        """freetoken_num_requests_running (0 when the unloaded model took the series with it)."""
        try:
            return metric(scrape_metrics(f"http://127.0.0.1:{self.metrics}/metrics"), "freetoken_num_requests_running")
        except KeyError:
            return 0.0

    def wait_ready(self, timeout: float = 300) -> None:
        assert wait_for(lambda: self.ready() or self.proc.poll() is not None, timeout, 0.5), self.log()
        assert self.proc.poll() is None, self.log()

    def engine_process(self):
        procs = psutil.Process(self.proc.pid).children(recursive=True)
        engines = [p for p in procs if "spawn_main" in " ".join(p.cmdline())]
        assert len(engines) == 1, [p.cmdline()[:3] for p in procs]
        return engines[0]

    def close(self) -> None:
        for p in [self.proc, *self.tree]:
            try:
                p.kill()
            except Exception:  # noqa: BLE001 (already gone)
                pass
        self._log.close()


def _open_streams(url: str, n: int, max_tokens: int) -> tuple[list, queue.Queue]:
    """n streams of the ensemble, one gRPC client each; `ended` gets each stream's index when it ends (its
    FINAL, an error, or a closed connection)."""
    from tests.serving.test_triton_server import ensemble_inputs

    ended: queue.Queue = queue.Queue()
    clients = []
    for i in range(n):
        client = grpcclient.InferenceServerClient(url)
        first = threading.Event()

        def callback(result, error, i=i, first=first):
            first.set()
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                ended.put(i)

        client.start_stream(callback=callback)
        client.async_stream_infer("ensemble", ensemble_inputs("Tell me a long story.", max_tokens, ignore_eos=True),
                                  enable_empty_final_response=True)
        clients.append((client, first))
    for _, first in clients:
        assert first.wait(120), "a stream got no first token"
    return [c for c, _ in clients], ended


def _run_files(launcher_pid: int) -> list[str]:
    from freetoken_core.serving.launch.guard import RUN_PREFIX, SHM_DIR

    import tempfile

    prefix = f"{RUN_PREFIX}{launcher_pid}-"
    return [str(e) for d in (Path(tempfile.gettempdir()), SHM_DIR) if d.is_dir() for e in d.iterdir()
            if e.name.startswith(prefix)]


def test_sigkilled_launcher_takes_the_whole_server_down(smollm2_path: str, tmp_path: Path):
    server = Launcher(smollm2_path, tmp_path)
    clients: list = []
    try:
        server.wait_ready()
        server.tree = psutil.Process(server.proc.pid).children(recursive=True)
        names = [p.name() for p in server.tree]
        assert "tritonserver" in names and sum("stub" in n for n in names) == 3, names
        server.engine_process()  # the engine process is part of the tree
        assert _run_files(server.proc.pid), "the server's run directory and shared-memory regions carry its tag"
        assert re.search(r"freetoken-admin=[0-9a-f]{8}", server.log()) is None, "the admin key is in the log"
        clients, ended = _open_streams(f"127.0.0.1:{server.grpc}", 8, 2000)

        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        _, alive = psutil.wait_procs(server.tree, timeout=30)
        took = time.monotonic() - t0
        assert not alive, f"still running {took:.1f} s after the launcher's SIGKILL: {[p.pid for p in alive]}"
        assert "Signal (11)" not in server.log() and "Signal (6)" not in server.log(), server.log()  # a crash report
        assert wait_for(lambda: ended.qsize() == 8, 30), f"only {ended.qsize()} of 8 streams ended"
        assert wait_for(lambda: not _run_files(server.proc.pid), 10), _run_files(server.proc.pid)
        assert wait_for(lambda: all(map(_port_free, (server.http, server.grpc, server.metrics))), 5), "ports held"
        print(f"the server's {len(server.tree)} processes exited {took:.1f} s after the launcher's SIGKILL")
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_dead_engine_is_restarted_until_its_restarts_are_spent(smollm2_path: str, tmp_path: Path):
    from tests.serving.test_triton_server import _post

    server = Launcher(smollm2_path, tmp_path, "--engine-restarts", "1")
    try:
        server.wait_ready()
        server.tree = psutil.Process(server.proc.pid).children(recursive=True)
        engine = server.engine_process()
        clients, ended = _open_streams(f"127.0.0.1:{server.grpc}", 4, 2000)
        t0 = time.monotonic()
        engine.kill()
        assert wait_for(lambda: not server.ready(), 1.0, 0.02), "still ready 1 s after the engine died"
        print(f"not ready {time.monotonic() - t0:.2f} s after the engine's SIGKILL")
        assert wait_for(lambda: ended.qsize() == 4, 5), f"only {ended.qsize()} of 4 streams ended"
        for c in clients:
            c.close()
        # while the engine is down, its gauges say so (0, or gone with the unloaded model), not the dead engine's 4
        assert wait_for(lambda: server.running() == 0, 10), f"{server.running()} running: a gauge kept the dead value"
        # not ready all the way through the restart: no moment says ready without an engine behind it
        while not server.ready():
            assert server.proc.poll() is None, server.log()
            assert time.monotonic() - t0 < 300, server.log()
            time.sleep(0.05)
        status, body = _post(f"http://127.0.0.1:{server.http}/v2/models/ensemble/generate",
                             {"text_input": "The capital of France is", "max_tokens": 4})
        assert status == 200 and json.loads(body)["text_output"], body
        assert wait_for(lambda: server.running() == 0, 10), f"{server.running()} requests running after the restart"

        server.tree += psutil.Process(server.proc.pid).children(recursive=True)
        server.engine_process().kill()
        assert server.proc.wait(120) == 3, server.log()  # supervisor.RESTARTS_SPENT_EXIT
        _, alive = psutil.wait_procs(server.tree, timeout=30)
        assert not alive, [p.pid for p in alive]
    finally:
        server.close()
