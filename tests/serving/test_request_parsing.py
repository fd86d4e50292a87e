"""Request tensors -> SamplingParams: the validation every Triton client hits first."""

import json

import numpy as np
import pytest

from freetoken_core.serving.triton.request import parse_request, parse_sampling_parameters


def _t(**kw):
    out = {"input_ids": np.array([1, 2, 3], dtype=np.int32)}
    for k, v in kw.items():
        out[k] = v if isinstance(v, np.ndarray) else np.array([v])
    return out


def test_defaults_and_explicit_tensors():
    r = parse_request(_t(max_tokens=np.array([7], np.int32), temperature=np.array([0.5], np.float32),
                         top_k=np.array([20], np.int32), random_seed=np.array([3], np.uint64),
                         stream=np.array([True]), min_length=np.array([2], np.int32)))
    assert r.input_ids == [1, 2, 3]
    assert (r.params.max_tokens, r.params.temperature, r.params.top_k, r.params.seed, r.params.min_tokens) == (7, 0.5, 20, 3, 2)
    assert r.stream and r.exclude_input_in_output and not r.return_logprobs


def test_genai_perf_vllm_payload_string_values():
    # genai-perf's vllm converter sends numbers as strings inside the JSON
    sp = json.dumps({"max_tokens": "128", "min_tokens": "128"})
    r = parse_request(_t(sampling_parameters=np.array([sp.encode()], dtype=object),
                         exclude_input_in_output=np.array([True]), stream=np.array([True])))
    assert r.params.max_tokens == 128 and r.params.min_tokens == 128


def test_tensor_overrides_sampling_parameters():
    sp = json.dumps({"max_tokens": 50, "temperature": 0.7, "stop": "###"})
    r = parse_request(_t(sampling_parameters=np.array([sp.encode()], dtype=object), max_tokens=np.array([5], np.int32),
                         stop_words=np.array([b"END", b""], dtype=object)))
    assert r.params.max_tokens == 5 and r.params.temperature == pytest.approx(0.7)
    assert r.params.stop == ["###", "END"]


def test_return_logprobs_asks_engine_for_logprobs():
    r = parse_request(_t(return_logprobs=np.array([True])))
    assert r.return_logprobs and r.params.logprobs == 0


def test_optional_outputs_are_sent_unless_turned_off():
    """An absent return_<name> sends the output, false leaves it out; num_cached_tokens goes out only when asked."""
    assert parse_request(_t()).omit_outputs == {"num_cached_tokens"}
    assert parse_request(_t(return_finish_reason=np.array([False]))).omit_outputs == {"finish_reason",
                                                                                      "num_cached_tokens"}
    assert parse_request(_t(return_num_cached_tokens=np.array([True]))).omit_outputs == frozenset()


def test_num_cached_tokens_output_when_asked():
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.response import build_outputs

    msg = DetokenizeMsg(uid=1, next_tokens=[5], finished=True, finish_reason="length", num_cached_tokens=48)
    asked = parse_request(_t(return_num_cached_tokens=np.array([True]))).omit_outputs
    assert int(build_outputs(msg, [5], None, [], "", "", omit=asked)["num_cached_tokens"][0]) == 48
    assert "num_cached_tokens" not in build_outputs(msg, [5], None, [], "", "", omit=parse_request(_t()).omit_outputs)


@pytest.mark.parametrize("kw, match", [
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens must be >= 1"),
    ({"max_tokens": np.array([-3], np.int32)}, "max_tokens must be >= 1"),
    ({"top_p": np.array([2.0], np.float32)}, "top_p"),
    ({"sampling_parameters": np.array([b"{not json"], dtype=object)}, "not valid JSON"),
    ({"sampling_parameters": np.array([b'{"max_tokens": "many"}'], dtype=object)}, "max_tokens"),
    ({"sampling_parameters": np.array([b'{"frobnicate": 1}'], dtype=object)}, "unknown key"),
    ({"sampling_parameters": np.array([b'{"length_penalty": 1.0}'], dtype=object)}, "unsupported"),
    ({"sampling_parameters": np.array([b'{"presence_penalty": 2.5}'], dtype=object)},
     r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
    ({"sampling_parameters": np.array([b"[1, 2]"], dtype=object)}, "JSON object"),
    ({"bad_words": np.array([b"foo"], dtype=object)}, "bad_words is not supported"),
    ({"beam_width": np.array([4], np.int32)}, "beam_width"),
])
def test_bad_inputs_name_the_problem(kw, match):
    with pytest.raises(ValueError, match=match):
        parse_request(_t(**kw))


def test_max_tokens_limit_and_vocab():
    with pytest.raises(ValueError, match="exceeds the limit of 10"):
        parse_request(_t(max_tokens=np.array([11], np.int32)), max_tokens_limit=10)
    with pytest.raises(ValueError, match="input_ids must be in"):
        parse_request({"input_ids": np.array([5, 300], np.int32)}, vocab_size=256)
    with pytest.raises(ValueError, match="empty"):
        parse_request({"input_ids": np.zeros((0,), np.int32)})
    with pytest.raises(ValueError, match="input_ids"):
        parse_request({})


def test_sampling_parameters_types():
    d = parse_sampling_parameters('{"ignore_eos": "true", "top_p": "0.9", "seed": 4, "stop": ["a", "b"]}')
    assert d == {"ignore_eos": True, "top_p": 0.9, "seed": 4, "stop": ["a", "b"]}
    assert parse_sampling_parameters("") == {}


def test_return_flags_false_omit_their_outputs():
    r = parse_request(_t(return_finish_reason=np.array([False]), return_num_input_tokens=np.array([False]),
                         return_num_output_tokens=np.array([True])))
    assert r.omit_outputs == {"finish_reason", "num_input_tokens", "num_cached_tokens"}
    assert parse_request(_t()).omit_outputs == {"num_cached_tokens"}  # absent = sent (the default), but that one


def test_build_outputs_honours_omit_and_sends_cancel_key_only_when_set():
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.response import build_outputs

    msg = DetokenizeMsg(uid=1, next_tokens=[5], finished=True, finish_reason="length", num_prompt_tokens=3,
                        num_output_tokens=1)
    out = build_outputs(msg, [5], None, [], "", "", omit=frozenset({"finish_reason", "num_output_tokens"}))
    assert "finish_reason" not in out and "num_output_tokens" not in out and "cancel_key" not in out
    assert int(out["num_input_tokens"][0]) == 3
    assert "cancel_key" in build_outputs(msg, [5], None, [], "", "", cancel_key="k")


def test_max_nonstream_tokens_bounds_only_non_streaming_requests():
    with pytest.raises(ValueError, match="max_tokens=65 exceeds max_nonstream_tokens=64.*generate_stream"):
        parse_request(_t(max_tokens=np.array([65], np.int32)), max_nonstream_tokens=64)
    assert parse_request(_t(max_tokens=np.array([64], np.int32)), max_nonstream_tokens=64).params.max_tokens == 64
    r = parse_request(_t(max_tokens=np.array([500], np.int32), stream=np.array([True])), max_nonstream_tokens=64)
    assert r.stream and r.params.max_tokens == 500
    assert parse_request(_t(max_tokens=np.array([500], np.int32)), max_nonstream_tokens=None).params.max_tokens == 500
