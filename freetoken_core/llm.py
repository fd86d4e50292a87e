"""LLM: the offline API. generate() for whole results, stream() for deltas, chat() for messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .config import EngineConfig, SamplingParams
from .messages import DetokenizeMsg
from .scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from .tokenizer.detokenize import IncrementalDetokenizer

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    spec_accepted: int = 0  # speculative decoding: accepted draft tokens
    spec_proposed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not prefilled)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamDelta:
    index: int  # which prompt of the call
    text: str  # new text since the previous delta
    next_tokens: list[int]  # tokens committed in this step
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    spec_accepted: int = 0  # speculative decoding, set on the final delta: accepted draft tokens
    spec_proposed: int = 0


class LLM:
    """Offline engine: `LLM(model_path, dtype=..., max_running_req=..., page_size=..., ...)`.

    Extra keyword arguments are EngineConfig fields. `close()` (or leaving `with LLM(...) as llm:`)
    frees the engine: its graphs, K/V pool, model and tensor-parallel ranks with their process group,
    so another LLM can start in this process; a stream still open then ends."""

    def __init__(self, model_path: str, **engine_kwargs: Any) -> None:
        self.config = EngineConfig(model_path=str(model_path), **engine_kwargs)
        self.scheduler = Scheduler(self.config)
        self.tokenizer = self.scheduler.tokenizer
        self.closed = False

    def close(self) -> None:
        """Free the engine now (idempotent). Requests still running end with finish_reason "abort"."""
        if self.closed:
            return
        self.closed = True
        self.scheduler.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inputs -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model directory has none (pass token ids)")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def encode_chat(self, messages: list[Message]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    # --- generation -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        ids = self._as_id_lists(prompts)
        params = self._params_for(ids, sampling_params)
        outputs = [RequestOutput(prompt_token_ids=p) for p in ids]
        for _ in self._run(ids, params, outputs, detokenize_each_step=False):
            pass
        # The text of each request once the engine is done, not on its step loop: there the host's detokenizing
        # between steps was time the steps of a fast model waited for.
        # Stop strings need no text here (the scheduler's StopChecker ends the request), and one add() of every token
        # gives the text the step-by-step adds give (IncrementalDetokenizer: the text is defined by the ids alone).
        if self.tokenizer is not None:
            for out, p in zip(outputs, params):
                detok = self._detokenizer(out.prompt_token_ids, p)
                out.text = detok.add(out.token_ids) + detok.finish()
        return outputs

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamDelta]:
        ids = self._as_id_lists(prompts)
        outputs = [RequestOutput(prompt_token_ids=p) for p in ids]
        yield from self._run(ids, self._params_for(ids, sampling_params), outputs, detokenize_each_step=True)

    def chat(
        self,
        conversations: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self.generate([self.encode_chat(c) for c in conversations], sampling_params)  # type: ignore[arg-type]

    # --- internals --------------------------------------------------------------------------
    def _as_id_lists(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return [self.encode(p) for p in prompts]  # type: ignore[union-attr]

    @staticmethod
    def _params_for(ids: list[list[int]],
                    sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * len(ids)
        params = list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} sampling params for {len(ids)} prompts")
        return params

    def _detokenizer(self, prompt_ids: list[int], p: SamplingParams) -> IncrementalDetokenizer:
        from .tokenizer.detokenize import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=p.skip_special_tokens,
                                      stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)

    def _run(
        self,
        ids: list[list[int]],
        params: list[SamplingParams],
        outputs: list[RequestOutput],
        detokenize_each_step: bool,
    ) -> Iterator[StreamDelta]:
        """Step the scheduler until every request of the call finished; a delta per message. With
        detokenize_each_step the deltas (and outputs) carry text, else only tokens."""
        if self.closed:
            raise RuntimeError("this LLM is closed")
        sched = self.scheduler
        index: dict[int, int] = {}
        detoks: dict[int, IncrementalDetokenizer | None] = {}
        try:
            for i, (p_ids, p) in enumerate(zip(ids, params)):
                uid = sched.add_request(p_ids, p)
                index[uid] = i
                detoks[uid] = (self._detokenizer(p_ids, p) if self.tokenizer is not None and detokenize_each_step
                               else None)
            remaining = set(index)
            while remaining:
                for msg in sched.step():
                    if msg.uid not in remaining:
                        continue
                    delta = self._apply(msg, outputs[index[msg.uid]], detoks[msg.uid], index[msg.uid])
                    if msg.finished:
                        remaining.discard(msg.uid)
                    yield delta
                    if self.closed:  # closed while the caller held this delta: the engine is gone
                        yield from self._end_closed(remaining, index, outputs)
                        return
        finally:
            # a caller that stops iterating (or an error) must not leave requests holding pages; after
            # close() the engine is freed and nothing is left to abort or step
            if not self.closed:
                for uid in list(index):
                    if sched.has_request(uid):
                        sched.abort(uid)
                while sched.has_queued_messages or sched.in_flight:
                    sched.step()

    @staticmethod
    def _end_closed(remaining: set[int], index: dict[int, int], outputs: list[RequestOutput]) -> Iterator[StreamDelta]:
        """The final delta of each request a close() cut short."""
        for uid in sorted(remaining, key=index.__getitem__):
            out = outputs[index[uid]]
            out.finish_reason = "abort"
            yield StreamDelta(index[uid], "", [], True, "abort", None, out.spec_accepted, out.spec_proposed)
        remaining.clear()

    @staticmethod
    def _apply(msg: DetokenizeMsg, out: RequestOutput, detok: IncrementalDetokenizer | None, i: int) -> StreamDelta:
        out.token_ids.extend(msg.next_tokens)
        text = detok.add(msg.next_tokens) if detok is not None else ""
        if msg.finished:
            text += detok.finish() if detok is not None else ""
            out.finish_reason = msg.finish_reason
            out.stop_reason = msg.stop_reason
            out.spec_accepted, out.spec_proposed = msg.spec_accepted, msg.spec_proposed
            out.num_cached_tokens = msg.num_cached_tokens
        out.text += text
        if msg.logprobs is not None:
            out.logprobs = (out.logprobs or []) + msg.logprobs
        if msg.top_logprobs is not None:
            out.top_logprobs = (out.top_logprobs or []) + msg.top_logprobs
        return StreamDelta(i, text, list(msg.next_tokens), msg.finished, msg.finish_reason, msg.logprobs,
                           out.spec_accepted, out.spec_proposed)
