"""The served engine in a child process (serving/engine_proc/engine_process.py): the Scheduler's interface over
pipes must give what the in-process Scheduler gives (tokens, refusals, aborts, stats), and a child
that dies must end the engine as a device fault does, never hang it. Through tritonserver the child
is the default, so every tests/serving server test runs it too."""

from __future__ import annotations

import os
import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.engine_proc.engine_process import RING_BYTES, EngineClient, EngineProcessError
from freetoken_core.serving.engine_proc.protocol import Stop, decode, encode
from freetoken_core.serving.engine_proc.faults import is_device_fatal
from freetoken_core.serving.engine_proc.msg_ring import supported as ring_supported
from freetoken_core.serving.triton.request import ParsedRequest

PROMPTS = ["Write one sentence about cats.", "Dis bonjour en français.", "数到五", "def fib(n):"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=2)


# the pipe client's engine process runs on a CPU of its own (engine_cpus, serving/engine_proc/cpu_affinity.py) where the host
# has two or more
PINNED_CPUS = frozenset({max(os.sched_getaffinity(0))}) if len(os.sched_getaffinity(0)) > 1 else frozenset()


@pytest.fixture(scope="module", params=["ring", "pipe"])
def client(smollm2_path, request):
    """The step messages through the shared-memory ring (opt-in, serving/engine_proc/msg_ring.py) and over the pipe (with the
    engine process on a CPU of its own: opt-in too)."""
    ring_bytes = RING_BYTES if request.param == "ring" else 0
    engine_cpus = PINNED_CPUS if request.param == "pipe" else frozenset()
    c = EngineClient(EngineConfig(model_path=smollm2_path, dtype="float32", max_running_req=2),
                     ring_bytes=ring_bytes, engine_cpus=engine_cpus)
    c.asked_cpus = engine_cpus
    assert (c._ring is not None) == (ring_bytes > 0 and ring_supported())
    yield c
    c.close()


def cpus_of(pid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(pid))


def test_the_engine_process_runs_on_its_cpus(client):
    """engine_cpus: the child moved itself (and every thread it started) onto them; without, it runs where its
    parent may."""
    expected = client.asked_cpus or cpus_of(0)
    assert cpus_of(client._proc.pid) == expected
    for task in os.listdir(f"/proc/{client._proc.pid}/task"):  # the reader threads, torch's pool
        assert cpus_of(int(task)) == expected


def run_all(client: EngineClient, timeout_s: float = 120.0) -> dict[int, list[DetokenizeMsg]]:
    out: dict[int, list[DetokenizeMsg]] = {}
    deadline = time.monotonic() + timeout_s
    while client.has_work():
        assert time.monotonic() < deadline, "the engine process stopped answering"
        for m in client.step():
            out.setdefault(m.uid, []).append(m)
    return out


def idle_stats(client: EngineClient):
    """The snapshot the child sends once it has nothing left to do (it may trail the last message)."""
    deadline = time.monotonic() + 10
    while True:
        stats = client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        assert time.monotonic() < deadline, stats
        client.step()


def test_messages_cross_the_pipe_field_for_field():
    msg = DetokenizeMsg(7, [1, 2], finished=True, finish_reason="stop", stop_reason="</s>", logprobs=[-0.5, -1.0],
                        top_logprobs=[{1: -0.5}, {2: -1.0}], num_prompt_tokens=3, num_output_tokens=9,
                        spec_accepted=4, spec_proposed=6)
    msg.error = "set after construction, as Scheduler.fail_step does"
    assert decode(encode(msg)) == msg


def test_greedy_tokens_equal_the_in_process_engine(llm, client):
    """More prompts than max_running_req: they queue in the child and come out exactly as in-process."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(PROMPTS, params)
    uids = [client.add_request(llm.encode(p), params) for p in PROMPTS]
    out = run_all(client)
    for uid, exp in zip(uids, expected):
        msgs = out[uid]
        assert [t for m in msgs for t in m.next_tokens] == exp.token_ids
        assert [m.finished for m in msgs] == [False] * (len(msgs) - 1) + [True]
        assert msgs[-1].finish_reason == "length"
    stats = idle_stats(client)
    assert stats.num_free_pages == stats.num_total_pages


def test_a_refused_request_ends_with_the_schedulers_error(llm, client):
    too_long = [1] * (client.max_req_len + 5)
    bad_uid = client.add_request(too_long, SamplingParams(max_tokens=4))
    oov_uid = client.add_request([10 ** 8], SamplingParams(max_tokens=4))
    ok_uid = client.add_request(llm.encode("Hi"), SamplingParams(max_tokens=4, ignore_eos=True))
    out = run_all(client)
    for uid, words in ((bad_uid, "the limit is"), (oov_uid, "outside the vocabulary")):
        (msg,) = out[uid]
        assert msg.finished and msg.finish_reason == "error" and words in msg.error and not msg.next_tokens
    assert sum(len(m.next_tokens) for m in out[ok_uid]) == 4


def test_abort_ends_a_request_and_frees_its_pages(llm, client):
    uid = client.add_request(llm.encode("Tell me a long story."), SamplingParams(max_tokens=500, ignore_eos=True))
    got = []
    while not got:
        got = client.step()
    assert client.abort(uid)
    out = run_all(client)
    assert out[uid][-1].finished and out[uid][-1].finish_reason == "abort"
    assert not client.abort(uid)  # finished: nothing to abort
    stats = idle_stats(client)
    assert stats.num_free_pages == stats.num_total_pages


class Recording:
    def __init__(self, expected: int) -> None:
        self.sent: dict[str, list[tuple]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = expected

    def send(self, handle, outputs, error, final) -> None:
        with self.lock:
            self.sent.setdefault(handle, []).append((outputs, error, final))
            if sum(1 for r in self.sent.values() if r[-1][2]) == self.expected:
                self.done.set()

    def is_cancelled(self, handle) -> bool:
        return False


def test_a_dead_engine_process_fails_every_request_once_and_never_hangs(smollm2_path, llm):
    """The child killed mid-stream (an OOM kill, a segfault): step() raises EngineProcessError, which is
    device-fatal, so EngineLoop gives each request one FINAL error and refuses new ones."""
    client = EngineClient(EngineConfig(model_path=smollm2_path, dtype="float32", max_running_req=2),
                          ring_bytes=RING_BYTES)  # the ring's messages before the death still arrive
    transport = Recording(expected=3)
    loop = EngineLoop(client, transport, LoopOptions())
    loop.start()
    try:
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        for i in range(2):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(PROMPTS[i]), params=params, stream=True))
        deadline = time.monotonic() + 60
        while not all(transport.sent.get(f"h{i}") for i in range(2)):  # both stream
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client._proc.kill()
        deadline = time.monotonic() + 30
        while loop.dead is None:
            assert time.monotonic() < deadline, "a dead engine process went unnoticed"
            time.sleep(0.01)
        loop.submit("late", ParsedRequest(input_ids=[1, 2], params=params, stream=True))
        assert transport.done.wait(30)
    finally:
        loop.stop()
    assert "engine process exited" in loop.dead
    for handle in ("h0", "h1", "late"):
        finals = [r for r in transport.sent[handle] if r[2]]
        assert len(finals) == 1 and finals[0][1] and "engine process" in finals[0][1]
    with pytest.raises(EngineProcessError) as err:
        client.step()
    assert is_device_fatal(err.value)


def run_clients(clients, timeout_s: float = 120.0) -> list[dict[int, list[DetokenizeMsg]]]:
    outs: list[dict[int, list[DetokenizeMsg]]] = [{} for _ in clients]
    deadline = time.monotonic() + timeout_s
    while any(c.has_work() for c in clients):
        assert time.monotonic() < deadline, "the shared engine stopped answering"
        for c, out in zip(clients, outs):
            if c.has_work():
                for m in c.step():
                    out.setdefault(m.uid, []).append(m)
    return outs


def test_one_engine_process_shared_by_two_instances(smollm2_path, llm):
    """Several `freetoken` instances, one engine (serving/engine_proc/engine_share.py): the first to arrive starts
    it, the next joins; each gets exactly its own requests' tokens (as in-process), a member that leaves
    has its requests aborted, and when the owner stops the engine a member's requests end with one error
    each (not a device fault)."""
    import os
    import secrets

    from freetoken_core.serving.engine_proc.engine_server import STOPPED
    from freetoken_core.serving.engine_proc.engine_share import EngineRendezvous

    config = EngineConfig(model_path=smollm2_path, dtype="float32", max_running_req=2)
    name = f"test-{secrets.token_hex(4)}"
    owner = EngineClient(config, share=EngineRendezvous(name, server_pid=os.getpid()), ring_bytes=RING_BYTES)
    member = EngineClient(config, share=EngineRendezvous(name, server_pid=os.getpid()))
    late = None
    try:
        assert owner._proc is not None and member._proc is None  # one child process
        assert (owner._index, member._index) == (0, 1)
        assert (member._ring is not None) == ring_supported()  # each instance its own ring
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        expected = llm.generate(PROMPTS, params)
        uids = [(owner if i % 2 == 0 else member).add_request(llm.encode(p), params) for i, p in enumerate(PROMPTS)]
        assert len(set(uids)) == len(uids)
        outs = run_clients([owner, member])
        for i, (uid, exp) in enumerate(zip(uids, expected)):
            mine, other = outs[i % 2], outs[1 - i % 2]
            assert uid not in other
            assert [t for m in mine[uid] for t in m.next_tokens] == exp.token_ids
            assert [m.finished for m in mine[uid]][-1] and mine[uid][-1].finish_reason == "length"

        # a member that leaves mid-request: the engine aborts what it had and frees the pages
        long = SamplingParams(max_tokens=2000, ignore_eos=True)
        left = member.add_request(llm.encode(PROMPTS[0]), long)
        while not member.step():
            pass
        member.close()
        seen: list[DetokenizeMsg] = []
        t0 = time.monotonic()
        while True:  # the engine aborts it within a step or two; its snapshot trails by up to 0.25 s
            seen += owner.step()
            s = owner.stats()
            if time.monotonic() - t0 > 1.0 and not s.num_running and not s.num_waiting:
                break
            assert time.monotonic() - t0 < 30, s
        seen += owner.step()
        assert s.num_free_pages == s.num_total_pages
        assert all(m.uid != left for m in seen)  # the abort of a member's request goes nowhere

        # the owner stops the engine: a member's running request ends with one error, later ones too
        late = EngineClient(config, share=EngineRendezvous(name, server_pid=os.getpid()))
        assert late._index == 2
        running = late.add_request(llm.encode(PROMPTS[1]), long)
        while not late.step():
            pass
        owner.close()
        out = run_clients([late], timeout_s=60)[0]
        assert out[running][-1].finished and out[running][-1].error == STOPPED
        after = late.add_request([1, 2, 3], params)
        (msg,) = late.step()
        assert msg.uid == after and msg.finish_reason == "error" and msg.error == STOPPED
        assert not late.has_work()
        assert not EngineRendezvous(name, server_pid=os.getpid()).dir.exists()  # the owner cleaned up
    finally:
        for c in (late, member, owner):
            if c is not None:
                c.close()


class CountingScheduler:
    """Work for `steps` steps, a message for request 0 each, ~1 ms apart; then idle."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list[DetokenizeMsg]:
        time.sleep(0.001)
        self.left -= 1
        return [DetokenizeMsg(0, [5], finished=self.left == 0)]

    def stats(self):
        from freetoken_core.messages import EngineStats

        return EngineStats(0, 0, 1, 1, 16)


def test_the_engine_process_times_its_back_to_back_steps():
    """EngineServer's step pace (logged beside the sender's report): one interval per step after the first of a run of
    back-to-back steps, each at least the step's own time; StepPace's line states them."""
    import multiprocessing as mp

    from freetoken_core.serving.engine_proc.engine_server import EngineServer, StepPace

    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    server = EngineServer(CountingScheduler(steps=20), cmd_r, out_w)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    got = 0
    while got < 20:  # every step's message reaches the owner
        event = out_r.recv()
        got += len(event) if isinstance(event, list) else 0  # a StepBatch
    cmd_w.send(Stop())
    thread.join(10)
    assert not thread.is_alive()
    assert len(server.pace.intervals) == 19 and min(server.pace.intervals) >= 0.001
    line = StepPace(t0=0.0, intervals=[0.0007] * 8 + [0.002, 0.0001]).line(now=10.0)
    assert line == "engine process: 10 steps back to back in 10 s, p10 / p50 / p90 0.7000 / 0.7000 / 2.0000 ms a step"
