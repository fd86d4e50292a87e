"""One engine process behind several instances of the `freetoken` model (issue 13).

Why: every response a decoupled Python model sends is one IPC round trip between its stub process
and the server, and one stub's sends do not scale with threads (on the H200 four sender threads
doubled each send's cost, `send()` p50 250 -> 550 us, for ~1.5x the responses/s). Each model instance
is a stub of its own, so N instances send N times as many responses; but the GPU must hold one
engine. So the first instance to load starts the engine process (serving/engine_proc/engine_process.py) and the
others connect to it; each instance keeps its own requests, cancel channel, metrics and sends, and the
engine routes every message to the instance whose request it is.

How the instances find each other, safely:
- a directory named after the server process (the stubs' parent) and the model, created 0700 by the
  instance that wins the election (`os.mkdir` succeeds for exactly one of them); the others wait for it;
- in it the engine listens on an AF_UNIX socket; a connection must also prove it knows the random
  authkey (`multiprocessing.connection`'s HMAC handshake) written there 0600 by the owner;
- the owner writes `ready` (its pid) last; a directory whose owner process is gone is stale (a server
  pid reused, a crashed load) and is removed and elected again.

Limit: the instances of one load are told apart from another load's only by what `load_identity`
(serving/triton/freetoken_model.py) reads: model name, version and the config file's mtime. Reloading unchanged
files while the model is loaded would let the new instances join the old engine, which stops with the
old load; unload first, then load.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DIR_PREFIX = "freetoken-engine-"
SOCKET_NAME = "engine.sock"
AUTHKEY_NAME = "authkey"
READY_NAME = "ready"
INDEX_BITS = 6  # request uids carry their instance index in the low bits: at most 64 instances
MAX_INSTANCES = 1 << INDEX_BITS


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, and not ours to trust
        return True
    return True


@dataclass
class EngineRendezvous:
    """Where the instances of one model in one server meet. `model` names it (model name and version)."""

    model: str
    server_pid: int = 0  # 0: the parent of this process (the server that started this stub)

    def __post_init__(self) -> None:
        pid = self.server_pid or os.getppid()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model)
        self.dir = Path(tempfile.gettempdir()) / f"{DIR_PREFIX}{pid}-{safe}"
        self.address = str(self.dir / SOCKET_NAME)

    def elect(self, timeout_s: float = 60.0) -> bool:
        """True for the one instance that must start the engine (it now owns the directory)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.mkdir(self.dir, 0o700)
                os.chmod(self.dir, 0o700)
                return True
            except FileExistsError:
                pass
            if self._stale():
                log.warning("removing the stale engine directory %s (its owner is gone)", self.dir)
                shutil.rmtree(self.dir, ignore_errors=True)
                continue
            if (self.dir / READY_NAME).exists() or time.monotonic() > deadline:
                return False
            time.sleep(0.05)  # another instance is creating it right now

    def _stale(self) -> bool:
        ready = self.dir / READY_NAME
        try:
            pid = int(ready.read_text().strip() or 0)
        except (OSError, ValueError):
            # no ready file yet: stale only if the directory is old (an owner that died while starting)
            try:
                return time.time() - self.dir.stat().st_mtime > 3600
            except OSError:
                return False
        return pid > 0 and not _alive(pid)

    def new_authkey(self) -> bytes:
        """The owner: a fresh key, written 0600 before the engine listens."""
        key = secrets.token_bytes(32)
        path = self.dir / AUTHKEY_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key

    def publish_ready(self) -> None:
        """The owner, once the engine listens: the others may connect."""
        tmp = self.dir / f".{READY_NAME}.{os.getpid()}"
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, self.dir / READY_NAME)

    def wait_ready(self, timeout_s: float) -> bytes:
        """A member: wait until the owner's engine listens (its build may take minutes); its authkey."""
        deadline = time.monotonic() + timeout_s
        while not (self.dir / READY_NAME).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine came up in {self.dir} within {timeout_s:.0f} s")
            if not self.dir.exists():
                raise RuntimeError(f"the instance that was starting the engine gave up ({self.dir} is gone)")
            time.sleep(0.1)
        return (self.dir / AUTHKEY_NAME).read_bytes()

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
