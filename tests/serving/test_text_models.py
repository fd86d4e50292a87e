"""The tokenizer and detokenizer models' logic without a server: conflicting inputs, chat roles and
keys, outputs turned off by return_<name>=false."""

from __future__ import annotations

import json

import numpy as np
import pytest

from freetoken_core.serving.chat import CHAT_ROLES, parse_chat_messages
from freetoken_core.serving.text_models import detokenize_response, tokenize_request


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
