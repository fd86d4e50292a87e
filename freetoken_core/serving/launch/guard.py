"""The launcher's guard: takes the server down and cleans up when `freetoken-core serve` dies.

A launcher killed with SIGKILL (OOM killer, a CI timeout, `kill -9`) runs no cleanup of its own. Its
tritonserver gets SIGTERM from the parent-death signal, but a server with streams in flight can take
its `--exit-timeout-secs` and more to stop, and its stubs and the engine process are left behind. So
the launcher starts this small process in a session of its own and holds the write end of its stdin:
when that pipe closes without the word `stopped` (the launcher's clean stop), the launcher is gone,
and the guard
1. sends the server SIGTERM and gives it GRACE_S to exit (streams in flight end then),
2. SIGKILLs the server's whole process group (tritonserver started it: every stub, the engine process
   and its ranks are in it, re-parented or not),
3. removes the run's files: its temporary directory (cancel sockets, engine rendezvous, runtime
   repository) and its shared-memory regions in /dev/shm (the Python backend's and ours share a prefix).

A run's files carry the launcher's pid (`RunFiles`), so whatever a guard could not remove (the machine
lost power) is found and removed by the next start (`remove_stale_runs`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

GRACE_S = 2.0  # SIGTERM to SIGKILL: streams in flight end within a few seconds of the launcher
STOPPED = "stopped"  # the launcher's last line to its guard: a clean stop, nothing to do
RUN_PREFIX = "freetoken-run-"  # /tmp/freetoken-run-<launcher pid> and /dev/shm/freetoken-run-<pid>-*
SHM_DIR = Path("/dev/shm")
RUN_SHM_PREFIX_ENV = "FREETOKEN_RUN_SHM_PREFIX"  # set for the server: the prefix our own /dev/shm files take


_runs = itertools.count()


@dataclass(frozen=True)
class RunFiles:
    """Where one server's files go: `<tmp>/freetoken-run-<launcher pid>-<n>/` (the server's TMPDIR, so every
    file a stub makes lands there) and `/dev/shm/freetoken-run-<pid>-<n>-*` (the Python backend's regions and
    our rings share the prefix)."""

    tag: str

    @classmethod
    def new(cls) -> "RunFiles":
        return cls(f"{RUN_PREFIX}{os.getpid()}-{next(_runs)}")

    @property
    def dir(self) -> Path:
        return Path(tempfile.gettempdir()) / self.tag

    @property
    def shm_prefix(self) -> str:
        return f"{self.tag}-"

    def create(self) -> "RunFiles":
        self.dir.mkdir(mode=0o700)
        return self

    def remove(self, extra: tuple[str, ...] = ()) -> None:
        """The directory, the shared-memory regions and `extra` paths."""
        for path in [self.dir, *map(Path, extra)]:
            shutil.rmtree(path, ignore_errors=True)
        if SHM_DIR.is_dir():
            for entry in SHM_DIR.iterdir():
                if entry.name.startswith(self.shm_prefix):
                    try:
                        entry.unlink()
                    except OSError:
                        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_RUN_RE = re.compile(rf"^({re.escape(RUN_PREFIX)}(\d+)-\d+)")


def remove_stale_runs() -> list[str]:
    """Remove what runs of dead launchers left behind (their pids are in the names); the runs removed."""
    runs: dict[str, int] = {}
    for folder in (Path(tempfile.gettempdir()), SHM_DIR):
        if folder.is_dir():
            for entry in folder.iterdir():
                m = _RUN_RE.match(entry.name)
                if m and int(m.group(2)) != os.getpid():
                    runs[m.group(1)] = int(m.group(2))
    stale = sorted(tag for tag, pid in runs.items() if not _alive(pid))
    for tag in stale:
        log.warning("removing %s*: the files of an earlier server whose launcher is gone", tag)
        RunFiles(tag).remove()
    return stale


@dataclass(frozen=True)
class GuardOrders:
    server_pid: int  # tritonserver: the leader of its own process group
    run: str  # RunFiles.tag
    extra_paths: tuple[str, ...] = ()  # besides the run directory: e.g. a runtime repository the launcher made
    grace_s: float = GRACE_S


def take_down(orders: GuardOrders) -> None:
    """SIGTERM the server, SIGKILL its process group after the grace, remove the run's files."""
    pid = orders.server_pid
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + orders.grace_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # the stubs and the engine process too, wherever they were re-parented
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 5.0
    while _group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    RunFiles(orders.run).remove(orders.extra_paths)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def start_guard(orders: GuardOrders) -> subprocess.Popen:
    """Start the guard for `orders`; the caller keeps `.stdin` open for as long as it lives and writes
    STOPPED there on a clean stop (`stop_guard`)."""
    guard = subprocess.Popen([sys.executable, "-m", "freetoken_core.serving.launch.guard"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, start_new_session=True, text=True)
    assert guard.stdin is not None
    guard.stdin.write(json.dumps(asdict(orders)) + "\n")
    guard.stdin.flush()
    return guard


def stop_guard(guard: subprocess.Popen) -> None:
    """The launcher stopped the server itself: the guard has nothing left to do."""
    try:
        assert guard.stdin is not None
        guard.stdin.write(STOPPED + "\n")
        guard.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        guard.wait(5)
    except subprocess.TimeoutExpired:
        guard.kill()


def main() -> int:
    line = sys.stdin.readline()
    if not line:
        return 0
    fields = json.loads(line)
    orders = GuardOrders(**{**fields, "extra_paths": tuple(fields.get("extra_paths", ()))})
    rest = sys.stdin.read()  # blocks until the launcher closes the pipe: cleanly, or by dying
    if rest.strip() == STOPPED:
        return 0
    take_down(orders)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the launcher is not for its guard
    sys.exit(main())
