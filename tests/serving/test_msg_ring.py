"""The engine process's shared-memory message ring (serving/engine_proc/msg_ring.py): every record comes out once, in
order, whole, across processes and across the wrap at the end; a full ring refuses instead of overwriting;
the file is gone once the reader mapped it. The engine process's own tests (test_engine_process.py) run
with the ring on (the default) and off."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import pytest

from freetoken_core.serving.engine_proc.msg_ring import MsgRing, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the ring is used on x86-64 only")


def _payload(i: int, rng: random.Random) -> bytes:
    n = rng.choice([1, 7, 8, 9, 63, 200, 900])
    return i.to_bytes(4, "little") + bytes((i + k) % 251 for k in range(n))


def _writer(path_q, count: int, capacity: int, seed: int) -> None:
    ring = MsgRing.create(capacity)
    path_q.put(ring.path)
    rng = random.Random(seed)
    for i in range(count):
        payload = _payload(i, rng)
        while not ring.put(payload):  # the reader frees room as it goes
            time.sleep(1e-5)
    ring.close()  # the reader's mapping outlives the writer's


def test_records_cross_processes_in_order_through_many_wraps():
    """A 4 KiB ring, records of 9 to 908 bytes, 3000 of them: hundreds of wraps and many full-ring waits."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    count, seed = 3000, 7
    proc = ctx.Process(target=_writer, args=(q, count, 4096, seed))
    proc.start()
    try:
        ring = MsgRing.attach(q.get(timeout=60))
        assert not os.path.exists(ring.path)  # unlinked once mapped
        rng = random.Random(seed)
        got = 0
        deadline = time.monotonic() + 60
        while got < count:
            assert time.monotonic() < deadline, f"only {got} of {count} records arrived"
            for record in ring.take():
                assert record == _payload(got, rng), f"record {got} differs"
                got += 1
        proc.join(60)
        assert ring.take() == []
        ring.close()
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_a_full_ring_refuses_and_takes_again_once_read():
    writer = MsgRing.create(4096)
    reader = MsgRing.attach(writer.path)
    try:
        record = b"x" * 1000  # 1008 bytes a record: four fit in 4096
        assert [writer.put(record) for _ in range(5)] == [True] * 4 + [False]
        assert reader.take() == [record] * 4
        assert writer.put(record) and writer.put(b"y")  # the next crosses the end: it wraps to the start
        assert reader.take() == [record, b"y"]
        with pytest.raises(ValueError, match="at most 1016 bytes"):
            writer.put(b"z" * 1017)
    finally:
        writer.close()
        reader.close()


def test_an_unattached_ring_is_removed_by_its_writer():
    writer = MsgRing.create(4096)
    assert os.path.exists(writer.path) and (os.stat(writer.path).st_mode & 0o777) == 0o600
    writer.discard()
    assert not os.path.exists(writer.path)
