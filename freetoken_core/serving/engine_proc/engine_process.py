"""The served engine in a process of its own (serving parameter `engine_process`, on by default).

Why (issue 13): in the Triton stub's process the engine thread (scheduling, sampling, launches:
Python) and the sender thread (one `send()` per streamed response: Python) share one GIL, and at
64 streams the responses, not the GPU, set the pace. Here the Scheduler runs in a child process
with a GIL of its own, as vLLM's engine core and SGLang's scheduler do; the stub keeps only request
intake, cancellation, metrics and the sends.

`EngineClient` is what `EngineLoop` sees: the Scheduler's interface (add_request, abort, has_work,
step, stats), over two pipes. Request ids are chosen here, so `add_request` never waits for the
child; a request the child refuses comes back as a message with finish_reason "error" and the
scheduler's own words. `step()` returns the messages the child produced since the last call (the
child steps on its own, back to back). Every message keeps its order: one pipe, one reader.

Shared (`share`: serving/engine_proc/engine_share.py): several `freetoken` model instances, one engine. The
instance that wins the rendezvous starts the child, which also listens on an AF_UNIX socket; the
others connect there and get the same interface. Each instance's request ids carry its index in the
low INDEX_BITS, and the child sends each message to the instance whose request it is. An instance
that goes away has its requests aborted; when the owner stops the engine, the others' requests end
with an error saying so (not a device fault: nothing unloads).

Faults: a step fault is handled inside the child (Scheduler.fail_step, as in the stub); a device
fault, a child that fails to start or one that exits, ends this engine: `step()` raises
`EngineProcessError`, which serving/engine_proc/faults.py counts as device-fatal (every request gets its FINAL
error and the model unloads itself).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from multiprocessing.connection import Client
from types import SimpleNamespace
from typing import Any

from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.messages import DetokenizeMsg, EngineStats
from freetoken_core.serving.engine_proc.engine_server import ChildOptions, engine_main
from freetoken_core.serving.engine_proc.protocol import (Abort, AddRequest, Bye, Dead, Failed, Ready, Stats, Stop,
                                                        Stopped, decode)
from freetoken_core.serving.engine_proc.engine_share import INDEX_BITS, EngineRendezvous
from freetoken_core.serving.engine_proc.faults import DeviceFatalError, FaultSpec
from freetoken_core.serving.engine_proc.msg_ring import RING_POLL_S, MsgRing
from freetoken_core.spawn import spawn_context

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.002  # how long step() waits for the child's next messages before the loop looks around
MEMBER_READY_TIMEOUT_S = 1800.0  # a member waits this long for the owner's engine build (GGUF conversion...)
RING_BYTES = 1 << 20  # a shared-memory message ring's size when one is asked for (serving/engine_proc/msg_ring.py)


class EngineProcessError(DeviceFatalError):
    """The engine process failed or exited: no later step can run."""


class EngineClient:
    """The Scheduler's interface for EngineLoop, with the Scheduler in a child process."""

    def __init__(self, config: EngineConfig, faults: list[FaultSpec] | None = None,
                 step_wait_s: float = STEP_WAIT_S, share: EngineRendezvous | None = None,
                 member_ready_timeout_s: float = MEMBER_READY_TIMEOUT_S, ring_bytes: int = 0,
                 ring_poll_s: float = RING_POLL_S, engine_cpus: frozenset[int] = frozenset(),
                 gc_freeze: bool = True) -> None:
        """engine_cpus: the CPUs the child moves onto (serving/engine_proc/cpu_affinity.py; empty = where it is started).
        gc_freeze: the child freezes its start-up heap (serving/engine_proc/gc_freeze.py).
        The child's options are the owner's: a member of a shared engine joins it as it runs."""
        self.step_wait_s = step_wait_s
        self.ring_poll_s = ring_poll_s
        self._ring: MsgRing | None = None  # the step messages' ring, when the engine made one for this instance
        self._uids = 0
        self._lock = threading.Lock()  # add_request's thread and the engine thread: uids, the command pipe, _early
        self._outstanding: set[int] = set()  # submitted, final message not seen yet
        self._dead: str | None = None  # why the child can run no more steps
        self._stopped: str | None = None  # the owner stopped the shared engine (a member's view)
        self._early: list[DetokenizeMsg] = []  # messages stats() read from the pipe, for the next step()
        self._closed = False
        self._proc: Any = None
        self._share: EngineRendezvous | None = None  # set on the owner: it removes the rendezvous
        self._index = 0
        self._uid_shift = INDEX_BITS if share is not None else 0
        if share is None or share.elect():
            self._start_child(config, faults, share, ChildOptions(ring_bytes, engine_cpus, gc_freeze))
        else:
            self._connect(share, member_ready_timeout_s)

    def _start_child(self, config: EngineConfig, faults: list[FaultSpec] | None,
                     share: EngineRendezvous | None, options: ChildOptions) -> None:
        listen = None
        if share is not None:
            self._share = share
            listen = (share.address, share.new_authkey())
        ctx = spawn_context()
        self._cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
        self._out_r, self._out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_main,
                                 args=(self._cmd_r, self._out_w, config, list(faults or []), listen, options),
                                 name="freetoken-engine", daemon=False)  # daemonic processes cannot start TP ranks
        self._proc.start()
        self._cmd_r.close()
        self._out_w.close()
        ready = self._wait_ready()
        if not isinstance(ready, Ready):
            self.close()
            raise RuntimeError(f"the engine process failed to start: {ready.reason}")
        self._ready(ready)
        if share is not None:
            share.publish_ready()
        log.info("engine process %d ready%s%s", self._proc.pid, f" (shared at {share.dir})" if share else "",
                 self._ring_note())

    def _connect(self, share: EngineRendezvous, timeout_s: float) -> None:
        """A member: connect to the engine another instance started."""
        authkey = share.wait_ready(timeout_s)
        conn = Client(share.address, family="AF_UNIX", authkey=authkey)
        self._cmd_w = self._out_r = conn
        ready = self._wait_ready()
        if not isinstance(ready, Ready):
            self._closed = True
            conn.close()
            raise RuntimeError(f"could not join the shared engine at {share.dir}: {ready.reason}")
        self._index = ready.index
        self._ready(ready)
        log.info("joined the shared engine at %s as instance %d%s", share.dir, self._index, self._ring_note())

    def _ring_note(self) -> str:
        return "; step messages through a shared-memory ring" if self._ring is not None else ""

    def _ready(self, ready: Ready) -> None:
        if ready.ring:
            self._ring = MsgRing.attach(ready.ring)
        self._stats: EngineStats = ready.stats
        self.tokenizer = SimpleNamespace(anchors=ready.anchors) if ready.anchors is not None else None
        self.max_req_len: int = ready.max_req_len

    def _wait_ready(self) -> Ready | Failed:
        # the engine build may take minutes (GGUF conversion, graph capture); Triton's load timeout bounds it
        try:
            while not self._out_r.poll(1.0):
                if self._proc is not None and not self._proc.is_alive():
                    return Failed(f"it exited with code {self._proc.exitcode} before it was ready")
            return self._out_r.recv()
        except (EOFError, OSError):
            return Failed(self._exit_text("before it was ready"))

    def _exit_text(self, when: str) -> str:
        if self._proc is None:
            return f"the shared engine closed its connection {when}"
        self._proc.join(1.0)
        return f"the engine process exited (code {self._proc.exitcode}) {when}"

    # --- the Scheduler's interface -----------------------------------------------------------
    # add_request may come from another thread than the rest (serving/engine_proc/engine_loop.py: execute()'s, so that a
    # request goes to the engine without waiting for the engine thread's wake-up); the rest is one thread's
    remote = True

    def add_request(self, input_ids: list[int], params: SamplingParams | None = None) -> int:
        cmd_params = params or SamplingParams()
        with self._lock:
            uid = (self._uids << self._uid_shift) | self._index
            self._uids += 1
            if self._stopped is not None:
                self._early.append(DetokenizeMsg.failed(uid, self._stopped))
                return uid
            self._outstanding.add(uid)
            self._command(AddRequest(uid, list(input_ids), cmd_params))
        return uid

    def abort(self, uid: int) -> bool:
        if uid not in self._outstanding:
            return False
        with self._lock:
            self._command(Abort(uid))
        return True

    def has_work(self) -> bool:
        return bool(self._outstanding or self._early) or self._dead is not None

    @property
    def running(self) -> list[int]:
        """Submitted requests not yet finished (the child alone knows which of them run)."""
        return sorted(self._outstanding)

    waiting: tuple = ()

    @property
    def engine_load(self) -> int:
        """Requests in the engine, every instance's, as its latest snapshot said (at most STATS_INTERVAL_S old while
        it is busy)."""
        return self._stats.num_running + self._stats.num_waiting

    def stats(self) -> EngineStats:
        """The child's latest snapshot (sent every STATS_INTERVAL_S while busy and when it goes idle).
        Reads what waits in the pipe first: once idle, nothing else would (step() runs only with work)."""
        if self._dead is None and self._stopped is None:
            self._early += self._receive(0.0)
        return self._stats

    def step(self) -> list[DetokenizeMsg]:
        """The messages the child produced since the last call; waits up to step_wait_s for some."""
        with self._lock:  # (add_request appends there from another thread once the shared engine stopped)
            msgs, self._early = self._early, []
        if self._dead is None and self._stopped is None and not msgs:
            msgs = self._receive(self.step_wait_s)
        if self._dead is not None and not msgs:
            raise EngineProcessError(self._dead)
        return msgs  # a death after these messages is raised by the next call

    def _receive(self, wait_s: float) -> list[DetokenizeMsg]:
        msgs: list[DetokenizeMsg] = []
        try:
            if self._ring is not None:
                # the step messages come through the ring: look every ring_poll_s (this thread's wake-ups,
                # not the engine's writes) until some come, something comes over the pipe, or wait_s passes
                self._take_ring(msgs)
                if not msgs and wait_s > 0:
                    deadline = time.perf_counter() + wait_s
                    while not msgs and not self._out_r.poll() and time.perf_counter() < deadline:
                        time.sleep(self.ring_poll_s)
                        self._take_ring(msgs)
                    wait_s = 0.0
            ready = self._out_r.poll(wait_s)
            while ready:
                event = self._out_r.recv()
                self._take_ring(msgs)  # what the engine put in the ring before this comes first
                if isinstance(event, list):  # a StepBatch
                    self._add_msgs(event, msgs)
                elif isinstance(event, Stats):
                    self._stats = event.stats
                elif isinstance(event, Dead):
                    self._dead = event.reason
                    break
                elif isinstance(event, Stopped):  # a member: the owner stopped the engine
                    msgs += self._end_outstanding(event.reason)
                    break
                ready = self._out_r.poll()
        except (EOFError, OSError):
            self._take_ring(msgs)
            if self._stopped is None:
                self._dead = self._exit_text("while serving")
        return msgs

    def _take_ring(self, msgs: list[DetokenizeMsg]) -> None:
        if self._ring is not None:
            for payload in self._ring.take():
                self._add_msgs(pickle.loads(payload), msgs)

    def _add_msgs(self, encoded: list[tuple], msgs: list[DetokenizeMsg]) -> None:
        for fields in encoded:
            msg = decode(fields)
            if msg.finished:
                self._outstanding.discard(msg.uid)
            msgs.append(msg)

    def _end_outstanding(self, reason: str) -> list[DetokenizeMsg]:
        self._stopped = reason
        ended = [DetokenizeMsg.failed(uid, reason) for uid in sorted(self._outstanding)]
        self._outstanding.clear()
        return ended

    def fail_step(self, error: str) -> list[DetokenizeMsg]:
        raise EngineProcessError(f"the engine process cannot recover from: {error}")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (it finishes its step, closes tensor-parallel ranks) and wait for it; a member
        only leaves (the engine aborts its requests)."""
        with self._lock:  # no add_request's command after this one
            if self._closed:
                return
            self._closed = True
            try:
                self._cmd_w.send(Stop() if self._proc is not None else Bye())
            except (OSError, ValueError):
                pass
        if self._ring is not None:  # the step messages still in it are for requests nobody waits for now
            self._ring.close()
            self._ring = None
        if self._proc is None:
            self._cmd_w.close()
            return
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("engine process %d did not stop in %.0f s: killing it", self._proc.pid, timeout)
            self._proc.kill()
            self._proc.join(5.0)
        for conn in (self._cmd_w, self._out_r):
            conn.close()
        if self._share is not None:  # after the child: its listener's socket lives there
            self._share.remove()

    def _command(self, cmd: AddRequest | Abort) -> None:
        if self._dead is not None or self._closed or self._stopped is not None:
            return  # its final error reaches the client through the dead engine's _fail_all
        try:
            self._cmd_w.send(cmd)
        except (OSError, ValueError) as e:
            self._dead = f"the engine process is gone ({type(e).__name__}: {e})"
