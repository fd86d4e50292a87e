"""A one-way message ring in shared memory: the engine process's per-step messages to one `freetoken`
stub without a system call (issue 13, serving parameter `engine_msg_ring_kib`; opt-in, off by default).

Why: the engine process (serving/engine_proc/engine_process.py) sends every step's messages to the stub whose
requests they are. Over a pipe that is a `write()` that also wakes the stub's sleeping engine thread,
paid on the engine's own thread, the one the decode rate depends on: on the H200 host ~9-12 us a
message back to back and ~23-28 us after a 0.7 ms gap (`benchmarks/wake_latency.py`). Here the engine
pickles the step's messages into a ring it shares with the stub (a memory copy); the stub's engine
thread, while it has requests in flight, polls the ring every RING_POLL_S, so the wake-up is paid on
the stub's side, off the engine's path. The price: a step's tokens reach the stub up to a poll later,
so a stream's tokens merge into fewer responses. Measured on the H200 (RESULTS.md, nineteenth
session): more throughput at 16 and 64 streams (+11-28%), one stream unchanged, tokens in lumps (one
stream ~2.3 tokens a response instead of ~1.4): hence opt-in. The pipe stays for everything else
(stats, faults, stop) and for the messages when the ring is off.

Layout: a header of two 8-byte counters on separate cache lines, the bytes written and the bytes read
(monotonic), then `capacity` bytes of records: a 4-byte length, 4 bytes of padding, the payload,
padded to 8 bytes; a record that would cross the end is preceded by a WRAP marker and starts at 0.
One writer (the engine's main thread), one reader (the stub's engine thread). The writer publishes a
record by storing the write counter after the record's bytes; the reader frees space by storing the
read counter after it copied the record out. Each counter is one aligned 8-byte store or load
(memoryview items are copied with a fixed-size memcpy), and the order of the stores is the order the
other process sees them only on a total-store-order CPU (x86-64), so the ring is used only there
(`supported()`); elsewhere the pipe carries the messages.

The ring's file lives in /dev/shm (or the temp directory), 0600, fully allocated up front (a tmpfs
without room fails here, and the engine falls back to the pipe, instead of a SIGBUS later); the
reader unlinks it once mapped, so nothing is left behind whichever side exits first.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile

from freetoken_core.serving.launch.guard import RUN_SHM_PREFIX_ENV

HEADER = 128  # [0]: bytes written, [8] (byte 64): bytes read
RECORD_HEADER = 8
WRAP = 0xFFFFFFFF
# how long the stub's engine thread sleeps between looks while requests are in flight (serving parameter
# engine_msg_ring_poll_us). Not much shorter: a thread that wakes this often retakes the GIL before the stub's
# other threads (the sender, execute) wake on theirs (~50 us here), starving them up to the 5 ms switch interval
# (measured with 50 us on the H200 host: the first response 0.9 ms later, a stream's tokens in lumps). 500 us
# against 250 there: 64 streams +15%, 16 streams -2.5%, one stream the same (RESULTS.md, nineteenth session)
RING_POLL_S = 500e-6
FULL_WAIT_S = 50e-6  # how long the engine sleeps before it looks again at a full ring


def supported() -> bool:
    """Whether this CPU keeps the order of one process's stores for another (total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _align8(n: int) -> int:
    return (n + 7) & ~7


class MsgRing:
    """One end of a ring: `MsgRing.create(capacity)` (the writer, in the engine process) or
    `MsgRing.attach(path)` (the reader, in the stub)."""

    def __init__(self, path: str, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self._buf = buf = memoryview(mm)
        self._counters = buf[:HEADER].cast("Q")
        self._data = buf[HEADER:]
        self._lengths = self._data.cast("I")
        self.capacity = len(self._data)
        # the largest payload put() takes (a step's messages larger than this are split by the caller)
        self.max_payload = self.capacity // 4 - RECORD_HEADER
        self._read = self._counters[8]  # the reader's position (only the reader stores it)

    @classmethod
    def create(cls, capacity: int) -> "MsgRing":
        capacity = max(_align8(capacity), 4096)
        # under `serve` the file takes the run's prefix, so the guard removes it if the server is killed
        prefix = os.environ.get(RUN_SHM_PREFIX_ENV, "freetoken-") + "ring-"
        fd, path = tempfile.mkstemp(prefix=prefix, dir=_shm_dir())
        try:
            os.posix_fallocate(fd, 0, HEADER + capacity)  # ENOSPC now, not a SIGBUS on a later write
            mm = mmap.mmap(fd, HEADER + capacity)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return cls(path, mm)

    @classmethod
    def attach(cls, path: str) -> "MsgRing":
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        ring = cls(path, mm)
        ring.unlink()  # both ends hold a mapping now: the name is no longer needed
        return ring

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # --- the writer ---------------------------------------------------------------------------
    def put(self, payload: bytes) -> bool:
        """Append one record; False when the reader has not yet freed the room for it (try again later).
        A payload over `max_payload` raises ValueError."""
        n = len(payload)
        if n > self.max_payload:
            raise ValueError(f"a ring record holds at most {self.max_payload} bytes, got {n}")
        size = RECORD_HEADER + _align8(n)
        written = self._counters[0]
        free = self.capacity - (written - self._counters[8])
        offset = written % self.capacity
        skip = self.capacity - offset if offset + size > self.capacity else 0
        if free < skip + size:
            return False
        if skip:
            self._lengths[offset // 4] = WRAP
            offset = 0
        self._data[offset + RECORD_HEADER:offset + RECORD_HEADER + n] = payload
        self._lengths[offset // 4] = n
        self._counters[0] = written + skip + size  # publishes the record (after its bytes)
        return True

    # --- the reader ---------------------------------------------------------------------------
    def take(self) -> list[bytes]:
        """Every record written since the last call, in order (copied out, then their room freed)."""
        written = self._counters[0]
        read = self._read
        if read == written:
            return []
        out = []
        while read < written:
            offset = read % self.capacity
            n = self._lengths[offset // 4]
            if n == WRAP:
                read += self.capacity - offset
                continue
            out.append(bytes(self._data[offset + RECORD_HEADER:offset + RECORD_HEADER + n]))
            read += RECORD_HEADER + _align8(n)
        self._read = read
        self._counters[8] = read  # frees the room (after the copies)
        return out

    def discard(self) -> None:
        """The writer's end when its reader may never have attached: the name removed, the mapping closed."""
        self.unlink()
        self.close()

    def close(self) -> None:
        if self._mm.closed:
            return
        for view in (self._lengths, self._data, self._counters, self._buf):
            view.release()
        self._mm.close()
