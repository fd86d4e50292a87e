"""The tokenizer and detokenizer models' logic without a server: conflicting inputs, chat roles and
keys, outputs turned off by return_<name>=false."""

from __future__ import annotations

import json

import numpy as np
import pytest

from freetoken_core.serving.triton.chat import CHAT_ROLES, parse_chat_messages
from freetoken_core.serving.triton.text_models import detokenize_response, tokenize_request


def _b(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=object)


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    return load_tokenizer(smollm2_path)


def test_text_input_and_messages_together_is_an_error(tok):
    msgs = json.dumps([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="either text_input or messages, not both"):
        tokenize_request(tok, {"text_input": _b("Hello"), "messages": _b(msgs)})
    # each alone works; an empty text_input next to messages is no conflict (nothing to choose)
    assert tokenize_request(tok, {"messages": _b(msgs)})["input_ids"].size
    assert tokenize_request(tok, {"text_input": _b(""), "messages": _b(msgs)})["input_ids"].size
    assert tokenize_request(tok, {"text_input": _b("Hello")})["input_ids"].size


def test_every_chat_role_and_template_key_is_accepted(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "What is the weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    assert {m["role"] for m in msgs} == set(CHAT_ROLES)
    ids = tokenize_request(tok, {"messages": _b(json.dumps(msgs))})["input_ids"].tolist()
    text = tok.hf.decode(ids)
    assert "<|im_start|>tool\nsunny" in text and "<|im_start|>developer" in text


@pytest.mark.parametrize("messages, match", [
    ([{"role": "wizard", "content": "abracadabra"}], "role 'wizard'; allowed roles: system, developer, user"),
    ([{"content": "no role"}], "role None"),
    ([{"role": "user", "content": "x", "mood": "happy"}], r"unknown key\(s\) \['mood'\]"),
    ([{"role": "user"}], "needs 'content'"),
    ([{"role": "user", "content": 5}], "'content' must be a string"),
    ([{"role": "tool", "content": "x", "tool_call_id": 7}], "'tool_call_id' must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant messages carry 'tool_calls'"),
    ([{"role": "assistant", "content": "x", "tool_calls": "call it"}], "must be a list of objects"),
    ([], "non-empty JSON list"),
    ({"role": "user", "content": "x"}, "non-empty JSON list"),
])
def test_bad_chat_messages_name_the_problem(messages, match):
    with pytest.raises(ValueError, match=match):
        parse_chat_messages(json.dumps(messages))
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_chat_messages("[{role: user}]")


def test_detokenizer_leaves_out_what_the_engine_left_out(tok):
    base = {"next_tokens": np.array([28], np.int32), "context_tokens": np.zeros(0, np.int32),
            "finished": np.array([True]), "logprobs": np.zeros(0, np.float32)}
    full = detokenize_response(tok, {**base, "finish_reason": _b("length"),
                                     "num_input_tokens": np.array([3], np.uint32),
                                     "num_output_tokens": np.array([1], np.uint32)})
    assert {"finish_reason_out", "num_input_tokens_out", "num_output_tokens_out"} <= set(full)
    bare = detokenize_response(tok, base)
    assert not {"finish_reason_out", "num_input_tokens_out", "num_output_tokens_out"} & set(bare)
    assert bare["text_output"][0] == full["text_output"][0]


def test_slim_ensemble_response_is_one_tensor_and_decodes_like_the_full_one(tok):
    """The slim ensemble response packs tokens, counts, flags and the ack ids into `meta` alone (one
    tensor a send); the detokenizer reads the same text and outputs from it as from the full response."""
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.response import build_ensemble_outputs, build_outputs, read_ensemble_meta
    from freetoken_core.serving.triton.text_models import ack_of

    ids = tok.encode("Hello there, 世界 🐍!")
    ctx, new = ids[:4], ids[4:]
    for finished in (False, True):
        msg = DetokenizeMsg(uid=7, next_tokens=new, finished=finished, finish_reason="length" if finished else None,
                            num_prompt_tokens=11, num_output_tokens=len(ids))
        slim = build_ensemble_outputs(msg, new, None, ctx, "", "", ack=(3, 7, 42))
        assert set(slim) == ({"meta", "finish_reason"} if finished else {"meta"})
        meta = read_ensemble_meta(slim["meta"])
        assert meta.context_tokens.tolist() == ctx and meta.next_tokens.tolist() == new
        assert (meta.finished, meta.num_input_tokens, meta.num_output_tokens) == (finished, 11, len(ids))
        assert ack_of(slim) == (3, 7, 42)
        full = build_outputs(msg, new, None, ctx, "", "")
        a, b = detokenize_response(tok, slim), detokenize_response(tok, full)
        # no logprobs output unless the client asked for logprobs (one tensor fewer a response)
        assert "logprobs_out" not in a and b["logprobs_out"].size == 0
        assert a.keys() == b.keys() - {"logprobs_out"} and all(np.array_equal(a[k], b[k]) for k in a)
        logprobs = [-0.5] * len(new)
        asked = build_ensemble_outputs(msg, new, logprobs, ctx, "", "", logprobs_asked=True)
        a, b = detokenize_response(tok, asked), detokenize_response(tok, build_outputs(msg, new, logprobs, ctx, "", ""))
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        empty = detokenize_response(tok, build_ensemble_outputs(msg, [], [], ctx, "", "", logprobs_asked=True))
        assert empty["logprobs_out"].size == 0  # asked, and this response has no tokens: an empty output
    no_ack = build_ensemble_outputs(msg, [], None, [], "", "", omit=frozenset({"num_input_tokens"}))
    assert ack_of(no_ack) is None and "num_input_tokens_out" not in detokenize_response(tok, no_ack)
    with pytest.raises(ValueError, match="header says"):
        read_ensemble_meta(np.concatenate([slim["meta"], [5]]).astype(np.int32))
    with pytest.raises(ValueError, match="fewer than"):
        read_ensemble_meta(np.array([1, 2, 3], np.int32))


def test_num_cached_tokens_reaches_the_ensemble_output_only_when_asked(tok):
    """num_cached_tokens rides in the slim response's meta header and comes out of the detokenizer as
    num_cached_tokens_out, as from the full response; the request's default (not asked) leaves it out of both."""
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.request import parse_request
    from freetoken_core.serving.triton.response import build_ensemble_outputs, build_outputs, read_ensemble_meta

    ids = tok.encode("The prefix cache served most of this prompt.")
    msg = DetokenizeMsg(uid=3, next_tokens=ids[2:], finished=True, finish_reason="stop", num_prompt_tokens=70,
                        num_output_tokens=len(ids), num_cached_tokens=48)
    text_in = {"input_ids": np.array([1, 2, 3], np.int32)}
    asked = parse_request({**text_in, "return_num_cached_tokens": np.array([True])}).omit_outputs
    default = parse_request(text_in).omit_outputs
    slim = build_ensemble_outputs(msg, ids[2:], None, ids[:2], "", "", omit=asked, ack=(1, 3, 0))
    meta = read_ensemble_meta(slim["meta"])
    assert (meta.num_cached_tokens, meta.num_output_tokens, meta.ack) == (48, len(ids), (1, 3, 0))
    for out in (detokenize_response(tok, slim), detokenize_response(tok, build_outputs(msg, ids[2:], None, ids[:2],
                                                                                         "", "", omit=asked))):
        assert out["num_cached_tokens_out"].tolist() == [48] and out["num_input_tokens_out"].tolist() == [70]
    for out in (build_ensemble_outputs(msg, ids[2:], None, ids[:2], "", "", omit=default),
                build_outputs(msg, ids[2:], None, ids[:2], "", "", omit=default)):
        assert "num_cached_tokens_out" not in detokenize_response(tok, out)


def test_detokenizer_refuses_ids_outside_the_vocabulary(tok):
    """A direct detokenizer call with ids no token has gets an error naming the id and the size, not empty text;
    padding ids of the model's vocabulary (past the tokenizer's) still decode, to nothing."""
    limit = tok.id_limit
    assert limit == max(tok.vocab_size, tok.model_vocab_size) and tok.model_vocab_size == 49152
    for name, bad in (("next_tokens", limit), ("next_tokens", -1), ("context_tokens", 10**6)):
        tensors = {"next_tokens": np.array([504, 3458], np.int32), "context_tokens": np.array([504], np.int32)}
        tensors[name] = np.array([bad], np.int32)
        with pytest.raises(ValueError, match=rf"{name}: token id {bad} is outside the vocabulary \[0, {limit}\)"):
            detokenize_response(tok, tensors)
    ok = detokenize_response(tok, {"next_tokens": np.array([limit - 1], np.int32)})
    assert ok["text_output"].dtype == object


def test_unknown_request_parameters_are_refused_by_the_tokenizer_step(tok):
    with pytest.raises(ValueError, match=r"unknown request field\(s\) \['max_token', 'temprature'\]"):
        tokenize_request(tok, {"text_input": _b("Hello")}, '{"max_token": 100, "temprature": 0.5}')
    assert tokenize_request(tok, {"text_input": _b("Hello")}, "{}")["input_ids"].size


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def qwen_like_tok(smollm2_path, tmp_path_factory):
    from freetoken_core.tokenizer.tokenize import load_tokenizer
    from tests.serving.qwen_like_model import qwen_like_model_dir

    return load_tokenizer(str(qwen_like_model_dir(smollm2_path, tmp_path_factory.mktemp("qwen_like") / "m")))


def test_tools_and_template_kwargs_reach_the_chat_template(qwen_like_tok):
    tok = qwen_like_tok
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    ids = tokenize_request(tok, {"messages": _b(json.dumps(msgs)), "tools": _b(json.dumps([WEATHER_TOOL])),
                                 "chat_template_kwargs": _b('{"enable_thinking": false}')})["input_ids"].tolist()
    text = tok.hf.decode(ids)
    assert json.dumps(WEATHER_TOOL) in text  # the schema, as the template writes it
    # a past call's arguments (an OpenAI JSON string) rendered as the object the template expects
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = tok.hf.decode(tokenize_request(tok, {"messages": _b(json.dumps(msgs[:1]))})["input_ids"].tolist())
    assert "# Tools" not in plain and "<think>" not in plain


@pytest.mark.parametrize("inputs, match", [
    ({"tools": '{"name": "f"}'}, "tools must be a JSON list"),
    ({"tools": '[{"type": "function", "function": {"description": "no name"}}]'}, r"tools\[0\].function.name"),
    ({"tools": "[{"}, "tools is not valid JSON"),
    ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs must be a JSON object"),
    ({"chat_template_kwargs": '{"tokenize": true}'}, r"chat_template_kwargs may not set \['tokenize'\]"),
])
def test_bad_tools_and_template_kwargs_name_the_input(qwen_like_tok, inputs, match):
    msgs = json.dumps([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match=match):
        tokenize_request(qwen_like_tok, {"messages": _b(msgs), **{k: _b(v) for k, v in inputs.items()}})


def test_tools_a_template_ignores_or_without_a_chat_are_refused(tok):
    msgs = json.dumps([{"role": "user", "content": "Hi"}])
    tools = _b(json.dumps([WEATHER_TOOL]))
    with pytest.raises(ValueError, match="tools: this model's chat template does not render tools"):
        tokenize_request(tok, {"messages": _b(msgs), "tools": tools})  # SmolLM2's template has no tools
    with pytest.raises(ValueError, match="tools: only with a chat"):
        tokenize_request(tok, {"text_input": _b("Hi"), "tools": tools})


def test_input_ids_pass_through_checked(tok):
    out = tokenize_request(tok, {"input_ids": np.array([1, 2, 3], np.int32), "stop_words": _b("<|im_end|>")})
    assert out["input_ids"].tolist() == [1, 2, 3] and out["stop_token_ids"].size == 1
    with pytest.raises(ValueError, match="input_ids: token id 99999999 is outside the vocabulary"):
        tokenize_request(tok, {"input_ids": np.array([1, 99999999], np.int32)})
    with pytest.raises(ValueError, match="input_ids: send one prompt"):
        tokenize_request(tok, {"input_ids": np.array([1], np.int32), "text_input": _b("Hi")})
    with pytest.raises(ValueError, match="the prompt is empty"):
        tokenize_request(tok, {"input_ids": np.zeros(0, np.int32)})


def test_top_logprobs_go_through_both_response_shapes(tok):
    """n per token, best first, flattened token by token; absent when the client asked for none."""
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.response import build_ensemble_outputs, build_outputs

    new, top = [10, 11], [{10: -0.1, 12: -2.5}, {11: -0.3, 13: -1.5}]
    msg = DetokenizeMsg(uid=1, next_tokens=new, finished=False, logprobs=[-0.1, -0.3], top_logprobs=top)
    for outputs in (build_ensemble_outputs(msg, new, msg.logprobs, [], "", "", logprobs_asked=True, top_logprobs=top),
                    build_outputs(msg, new, msg.logprobs, [], "", "", top_logprobs=top)):
        out = detokenize_response(tok, outputs)
        assert out["top_logprob_ids_out"].tolist() == [10, 12, 11, 13]
        assert out["top_logprobs_out"].tolist() == pytest.approx([-0.1, -2.5, -0.3, -1.5])
    assert "top_logprobs_out" not in detokenize_response(tok, build_outputs(msg, new, msg.logprobs, [], "", ""))
