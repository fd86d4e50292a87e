"""Start tritonserver on a runtime model repository and wait until it is ready.

The tritonserver of the nvidia-pytriton wheel runs with this venv first on PATH, on free ports unless given, in
a process group of its own whose life a guard process ties to the launcher's (launch/guard.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from freetoken_core.lifetime import die_with_parent
from freetoken_core.serving.config import FIELDS as SERVING_FIELDS, env_name
from freetoken_core.serving.engine_proc.cpu_affinity import format_cpu_list, keep_off, parse_cpu_list
from freetoken_core.serving.launch.guard import (RUN_SHM_PREFIX_ENV, GuardOrders, RunFiles, remove_stale_runs,
                                                start_guard, stop_guard)
from freetoken_core.serving.launch.repository import MODEL_NAMES, get_parameter, render_repository
from freetoken_core.serving.launch.tritonserver import cpu_host_server_args, find_tritonserver, server_env
from freetoken_core.serving.openai.process import stop_frontend
from freetoken_core.serving.triton.ensemble_secret import SECRET_ENV, new_secret

log = logging.getLogger(__name__)

# Header a client must send to reach the admin APIs (RESTRICTED_APIS); the value is random per start.
ADMIN_HEADER = "freetoken-admin"
# Triton's API categories that only the admin header reaches: model load/unload, registering shared memory (a
# client could map the Python backend's own IPC regions), changing the log level, and tracing.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# Seconds tritonserver waits for in-flight requests after SIGTERM before it exits anyway.
SERVER_EXIT_TIMEOUT_S = 10


def free_ports(n: int) -> list[int]:
    """Ports the OS says are free now (bound together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class ServerHandle:
    process: subprocess.Popen
    repo_dir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path | None = None
    admin_key: str = ""  # value of the ADMIN_HEADER the admin APIs demand (RESTRICTED_APIS)
    run: RunFiles | None = None  # the server's temporary files (its TMPDIR and /dev/shm regions)
    guard: subprocess.Popen | None = None  # takes the server down if this process dies (serving/launch/guard.py)
    host: str = "127.0.0.1"  # where clients of this process reach it
    ensemble_secret: str = ""  # the server's (serving/triton/ensemble_secret.py): for tests that play the tokenizer step
    frontend: subprocess.Popen | None = None  # the OpenAI API (serving/openai/process.py), stopped first
    metrics_on: bool = True  # False: an extra --allow-metrics=false, so readiness does not wait for the port
    _owned_dirs: list[Path] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {ADMIN_HEADER: self.admin_key}

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT (tritonserver unloads its models and drains), SIGKILL after `timeout`; then whatever of its
        process group is left (a stub or engine process that outlived it) and its files."""
        if self.frontend is not None:
            stop_frontend(self.frontend)
            self.frontend = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.run is not None:
            self.run.remove()
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)
        if self.guard is not None:
            stop_guard(self.guard)
            self.guard = None


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def wait_ready(handle: ServerHandle, timeout: float = 600.0, models: tuple[str, ...] = MODEL_NAMES) -> None:
    """Poll until the server and every model report ready and the metrics port answers (tritonserver opens it
    after the HTTP port); fail fast if the server exits."""
    deadline = time.monotonic() + timeout
    base = f"http://{handle.http_url}"
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"tritonserver exited with code {handle.process.returncode}:\n{handle.log_tail()}")
        if (_http_ok(f"{base}/v2/health/ready") and all(_http_ok(f"{base}/v2/models/{m}/ready") for m in models)
                and (not handle.metrics_on or _http_ok(handle.metrics_url))):
            return
        time.sleep(0.5)
    handle.stop()
    raise TimeoutError(f"tritonserver was not ready after {timeout:.0f} s:\n{handle.log_tail()}")


def start_server(
    overrides: Mapping[str, str] | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    repo_dir: Path | None = None,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    ready_timeout: float = 600.0,
    host: str = "0.0.0.0",
) -> ServerHandle:
    """Start tritonserver on a runtime copy of the repository and wait until it is ready.

    The server dies with the thread that calls this (see `spawn_tritonserver`)."""
    overrides = dict(overrides or {})
    if not overrides.get("model_path") and not os.environ.get("FREETOKEN_MODEL_PATH"):
        # resolve (fetch + convert) here, with a visible log, instead of inside the server's initialize()
        from freetoken_core.models.gguf import default_model_path

        overrides["model_path"] = default_model_path()
    remove_stale_runs()
    owned: list[Path] = []
    if repo_dir is None:
        repo_dir = Path(tempfile.mkdtemp(prefix="freetoken-repo-"))
        owned.append(repo_dir)
    render_repository(Path(repo_dir), overrides)
    engine_cpus = get_parameter((Path(repo_dir) / "freetoken" / "config.pbtxt").read_text(), "engine_cpus") or ""
    handle = spawn_tritonserver(Path(repo_dir), http_port, grpc_port, metrics_port, log_path, extra_args,
                                cpus_off=parse_cpu_list(engine_cpus) if engine_cpus else frozenset(), host=host,
                                owned_dirs=tuple(owned))
    try:
        wait_ready(handle, ready_timeout)
    except BaseException:
        handle.stop()
        raise
    return handle


def spawn_tritonserver(
    repo_dir: Path,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    cpus_off: frozenset[int] = frozenset(),
    host: str = "0.0.0.0",
    owned_dirs: tuple[Path, ...] = (),
) -> ServerHandle:
    """Start tritonserver on `repo_dir` (free ports unless given); does not wait for readiness. With `cpus_off`
    the server (and every stub it starts) runs on the other CPUs: the engine process's own (engine_cpus).

    The server runs detached (setsid: its own process group; a Ctrl-C meant for the launcher must not hit it
    before the launcher unloads it cleanly), but its life is tied to the launcher's: the parent-death signal
    (freetoken_core/lifetime.py) and a guard process (serving/launch/guard.py) that SIGKILLs its whole group and removes its
    files (`owned_dirs` too) if the launcher dies."""
    install = find_tritonserver()
    admin_key = secrets.token_hex(16)
    ports = free_ports(3)
    http_port = http_port or ports[0]
    grpc_port = grpc_port or ports[1]
    metrics_port = metrics_port or ports[2]
    run = RunFiles.new().create()
    restricted = ",".join(RESTRICTED_APIS)
    cmd = [
        str(install.binary),
        f"--model-repository={repo_dir}",
        f"--backend-directory={install.backend_dir}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--http-address={host}",
        f"--grpc-address={host}",
        f"--metrics-address={host}",
        "--allow-metrics=true",
        "--log-verbose=0",
        # bounded shutdown: after a SIGTERM (ours, or the parent-death signal) in-flight requests get
        # this long, then the server exits anyway and frees its ports and device memory
        f"--exit-timeout-secs={SERVER_EXIT_TIMEOUT_S}",
        # explicit model control (every model loaded at start) lets the engine unload itself when it
        # dies, so its ready endpoint says so (serving/engine_proc/faults.py), and `serve` reload it. The admin APIs
        # stay closed unless a request carries this random header.
        "--model-control-mode=explicit",
        "--load-model=*",
        # the Python backend's IPC regions carry the run's prefix, so the guard finds them
        f"--backend-config=python,shm-region-prefix-name={run.shm_prefix}",
        *cpu_host_server_args(),
        f"--http-restricted-api={restricted}:{ADMIN_HEADER}={admin_key}",
        f"--grpc-restricted-protocol={restricted}:{ADMIN_HEADER}={admin_key}",
        *(extra_args or []),
    ]
    log.info("starting %s", " ".join(cmd).replace(admin_key, "<admin key>"))
    out = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed with the process)
    preexec = die_with_parent(signal.SIGTERM)
    if cpus_off:
        log.info("tritonserver runs off CPU(s) %s (the engine process's)", format_cpu_list(cpus_off))
        preexec = chain_preexec(keep_off(cpus_off), preexec)
    secret = new_secret()
    server_vars = {**server_env(install), **(env or {}), "TMPDIR": str(run.dir), RUN_SHM_PREFIX_ENV: run.shm_prefix,
                   SECRET_ENV: secret}
    # the rendered config.pbtxt already holds the FREETOKEN_<NAME> overrides (below the explicit ones): the models
    # must not apply them a second time over an explicit --param
    for name in SERVING_FIELDS:
        server_vars.pop(env_name(name), None)
    proc = subprocess.Popen(cmd, env=server_vars, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True, preexec_fn=preexec)
    guard = start_guard(GuardOrders(proc.pid, run.tag, tuple(map(str, owned_dirs))))
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    metrics_flags = [a.split("=", 1)[1] for a in extra_args or [] if a.startswith("--allow-metrics=")]
    return ServerHandle(proc, Path(repo_dir), http_port, grpc_port, metrics_port, log_path, admin_key=admin_key,
                        run=run, guard=guard, host=client_host, ensemble_secret=secret,
                        metrics_on=not metrics_flags or metrics_flags[-1].lower() not in ("false", "0"),
                        _owned_dirs=list(owned_dirs))


def chain_preexec(*steps: Callable[[], None]) -> Callable[[], None]:
    """One Popen preexec_fn that runs `steps` in order."""
    def preexec() -> None:
        for step in steps:
            step()

    return preexec
