"""How long the served path's hand-offs take on this host (issue 13: one stream's request crosses ~10 of them).

Each row: a sender stamps time.perf_counter() (CLOCK_MONOTONIC, comparable across processes) and hands over;
the receiver stamps when it has the item. Hand-offs are spaced GAP_MS apart, so the receiving thread's core
idles in between as it does between one request's end and the next one's start at one stream. Rows:
- thread Event: a blocked `Event.wait()` woken by `set()` (the stub's execute -> engine thread);
- thread SimpleQueue: a blocked `get(timeout)` woken by `put()` (the engine process's reader -> main thread);
- process pipe, blocked: `Connection.recv()` in another process (stub <-> engine process);
- process pipe, spinning: the receiver polls `Connection.poll(0)` in a loop instead of blocking;
- thread SimpleQueue, spinning: `get_nowait()` + `time.sleep(0)` in a loop.
Then the cost of one step's message on the engine process's pipe (encode + pickle + write), per call, and the
engine main thread's time for one step's messages to INSTANCES pipes (the writer thread that took that time off
it, engine_send_thread, was measured slower served and removed: benchmarks/RESULTS.md, twenty-second session).

  python3 benchmarks/wake_latency.py [--n 300] [--gap-ms 5] [--instances 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import threading
import time


def _summary(name: str, lat_s: list[float]) -> str:
    us = sorted(1e6 * x for x in lat_s)
    return (f"| {name} | {statistics.median(us):.1f} | {us[int(0.9 * len(us))]:.1f} | "
            f"{us[min(len(us) - 1, int(0.99 * len(us)))]:.1f} |")


def thread_event(n: int, gap: float) -> list[float]:
    ev, done, lat = threading.Event(), threading.Event(), []
    sent = [0.0]

    def waiter() -> None:
        for _ in range(n):
            ev.wait()
            lat.append(time.perf_counter() - sent[0])
            ev.clear()
            done.set()

    t = threading.Thread(target=waiter)
    t.start()
    for _ in range(n):
        time.sleep(gap)
        done.clear()
        sent[0] = time.perf_counter()
        ev.set()
        done.wait()
    t.join()
    return lat


def _stamp_and_collect(n: int, gap: float, send, receive_latency) -> list[float]:
    """n hand-offs `gap` apart: each sends the time it was sent, the receiver answers how late it saw it."""
    lat = []
    for _ in range(n):
        time.sleep(gap)
        send(time.perf_counter())
        lat.append(receive_latency())
    return lat


def thread_queue(n: int, gap: float, spin: bool) -> list[float]:
    q: queue.SimpleQueue = queue.SimpleQueue()
    back: queue.SimpleQueue = queue.SimpleQueue()

    def waiter() -> None:
        for _ in range(n):
            if spin:
                while True:
                    try:
                        t0 = q.get_nowait()
                        break
                    except queue.Empty:
                        time.sleep(0)
            else:
                t0 = q.get(timeout=10.0)
            back.put(time.perf_counter() - t0)

    t = threading.Thread(target=waiter)
    t.start()
    lat = _stamp_and_collect(n, gap, q.put, back.get)
    t.join()
    return lat


def _pipe_receiver(conn, back, n: int, spin: bool) -> None:
    for _ in range(n):
        if spin:
            while not conn.poll(0):
                pass
        t0 = conn.recv()
        back.send(time.perf_counter() - t0)


def process_pipe(n: int, gap: float, spin: bool) -> list[float]:
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    back_r, back_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_pipe_receiver, args=(r, back_w, n, spin))
    p.start()
    lat = _stamp_and_collect(n, gap, w.send, back_r.recv)
    p.join()
    return lat


def _drain(conn, spin: bool) -> None:
    while True:
        if spin:
            while not conn.poll(0):
                pass
        else:
            conn.poll(None)
        try:
            if conn.recv() is None:
                return
        except EOFError:
            return


def _step_item() -> tuple:
    """One step's message for one instance, as EngineServer sends it."""
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.engine_proc.protocol import encode

    return [encode(DetokenizeMsg(5, [1234], num_prompt_tokens=128, num_output_tokens=7))]  # a StepBatch (protocol.py)


def _start_drains(count: int, spin: bool) -> tuple[list, list]:
    """COUNT pipes, each read by a process of its own (blocked in poll, or spinning); their write ends once the
    readers are up."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(count)]
    procs = [ctx.Process(target=_drain, args=(r, spin)) for r, _ in pipes]
    for p in procs:
        p.start()
    writers = []
    for r, w in pipes:
        r.close()
        w.send(_step_item())
        writers.append(w)
    time.sleep(0.5)  # the readers are up
    return writers, procs


def _stop_drains(writers: list, procs: list) -> None:
    for w in writers:
        w.send(None)
        w.close()
    for p in procs:
        p.join()


def message_cost(n: int, gap: float, spin: bool) -> tuple[float, float]:
    """(encode + pickle, encode + pickle + Connection.send) per message, messages GAP apart, the reader
    blocked in poll (as the stub's engine thread is between steps) or spinning."""
    import pickle

    (w,), procs = _start_drains(1, spin)
    pickled, sent = [], []
    for _ in range(n):
        time.sleep(gap)
        t0 = time.perf_counter()
        pickle.dumps(_step_item())
        t1 = time.perf_counter()
        w.send(_step_item())
        t2 = time.perf_counter()
        pickled.append(t1 - t0)
        sent.append(t2 - t1 + (t1 - t0))
    _stop_drains([w], procs)
    return statistics.median(pickled), statistics.median(sent)


def step_send_cost(n: int, gap: float, instances: int) -> float:
    """The engine main thread's time to send one step's messages to INSTANCES pipes (one message each, as
    EngineServer._send does), steps GAP apart, the readers blocked in poll. Median seconds a step."""
    writers, procs = _start_drains(instances, spin=False)
    costs = []
    for _ in range(n):
        time.sleep(gap)
        t0 = time.perf_counter()
        for w in writers:
            w.send(_step_item())
        costs.append(time.perf_counter() - t0)
    _stop_drains(writers, procs)
    return statistics.median(costs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--instances", type=int, default=6, help="pipes a step's messages go to (step_send_cost)")
    a = ap.parse_args()
    gap = a.gap_ms / 1e3
    print(f"hand-off latency, {a.n} hand-offs {a.gap_ms:g} ms apart")
    print("| hand-off | p50 us | p90 us | p99 us |\n|---|---|---|---|")
    print(_summary("thread Event (blocked wait)", thread_event(a.n, gap)))
    print(_summary("thread SimpleQueue (blocked get)", thread_queue(a.n, gap, spin=False)))
    print(_summary("thread SimpleQueue (spinning get_nowait + sleep(0))", thread_queue(a.n, gap, spin=True)))
    print(_summary("process pipe (blocked recv)", process_pipe(a.n, gap, spin=False)))
    print(_summary("process pipe (spinning poll(0))", process_pipe(a.n, gap, spin=True)))
    for spin in (False, True):
        pickled, sent = message_cost(a.n, 0.0007, spin)
        print(f"one step's message on the engine pipe, 0.7 ms apart, reader {'spinning' if spin else 'blocked'}: "
              f"encode + pickle {1e6 * pickled:.2f} us, + Connection.send {1e6 * sent:.2f} us (medians)")
    cost = step_send_cost(a.n, 0.0012, a.instances)
    print(f"one step's messages to {a.instances} pipes, 1.2 ms apart, Connection.send each: {1e6 * cost:.1f} us of the "
          f"engine's main thread a step (median)")


if __name__ == "__main__":
    main()
