"""Busy-waiting before a blocking wait, for the hand-offs of a lightly loaded served path (serving parameter
`idle_spin_us`; opt-in until measured).

Why: at one stream a request crosses several hand-offs inside our processes (the `freetoken` instance's execute
thread to its engine thread, that thread to the engine process, the step's messages back, the engine thread to
the sender), and each blocked waiter costs a wake-up: on the H200 host 50-110 us at the median and 200-370 us at
the 99th percentile (benchmarks/wake_latency.py), more when the waiter's core went idle and its caches cold. A
waiter that looks again and again for a short while instead sees the hand-off in a few microseconds. It costs a
CPU while it spins, so the served path spins only where at most SPIN_MAX_ACTIVE requests are in flight (there a
host has CPUs to spare) and for at most `idle_spin_us`, then blocks as before.
"""

from __future__ import annotations

import time
from typing import Callable

SPIN_MAX_ACTIVE = 1  # spin only while this few requests are in flight (more: the CPUs are better used elsewhere)


def spin_until(ready: Callable[[], bool], spin_s: float) -> bool:
    """Look at `ready` back to back for up to `spin_s` seconds; True as soon as it holds. Between looks the GIL is
    let go (`time.sleep(0)`), so this process's other threads, one of which makes `ready` true, run meanwhile."""
    if ready():
        return True
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        time.sleep(0)
        if ready():
            return True
    return False
