"""Engine responses of the `freetoken` model: DetokenizeMsg -> output tensors (numpy).

Besides `next_tokens`, each response carries `context_tokens`: the output tokens of the request's
decode window (freetoken_core/tokenizer/detokenize.py: from the L-th last "anchor" token on,
tracked by a DetokWindow per request, O(1) per token). The detokenizer is stateless, so this window
is what lets it decode `next_tokens` exactly: no lost leading space, no multi-byte character split
across responses, stop-string prefixes held back. The window stays short however long the output.
(The slim ensemble response packs both into its one `meta` tensor: build_ensemble_outputs.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from freetoken_core.messages import DetokenizeMsg


def _bytes1(s: str | None) -> np.ndarray:
    return np.array([(s or "").encode("utf-8")], dtype=np.object_)


def top_logprob_tensors(top: list[dict[int, float]] | None) -> dict[str, np.ndarray]:
    """The top logprobs of a response's tokens (n per token, best first), flattened token by token into
    `top_logprob_ids` and `top_logprobs` (n * tokens values each); nothing when the client asked for none."""
    if not top:
        return {}
    return {"top_logprob_ids": np.asarray([t for d in top for t in d], dtype=np.int32),
            "top_logprobs": np.asarray([v for d in top for v in d.values()], dtype=np.float32)}


def build_outputs(
    msg: DetokenizeMsg,
    next_tokens: list[int],
    logprobs: list[float] | None,
    context_tokens: list[int],
    prompt_text: str,
    detok_params: str,
    cancel_key: str = "",
    omit: frozenset[str] = frozenset(),
    top_logprobs: list[dict[int, float]] | None = None,
) -> dict[str, np.ndarray]:
    """One response's tensors. `omit` names outputs the client turned off (return_<name>=false);
    `cancel_key` goes out only when set, i.e. only to the ensemble's detokenizer (serving/stream/cancel.py);
    `top_logprobs` only when the client asked for them (num_top_logprobs)."""
    stop = msg.stop_reason
    out = {
        "next_tokens": np.asarray(next_tokens, dtype=np.int32),
        "context_tokens": np.asarray(context_tokens, dtype=np.int32),
        "finished": np.array([msg.finished], dtype=bool),
        "finish_reason": _bytes1(msg.finish_reason if msg.finished else ""),
        "stop_reason": _bytes1("" if stop is None else str(stop)),
        "num_input_tokens": np.array([msg.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([msg.num_output_tokens], dtype=np.uint32),
        "num_cached_tokens": np.array([msg.num_cached_tokens], dtype=np.uint32),
        "logprobs": np.asarray(logprobs or [], dtype=np.float32),
        "spec_accepted": np.array([msg.spec_accepted], dtype=np.uint32),
        "spec_proposed": np.array([msg.spec_proposed], dtype=np.uint32),
        "prompt_text": _bytes1(prompt_text),
        "detok_params": _bytes1(detok_params),
    }
    for name in omit:
        out.pop(name, None)
    out.update(top_logprob_tensors(top_logprobs))
    if cancel_key:
        out["cancel_key"] = _bytes1(cancel_key)
    return out


# The slim ensemble response is ONE int32 tensor, `meta` (issue 13: the cost of a response follows its
# tensor count, not its bytes: each tensor is a pb.Tensor to build in the stub, a shared-memory block to
# send, an output for the server and an input of the detokenizer's request). Layout: a header of
# META_HEADER values [flags, num_input_tokens, num_output_tokens, num_cached_tokens, engine id, uid, seq, order
# slot (-1: none), len(context), len(next_tokens), route tag (2 values)], then the context window's tokens, then
# next_tokens. The route tag proves the response comes from this server's engine (serving/triton/ensemble_secret.py).
META_HEADER = 12
# meta[0] bits
META_FINISHED = 1
META_OMIT = {"finish_reason": 2, "num_input_tokens": 4, "num_output_tokens": 8, "num_cached_tokens": 64}
META_ACK = 16  # meta[4:7] name a response the detokenizer acks (engine id, uid, seq)
META_LOGPROBS = 32  # the client asked for logprobs: the detokenizer sends a logprobs output (else none at all)


@dataclass(frozen=True)
class EnsembleMeta:
    """A slim ensemble response's `meta`, read back (text_models.detokenize_response, the tests)."""

    flags: int
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    ack: tuple[int, int, int] | None
    slot: int  # the stream's slot in the engine's order table, -1: none
    context_tokens: np.ndarray
    next_tokens: np.ndarray
    route_tag: tuple[int, int] = (0, 0)

    @property
    def finished(self) -> bool:
        return bool(self.flags & META_FINISHED)

    @property
    def order(self) -> tuple[int, int, int, int] | None:
        """(engine id, slot, uid, seq): wait for this stream's previous response first (send_order.py)."""
        if self.ack is None or self.slot < 0:
            return None
        engine, uid, seq = self.ack
        return engine, self.slot, uid, seq


def read_ensemble_meta(meta: np.ndarray) -> EnsembleMeta:
    m = np.asarray(meta, dtype=np.int32).reshape(-1)
    if m.size < META_HEADER:
        raise ValueError(f"meta holds {m.size} values, fewer than its {META_HEADER}-value header")
    flags, n_in, n_out, n_cached, engine, uid, seq, slot, n_ctx, n_new, tag0, tag1 = m[:META_HEADER].tolist()
    if n_ctx < 0 or n_new < 0 or META_HEADER + n_ctx + n_new != m.size:
        raise ValueError(f"meta holds {m.size} values, but its header says {META_HEADER} + {n_ctx} context "
                         f"+ {n_new} new tokens")
    ack = (engine, uid, seq) if flags & META_ACK else None
    return EnsembleMeta(flags, n_in, n_out, n_cached, ack, slot, m[META_HEADER:META_HEADER + n_ctx], m[META_HEADER + n_ctx:],
                        (tag0, tag1))


def build_ensemble_outputs(
    msg: DetokenizeMsg,
    next_tokens: list[int],
    logprobs: list[float] | None,
    context_tokens: list[int],
    prompt_text: str,
    detok_params: str,
    cancel_key: str = "",
    omit: frozenset[str] = frozenset(),
    ack: tuple[int, int, int] | None = None,
    order_slot: int | None = None,
    logprobs_asked: bool = False,
    route_tag: tuple[int, int] = (0, 0),
    top_logprobs: list[dict[int, float]] | None = None,
) -> dict[str, np.ndarray]:
    """A response meant for the ensemble's stateless detokenizer only: what it needs for this one
    response and nothing else. The tokens and every number go in `meta` (one tensor, layout above);
    strings go only when they differ from the detokenizer's defaults (its inputs are optional), and
    `cancel_key` only when the caller says it is due (EngineLoop: first response, then every cancel_check
    interval); spec_* and stop_reason are not ensemble outputs, so never sent. `ack` = (engine id, uid,
    seq): the detokenizer acks this response once it sent it on (serving/stream/cancel.py AckSender; the
    engine's flow control and per-stream order rest on it); `order_slot` (with `ack`): the stream's
    slot in the engine's order table, so that it is sent only after its previous response
    (serving/stream/send_order.py). `logprobs_asked`: the client asked for logprobs, so the detokenizer answers with a
    logprobs output (empty when this response has none); otherwise it sends none, one tensor fewer a response.
    `route_tag`: this server's (serving/triton/ensemble_secret.py), checked by the detokenizer before it touches an order
    table or acks anything."""
    flags = META_FINISHED if msg.finished else 0
    if logprobs_asked:
        flags |= META_LOGPROBS
    for name in omit:
        flags |= META_OMIT.get(name, 0)
    if ack is not None:
        flags |= META_ACK
    engine, uid, seq = ack or (0, 0, 0)
    n_ctx, n_new = len(context_tokens), len(next_tokens)
    meta = np.empty(META_HEADER + n_ctx + n_new, dtype=np.int32)
    slot = order_slot if ack is not None and order_slot is not None else -1
    meta[:META_HEADER] = (flags, msg.num_prompt_tokens, msg.num_output_tokens, msg.num_cached_tokens, engine, uid,
                          seq, slot, n_ctx, n_new, *route_tag)
    meta[META_HEADER:META_HEADER + n_ctx] = context_tokens
    meta[META_HEADER + n_ctx:] = next_tokens
    out = {"meta": meta}
    if msg.finished and "finish_reason" not in omit:
        out["finish_reason"] = _bytes1(msg.finish_reason)
    if logprobs:
        out["logprobs"] = np.asarray(logprobs, dtype=np.float32)
    out.update(top_logprob_tensors(top_logprobs))
    if prompt_text:
        out["prompt_text"] = _bytes1(prompt_text)
    if detok_params:
        out["detok_params"] = _bytes1(detok_params)
    if cancel_key:
        out["cancel_key"] = _bytes1(cancel_key)
    return out


def build_probe(cancel_key: str) -> dict[str, np.ndarray]:
    """An internal response of a non-streaming ensemble request, while it runs: the ensemble schedules
    the detokenizer for it, and Triton marks that new step cancelled if the client cancelled (it never
    marks the engine's step in flight). The decoupled detokenizer forwards the cancel and completes
    the probe with the FINAL flag alone, so no client sees it (tests/serving/cancel_signals_repro.py)."""
    empty = np.zeros(0, dtype=np.int32)
    return {
        "next_tokens": empty, "context_tokens": empty, "finished": np.array([False]),
        "stop_reason": _bytes1(""), "logprobs": np.zeros(0, dtype=np.float32), "prompt_text": _bytes1(""),
        "detok_params": _bytes1(""), "cancel_key": _bytes1(cancel_key), "probe": np.array([True]),
    }
