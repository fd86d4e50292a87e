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
