"""The frontend process: `python -m freetoken_core.serving.openai.process` runs the app under uvicorn, and
`start_frontend` is how `serve` starts it beside tritonserver.

It dies with the launcher like every other process of the server: the parent-death signal and a watcher thread
(lifetime.py), and `stop_frontend` when `serve` stops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_core.lifetime import die_with_parent, watch_parent

log = logging.getLogger(__name__)

API_KEY_ENV = "FREETOKEN_API_KEY"
DEFAULT_OPENAI_PORT = 9000
MAX_WORKERS = 64
# one worker process per this many host CPUs, at most MAX_DEFAULT_WORKERS: on a 16-CPU H100 host eight processes
# answered first tokens sooner than four at 16 and 64 streams, at about 40% of a CPU each (benchmarks/RESULTS.md,
# OpenAI-compatible API)
CPUS_PER_DEFAULT_WORKER = 2
MAX_DEFAULT_WORKERS = 8
# the app's settings, for worker processes uvicorn spawns (they build the app from them: app_from_env)
_WORKER_SETTINGS_ENV = "FREETOKEN_OPENAI_WORKER_SETTINGS"


def default_workers(cpus: int | None = None) -> int:
    """The frontend's processes when --openai-workers is not given: one per CPUS_PER_DEFAULT_WORKER host CPUs."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // CPUS_PER_DEFAULT_WORKER))


@dataclass(frozen=True)
class FrontendOptions:
    port: int = DEFAULT_OPENAI_PORT
    host: str = "0.0.0.0"
    served_model_name: str | None = None
    api_key: str | None = None  # else FREETOKEN_API_KEY, else none
    workers: int = field(default_factory=default_workers)  # uvicorn worker processes sharing the port

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"--openai-workers must be from 1 to {MAX_WORKERS}, got {self.workers}")


def start_frontend(grpc_url: str, repo_dir: Path, opts: FrontendOptions, log_path: Path | None = None,
                   ready_timeout: float = 120.0, metrics_url: str | None = None) -> subprocess.Popen:
    """Start the frontend against the server's gRPC port and wait until it answers /health (or fails)."""
    cmd = [sys.executable, "-m", "freetoken_core.serving.openai.process", "--grpc-url", grpc_url,
           "--repo-dir", str(repo_dir), "--host", opts.host, "--port", str(opts.port)]
    if metrics_url:
        cmd += ["--metrics-url", metrics_url]
    if opts.served_model_name:
        cmd += ["--served-model-name", opts.served_model_name]
    if opts.workers > 1:
        cmd += ["--workers", str(opts.workers)]
    env = dict(os.environ)
    if opts.api_key:  # by environment, not argv: other local users can read a command line
        env[API_KEY_ENV] = opts.api_key
    out = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            preexec_fn=die_with_parent(signal.SIGTERM))
    host = "127.0.0.1" if opts.host in ("0.0.0.0", "::", "") else opts.host
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the OpenAI frontend exited with code {proc.returncode}"
                               + (f":\n{Path(log_path).read_text()[-4000:]}" if log_path else ""))
        try:
            with urllib.request.urlopen(f"http://{host}:{opts.port}/health", timeout=2):
                return proc
        except urllib.error.HTTPError:
            return proc  # it answers (503 only says the engine is not ready)
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.2)
    stop_frontend(proc)
    raise TimeoutError(f"the OpenAI frontend did not answer on port {opts.port} within {ready_timeout:.0f} s")


def stop_frontend(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--openai-port", type=int, default=DEFAULT_OPENAI_PORT,
                   help=f"port of the OpenAI-compatible API (default {DEFAULT_OPENAI_PORT})")
    p.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible API")
    p.add_argument("--served-model-name", help="the model id of the OpenAI API (default: the model directory's name)")
    p.add_argument("--openai-workers", type=int, default=None,
                   help="processes serving the OpenAI API on its one port (default: one per "
                        f"{CPUS_PER_DEFAULT_WORKER} CPUs, 1 to {MAX_DEFAULT_WORKERS})")
    p.add_argument("--api-key", default=None,
                   help=f"clients of the OpenAI API must send 'Authorization: Bearer <key>' (default ${API_KEY_ENV})")


def frontend_options(args: argparse.Namespace) -> FrontendOptions | None:
    """The frontend `serve` starts, or None with --no-openai."""
    if args.no_openai:
        return None
    workers = {} if args.openai_workers is None else {"workers": args.openai_workers}  # else the options' default
    return FrontendOptions(port=args.openai_port, host=args.host, served_model_name=args.served_model_name,
                           api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, **workers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="freetoken-core openai frontend", description=__doc__.splitlines()[0])
    p.add_argument("--grpc-url", required=True, help="the Triton server's gRPC address (host:port)")
    p.add_argument("--repo-dir", type=Path, required=True, help="the runtime model repository `serve` rendered")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_OPENAI_PORT)
    p.add_argument("--served-model-name")
    p.add_argument("--metrics-url", help="Triton's metrics URL, served again at /metrics")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    args = p.parse_args(argv)
    _configure_logging()
    watch_parent("openai frontend")
    import uvicorn

    settings = {"grpc_url": args.grpc_url, "repo_dir": str(args.repo_dir),
                "served_model_name": args.served_model_name, "metrics_url": args.metrics_url}
    log.info("OpenAI API on %s:%d (ensemble at %s, %d worker(s))%s", args.host, args.port, args.grpc_url,
             args.workers, ", API key required" if os.environ.get(API_KEY_ENV) else "")
    if args.workers == 1:
        uvicorn.run(_app(settings), host=args.host, port=args.port, **_UVICORN_OPTIONS)
        return 0
    os.environ[_WORKER_SETTINGS_ENV] = json.dumps(settings)  # inherited by the workers uvicorn spawns
    uvicorn.run(f"{__name__}:app_from_env", factory=True, workers=args.workers, host=args.host, port=args.port,
                **_UVICORN_OPTIONS)
    return 0


# uvloop and httptools: named, not "auto", so that a missing one fails at start-up instead of serving slower
_UVICORN_OPTIONS = {"loop": "uvloop", "http": "httptools", "log_level": "warning", "access_log": False}


def _app(settings: dict):
    from freetoken_core.serving.openai.app import create_app
    from freetoken_core.serving.openai.served_model import load_served_model

    model = load_served_model(Path(settings["repo_dir"]), settings["served_model_name"])
    log.info("serving model '%s' (pid %d)", model.name, os.getpid())
    return create_app(settings["grpc_url"], model, api_key=os.environ.get(API_KEY_ENV) or None,
                      metrics_url=settings["metrics_url"])


def app_from_env():
    """uvicorn's app factory in each worker process: the app from the settings main() left in the environment.
    A worker exits when its parent (uvicorn's supervisor) dies, like every process of the server."""
    _configure_logging()  # a spawned worker runs none of main()
    watch_parent("openai frontend worker")
    return _app(json.loads(os.environ[_WORKER_SETTINGS_ENV]))


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
