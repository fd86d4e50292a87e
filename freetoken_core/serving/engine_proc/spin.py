"""Busy-waiting before a blocking wait, across the engine process's pipe at one stream (serving parameter
`idle_spin_us`; opt-in until measured).

Why: a lone request crosses the pipe between a `freetoken` instance and the engine process twice on its critical
path: its arrival (the idle engine process's main thread wakes for it) and each step's message back (the instance's
engine thread wakes for it). A blocked waiter costs a wake-up, on the H200 host 50-110 us at the median and
200-370 us at the 99th percentile (benchmarks/wake_latency.py), more when its core went idle and its caches cold; a
waiter that looks again and again for a while sees the hand-off in a few microseconds. It costs a CPU meanwhile, so
only while at most SPIN_MAX_ACTIVE requests are in flight (a host has CPUs to spare then), for at most
`idle_spin_us`, and only in these two waits: each spinner gives the GIL up between looks (`time.sleep(0)`), but a
Python thread that spins still delays the other threads of its process that want the GIL, so the threads that
hand work to each other inside one process (execute -> engine thread -> sender) keep blocking as before.
"""

from __future__ import annotations

import time
from typing import Callable

SPIN_MAX_ACTIVE = 1  # spin only while this few requests are in flight (more: the CPUs are better used elsewhere)


def spin_until(ready: Callable[[], bool], spin_s: float) -> bool:
    """Look at `ready` back to back for up to `spin_s` seconds; True as soon as it holds. Between looks the GIL is
    let go (`time.sleep(0)`), so this process's other threads, one of which may make `ready` true, run meanwhile."""
    if ready():
        return True
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        time.sleep(0)
        if ready():
            return True
    return False
