"""The engine process's heap trimmer: often while idle, rarely while busy, and it really calls malloc_trim."""

from __future__ import annotations

from freetoken_core.serving.engine_proc.heap_trim import HeapTrimmer


def test_trims_on_its_intervals():
    trimmer = HeapTrimmer(idle_interval_s=5.0, busy_interval_s=60.0)
    assert trimmer._trim is not None, "glibc's malloc_trim was not found"
    assert trimmer.maybe_trim(1000.0, idle=True)
    assert not trimmer.maybe_trim(1004.0, idle=True)
    assert trimmer.maybe_trim(1005.5, idle=True)
    assert not trimmer.maybe_trim(1030.0, idle=False)  # busy: once a minute at most
    assert trimmer.maybe_trim(1066.0, idle=False)
    assert trimmer.count == 3
