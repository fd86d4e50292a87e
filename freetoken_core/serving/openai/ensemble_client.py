"""The frontend's one road to the engine: the ensemble over tritonclient's asyncio gRPC streaming.

Every OpenAI request is one ensemble request on a gRPC stream of its own while it runs, streaming or not (a
non-streaming answer is the aggregate of the stream), so a client that leaves is seen at once: closing the generator
cancels that gRPC call, Triton marks the request cancelled, and the ensemble's detokenizer tells the engine to abort
it (serving/stream/cancel.py). A stream whose request finished goes back to an idle pool and carries a later request:
opening a gRPC stream costs a request's first token about 0.6 ms (benchmarks/RESULTS.md, OpenAI API). The request ends
at the response that carries a finish reason (the asyncio client cannot ask for Triton's empty FINAL response, so
the request asks for `finish_reason` in every response).

Requests go out as tritonclient's protobuf messages built here (`EnsembleRequest.infer_request`) on tritonclient's
service stub: its `InferInput` objects cost a request about 80 us more to build, all of it before the first token.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

ENSEMBLE_MODEL = "ensemble"
# What each OpenAI request asks of every response: the finish reason ends the stream; the counts become `usage`
# (num_cached_tokens: usage.prompt_tokens_details.cached_tokens)
ALWAYS_RETURNED = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                   "return_num_cached_tokens")
ALWAYS_SET = ("stream", *ALWAYS_RETURNED)  # the boolean inputs every request sets true


class EngineError(Exception):
    """The ensemble refused or failed the request; `message` is the server's."""


@dataclass(frozen=True)
class EnsembleRequest:
    """The ensemble inputs of one OpenAI request (names of model_repository/ensemble/config.pbtxt)."""

    text_input: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: tuple[int, ...] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_words: tuple[str, ...] = ()
    return_logprobs: bool = False
    top_logprobs: int = 0  # n > 0: the n most likely tokens of each position too
    sampling_parameters: Mapping[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, np.ndarray]:
        """{input name: numpy array}: the inputs every request sets, then the ones this request sets."""
        return _always_set_tensors() | self._own_tensors()

    def _own_tensors(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if self.text_input is not None:
            out["text_input"] = _string(self.text_input)
        if self.messages is not None:
            out["messages"] = _string(json.dumps(self.messages, ensure_ascii=False))
        if self.input_ids is not None:
            out["input_ids"] = np.array(self.input_ids, dtype=np.int32)
        if self.tools:
            out["tools"] = _string(json.dumps(self.tools, ensure_ascii=False))
        if self.chat_template_kwargs:
            out["chat_template_kwargs"] = _string(json.dumps(dict(self.chat_template_kwargs), ensure_ascii=False))
        for name, dtype in (("max_tokens", np.int32), ("temperature", np.float32), ("top_p", np.float32),
                            ("top_k", np.int32), ("min_p", np.float32), ("presence_penalty", np.float32),
                            ("frequency_penalty", np.float32), ("repetition_penalty", np.float32), ("seed", np.int64),
                            ("min_tokens", np.int32), ("ignore_eos", np.bool_)):
            value = getattr(self, name)
            if value is not None:
                out[name] = np.array([value], dtype=dtype)
        if self.stop_words:
            out["stop_words"] = np.array([s.encode() for s in self.stop_words], dtype=np.object_)
        if self.return_logprobs:
            out["return_logprobs"] = np.array([True])
        if self.top_logprobs:
            out["num_top_logprobs"] = np.array([self.top_logprobs], dtype=np.int32)
        if self.sampling_parameters:
            out["sampling_parameters"] = _string(json.dumps(dict(self.sampling_parameters)))
        return out

    def infer_request(self, model: str, request_id: str) -> service_pb2.ModelInferRequest:
        """The gRPC request: each input's bytes in `raw_input_contents`, as tritonclient sends them (the inputs every
        request sets copied from one message built once)."""
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(_ALWAYS_SET_REQUEST)
        request.model_name, request.id = model, request_id
        _add_inputs(request, self._own_tensors())
        return request


def _string(s: str) -> np.ndarray:
    return np.array([s.encode("utf-8")], dtype=np.object_)


_BYTES_LENGTH = struct.Struct("<I")  # each element of a raw BYTES tensor: its length, then its bytes


def _add_inputs(request: service_pb2.ModelInferRequest, tensors: dict[str, np.ndarray]) -> None:
    for name, value in tensors.items():
        request.inputs.add(name=name, datatype=_triton_dtype(value.dtype), shape=value.shape)
        if value.dtype == np.object_:
            request.raw_input_contents.append(b"".join(_BYTES_LENGTH.pack(len(v)) + v for v in value.reshape(-1)))
        else:
            request.raw_input_contents.append(value.tobytes())


@functools.cache
def _triton_dtype(dtype: np.dtype) -> str:
    return np_to_triton_dtype(dtype)


def _always_set_tensors() -> dict[str, np.ndarray]:
    return {name: np.array([True]) for name in ALWAYS_SET}


_ALWAYS_SET_REQUEST = service_pb2.ModelInferRequest()
_add_inputs(_ALWAYS_SET_REQUEST, _always_set_tensors())


@dataclass(frozen=True)
class EnsembleStep:
    """One ensemble response: the text delta and what came with it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "" until the last response
    num_input_tokens: int | None
    num_output_tokens: int | None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token: (id, logprob), best first


def _top_logprobs(ids: list[int] | None, values: list[float] | None, num_tokens: int):
    """The flat top_logprob_ids / top_logprobs outputs (n per token) -> per token (id, logprob) pairs."""
    if not ids or values is None or not num_tokens or len(ids) % num_tokens:
        return ()
    n = len(ids) // num_tokens
    pairs = list(zip(ids, values))
    return tuple(tuple(pairs[i * n:(i + 1) * n]) for i in range(num_tokens))


def _bytes_elements(data: bytes) -> list[bytes]:
    elements, offset, end = [], 0, len(data)
    while offset < end:
        (length,) = _BYTES_LENGTH.unpack_from(data, offset)
        offset += 4
        elements.append(data[offset:offset + length])
        offset += length
    return elements


@functools.cache
def _numpy_dtype(datatype: str) -> np.dtype:
    return np.dtype(triton_to_np_dtype(datatype))


def decode_outputs(response: service_pb2.ModelInferResponse) -> dict[str, list[Any]]:
    """Every output of a response as a flat list of Python values (bytes for BYTES), decoded once and without numpy
    arrays: reading responses is a large share of the frontend's CPU time per streamed chunk."""
    raw = response.raw_output_contents
    num_raw = len(raw)
    out: dict[str, list[Any]] = {}
    for index, output in enumerate(response.outputs):
        if index < num_raw:
            data = raw[index]
            out[output.name] = _bytes_elements(data) if output.datatype == "BYTES" else \
                np.frombuffer(data, dtype=_numpy_dtype(output.datatype)).tolist()
        else:  # an older server's typed contents
            out[output.name] = list(output.contents.bytes_contents)
    return out


def read_step(response: service_pb2.ModelInferResponse) -> EnsembleStep:
    """A response -> EnsembleStep (absent outputs read as empty)."""
    outputs = decode_outputs(response)
    get = outputs.get
    text = get("text_output")
    ids = get("next_tokens") or []
    reason = get("finish_reason")

    def count(name: str) -> int | None:
        values = get(name)
        return int(values[0]) if values else None

    return EnsembleStep(
        text=b"".join(text).decode("utf-8") if text else "",
        token_ids=tuple(ids),
        logprobs=tuple(get("logprobs") or ()),
        finish_reason=reason[0].decode() if reason else "",
        num_input_tokens=count("num_input_tokens"),
        num_output_tokens=count("num_output_tokens"),
        num_cached_tokens=count("num_cached_tokens"),
        top_logprobs=_top_logprobs(get("top_logprob_ids"), get("top_logprobs"), len(ids)),
    )


# tritonclient's own channel settings (tritonclient/grpc/aio): no message size limit of gRPC's below Triton's
_CHANNEL_OPTIONS = (("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1))

# idle streams kept per process: enough for every stream of a busy worker, few enough to be no burden on the server
MAX_IDLE_STREAMS = 256


class _Stream:
    """One gRPC stream to the server that carries one request at a time (the request iterator waits on a queue)."""

    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        self._requests: asyncio.Queue[service_pb2.ModelInferRequest | None] = asyncio.Queue()
        self.call = stub.ModelStreamInfer(self._iterate())

    async def _iterate(self) -> AsyncIterator[service_pb2.ModelInferRequest]:
        while (request := await self._requests.get()) is not None:
            yield request

    def send(self, request: service_pb2.ModelInferRequest) -> None:
        self._requests.put_nowait(request)

    def close(self) -> None:
        """Ends the request stream: the server then closes the call."""
        self._requests.put_nowait(None)


class EnsembleClient:
    """One asyncio gRPC channel to the local Triton server, shared by every request of this process, and the
    idle streams of finished requests. tritonclient's own client answers the health and metadata calls."""

    def __init__(self, grpc_url: str, model: str = ENSEMBLE_MODEL) -> None:
        import tritonclient.grpc.aio as grpcclient

        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._channel = grpc.aio.insecure_channel(grpc_url, options=_CHANNEL_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._model = model
        self._idle: list[_Stream] = []
        self._ids = (f"oa-{os.getpid()}-{n}" for n in itertools.count())  # unique: a stale response is told apart

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
        await self._channel.close()
        await self._client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready()) and bool(await self._client.is_model_ready(self._model))
        except Exception:  # noqa: BLE001 (any transport failure means: not ready)
            return False

    async def input_names(self) -> frozenset[str]:
        meta = await self._client.get_model_metadata(self._model, as_json=True)
        return frozenset(i["name"] for i in meta["inputs"])

    def _release(self, stream: _Stream) -> None:
        if len(self._idle) < MAX_IDLE_STREAMS:
            self._idle.append(stream)
        else:
            stream.close()

    async def generate(self, request: EnsembleRequest, request_id: str = "") -> AsyncIterator[EnsembleStep]:
        """The responses of one request until the one with a finish reason. Closing the generator early (the HTTP
        client left; asyncio cancelled the task) cancels the request's gRPC call, which aborts the engine request."""
        request_id = request_id or next(self._ids)
        stream = self._idle.pop() if self._idle else _Stream(self._stub)
        stream.send(request.infer_request(self._model, request_id))
        state = "running"  # -> "finished" (the stream can carry another request) or "failed" (it is dropped)
        try:
            while True:
                try:
                    message = await stream.call.read()
                except grpc.aio.AioRpcError as e:  # no server on the port, or it went away mid-answer
                    state = "failed"
                    raise EngineError(f"the Triton server is unreachable: {e.details()}") from None
                if message is grpc.aio.EOF:
                    state = "failed"
                    raise EngineError("the server closed the stream before the request finished")
                if message.error_message:
                    state = "failed"  # the request ended with its error: nothing to cancel
                    raise EngineError(message.error_message)
                if message.infer_response.id != request_id:
                    continue  # a late response of the stream's previous request
                step = read_step(message.infer_response)
                if step.finish_reason:
                    state = "finished"
                yield step
                if state == "finished":
                    return
        finally:
            if state == "finished":
                self._release(stream)
            elif state == "failed":
                stream.close()
            else:  # the consumer left early: cancelling the call aborts the engine request
                stream.call.cancel()
