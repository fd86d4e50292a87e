"""Hand the engine process's freed heap back to the OS now and then (glibc `malloc_trim`).

A long-running engine frees and allocates host buffers of every size (request state, CPU tensors, pickled
messages); glibc keeps freed heap pages mapped, and its mmap threshold rises after large frees, so more of
them land on the heap. RSS then creeps up although nothing is kept (benchmarks/RESULTS.md, the soak row).
`malloc_trim(0)` returns every free page, not only the heap's top; it takes ~10 ms on a few hundred MB of
heap, so it runs while the engine is idle, and at most once a minute while it is busy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Callable

log = logging.getLogger(__name__)

IDLE_INTERVAL_S = 5.0
BUSY_INTERVAL_S = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_size_t]
        fn.restype = ctypes.c_int
    return fn


class HeapTrimmer:
    def __init__(self, idle_interval_s: float = IDLE_INTERVAL_S, busy_interval_s: float = BUSY_INTERVAL_S) -> None:
        self._trim = _malloc_trim()
        self.idle_interval_s = idle_interval_s
        self.busy_interval_s = busy_interval_s
        self.last = 0.0
        self.count = 0

    def maybe_trim(self, now: float, idle: bool) -> bool:
        if self._trim is None:
            return False
        if now - self.last < (self.idle_interval_s if idle else self.busy_interval_s):
            return False
        self._trim(0)
        self.last = now
        self.count += 1
        return True
