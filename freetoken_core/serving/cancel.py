"""Cancellation that reaches the engine through an ensemble.

Triton (2.51) does not mark an in-flight request of a decoupled ensemble step as cancelled when the
client cancels the ensemble: `response_sender.is_cancelled()` stays False and sends keep succeeding,
so the engine would generate to max_tokens for nobody. The next step, the detokenizer, does see
`request.is_cancelled()`. So every engine response carries a `cancel_key` naming the engine's
cancel channel (an abstract-namespace Unix datagram socket, local to the host, nothing on disk) and
the request; a detokenizer that sees a cancelled request sends the key there, and the engine
thread aborts that request on its next loop (freeing its KV pages).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket

log = logging.getLogger(__name__)
_counter = itertools.count()


class CancelChannel:
    """Engine side: a non-blocking datagram socket that receives cancel keys."""

    def __init__(self) -> None:
        self.name = f"freetoken-cancel-{os.getpid()}-{next(_counter)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.setblocking(False)

    def key(self, uid: int) -> str:
        return f"{self.name}:{uid}"

    def poll(self) -> list[int]:
        """uids cancelled since the last poll (never blocks)."""
        uids = []
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return uids
            try:
                uids.append(int(data.decode().rsplit(":", 1)[1]))
            except (ValueError, IndexError):
                log.warning("ignoring malformed cancel message %r", data[:64])

    def close(self) -> None:
        self.sock.close()


def notify_cancel(key: str) -> bool:
    """Detokenizer side: tell the engine behind `key` that its request was cancelled."""
    name, sep, _ = key.rpartition(":")
    if not sep or not name.startswith("freetoken-cancel-"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(key.encode(), "\0" + name)
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
