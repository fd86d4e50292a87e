"""Cancellation that reaches the engine through an ensemble, on a channel only the server can use.

Triton (2.51) does not mark an in-flight request of a decoupled ensemble step as cancelled when the
client cancels the ensemble: `response_sender.is_cancelled()` stays False and sends keep succeeding,
so the engine would generate to max_tokens for nobody. Triton does mark the steps it schedules after
the cancel, so the detokenizer sees `request.is_cancelled()` (benchmarks/repro_cancel_signals.py
shows both). So an engine response meant for the ensemble's detokenizer carries a `cancel_key`; a
detokenizer that sees its request cancelled sends the key back, and the engine thread aborts that
request on its next loop (freeing its KV pages).

Why no one else can cancel (issue 14, defect 2):
- the key's token is 128 random bits per request (`secrets`), known only to the engine and to
  the steps of that one request; a token the engine did not hand out is ignored;
- the socket is a file in a fresh 0700 directory: only the server's user can reach it (an
  abstract-namespace socket has no permissions at all);
- the key never reaches a client: the engine adds it only to requests whose `return_cancel_key`
  input is set, which the ensemble's tokenizer step does and a direct client does not, and the
  detokenizer has no cancel output. A client that sets it anyway sees the key of its own request.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_NAME = "engine.sock"
DIR_PREFIX = "freetoken-cancel-"
KEY_SEP = "#"  # the token is hex, so the last '#' splits "socket path#token"


class CancelChannel:
    """Engine side: a non-blocking datagram socket that receives cancel tokens it handed out."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))  # mode 0700: the server's user only
        self.path = self.dir / SOCKET_NAME
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.setblocking(False)
        self._uids: dict[str, int] = {}  # token -> request uid, while the request runs

    def register(self, uid: int) -> str:
        """A fresh key that cancels request `uid` until `unregister` (the request finished)."""
        token = secrets.token_hex(16)
        self._uids[token] = uid
        return f"{self.path}{KEY_SEP}{token}"

    def unregister(self, key: str) -> None:
        self._uids.pop(key.rpartition(KEY_SEP)[2], None)

    def poll(self) -> list[int]:
        """uids cancelled since the last poll (never blocks); tokens not handed out are ignored."""
        uids = []
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return uids
            uid = self._uids.get(data.decode("ascii", errors="replace").strip())
            if uid is None:  # forged, or a request that already finished: nothing to cancel
                log.debug("ignoring a cancel token this engine did not hand out (%d bytes)", len(data))
            else:
                uids.append(uid)

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def notify_cancel(key: str) -> bool:
    """Detokenizer side: tell the engine behind `key` that its request was cancelled."""
    path, sep, token = key.rpartition(KEY_SEP)
    # only ever write to a socket a CancelChannel made (the key comes from the ensemble, but a client
    # calling the detokenizer directly could send any string)
    p = Path(path)
    if not sep or not token or p.name != SOCKET_NAME or not p.parent.name.startswith(DIR_PREFIX):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(token.encode("ascii", errors="replace"), os.fspath(p))
            return True
        except OSError:  # the engine is gone or its queue is full: nothing to stop
            return False


class CancelCheckLimiter:
    """Detokenizer side: how often to ask Triton whether a request was cancelled.

    `request.is_cancelled()` is an IPC round trip to the server, and a streaming request reaches
    the detokenizer once per engine step: asking every time doubled the detokenizer's IPC traffic.
    A request (named by its cancel key) is asked on its first response and then at most every
    `interval_s`; a cancel still reaches the engine within one interval. Keys not seen for
    `forget_after_s` are dropped, so the table stays as small as the set of live streams.
    """

    def __init__(self, interval_s: float = 0.2, forget_after_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.forget_after_s = forget_after_s
        self._last: dict[str, float] = {}
        self._next_prune = 0.0

    def due(self, key: str, now: float) -> bool:
        if not key:
            return True  # not from a freetoken engine: nothing to rate-limit by
        if now >= self._next_prune:
            self._last = {k: t for k, t in self._last.items() if now - t < self.forget_after_s}
            self._next_prune = now + self.forget_after_s
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[key] = now
        return True
