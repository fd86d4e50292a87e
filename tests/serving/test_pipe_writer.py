"""engine_send_thread (serving/pipe_writer.py): the engine process's pipe writes on a thread of their own keep each
connection's order, report a broken connection instead of raising, close a connection only after what was queued
for it, and flush at exit."""

from __future__ import annotations

import multiprocessing
import pickle
import threading

from freetoken_core.serving.pipe_writer import PipeWriter


def pickled(item) -> bytes:
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def test_each_connection_gets_its_items_in_order_and_recv_unpickles_them():
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(3)]
    writer = PipeWriter()
    received: list[list] = [[] for _ in pipes]

    def drain(i: int) -> None:
        while True:
            item = pipes[i][0].recv()
            if item == "end":
                return
            received[i].append(item)

    readers = [threading.Thread(target=drain, args=(i,)) for i in range(3)]
    for t in readers:
        t.start()
    # more than a pipe buffer holds (64 KiB): the writer blocks on a slow reader, the queue keeps the rest
    for n in range(600):
        for i, (_, w) in enumerate(pipes):
            writer.put(i, w, pickled(("msgs", [(n, i, "x" * 300)])))
    for i, (_, w) in enumerate(pipes):
        writer.put(i, w, pickled("end"))
    writer.close()
    for t in readers:
        t.join(10)
        assert not t.is_alive()
    for i in range(3):
        assert received[i] == [("msgs", [(n, i, "x" * 300)]) for n in range(600)]
    assert writer.broken() == []


def test_a_broken_connection_is_reported_not_raised_and_the_others_go_on():
    (r0, w0), (r1, w1) = multiprocessing.Pipe(duplex=False), multiprocessing.Pipe(duplex=False)
    r1.close()  # instance 1 went away
    writer = PipeWriter()
    writer.put(1, w1, pickled("lost"))
    writer.put(0, w0, pickled("kept"))
    writer.close()
    assert r0.recv() == "kept"
    assert writer.broken() == [1]
    assert writer.broken() == []  # drained


def test_close_after_closes_once_the_queued_writes_are_out():
    r, w = multiprocessing.Pipe(duplex=False)
    writer = PipeWriter()
    writer.put(0, w, pickled("first"))
    writer.close_after(0, w)
    writer.put(0, w, pickled("after the close"))  # written to a closed connection: reported, never raised
    writer.close()
    assert r.recv() == "first"
    assert w.closed
    assert writer.broken() == [0]
    try:
        r.recv()
        raise AssertionError("the connection stayed open")
    except EOFError:
        pass
