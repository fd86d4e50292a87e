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
- the directory is named after a random engine id (`freetoken-cancel-<id:08x>`), so that the
  detokenizer can find the engine's second socket, `acks.sock`, from the id alone (below); the name
  grants nothing: the directory is created 0700 by the engine, and an existing one is never reused;
- the key never reaches a client: the engine adds it only to requests whose `ensemble_key` input
  holds the server's secret, which the ensemble's tokenizer step sends and a direct client cannot
  (serving/triton/ensemble_secret.py), and the detokenizer has no cancel output.

Delivery acks (issue 13) use the same directory: every streamed ensemble response carries
(engine id, request uid, response seq) in its `meta` tensor; the detokenizer, after it has sent a
response on (decoupled: `send()` returns once the ensemble took it), sends the engine one datagram
per execute listing what it delivered (`AckSender`). The engine lets a request have only a bounded
number of responses in the detokenizer's queue (serving/engine_proc/engine_loop.py): that is its flow control
(tokens merge while the detokenizer is behind, and only then) and, with several detokenizer
instances, what keeps a stream's responses in order. A forged ack can only make the engine send a
response sooner; acks are ints in a fixed format, never parsed as anything else.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np

from freetoken_core.serving.stream.send_order import ORDER_FILE, OrderTable

log = logging.getLogger(__name__)

SOCKET_NAME = "engine.sock"
ACK_SOCKET_NAME = "acks.sock"
DIR_PREFIX = "freetoken-cancel-"
KEY_SEP = "#"  # the token is hex, so the last '#' splits "socket path#token"
ACK_DTYPE = np.dtype("<i4")  # an ack datagram: int32 pairs (uid, seq)


def channel_dir(engine_id: int) -> Path:
    return Path(tempfile.gettempdir()) / f"{DIR_PREFIX}{engine_id:08x}"


@functools.lru_cache(maxsize=1024)
def ack_socket_path(engine_id: int) -> str:
    """Where the engine with this id receives delivery acks (the detokenizer's side computes it, once per
    engine: building the Path on every flush cost more than the sendto)."""
    return os.fspath(channel_dir(engine_id) / ACK_SOCKET_NAME)


def _make_channel_dir() -> tuple[int, Path]:
    for _ in range(100):
        engine_id = secrets.randbelow(2**31 - 1) + 1
        d = channel_dir(engine_id)
        try:
            os.mkdir(d, 0o700)  # fails if it exists: never reuse (or trust) a directory someone else made
        except FileExistsError:
            continue
        os.chmod(d, 0o700)  # whatever the umask
        return engine_id, d
    raise RuntimeError(f"could not create a fresh {DIR_PREFIX}* directory in {tempfile.gettempdir()}")


class CancelChannel:
    """Engine side: a non-blocking datagram socket that receives cancel tokens it handed out, and
    one that receives delivery acks (`poll_acks`)."""

    def __init__(self, send_order: bool = False) -> None:
        self.engine_id, self.dir = _make_channel_dir()  # mode 0700: the server's user only
        self.path = self.dir / SOCKET_NAME
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.setblocking(False)
        self.ack_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ack_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.ack_sock.bind(str(self.dir / ACK_SOCKET_NAME))
        self.ack_sock.setblocking(False)
        self._uids: dict[str, int] = {}  # token -> request uid, while the request runs
        # detok_send_order: the streams' send order, shared with the detokenizer instances (send_order.py)
        self.order = OrderTable(self.dir / ORDER_FILE, create=True) if send_order else None

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

    def poll_acks(self) -> list[np.ndarray]:
        """Ack datagrams received since the last poll, each an int32 array [uid0, seq0, uid1, seq1, ...]."""
        out = []
        while True:
            try:
                data = self.ack_sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError:  # closed
                return out
            if len(data) % 8 == 0:
                out.append(np.frombuffer(data, dtype=ACK_DTYPE))

    def close(self) -> None:
        self.sock.close()
        self.ack_sock.close()
        if self.order is not None:
            self.order.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class AckSender:
    """Detokenizer side: collect (engine id, uid, seq) of the responses sent on in one execute, then
    tell each engine in one datagram (`flush`). Never raises: a lost ack only delays that stream
    until the engine's ack timeout."""

    def __init__(self) -> None:
        self._pending: dict[int, list[int]] = {}
        self._sock: socket.socket | None = None

    def add(self, engine_id: int, uid: int, seq: int) -> None:
        if engine_id > 0:
            self._pending.setdefault(engine_id, []).extend((uid, seq))

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.settimeout(1.0)  # the engine drains it continuously; never block an execute long
        for engine_id, values in pending.items():
            data = np.asarray(values, dtype=ACK_DTYPE).tobytes()
            try:
                for i in range(0, len(data), 1 << 15):  # datagrams of at most 4096 acks
                    self._sock.sendto(data[i:i + (1 << 15)], ack_socket_path(engine_id))
            except OSError as e:  # engine gone (request finished / model unloaded), or its queue full
                log.debug("ack to engine %08x not delivered: %s", engine_id, e)


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
    A request (named by its cancel key) is asked at most every `interval_s`, from the response that
    carries its key after the first one: not on the first response itself, whose latency is the client's time
    to first token (and at one stream part of every request's time); the engine sends the key again
    one interval later (stream/state.py CANCEL_KEY_INTERVAL_S), so a cancel still reaches the engine within
    about one interval. Keys not seen for `forget_after_s` are dropped, so the table stays as small as
    the set of live streams.
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
        if last is None:  # its first response: not asked (see above); counted as asked half an interval
            self._last[key] = now - self.interval_s / 2  # ago, so the key's next coming is asked whatever its jitter
            return False
        if now - last < self.interval_s:
            return False
        self._last[key] = now
        return True
