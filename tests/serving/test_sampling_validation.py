"""SamplingParams.validate and parse_request: every field's exact type and range, named in the message
(issue 52's accepted nonsense). Fast: no model, no server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from freetoken_core.config import INT64_MAX, SamplingParams
from freetoken_core.serving.triton.request import check_request_parameters, parse_request

VOCAB = 256


def _sp(d: dict) -> dict:
    return {"input_ids": np.array([1, 2, 3], np.int32),
            "sampling_parameters": np.array([json.dumps(d).encode()], dtype=object)}


@pytest.mark.parametrize("d, match", [
    ({"top_k": 10**23, "temperature": 1.0}, r"top_k must be -1 or 0 \(disabled\) or in \[1, 256\]"),
    ({"top_k": VOCAB + 1}, r"top_k .*\[1, 256\] \(the vocabulary size\), got 257"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 10**30}, r"seed must be in \[0, 9223372036854775807\]"),
    ({"seed": -1}, r"seed must be in \[0, "),
    ({"ignore_eos": 2}, "ignore_eos must be true or false, got 2"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"skip_special_tokens": 0}, "skip_special_tokens must be true or false"),
    ({"stop": {"a": 1}}, "stop must be a list of str"),
    ({"stop": [None]}, "stop must be a string, got None"),
    ({"stop": [1, 2]}, "stop must be a string, got 1"),
    ({"stop": [""]}, "stop must be a non-empty string"),
    ({"stop_token_ids": [1.7]}, "stop_token_ids must be an integer, got 1.7"),
    ({"stop_token_ids": [1e20]}, r"stop_token_ids must be integers in \[0, 255\] \(the vocabulary\)"),
    ({"stop_token_ids": [VOCAB]}, r"stop_token_ids must be integers in \[0, 255\]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be an integer, got True"),
    ({"stop_token_ids": "7"}, "stop_token_ids must be a list of int"),
    ({"temperature": "nan"}, "temperature must be a finite number"),
    ({"temperature": 1e39}, r"temperature must be in \[0, 3.403e\+38\]"),
    ({"temperature": -0.5}, r"temperature must be in \[0, "),
    ({"temperature": True}, "temperature must be a finite number, got True"),
    ({"temperature": 10**400}, "temperature must be a finite number"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": float("inf")}, "top_p must be a finite number"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 10**30}, "max_tokens=1000000000000000000000000000000 exceeds the limit of 100 new tokens"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"min_tokens": -1}, r"min_tokens must be in \[0, "),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens=5 is larger than max_tokens=4"),
    ({"logprobs": 1.5}, "logprobs must be an integer, got 1.5"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"logprobs": True}, "logprobs must be an integer, got True"),
])
def test_sampling_parameters_json_refused_naming_field_and_limit(d, match):
    with pytest.raises(ValueError, match=match):
        parse_request(_sp(d), max_tokens_limit=100, vocab_size=VOCAB)


@pytest.mark.parametrize("name, arr, match", [
    ("top_k", np.array([100_000], np.int32), r"top_k .*\[1, 256\]"),
    ("random_seed", np.array([2**64 - 1], np.uint64), r"seed must be in \[0, 9223372036854775807\]"),
    ("seed", np.array([-5], np.int64), "seed must be in"),
    ("stop_token_ids", np.array([3, 300], np.int32), r"stop_token_ids must be integers in \[0, 255\]"),
    ("temperature", np.array([np.inf], np.float32), "temperature must be a finite number"),
    ("min_length", np.array([-3], np.int32), "min_tokens"),
])
def test_tensor_inputs_refused_naming_field_and_limit(name, arr, match):
    with pytest.raises(ValueError, match=match):
        parse_request({"input_ids": np.array([1, 2], np.int32), name: arr}, max_tokens_limit=100, vocab_size=VOCAB)


def test_good_values_pass_and_strings_convert():
    p = parse_request(_sp({"top_k": VOCAB, "seed": INT64_MAX, "ignore_eos": "true", "stop": "x", "max_tokens": "8",
                           "stop_token_ids": [0, VOCAB - 1], "temperature": 1, "skip_special_tokens": False}),
                      vocab_size=VOCAB).params
    assert (p.top_k, p.seed, p.ignore_eos, p.stop, p.max_tokens, p.stop_token_ids, p.temperature) == (
        VOCAB, INT64_MAX, True, ["x"], 8, [0, VOCAB - 1], 1.0)
    assert p.skip_special_tokens is False
    for disabled in (-1, 0):
        assert parse_request(_sp({"top_k": disabled}), vocab_size=VOCAB).params.top_k == disabled


def test_tiny_temperature_is_greedy():
    # 1e-40 divides the logits into inf/NaN in float32: below vLLM's 1e-5 it samples greedily
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert parse_request(_sp({"temperature": 1e-40})).params.greedy


def test_direct_construction_is_checked_too():
    """The offline LLM and the scheduler call the same validator on SamplingParams built in Python."""
    with pytest.raises(ValueError, match="temperature must be a finite number, got '1'"):
        SamplingParams(temperature="1").validate()
    with pytest.raises(ValueError, match="ignore_eos must be true or false, got 1"):
        SamplingParams(ignore_eos=1).validate()
    with pytest.raises(ValueError, match="stop must be a non-empty string or a list"):
        SamplingParams(stop=("a",)).validate()
    with pytest.raises(ValueError, match=r"top_k .*\[1, 10\]"):
        SamplingParams(top_k=11).validate(vocab_size=10)
    SamplingParams(top_k=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(3)).validate(vocab_size=10)


def test_unknown_request_parameters_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown request field\(s\) \['max_token', 'temprature'\]"):
        check_request_parameters('{"max_token": 100, "temprature": 0.5}')
    with pytest.raises(ValueError, match=r"\['x'\]"):
        parse_request({"input_ids": np.array([1], np.int32)}, parameters='{"x": 1}')
    check_request_parameters("")
    check_request_parameters("{}")
    assert parse_request({"input_ids": np.array([1], np.int32)}, parameters="{}").params.max_tokens == 16
