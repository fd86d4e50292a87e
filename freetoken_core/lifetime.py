"""Every process of a served engine dies with the process that started it.

The tree is launcher -> tritonserver -> one stub per model instance -> the engine process -> its
tensor-parallel ranks. Each process below the launcher watches its parent: once the parent is gone
(the process is re-parented), it ends its own children and exits at once with `os._exit`. A plain
`exit()` is not enough: Python joins non-daemonic threads and multiprocessing children at exit, and
a stub whose engine process still waits for a `stop` command that will never come hangs there forever.

The launcher's own death is handled by its guard (serving/launch/guard.py); this module covers the rest
(and `LLM`'s tensor-parallel ranks, whose parent is the user's process).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

PR_SET_DEATHSIG = 1  # <sys/prctl.h>
PARENT_POLL_S = 0.2  # how often a watcher looks at its parent: the bound on how long an orphan lives
ORPHAN_EXIT_CODE = 70  # what an orphaned process exits with (EX_SOFTWARE): its parent died under it

_watching = threading.Lock()
_watchers: set[int] = set()  # pids of processes that already watch their parent (one watcher a process)


def die_with_parent(sig: int) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets `sig` when the thread that started it dies, however it dies.

    Linux's PR_SET_DEATHSIG fires when the *thread* that forked exits, so start the child from a
    long-lived thread. If the parent already died between fork and prctl, the child has been
    re-parented: it exits at once. libc is resolved here, before the fork, so the child runs no
    import machinery."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_DEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def watch_parent(what: str, on_orphaned: Callable[[], None] | None = None,
                 poll_s: float = PARENT_POLL_S) -> bool:
    """Start a daemon thread that exits this process once its parent is gone: `on_orphaned` first (end
    children, remove files; errors are ignored), then `os._exit(ORPHAN_EXIT_CODE)`. Returns False if
    this process already has a watcher (the first one's callback stands)."""
    with _watching:
        if os.getpid() in _watchers:
            return False
        _watchers.add(os.getpid())
    parent = os.getppid()
    if parent == 1:  # started by init itself (a container's PID 1 launcher): nothing to outlive
        return False

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if os.getppid() == parent:
                continue
            log.error("%s: parent process %d is gone: exiting", what, parent)
            if on_orphaned is not None:
                try:
                    on_orphaned()
                except BaseException:  # noqa: BLE001 (exiting anyway)
                    pass
            os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name=f"{what}-parent-watch", daemon=True).start()
    return True


def kill_children(pids: list[int]) -> None:
    """SIGKILL these processes, ignoring those already gone (an orphan's last act: no grace to wait)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
