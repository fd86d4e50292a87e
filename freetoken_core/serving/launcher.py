"""`freetoken-core serve`: render a runtime model repository and run tritonserver on it.

Steps: resolve the model (default: SmolLM2, fetched and converted on first use), copy
model_repository/ into a runtime directory with the `freetoken` parameters filled from
FREETOKEN_<NAME> environment variables and command-line overrides, pick free ports (or take the
given ones), start the tritonserver of the nvidia-pytriton wheel with this venv first on PATH,
wait until the server and every model are ready, print the ports and a sample client command.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from freetoken_core.serving.cpu_affinity import (engine_cpus_of_model, format_cpu_list, keep_off, parse_cpu_list,
                                                 resolve_engine_cpus)
from freetoken_core.serving.ensemble_secret import SECRET_ENV, new_secret
from freetoken_core.serving.guard import (RUN_SHM_PREFIX_ENV, GuardOrders, RunFiles, remove_stale_runs, start_guard,
                                         stop_guard)
from freetoken_core.lifetime import die_with_parent
from freetoken_core.serving.openai.process import add_frontend_args, frontend_options, start_frontend, stop_frontend
from freetoken_core.serving.params import all_param_names, env_overrides
from freetoken_core.serving.report import configure_logging
from freetoken_core.serving.supervisor import RESTARTS_SPENT_EXIT, EngineSupervisor, RestartPolicy
from freetoken_core.serving.tritonserver import cpu_host_server_args, find_tritonserver, server_env

log = logging.getLogger(__name__)

MODEL_NAMES = ("tokenizer", "freetoken", "detokenizer", "ensemble")
# Header a client must send to reach the admin APIs (RESTRICTED_APIS); the value is random per start.
ADMIN_HEADER = "freetoken-admin"
# Triton's API categories that only the admin header reaches: model load/unload, registering shared memory (a
# client could map the Python backend's own IPC regions), changing the log level, and tracing.
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
DEFAULT_ENGINE_RESTARTS = 3
ENGINE_RESTARTS_ENV = "FREETOKEN_ENGINE_RESTARTS"
# How often `serve` looks at the engine model's readiness: an unload takes ~1.5 s, and the reload must be asked
# for before it ends (serving/supervisor.py)
SUPERVISE_INTERVAL_S = 0.1
# Seconds tritonserver waits for in-flight requests after SIGTERM before it exits anyway.
SERVER_EXIT_TIMEOUT_S = 10
# Instance counts, overridable like the engine parameters: the stateless Python models', and the engine
# model's (its instances share one engine process: serving/engine_share.py).
INSTANCE_ENV = {"tokenizer": "FREETOKEN_TOKENIZER_INSTANCES", "detokenizer": "FREETOKEN_DETOKENIZER_INSTANCES",
                "freetoken": "FREETOKEN_FREETOKEN_INSTANCES"}


def source_repository() -> Path:
    """model_repository/ next to the package (a source checkout or the Docker image's /opt copy)."""
    env = os.environ.get("FREETOKEN_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "model_repository"


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


_PARAM_RE = r'(parameters\s*\{\s*key:\s*"{key}"\s*value:\s*\{\s*string_value:\s*)"((?:[^"\\]|\\.)*)"'


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace one `parameters { key: "K" value: { string_value: "..." } }`, or append it."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    pattern = re.compile(_PARAM_RE.replace("{key}", re.escape(key)))
    if pattern.search(config_text):
        return pattern.sub(lambda m: f'{m.group(1)}"{escaped}"', config_text, count=1)
    return config_text.rstrip("\n") + f'\nparameters {{ key: "{key}" value: {{ string_value: "{escaped}" }} }}\n'


def get_parameter(config_text: str, key: str) -> str | None:
    m = re.search(_PARAM_RE.replace("{key}", re.escape(key)), config_text)
    return None if m is None else m.group(2).replace('\\"', '"').replace("\\\\", "\\")


def set_instance_count(config_text: str, count: int) -> str:
    return re.sub(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", rf"\g<1>{count}", config_text, count=1)


def set_decoupled(config_text: str) -> str:
    """Make a model config decoupled (after its max_batch_size line), unless it already is."""
    if re.search(r"^\s*model_transaction_policy", config_text, re.M):
        return config_text
    return re.sub(r"^(max_batch_size:.*)$", r"\1\nmodel_transaction_policy { decoupled: true }", config_text,
                  count=1, flags=re.M)


def render_repository(dest: Path, overrides: Mapping[str, str], environ: Mapping[str, str] | None = None,
                      source: Path | None = None) -> Path:
    """Copy the model repository to dest with the freetoken parameters filled in.

    Precedence: config.pbtxt defaults < FREETOKEN_<NAME> environment < explicit overrides."""
    environ = os.environ if environ is None else environ
    source = source or source_repository()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cfg_path = dest / "freetoken" / "config.pbtxt"
    text = cfg_path.read_text()
    values = {**env_overrides(environ), **{k: v for k, v in overrides.items() if v is not None}}
    unknown = sorted(set(values) - set(all_param_names()))
    if unknown:
        raise ValueError(f"unknown engine parameter(s) {unknown}; known: {all_param_names()}")
    for key, value in values.items():
        text = set_parameter(text, key, str(value))
    cfg_path.write_text(text)
    # tokenizer and detokenizer load the same tokenizer files as the engine, and freeze their start-up heap as it does
    model_path = get_parameter(text, "model_path") or ""
    gc_freeze = get_parameter(text, "gc_freeze") or "1"
    for model in ("tokenizer", "detokenizer"):
        p = dest / model / "config.pbtxt"
        p.write_text(set_parameter(set_parameter(p.read_text(), "model_path", model_path), "gc_freeze", gc_freeze))
    engine_process = float(get_parameter(text, "engine_process") or 1) != 0
    engine_cpus = get_parameter(text, "engine_cpus") or ""
    if engine_cpus.strip():  # "auto" becomes the list it means here, where the whole host is in view
        ranks = int(get_parameter(text, "tensor_parallel_size") or 1)
        # with an engine process: auto resolved, a list checked against this host's CPUs; without one: auto is off
        # and a list is refused
        cpus = (resolve_engine_cpus(engine_cpus, ranks) if engine_process
                else engine_cpus_of_model(engine_cpus, ranks, engine_process=False))
        text = set_parameter(text, "engine_cpus", format_cpu_list(cpus))
        cfg_path.write_text(text)
    if float(get_parameter(text, "nonstream_cancel_probe_ms") or 0) > 0:
        # probes must end inside the detokenizer without a response: only a decoupled model can do that
        p = dest / "detokenizer" / "config.pbtxt"
        p.write_text(set_decoupled(p.read_text()))
    counts = {"detokenizer": default_detokenizer_instances(),
              "freetoken": default_freetoken_instances(engine_process=engine_process)}
    for model, var in INSTANCE_ENV.items():
        if environ.get(var):
            counts[model] = int(environ[var])
    for model, count in counts.items():
        p = dest / model / "config.pbtxt"
        p.write_text(set_instance_count(p.read_text(), count))
    log.info("model instances: %s", ", ".join(f"{m} {c}" for m, c in counts.items()))
    return dest


def default_detokenizer_instances(cpus: int | None = None) -> int:
    """Detokenizer instances for this host. Each is a light stub process (no torch: its imports take ~35 MB)
    that waits most of a response on IPC round trips (the execute it is handed, its `send()`), not on a CPU: at
    16 and 64 streams the 8 stubs of the H200 host kept ~2.3-2.7 cores busy (benchmarks/RESULTS.md, twenty-first
    session), so instances, not cores, set how many responses a second the ensemble answers. 1 on small boxes (2 cores
    here), 1 per 4 CPUs up to 4 below 16 CPUs (not measured there), 16 on 16 or more: on the H200 host
    (16 cores) 16 instances answered 10.7k responses/s at 16 streams (1.29 tokens a response) and 11.3k at
    64, against 8.8-9.6k (1.28-1.43) and 8.3-9.2k with 8 in the same call (twenty-sixth session); 8 against
    2 and 4: seventeenth session."""
    cpus = cpus or os.cpu_count() or 1
    return 16 if cpus >= 16 else max(1, min(4, cpus // 4))


def default_freetoken_instances(cpus: int | None = None, engine_process: bool = True) -> int:
    """`freetoken` instances for this host. Each is a stub process whose sends are serialized (one
    `send()` is an IPC round trip to a server thread, ~2.8k responses/s a stub), and they share one engine
    process: on the H200 host (16 cores) six instances with 8 detokenizers answered 10.5-10.8k responses/s at
    64 streams, four 7.3k (8.8k with 6 detokenizers), two 5.9k, at the same or higher tok/s (seventeenth
    session). Eight since the twenty-eighth session: with 16 detokenizers and 2 send threads each
    (`sender_threads` auto) they answered 11.2-11.5k responses/s at 64 streams where six of one thread answered
    7.1k, at equal or higher tok/s (benchmarks/RESULTS.md). One on smaller hosts (not measured there), and one
    when the engine runs in the model's process (engine_process=0 cannot share)."""
    cpus = cpus or os.cpu_count() or 1
    return 8 if engine_process and cpus >= 16 else 1


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
    guard: subprocess.Popen | None = None  # takes the server down if this process dies (serving/guard.py)
    host: str = "127.0.0.1"  # where clients of this process reach it
    ensemble_secret: str = ""  # the server's (serving/ensemble_secret.py): for tests that play the tokenizer step
    frontend: subprocess.Popen | None = None  # the OpenAI API (serving/openai/process.py), stopped first
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
    """Poll until the server and every model report ready; fail fast if the server exits."""
    deadline = time.monotonic() + timeout
    base = f"http://{handle.http_url}"
    while time.monotonic() < deadline:
        if not handle.alive():
            raise RuntimeError(f"tritonserver exited with code {handle.process.returncode}:\n{handle.log_tail()}")
        if _http_ok(f"{base}/v2/health/ready") and all(_http_ok(f"{base}/v2/models/{m}/ready") for m in models):
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

    The server runs in its own session and process group (a Ctrl-C meant for the launcher must not hit it
    before the launcher unloads it cleanly), but its life is tied to the launcher's: the parent-death signal
    (serving/lifetime.py) and a guard process (serving/guard.py) that SIGKILLs its whole group and removes its
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
        # dies, so its ready endpoint says so (serving/faults.py), and `serve` reload it. The admin APIs
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
    proc = subprocess.Popen(cmd, env=server_vars, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True, preexec_fn=preexec)
    guard = start_guard(GuardOrders(proc.pid, run.tag, tuple(map(str, owned_dirs))))
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return ServerHandle(proc, Path(repo_dir), http_port, grpc_port, metrics_port, log_path, admin_key=admin_key,
                        run=run, guard=guard, host=client_host, ensemble_secret=secret, _owned_dirs=list(owned_dirs))


def chain_preexec(*steps: Callable[[], None]) -> Callable[[], None]:
    """One Popen preexec_fn that runs `steps` in order."""
    def preexec() -> None:
        for step in steps:
            step()

    return preexec


def sample_commands(handle: ServerHandle) -> str:
    """Client commands to try, each runnable as printed from the directory `serve` was started in, with no
    virtual environment active: the Python client runs with this interpreter (which has tritonclient),
    named by a path relative to that directory where it lies below it."""
    import json
    import shlex

    def shell_path(path: str) -> str:
        rel = os.path.relpath(path)
        return shlex.quote(path if rel.startswith("..") else rel)

    http = handle.http_url
    # over HTTP every input is a JSON value of its tensor: `messages` (a BYTES tensor) is a string holding the chat
    chat = {"messages": json.dumps([{"role": "user", "content": "Name three colours."}]), "max_tokens": 32}
    lines = [
        f"HTTP     {http}   gRPC {handle.grpc_url}   metrics {handle.metrics_url}",
        "Try:",
        f"  curl -s -X POST {http}/v2/models/ensemble/generate "
        "-d '{\"text_input\": \"The capital of France is\", \"max_tokens\": 32}'",
        f"  curl -sN -X POST {http}/v2/models/ensemble/generate_stream "
        "-d '{\"text_input\": \"Write a haiku about the sea.\", \"max_tokens\": 64, \"stream\": true, "
        "\"apply_chat_template\": true}'",
        f"  curl -s -X POST {http}/v2/models/ensemble/generate -d {shlex.quote(json.dumps(chat))}",
    ]
    example = Path(__file__).resolve().parents[2] / "client_examples" / "grpc_stream_chat.py"
    if example.is_file():  # a source checkout (the Docker image carries no client_examples/)
        lines.append(f"  {shell_path(sys.executable)} {shell_path(str(example))} --url {handle.grpc_url} "
                     "'Write a haiku about the sea.'")
    return "\n".join(lines)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", help="converted model directory (default: SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-running-req", help="most requests decoding at once")
    p.add_argument("--page-size", help="tokens per KV page")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="any other freetoken model parameter (e.g. --param kv_cache_gb=2)")
    p.add_argument("--http-port", type=int, help="default: a free port")
    p.add_argument("--grpc-port", type=int, help="default: a free port")
    p.add_argument("--metrics-port", type=int, help="default: a free port")
    p.add_argument("--repo-dir", type=Path, help="where to write the runtime model repository (default: a temp dir)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--host", default="0.0.0.0",
                   help="address the HTTP, gRPC and metrics ports listen on (default 0.0.0.0, for containers; "
                        "127.0.0.1 keeps a single-host server off the network)")
    p.add_argument("--engine-restarts", type=int, default=None,
                   help=f"how often a dead engine is restarted before serve exits with code {RESTARTS_SPENT_EXIT} "
                        f"(default {DEFAULT_ENGINE_RESTARTS}, or ${ENGINE_RESTARTS_ENV})")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more tritonserver argument, as --server-arg=--trace-config=level=TIMESTAMPS (repeatable)")
    add_frontend_args(p)


def serve_main(args: argparse.Namespace) -> int:
    """Run the server in the foreground until Ctrl-C (or SIGTERM)."""
    configure_logging()
    overrides = {
        "model_path": args.model_path, "dtype": args.dtype, "device": args.device,
        "max_running_req": args.max_running_req, "page_size": args.page_size,
    }
    for item in args.param:
        if "=" not in item:
            raise SystemExit(f"--param expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    overrides = {k: v for k, v in overrides.items() if v is not None}
    restarts = args.engine_restarts if args.engine_restarts is not None else int(
        os.environ.get(ENGINE_RESTARTS_ENV, DEFAULT_ENGINE_RESTARTS))
    if restarts < 0:
        raise SystemExit(f"--engine-restarts must be >= 0, got {restarts}")
    openai = frontend_options(args)
    triton_host = args.host
    if openai is not None and openai.api_key:  # Triton's own ports would bypass the key
        triton_host = "127.0.0.1"
        log.info("an API key is set: Triton's HTTP, gRPC and metrics ports listen on 127.0.0.1 only")
    handle = start_server(overrides, args.http_port, args.grpc_port, args.metrics_port, args.repo_dir,
                          extra_args=args.server_arg, ready_timeout=args.ready_timeout, host=triton_host)
    if openai is not None:
        try:
            handle.frontend = start_frontend(handle.grpc_url, handle.repo_dir, openai, metrics_url=handle.metrics_url)
        except BaseException:
            handle.stop()
            raise
    print("\nfreetoken is serving on tritonserver (Ctrl-C stops it)\n" + sample_commands(handle)
          + (f"\nOpenAI API localhost:{openai.port}/v1" if openai is not None else "") + "\n", flush=True)
    supervisor = EngineSupervisor(f"http://{handle.http_url}", handle.admin_headers, RestartPolicy(restarts))
    stop = {"now": False}

    def _on_term(signum, frame):  # noqa: ARG001
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on_term)
    spent = False
    try:
        while handle.alive() and not stop["now"]:
            time.sleep(SUPERVISE_INTERVAL_S)
            if not supervisor.check():
                spent = True
                break
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
    if spent:
        return RESTARTS_SPENT_EXIT
    return 0 if stop["now"] or handle.process.returncode in (0, None, -signal.SIGINT) else handle.process.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="freetoken-core serve", description=__doc__.splitlines()[0])
    add_serve_args(p)
    return serve_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
