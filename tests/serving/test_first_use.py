"""First use (issue 52): the client commands `serve` prints and the README's "First requests" block run as shown,
against a live server, from a shell where the venv is not active; the load-test scripts say what to install where
perf_analyzer cannot run; an HTTP chat needs `messages` as a JSON string; on a host without a CUDA driver,
`cpu_host_server_args` quiets tritonserver's pinned-memory warning."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

REPO = Path(__file__).resolve().parents[2]


def plain_shell_env() -> dict[str, str]:
    """A user's shell without the venv: no VIRTUAL_ENV, the venv's bin off PATH."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    return env


def run_shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=plain_shell_env(), capture_output=True, text=True,
                          timeout=300)


def check_client_output(command: str, proc: subprocess.CompletedProcess) -> None:
    """Each kind of sample command answers in its own shape; any of them failing fails the test."""
    assert proc.returncode == 0, f"{command}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    out = proc.stdout
    if "grpc_stream_chat.py" in command:
        assert "[finish_reason=" in out and len(out.split("[finish_reason=")[0].strip()) > 0, out
    elif "http_infer.py" in command:
        assert out.strip() and "finish_reason=" in proc.stderr, (out, proc.stderr)
    elif "generate_stream" in command:
        events = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: ")]
        assert events and all("error" not in e for e in events), out
        assert "".join(e.get("text_output", "") for e in events).strip(), out
    else:  # curl ... /generate: one JSON reply
        reply = json.loads(out)
        assert "error" not in reply and reply["text_output"].strip(), out


def commands_of(sample: str) -> list[str]:
    """The indented lines after 'Try:' in serve's banner."""
    return [line.strip() for line in sample.split("Try:", 1)[1].splitlines() if line.startswith("  ")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this host")
@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_printed_sample_commands_run_without_the_venv(triton_server, where, tmp_path, monkeypatch):
    from freetoken_core.serving.launch.serve import sample_commands

    cwd = REPO if where == "checkout" else tmp_path
    monkeypatch.chdir(cwd)  # serve prints paths relative to where it was started, absolute outside the checkout
    commands = commands_of(sample_commands(triton_server))
    assert len(commands) == 4 and any("grpc_stream_chat.py" in c for c in commands), commands
    assert any('"messages": "[' in c for c in commands), commands  # the HTTP chat, messages as a JSON string
    python, example = next(c for c in commands if "grpc_stream_chat.py" in c).split()[:2]
    assert Path(cwd, python).resolve() == Path(sys.executable).resolve()  # the interpreter that has tritonclient
    assert example == ("client_examples/grpc_stream_chat.py" if where == "checkout"
                       else str(REPO / "client_examples" / "grpc_stream_chat.py")), example
    for command in commands:
        check_client_output(command, run_shell(command, cwd))


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block under `heading` in README.md (continuation lines joined)."""
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this host")
def test_readme_first_requests_run_as_shown(triton_server):
    commands = readme_block("## First requests")
    assert len(commands) == 5, commands
    ports = {"localhost:8000": triton_server.http_url, "localhost:8001": triton_server.grpc_url}
    for command in commands:
        live = re.sub(r"localhost:800[01]", lambda m: ports[m.group(0)], command)
        check_client_output(command, run_shell(live, REPO))


def test_http_chat_needs_messages_as_a_json_string(triton_server):
    """What the README's note says: a string holding the list works, a bare array is refused by Triton's parser."""
    messages = [{"role": "user", "content": "Name three colours."}]

    def generate(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/ensemble/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, reply = generate({"messages": json.dumps(messages), "max_tokens": 8})
    assert status == 200 and reply["text_output"].strip(), reply
    status, reply = generate({"messages": messages, "max_tokens": 8})
    assert status >= 400 and "JSON" in reply["error"], (status, reply)


def perf_analyzer_runs() -> bool:
    pa = shutil.which("perf_analyzer", path=os.pathsep.join([str(REPO / ".venv" / "bin"), os.environ.get("PATH", "")]))
    return pa is not None and subprocess.run([pa, "--version"], capture_output=True).returncode == 0


@pytest.mark.skipif(perf_analyzer_runs(), reason="perf_analyzer runs here: the scripts go on to load the server")
@pytest.mark.parametrize("script", ["perf_analyzer.sh", "genai_perf.sh"])
def test_load_test_scripts_say_what_to_install(script):
    proc = run_shell(f"bash client_examples/{script} localhost:1", REPO)
    assert proc.returncode == 1, proc
    assert "perf_analyzer does not run here" in proc.stderr and ".[perf]" in proc.stderr, proc.stderr
    # a fake binary that fails is named as such, not run as if it were perf_analyzer
    fake = subprocess.run(["bash", "-c", f"PERF_ANALYZER=/bin/false bash client_examples/{script} localhost:1"],
                          cwd=REPO, env=plain_shell_env(), capture_output=True, text=True, timeout=60)
    assert fake.returncode == 1 and "perf_analyzer does not run here" in fake.stderr, fake


def test_cpu_host_server_args_quiet_the_pinned_memory_warning(tmp_path):
    """On a host without a CUDA driver the flag turns tritonserver's pinned-memory warning into an info line; the
    two CUDA error lines no flag removes are what CPU_HOST_NOTE explains (it quotes them)."""
    from freetoken_core.serving.launch.server import free_ports
    from freetoken_core.serving.launch.tritonserver import (CPU_HOST_NOTE, cpu_host_server_args, cuda_driver_present,
                                                     find_tritonserver, server_env)

    if cuda_driver_present():
        assert cpu_host_server_args() == []
        pytest.skip("a CUDA driver is present: tritonserver logs no CPU-host errors to explain")
    try:
        install = find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")

    def startup_log(extra: list[str]) -> str:
        (tmp_path / "repo").mkdir(exist_ok=True)
        http, grpc, metrics = free_ports(3)
        proc = subprocess.Popen(
            [str(install.binary), f"--model-repository={tmp_path / 'repo'}", f"--backend-directory={install.backend_dir}",
             f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}", *extra],
            env=server_env(install), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        deadline = time.monotonic() + 60
        try:
            for line in proc.stdout:
                lines.append(line)
                if "Started GRPCInferenceService" in line or time.monotonic() > deadline:
                    break
        finally:  # what the test reads came before this: no need to wait for a clean shutdown
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
        return "".join(lines)

    plain = startup_log([])
    assert "Unable to allocate pinned system memory" in plain, plain
    quiet = startup_log(cpu_host_server_args())
    assert "Unable to allocate pinned system memory" not in quiet and "Pinned memory pool disabled" in quiet, quiet
    for error in re.findall(r'^E\d+ [^\]]+\] "(.*)"$', quiet, re.MULTILINE):
        assert error.rstrip(".") in CPU_HOST_NOTE, error
