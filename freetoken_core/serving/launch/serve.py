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
import signal
import sys
import time
from pathlib import Path

from freetoken_core.serving.launch.server import ServerHandle, start_server
from freetoken_core.serving.launch.supervisor import RESTARTS_SPENT_EXIT, EngineSupervisor, RestartPolicy
from freetoken_core.serving.openai.process import add_frontend_args, frontend_options, start_frontend
from freetoken_core.serving.report import configure_logging

log = logging.getLogger(__name__)

DEFAULT_ENGINE_RESTARTS = 3
ENGINE_RESTARTS_ENV = "FREETOKEN_ENGINE_RESTARTS"
# How often `serve` looks at the engine model's readiness: an unload takes ~1.5 s, and the reload must be asked
# for before it ends (serving/launch/supervisor.py)
SUPERVISE_INTERVAL_S = 0.1


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
    example = Path(__file__).resolve().parents[3] / "client_examples" / "grpc_stream_chat.py"
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
