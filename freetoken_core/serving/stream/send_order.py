"""Per-stream send order across detokenizer instances (issue 13, `detok_send_order`).

Why: with several detokenizer instances, two responses of one stream may be detokenized by two
instances at once, and the later one could reach the client first. Without this module the engine
keeps one response per stream in flight (the ack, serving/stream/cancel.py), so a stream gets at most one
response per detokenizer round trip (3-4 ms at 16 streams on the H200) and its tokens merge.

How: the engine gives each acked ensemble stream a slot in a small table in shared memory (a file in
the engine's private 0700 channel directory, serving/stream/cancel.py) and numbers its responses. A
detokenizer instance sends response `seq` of a slot only once the slot says `seq` is next, then
advances it. Each slot word is (stream tag << 32 | next seq): a reused slot never matches a stale
stream's responses.

Why waiting inside a detokenizer's execute cannot deadlock: Triton core hands a non-batched model's
requests to its instances from one FIFO queue (rate_limiter.cc, EnqueuePayload / DequeuePayload), and a
Python instance runs one execute at a time. The engine sends a stream's responses in order, so when
response k is taken by an instance, k-1 was taken before it by an instance that runs it now: the
oldest response in flight never waits. A response that never comes (a dropped request) costs the next
one `wait_timeout_s`, after which it goes anyway (logged).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

ORDER_FILE = "order"
# Slots per engine instance: more than max_running_req can ever be (streams wait for a slot's final
# response to be sent before the slot is reused). A stream that finds none free runs without ordering,
# one response in flight (what keeps it in order without the table).
ORDER_SLOTS = 4096
TAG_MASK = 0x7FFFFFFF
WAIT_TIMEOUT_S = 1.0  # only a response that never comes lets it run out


def _word(tag: int, seq: int) -> int:
    return ((tag & TAG_MASK) << 32) | (seq & 0xFFFFFFFF)


class OrderTable:
    """int64 slot words in a shared file: (tag << 32 | the seq that may be sent next)."""

    def __init__(self, path: Path, create: bool, slots: int = ORDER_SLOTS) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, slots * 8)
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        # aligned 8-byte loads and stores: one word is never seen half written
        self.words = np.frombuffer(self._mmap, dtype=np.int64)
        self.slots = self.words.size

    def start(self, slot: int, tag: int) -> None:
        """Engine: slot now belongs to stream `tag`, whose first response is seq 0."""
        self.words[slot] = _word(tag, 0)

    def wait_turn(self, slot: int, tag: int, seq: int, timeout_s: float = WAIT_TIMEOUT_S) -> bool:
        """Detokenizer: block until response `seq` of stream `tag` is next (True), or timeout_s (False)."""
        if not 0 <= slot < self.slots:
            return False
        want = _word(tag, seq)
        words = self.words
        if int(words[slot]) == want:
            return True
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while int(words[slot]) != want:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)  # the previous response is in another instance's execute: ~0.1-1 ms
            pause = min(pause * 2, 500e-6)
        return True

    def sent(self, slot: int, tag: int, seq: int) -> None:
        """Detokenizer: response `seq` went on; the next may go. Never moves a slot back (a response that
        went after a timeout may have overtaken it) and never touches another stream's slot."""
        if not 0 <= slot < self.slots:
            return
        cur = int(self.words[slot])
        if cur >> 32 == tag & TAG_MASK and (cur & 0xFFFFFFFF) <= seq:
            self.words[slot] = _word(tag, seq + 1)

    def close(self) -> None:
        del self.words
        try:
            self._mmap.close()
        except BufferError:  # a view still exists somewhere: the mapping goes with the process
            pass


class SlotAllocator:
    """Engine side (the sender thread): slots of its OrderTable for acked streams."""

    def __init__(self, table: OrderTable) -> None:
        self.table = table
        self._free = list(range(table.slots - 1, -1, -1))

    def take(self, tag: int) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.table.start(slot, tag)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


class SendOrder:
    """Detokenizer side: the engines' order tables, opened on first use (by the engine id in `meta`)."""

    def __init__(self, channel_dir_of, wait_timeout_s: float = WAIT_TIMEOUT_S) -> None:
        self._dir_of = channel_dir_of
        self._tables: dict[int, OrderTable] = {}
        self.wait_timeout_s = wait_timeout_s
        self._late = 0

    def _table(self, engine_id: int) -> OrderTable | None:
        if engine_id not in self._tables:
            try:
                self._tables[engine_id] = OrderTable(self._dir_of(engine_id) / ORDER_FILE, create=False)
            except OSError as e:  # the engine is gone (unloaded): nothing to order
                log.debug("order table of engine %08x: %s", engine_id, e)
                return None
        return self._tables[engine_id]

    def wait_turn(self, engine_id: int, slot: int, tag: int, seq: int) -> None:
        table = self._table(engine_id)
        if table is not None and not table.wait_turn(slot, tag, seq, self.wait_timeout_s):
            self._late += 1
            if self._late in (1, 10, 100) or self._late % 1000 == 0:
                log.warning("a streamed response waited %.0f ms for the one before it (%d times so far): "
                            "sending it anyway", 1e3 * self.wait_timeout_s, self._late)

    def sent(self, engine_id: int, slot: int, tag: int, seq: int) -> None:
        table = self._tables.get(engine_id)
        if table is not None:
            table.sent(slot, tag, seq)
