"""The engine process's pipe writes on a thread of their own (serving parameter `engine_send_thread`, opt-in).

Why: the engine process's main thread steps the scheduler, and whatever else it does between two steps delays
the next one when the host is busy. Each step it sends that step's messages to every instance with a request in it
(one `Connection.send` an instance: 6 at 16 streams with six `freetoken` instances), and on the H200 host a send
costs that thread ~21 us of system call (the write and the reader's wake-up) on top of ~6 us of pickling
(benchmarks/RESULTS.md, nineteenth session): ~0.1 ms of a ~1.2 ms step. With this on, the main thread pickles and
queues; a writer thread does the writes, which release the GIL, while the main thread goes on (on the engine's
second hyperthread with `engine_cpus`).

Order: one thread and one FIFO, so each connection's messages keep the order the main thread queued them in.
A failed write (the instance went away) is reported back (`broken`), never raised here: the main thread, which
owns the scheduler, drops that instance. Connections are closed by this thread too (`close_after`), after what was
queued before, so no write ever races a close of its file descriptor.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger(__name__)

_CLOSE = object()  # in place of a payload: close the connection
_STOP = None
FLUSH_TIMEOUT_S = 10.0  # at exit: how long the queued messages may take to go out


class PipeWriter:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Any, Any] | None] = queue.SimpleQueue()
        self._broken: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="freetoken-engine-writer", daemon=True)
        self._thread.start()

    def put(self, index: int, conn: Any, payload: bytes) -> None:
        """Queue one pickled item for connection `index` (`conn.recv()` on the other side unpickles it)."""
        self._queue.put((index, conn, payload))

    def close_after(self, index: int, conn: Any) -> None:
        """Close `conn` once what was queued for it before has been written (or has failed)."""
        self._queue.put((index, conn, _CLOSE))

    def broken(self) -> list[int]:
        """The connections whose writes failed since the last call (each may appear more than once)."""
        out = []
        while True:
            try:
                out.append(self._broken.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Write what is queued, then end the thread (the engine process is exiting)."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the engine's pipe writer did not finish within %.0f s", timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            index, conn, payload = item
            try:
                if payload is _CLOSE:
                    conn.close()
                else:
                    conn.send_bytes(payload)
            except (OSError, ValueError):  # the other side is gone, or the connection was closed already
                if payload is not _CLOSE:
                    self._broken.put(index)
