"""detok_send_order (serving/stream/send_order.py): detokenizer instances keep each stream's responses in order
through a shared order table, so the engine may keep several responses of a stream in flight."""

from __future__ import annotations

import random
import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.triton.response import read_ensemble_meta
from freetoken_core.serving.stream.send_order import ORDER_FILE, OrderTable, SendOrder, SlotAllocator
from freetoken_core.serving.triton.text_models import detokenize_response, order_of
from test_engine_loop import AckingTransport, RecordingTransport, run_acked_streams


def test_a_response_waits_for_the_one_before_it_and_slots_never_go_back(tmp_path):
    engine = OrderTable(tmp_path / ORDER_FILE, create=True, slots=8)
    detok = OrderTable(tmp_path / ORDER_FILE, create=False)  # what another process maps
    assert detok.slots == 8
    slots = SlotAllocator(engine)
    slot = slots.take(tag=77)
    assert detok.wait_turn(slot, 77, 0, timeout_s=0.0)  # a stream's first response never waits
    t0 = time.monotonic()
    assert not detok.wait_turn(slot, 77, 1, timeout_s=0.05) and time.monotonic() - t0 >= 0.05
    detok.sent(slot, 77, 0)
    assert detok.wait_turn(slot, 77, 1, timeout_s=0.0)
    detok.sent(slot, 77, 3)  # one that went after a timeout moves the slot on...
    detok.sent(slot, 77, 1)  # ...and a late one never moves it back
    assert detok.wait_turn(slot, 77, 4, timeout_s=0.0)
    detok.sent(slot, 5, 4)  # another stream's responses never touch this slot
    assert detok.wait_turn(slot, 77, 4, timeout_s=0.0)
    slots.give_back(slot)
    again = slots.take(tag=78)  # a reused slot starts over for its new stream; the old one's ids miss it
    assert again == slot and detok.wait_turn(slot, 78, 0, timeout_s=0.0)
    assert not detok.wait_turn(slot, 77, 4, timeout_s=0.0)
    assert not detok.wait_turn(99, 78, 0, timeout_s=0.0)  # a slot outside the table: nothing to wait for
    assert [slots.take(tag=t) is not None for t in range(8)] == [True] * 7 + [False]  # full: no slot


def test_two_instances_taking_a_streams_responses_out_of_order_send_them_in_order(tmp_path):
    """Two workers (the instances) take a stream's responses alternately, the later one often first;
    each waits its turn, so what they send comes out in seq order."""
    engine = OrderTable(tmp_path / ORDER_FILE, create=True, slots=4)
    slot = SlotAllocator(engine).take(tag=9)
    orders = [SendOrder(lambda _engine_id: tmp_path) for _ in range(2)]
    sent: list[int] = []
    lock = threading.Lock()
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(60)]

    def instance(k: int) -> None:
        for seq in range(k, 60, 2):
            time.sleep(delays[seq])  # detokenizing: the two take different times
            orders[k].wait_turn(1, slot, 9, seq)
            with lock:
                sent.append(seq)
            orders[k].sent(1, slot, 9, seq)

    threads = [threading.Thread(target=instance, args=(k,)) for k in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sent == list(range(60))


class AcksHeldUntilWindowFull(AckingTransport):
    """A detokenizer that falls behind however fast or slow the engine steps: the first response is acked at
    once (so the loop knows acks arrive), later ones of a stream only once `window` are unacked, and then
    0.3 s late, so a fifth sent against a full window would show in most_unacked. A final response, or
    10 s without the window filling (a broken window), releases what is held instead of hanging."""

    def __init__(self, window: int) -> None:
        super().__init__(0.0)
        self.window = window
        self.first = True
        self.held: dict[str, list] = {}

    def send(self, handle, outputs, error, final) -> None:
        meta = None if outputs is None else outputs.get("meta")
        ack_ids = None if meta is None else read_ensemble_meta(meta).ack
        RecordingTransport.send(self, handle, outputs, error, final)
        if ack_ids is None:
            return
        with self.lock:
            if self.first:
                self.first = False
                self._release([(handle, ack_ids, False)], 0.0)
                return
            if not final:
                self.unacked[handle] = self.unacked.get(handle, 0) + 1
                self.most_unacked = max(self.most_unacked, self.unacked[handle])
            held = self.held.setdefault(handle, [])
            held.append((handle, ack_ids, not final))
            if final or self.unacked.get(handle, 0) >= self.window:
                self._release(self.held.pop(handle), 0.0 if final else 0.3)
            elif len(held) == 1:
                threading.Timer(10.0, self._release_held, args=(handle,)).start()

    def _release_held(self, handle) -> None:
        with self.lock:
            held = self.held.pop(handle, None)
        if held:
            self._release(held, 0.0)

    def _release(self, held: list, delay_s: float) -> None:
        def ack() -> None:
            with self.lock:
                for handle, ack_ids, counted in held:
                    if counted:
                        self.unacked[handle] -= 1
                    self.acks.add(*ack_ids)
                self.acks.flush()

        threading.Timer(delay_s, ack).start()


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=8)


def test_engine_numbers_each_streams_responses_and_keeps_several_in_flight(llm):
    """With send_order the engine gives each acked stream a slot and numbers all of its responses, the last
    one too; up to max_inflight are unacked at once (late acks), tokens and text stay exact, and every slot
    is free again once the last responses are acked."""
    prompts = ["Write one sentence about cats.", "数到五"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = AcksHeldUntilWindowFull(window=4)

    def slots_come_back(loop: EngineLoop) -> None:  # once the last responses are acked
        slots = loop.sender._slots
        deadline = time.monotonic() + 10
        while len(slots._free) != slots.table.slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(slots._free) == slots.table.slots

    run_acked_streams(llm, prompts, params, transport, LoopOptions(max_inflight=4, send_order=True),
                      before_stop=slots_come_back)
    assert transport.most_unacked == 4  # the window filled, and no fifth went out while it was full
    assert len(assert_numbered_and_exact(llm, transport, expected)) == len(prompts)  # one slot per stream


def assert_numbered_and_exact(llm, transport, expected) -> set[int]:
    """Each stream: one FINAL response, last; its responses numbered 0, 1, ... (the last one included); its
    tokens and text exactly the offline run's. Returns the order slots the streams used."""
    slots = set()
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        orders = [order_of(out) for out, _, _ in responses]
        assert all(o is not None for o in orders)
        assert [o[3] for o in orders] == list(range(len(responses)))
        slots |= {o[1] for o in orders}
        metas = [read_ensemble_meta(out["meta"]) for out, _, _ in responses]
        assert [t for m in metas for t in m.next_tokens.tolist()] == exp.token_ids
        text = "".join(detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8")
                       for out, _, _ in responses)
        assert text == exp.text
    return slots


@pytest.mark.parametrize("streams,budget,floor,window", [(2, 16, 4, 8), (3, 16, 4, 5), (2, 4, 4, 4), (3, 4, 1, 1),
                                                         (2, 4, 1, 2)])
def test_an_inflight_budget_gives_few_streams_a_larger_window(llm, streams, budget, floor, window):
    """detok_inflight_budget: an ordered stream may have max(max_inflight, budget // the instance's streams in
    flight) responses unacked: 16 shared by 2 streams is 8 each, by 3 is 5, a budget below max_inflight x streams
    leaves max_inflight, and with max_inflight 1 (auto with the budget) 4 shared by 3 streams is 1 each, by 2 is 2.
    The detokenizer here holds its acks until a stream has `window` unacked, so a response sent past the window
    shows in most_unacked, and a window that never fills in most_unacked too.
    The streams start and end together: a stream's share grows while fewer are in flight (by design), and a loaded
    host that admitted the first request a step before the others gave it 6 of 5 (CI, thirty-fourth session)."""
    prompts = ["Write one sentence about cats.", "数到五", "List three colours."][:streams]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = AcksHeldUntilWindowFull(window=window)
    run_acked_streams(llm, prompts, params, transport,
                      LoopOptions(max_inflight=floor, send_order=True, inflight_budget=budget), together=True)
    assert transport.most_unacked == window
    assert_numbered_and_exact(llm, transport, expected)
