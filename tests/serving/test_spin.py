"""idle_spin_us (serving/engine_proc/spin.py): across the engine process's pipe, the waiters of a lone request look for their
next message a while before they block. What it buys is measured on the GPU host (benchmarks/); here: that a spin
wakes on the hand-off and gives up after its time. The engine process and its client spinning are tested with a
real child in test_engine_process.py, a served run with it on in test_batched_streams.py."""

from __future__ import annotations

import threading
import time

from freetoken_core.serving.engine_proc.spin import spin_until


def test_spin_sees_the_hand_off_of_another_thread():
    flag = threading.Event()
    threading.Timer(0.02, flag.set).start()
    assert spin_until(flag.is_set, 5.0)  # long enough never to run out first, even on a loaded box
    assert flag.is_set()


def test_spin_gives_up_after_its_time_and_answers_at_once_when_ready():
    t0 = time.perf_counter()
    assert not spin_until(lambda: False, 0.01)
    assert time.perf_counter() - t0 >= 0.01
    assert spin_until(lambda: True, 0.0)
