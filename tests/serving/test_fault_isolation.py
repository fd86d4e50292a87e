"""Fault isolation in the engine loop, in process on CPU (issue 14): an exception inside an engine step
fails exactly the requests of the step(s) in flight, each with a clear error and one FINAL, frees
their pages, and the engine serves on; a device fault (a sticky CUDA error, simulated) fails
everything and ends the engine. The faults come from the test-only hook of serving/engine_proc/faults.py."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.engine_proc.faults import (
    DeviceFatalError, FaultSpec, InjectedFault, install_fault_hook, is_device_fatal, parse_fault_specs,
)
from freetoken_core.serving.triton.request import ParsedRequest

VICTIM_SEED = 666


class Recorder:
    """A transport that records responses per handle and signals when a handle got its FINAL."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[dict | None, str | None, bool]]] = {}
        self.cond = threading.Condition()

    def send(self, handle, outputs, error, final) -> None:
        with self.cond:
            self.sent.setdefault(handle, []).append((outputs, error, final))
            self.cond.notify_all()

    def is_cancelled(self, handle) -> bool:
        return False

    def wait(self, pred, timeout: float = 120.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.sent), timeout), self.sent.keys()

    def finished(self, handle: str) -> bool:
        return any(final for _, _, final in self.sent.get(handle, []))

    def check_one_final(self, handle: str) -> list:
        responses = self.sent[handle]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2], responses
        return responses


def _tokens(responses) -> list[int]:
    return [int(t) for out, _, _ in responses if out is not None for t in out["next_tokens"]]


def _req(llm: LLM, text: str, max_tokens: int, seed: int | None = None, stream: bool = True) -> ParsedRequest:
    return ParsedRequest(input_ids=llm.encode(text), params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                           seed=seed), stream=stream)


def _run(llm: LLM, specs: list[FaultSpec], body, on_fatal=None) -> Recorder:
    rec = Recorder()
    install_fault_hook(llm.scheduler, specs)
    loop = EngineLoop(llm.scheduler, rec, LoopOptions(), on_device_fatal=on_fatal, owns_scheduler=False)
    loop.start()
    try:
        body(loop, rec)
    finally:
        loop.stop()
    return rec


def _all_pages_back(llm: LLM) -> bool:
    st = llm.scheduler.stats()
    return st.num_free_pages == st.num_total_pages and not st.num_running and not st.num_waiting


def test_fault_specs_parse_and_classify():
    assert parse_fault_specs("") == []
    assert parse_fault_specs("init, step:seed=3:phase=decode") == [FaultSpec("init"), FaultSpec("step", 3, "decode")]
    for bad in ("boom", "step", "step:seed=1:colour=red"):
        with pytest.raises(ValueError, match="fault_injection"):
            parse_fault_specs(bad)
    assert is_device_fatal(DeviceFatalError("x"))
    assert is_device_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_device_fatal(InjectedFault("x")) and not is_device_fatal(RuntimeError("CUDA out of memory"))


@pytest.mark.parametrize("overlap,mixed", [(False, False), (True, False), (False, True)],
                         ids=["plain", "overlap", "mixed"])
def test_step_fault_fails_only_the_steps_in_flight(smollm2_path, overlap, mixed):
    """plain: the victim's prefill step fails; the request decoding beside it is not in that step and
    finishes exactly. overlap: the fault hits a decode step holding both, with the previous step
    still in flight: both fail. mixed (mixed_prefill, the served default): the decoding request rides in
    the victim's prefill step, so it fails with it. Either way a request sent afterwards is served
    exactly and every page comes back."""
    llm = LLM(smollm2_path, dtype="float32", max_running_req=4, num_pages=128, overlap_schedule=overlap,
              mixed_prefill=mixed)
    ref_b = llm.generate([llm.encode("Write one sentence about cats.")], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    ref_c = llm.generate([llm.encode("数到五")], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    spec = FaultSpec("step", VICTIM_SEED, "decode" if overlap else "prefill")

    def body(loop: EngineLoop, rec: Recorder) -> None:
        loop.submit("b", _req(llm, "Write one sentence about cats.", 30))
        rec.wait(lambda sent: len(sent.get("b", [])) >= 2)  # b decodes
        loop.submit("v", _req(llm, "Tell me a joke.", 30, seed=VICTIM_SEED))
        rec.wait(lambda sent: rec.finished("v") and rec.finished("b"))
        loop.submit("c", _req(llm, "数到五", 8, stream=False))
        rec.wait(lambda sent: rec.finished("c"))

    rec = _run(llm, [spec], body)
    v = rec.check_one_final("v")
    assert v[-1][1] is not None and "engine step running this request failed" in v[-1][1] and "injected step fault" in v[-1][1]
    b = rec.check_one_final("b")
    if overlap or mixed:  # it was in both steps in flight / it rode in the failed prefill step
        assert b[-1][1] is not None and "injected step fault" in b[-1][1]
    else:
        assert b[-1][1] is None and _tokens(b) == ref_b.token_ids  # not in the failed step: untouched
    c = rec.check_one_final("c")
    assert c[-1][1] is None and _tokens(c) == ref_c.token_ids
    assert _all_pages_back(llm)


def test_device_fault_fails_everything_and_ends_the_engine(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", max_running_req=4, num_pages=128)
    fatal: list[str] = []

    def body(loop: EngineLoop, rec: Recorder) -> None:
        loop.submit("b", _req(llm, "Write one sentence about cats.", 60))
        rec.wait(lambda sent: len(sent.get("b", [])) >= 2)
        loop.submit("v", _req(llm, "Tell me a joke.", 30, seed=VICTIM_SEED))
        rec.wait(lambda sent: rec.finished("v") and rec.finished("b"))
        loop.submit("after", _req(llm, "Hello", 4))
        rec.wait(lambda sent: rec.finished("after"))
        time.sleep(0.2)

    rec = _run(llm, [FaultSpec("device", VICTIM_SEED)], body, on_fatal=fatal.append)
    for handle in ("b", "v", "after"):
        responses = rec.check_one_final(handle)
        assert "device failed" in (responses[-1][1] or ""), responses[-1]
    assert len(fatal) == 1 and "serves no more" in fatal[0]
