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

Faults: a step fault is handled inside the child (Scheduler.fail_step, as in the stub); a device
fault, a child that fails to start or one that exits, ends this engine: `step()` raises
`EngineProcessError`, which serving/faults.py counts as device-fatal (every request gets its FINAL
error and the model unloads itself).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

from freetoken_core.config import EngineConfig, SamplingParams
from freetoken_core.messages import DetokenizeMsg, EngineStats
from freetoken_core.serving.faults import DeviceFatalError, FaultSpec, install_fault_hook, is_device_fatal
from freetoken_core.spawn import spawn_context

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # how often a busy child sends its EngineStats (an idle one sends once)
STEP_WAIT_S = 0.002  # how long step() waits for the child's next messages before the loop looks around


class EngineProcessError(DeviceFatalError):
    """The engine process failed or exited: no later step can run."""


def encode(msg: DetokenizeMsg) -> tuple:
    """A message as a plain tuple in field order (what pickles fastest; the child pays for it per step)."""
    return tuple(msg.__dict__.values())


def decode(fields: tuple) -> DetokenizeMsg:
    return DetokenizeMsg(*fields)


class EngineClient:
    """The Scheduler's interface for EngineLoop, with the Scheduler in a child process."""

    def __init__(self, config: EngineConfig, faults: list[FaultSpec] | None = None,
                 step_wait_s: float = STEP_WAIT_S) -> None:
        ctx = spawn_context()
        self._cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
        self._out_r, self._out_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_main, args=(self._cmd_r, self._out_w, config, list(faults or [])),
                                 name="freetoken-engine", daemon=False)  # daemonic processes cannot start TP ranks
        self._proc.start()
        self._cmd_r.close()
        self._out_w.close()
        self.step_wait_s = step_wait_s
        self._uids = 0
        self._outstanding: set[int] = set()  # submitted, final message not seen yet
        self._dead: str | None = None  # why the child can run no more steps
        self._early: list[DetokenizeMsg] = []  # messages stats() read from the pipe, for the next step()
        self._closed = False
        kind, info = self._wait_ready()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the engine process failed to start: {info}")
        self._stats: EngineStats = info["stats"]
        anchors = info["anchors"]
        self.tokenizer = SimpleNamespace(anchors=anchors) if anchors is not None else None
        self.max_req_len: int = info["max_req_len"]
        log.info("engine process %d ready", self._proc.pid)

    def _wait_ready(self) -> tuple[str, Any]:
        # the engine build may take minutes (GGUF conversion, graph capture); Triton's load timeout bounds it
        while not self._out_r.poll(1.0):
            if not self._proc.is_alive():
                return "failed", f"it exited with code {self._proc.exitcode} before it was ready"
        try:
            return self._out_r.recv()
        except (EOFError, OSError):
            return "failed", f"it exited with code {self._proc.exitcode} before it was ready"

    # --- the Scheduler's interface -----------------------------------------------------------
    def add_request(self, input_ids: list[int], params: SamplingParams | None = None) -> int:
        uid = self._uids
        self._uids += 1
        self._outstanding.add(uid)
        self._command(("add", uid, list(input_ids), params or SamplingParams()))
        return uid

    def abort(self, uid: int) -> bool:
        if uid not in self._outstanding:
            return False
        self._command(("abort", uid))
        return True

    def has_work(self) -> bool:
        return bool(self._outstanding or self._early) or self._dead is not None

    @property
    def running(self) -> list[int]:
        """Submitted requests not yet finished (the child alone knows which of them run)."""
        return sorted(self._outstanding)

    waiting: tuple = ()

    def stats(self) -> EngineStats:
        """The child's latest snapshot (sent every STATS_INTERVAL_S while busy and when it goes idle).
        Reads what waits in the pipe first: once idle, nothing else would (step() runs only with work)."""
        if self._dead is None:
            self._early += self._receive(0.0)
        return self._stats

    def step(self) -> list[DetokenizeMsg]:
        """The messages the child produced since the last call; waits up to step_wait_s for some."""
        msgs, self._early = self._early, []
        if self._dead is None and not msgs:
            msgs = self._receive(self.step_wait_s)
        if self._dead is not None and not msgs:
            raise EngineProcessError(self._dead)
        return msgs  # a death after these messages is raised by the next call

    def _receive(self, wait_s: float) -> list[DetokenizeMsg]:
        msgs: list[DetokenizeMsg] = []
        try:
            ready = self._out_r.poll(wait_s)
            while ready:
                kind, payload = self._out_r.recv()
                if kind == "msgs":
                    for fields in payload:
                        msg = decode(fields)
                        if msg.finished:
                            self._outstanding.discard(msg.uid)
                        msgs.append(msg)
                elif kind == "stats":
                    self._stats = payload
                elif kind == "dead":
                    self._dead = payload
                    break
                ready = self._out_r.poll()
        except (EOFError, OSError):
            self._proc.join(1.0)
            self._dead = f"the engine process exited (code {self._proc.exitcode})"
        return msgs

    def fail_step(self, error: str) -> list[DetokenizeMsg]:
        raise EngineProcessError(f"the engine process cannot recover from: {error}")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child (it finishes its step, closes tensor-parallel ranks) and wait for it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cmd_w.send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("engine process %d did not stop in %.0f s: killing it", self._proc.pid, timeout)
            self._proc.kill()
            self._proc.join(5.0)
        for conn in (self._cmd_w, self._out_r):
            conn.close()

    def _command(self, cmd: tuple) -> None:
        if self._dead is not None or self._closed:
            return  # its final error reaches the client through the dead engine's _fail_all
        try:
            self._cmd_w.send(cmd)
        except (OSError, ValueError) as e:
            self._dead = f"the engine process is gone ({type(e).__name__}: {e})"


# --- the child ------------------------------------------------------------------------------------
def engine_main(cmd_conn: Any, out_conn: Any, config: EngineConfig, faults: list[FaultSpec]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        from freetoken_core.scheduler.scheduler import Scheduler

        sched = Scheduler(config)
        if faults:
            install_fault_hook(sched, faults)
        anchors = sched.tokenizer.anchors if sched.tokenizer is not None else None
        out_conn.send(("ready", {"anchors": anchors, "stats": sched.stats(), "max_req_len": sched.max_req_len}))
    except BaseException as e:  # noqa: BLE001  the parent reports it and fails the model load
        log.exception("the engine failed to start")
        out_conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        return
    try:
        EngineServer(sched, cmd_conn, out_conn).run()
    finally:
        sched.close()


class EngineServer:
    """The child's loop: take commands (a reader thread keeps the command pipe drained, so neither
    side ever blocks on a full pipe), step the scheduler back to back while it has work, send each
    step's messages at once."""

    def __init__(self, sched: Any, cmd_conn: Any, out_conn: Any) -> None:
        self.sched = sched
        self.out = out_conn
        self.commands: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.reader = threading.Thread(target=self._read, args=(cmd_conn,), name="freetoken-engine-commands",
                                       daemon=True)
        self.last_stats = 0.0
        self.stopping = False

    def _read(self, conn: Any) -> None:
        try:
            while True:
                self.commands.put(conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop
            self.commands.put(None)

    def run(self) -> None:
        self.reader.start()
        sched = self.sched
        while not self.stopping:
            self._take_commands(block=not sched.has_work())
            if self.stopping:
                break
            if sched.has_work():
                try:
                    msgs = sched.step()
                except Exception as e:  # noqa: BLE001
                    msgs = self._on_step_failure(e)
                    if msgs is None:
                        return
                if msgs:
                    self.out.send(("msgs", [encode(m) for m in msgs]))
            now = time.perf_counter()
            if now - self.last_stats >= STATS_INTERVAL_S or not sched.has_work():
                self.out.send(("stats", sched.stats()))
                self.last_stats = now

    def _take_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self.commands.get(timeout=1.0) if block else self.commands.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return
            block = False
            if cmd is None or cmd[0] == "stop":
                self.stopping = True
                return
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self.sched.abort(cmd[1])

    def _add(self, uid: int, input_ids: list[int], params: SamplingParams) -> None:
        try:
            self.sched.add_request(input_ids, params, uid=uid)
            return
        except ValueError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001  never let one bad request kill the loop
            log.exception("add_request failed")
            error = f"{type(e).__name__}: {e}"
        msg = DetokenizeMsg(uid, [], finished=True, finish_reason="error", error=error)
        self.out.send(("msgs", [encode(msg)]))

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
        try:
            self.out.send(("dead", what))
        except (OSError, ValueError):
            pass
        return None
