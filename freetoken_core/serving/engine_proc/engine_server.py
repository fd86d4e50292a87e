"""The child side of serving/engine_proc/engine_process.py: the engine process's main and its loop.

`EngineServer` takes the commands of the instance that started it (connection 0: a pipe pair) and, for
a shared engine (serving/engine_proc/engine_share.py), of the members that joined on its listener; it steps the
Scheduler back to back and sends each message to the instance whose request it is.
"""

from __future__ import annotations

import logging
import dataclasses
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from typing import Any

from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.lifetime import watch_parent
from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.engine_proc.cpu_affinity import format_cpu_list, pin_this_process
from freetoken_core.serving.engine_proc.engine_share import MAX_INSTANCES
from freetoken_core.serving.engine_proc.faults import FaultSpec, install_fault_hook, is_device_fatal
from freetoken_core.serving.engine_proc.gc_freeze import freeze_startup_heap
from freetoken_core.serving.engine_proc.heap_trim import HeapTrimmer
from freetoken_core.serving.engine_proc.msg_ring import FULL_WAIT_S, MsgRing, supported
from freetoken_core.serving.engine_proc.protocol import (Abort, AddRequest, Bye, Dead, Failed, Ready, Stats, StepBatch,
                                                        Stop, Stopped, encode)
from freetoken_core.serving.report import REPORT_INTERVAL_S, configure_logging, percentile

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often a busy child sends its EngineStats (an idle one sends once)
STOPPED = "the engine stopped (the model is unloading)"


def make_ring(capacity: int) -> MsgRing | None:
    """A message ring for one instance (serving/engine_proc/msg_ring.py), or None: off (capacity 0), not on this CPU, or
    no room in shared memory (then the pipe carries the messages, as it always can)."""
    if capacity <= 0 or not supported():
        return None
    try:
        return MsgRing.create(capacity)
    except OSError as e:
        log.warning("no shared-memory message ring (%s): the step messages go over the pipe", e)
        return None


@dataclass
class StepPace:
    """The engine process's own time a step while it steps back to back, logged every REPORT_INTERVAL_S: beside the
    pace a client sees its tokens at (benchmarks/pa_export.py --arrivals) it tells the engine's share from the
    delivery's (issue 13: served one stream ran ~3 us a step slower than the engine alone)."""

    t0: float = field(default_factory=time.perf_counter)
    intervals: list[float] = field(default_factory=list)  # from one step's end to the next one's

    def line(self, now: float) -> str:
        steps = sorted(self.intervals)
        return (f"engine process: {len(steps)} steps back to back in {now - self.t0:.0f} s, p10 / p50 / p90 "
                f"{1e3 * percentile(steps, 0.1):.4f} / {1e3 * percentile(steps, 0.5):.4f} / "
                f"{1e3 * percentile(steps, 0.9):.4f} ms a step")


@dataclass(frozen=True)
class MemberJoined:
    """Not a pipe message: the accept thread hands the main loop a member's connection (and its ring)."""

    conn: Any
    ring: MsgRing | None


@dataclass(frozen=True)
class ChildOptions:
    """How the engine process talks to its instances and where it runs (the serving parameters of its owner)."""

    ring_bytes: int = 0  # engine_msg_ring_kib: each instance's shared-memory message ring (0: the pipe)
    engine_cpus: frozenset[int] = frozenset()  # engine_cpus: the CPUs this process moves onto (empty: stays)
    gc_freeze: bool = True  # gc_freeze: this process's start-up heap out of the garbage collector's way (gc_freeze.py)


def engine_main(cmd_conn: Any, out_conn: Any, config: EngineConfig, faults: list[FaultSpec],
                listen: tuple[str, bytes] | None = None, options: ChildOptions = ChildOptions()) -> None:
    configure_logging("[engine]")
    ring = None
    try:
        if options.engine_cpus:  # before the model loads: every thread started from here on stays there too
            pin_this_process(options.engine_cpus)
            log.info("engine process on CPU(s) %s", format_cpu_list(options.engine_cpus))
        watch_parent("engine process")  # its stub is gone: nobody is left to send a `stop`
        from freetoken_core.scheduler.scheduler import Scheduler

        sched = Scheduler(config)
        if faults:
            install_fault_hook(sched, faults)
        anchors = sched.tokenizer.anchors if sched.tokenizer is not None else None
        info = Ready(anchors, sched.stats(), sched.max_req_len)
        listener = Listener(listen[0], family="AF_UNIX", authkey=listen[1]) if listen is not None else None
        ring = make_ring(options.ring_bytes)
        if options.gc_freeze:  # the model, its graphs and warm-up are in place: what lives now lives as long
            freeze_startup_heap("engine process")
        out_conn.send(dataclasses.replace(info, ring=ring.path if ring is not None else None))
    except BaseException as e:  # noqa: BLE001  the parent reports it and fails the model load
        log.exception("the engine failed to start")
        if ring is not None:
            ring.discard()
        out_conn.send(Failed(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        return
    try:
        EngineServer(sched, cmd_conn, out_conn, listener, info, ring=ring, ring_bytes=options.ring_bytes).run()
    finally:
        sched.close()


class EngineServer:
    """The child's loop: take commands (a reader thread per connection keeps it drained, so neither
    side ever blocks on a full pipe), step the scheduler back to back while it has work, send each
    step's messages at once, each to the instance whose request it is. Connection 0 is the owner's
    pipe pair; a shared engine accepts members on `listener` (1, 2, ...). With `ring_bytes` each
    instance's step messages go through a shared-memory ring of its own (serving/engine_proc/msg_ring.py; `ring`:
    the owner's, made before the ready message), everything else over its connection."""

    def __init__(self, sched: Any, cmd_conn: Any, out_conn: Any, listener: Any = None,
                 ready_info: Ready | None = None, ring: MsgRing | None = None, ring_bytes: int = 0) -> None:
        self.sched = sched
        self.outs: dict[int, Any] = {0: out_conn}
        self.rings: dict[int, MsgRing] = {0: ring} if ring is not None else {}
        self.ring_bytes = ring_bytes
        self.gone: set[int] = set()  # connections whose reader saw the other side go (a full ring stops waiting)
        self.owner_of: dict[int, int] = {}  # request uid -> connection index
        self.orphans: set[int] = set()  # requests of a member that left: aborted, their last messages dropped
        self.requests_by_instance: dict[int, int] = {}  # how many requests each connection submitted (logged)
        # (connection index, its command; None: that side is gone); MemberJoined comes from the accept thread
        self.commands: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.readers = [self._reader(0, cmd_conn)]
        self.listener = listener
        self.ready_info = ready_info
        self.last_stats = 0.0
        self.heap = HeapTrimmer()
        self.stopping = False
        self.pace = StepPace()

    def _reader(self, index: int, conn: Any) -> threading.Thread:
        return threading.Thread(target=self._read, args=(index, conn), name=f"freetoken-engine-commands-{index}",
                                daemon=True)

    def _read(self, index: int, conn: Any) -> None:
        try:
            while True:
                self.commands.put((index, conn.recv()))
        except (EOFError, OSError):  # that side is gone
            self.gone.add(index)
            self.commands.put((index, None))

    def _accept(self) -> None:
        """Members join here: each gets the ready info with its index, then a reader of its own."""
        index = 1
        while not self.stopping:
            try:
                conn = self.listener.accept()
            except OSError:  # the listener was closed: the engine is stopping
                return
            except Exception as e:  # noqa: BLE001  a client that failed the authkey handshake
                log.warning("refused a connection to the shared engine: %s", e)
                continue
            ring = None
            try:
                if index >= MAX_INSTANCES:
                    conn.send(Failed(f"a shared engine serves at most {MAX_INSTANCES} instances"))
                    conn.close()
                    continue
                ring = make_ring(self.ring_bytes)
                # its stats: the loop's next broadcast
                conn.send(dataclasses.replace(self.ready_info, index=index, ring=ring.path if ring else None))
            except (OSError, ValueError):
                if ring is not None:
                    ring.discard()
                continue
            self.commands.put((index, MemberJoined(conn, ring)))  # before its commands: the main loop registers it
            reader = self._reader(index, conn)
            self.readers.append(reader)
            reader.start()
            index += 1

    def run(self) -> None:
        self.readers[0].start()
        if self.listener is not None:
            threading.Thread(target=self._accept, name="freetoken-engine-accept", daemon=True).start()
        sched = self.sched
        stepped_at: float | None = None  # when the last step (and its sends) ended, while stepping back to back
        try:
            while not self.stopping:
                self._take_commands(block=not sched.has_work())
                if self.stopping:
                    break
                stepped = sched.has_work()
                if stepped:
                    try:
                        msgs = sched.step()
                    except Exception as e:  # noqa: BLE001
                        msgs = self._on_step_failure(e)
                        if msgs is None:
                            return
                    if msgs:
                        self._send_msgs(msgs)
                now = time.perf_counter()
                if stepped and stepped_at is not None:
                    self.pace.intervals.append(now - stepped_at)
                stepped_at = now if stepped else None
                if now - self.pace.t0 >= REPORT_INTERVAL_S:
                    if self.pace.intervals:
                        log.info("%s", self.pace.line(now))
                    self.pace = StepPace(t0=now)
                if now - self.last_stats >= STATS_INTERVAL_S or not sched.has_work():
                    self._broadcast(Stats(sched.stats()))
                    self.last_stats = now
                self.heap.maybe_trim(now, idle=not sched.has_work())
            for index in [i for i in self.outs if i != 0]:  # the owner stopped it: tell the members
                self._send(index, Stopped(STOPPED))
            if self.listener is not None:
                log.info("shared engine stopping: requests per instance %s", dict(sorted(self.requests_by_instance.items())))
        finally:
            if self.listener is not None:
                try:
                    self.listener.close()
                except OSError:  # its socket file is already gone
                    pass
            for ring in self.rings.values():
                ring.discard()  # its name too, for a reader that never attached (one that did unlinked it)

    def _send_msgs(self, msgs: list[DetokenizeMsg]) -> None:
        if len(self.outs) == 1 and not self.orphans:  # not shared (or no member yet): everything is the owner's
            for m in msgs:
                if m.finished:
                    self.owner_of.pop(m.uid, None)
            self._send_encoded(0, [encode(m) for m in msgs])
            return
        groups: dict[int, StepBatch] = {}
        for m in msgs:
            if m.uid in self.orphans:
                if m.finished:
                    self.orphans.discard(m.uid)
                continue
            index = self.owner_of.pop(m.uid, 0) if m.finished else self.owner_of.get(m.uid, 0)
            groups.setdefault(index, []).append(encode(m))
        for index, group in groups.items():
            self._send_encoded(index, group)

    def _send_encoded(self, index: int, group: StepBatch) -> None:
        """One step's messages for one instance: through its ring when it has one, else its connection."""
        ring = self.rings.get(index)
        if ring is None:
            self._send(index, group)
            return
        payload = pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > ring.max_payload and len(group) > 1:  # a huge step: in parts, in order
            half = len(group) // 2
            self._send_encoded(index, group[:half])
            self._send_encoded(index, group[half:])
            return
        if len(payload) > ring.max_payload:  # one message larger than a record (a huge error text)
            self._send(index, group)  # after what the ring holds: the reader drains it first
            return
        while not ring.put(payload):  # the instance is behind: wait for room, as a full pipe would
            if index in self.gone:
                if index == 0:
                    self.stopping = True  # the owner is gone, so is the model
                else:
                    self._drop(index)
                return
            time.sleep(FULL_WAIT_S)

    def _send(self, index: int, item: Any) -> None:
        out = self.outs.get(index)
        if out is None:
            return
        if index == 0:
            out.send(item)  # the owner's pipe: if it is gone, so is the model
            return
        try:
            out.send(item)
        except (OSError, ValueError):
            self._drop(index)

    def _broadcast(self, item: Any) -> None:
        for index in list(self.outs):
            self._send(index, item)

    def _drop(self, index: int) -> None:
        """A member left (or its connection broke): abort its requests, forget it."""
        out = self.outs.pop(index, None)
        if out is not None:
            try:
                out.close()
            except OSError:
                pass
        ring = self.rings.pop(index, None)
        if ring is not None:
            ring.discard()
        for uid in [u for u, i in self.owner_of.items() if i == index]:
            del self.owner_of[uid]
            if self.sched.abort(uid):
                self.orphans.add(uid)  # its abort message has no one to go to

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                index, cmd = self.commands.get(timeout=1.0) if block else self.commands.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return
            block = False
            if index != 0 and (cmd is None or isinstance(cmd, Bye)):
                self._drop(index)
                continue
            if cmd is None or isinstance(cmd, Stop):
                if index == 0:  # only the owner stops the engine
                    self.stopping = True
                    return
                continue
            if isinstance(cmd, MemberJoined):
                self.outs[index] = cmd.conn
                if cmd.ring is not None:
                    self.rings[index] = cmd.ring
            elif isinstance(cmd, AddRequest):
                self.requests_by_instance[index] = self.requests_by_instance.get(index, 0) + 1
                if index != 0 or len(self.outs) > 1:
                    self.owner_of[cmd.uid] = index
                self._add(cmd.uid, cmd.input_ids, cmd.params)
            elif isinstance(cmd, Abort):
                self.sched.abort(cmd.uid)

    def _add(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        try:
            self.sched.add_request(input_ids, params, uid=uid)
            return
        except ValueError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001  never let one bad request kill the loop
            log.exception("add_request failed")
            error = f"{type(e).__name__}: {e}"
        self._send_msgs([DetokenizeMsg.failed(uid, error)])

    def _on_step_failure(self, e: Exception) -> list[DetokenizeMsg] | None:
        """As EngineLoop does in the stub: a step fault fails the step's requests and the engine serves
        on; a device fault (or a scheduler that cannot clean up) tells the parent and ends the child."""
        what = f"{type(e).__name__}: {e}"
        if not is_device_fatal(e):
            log.exception("engine step failed: failing the requests of the step(s) in flight")
            try:
                return self.sched.fail_step(f"the engine step running this request failed ({what})")
            except Exception:  # noqa: BLE001
                log.exception("recovering from the failed step failed")
                what = f"the engine failed ({what})"
        else:
            log.critical("the device is unusable (%s)", what, exc_info=e)
        for index in list(self.outs):
            try:
                self._send(index, Dead(what))
            except (OSError, ValueError):
                pass
        return None
