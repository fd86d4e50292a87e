"""The real SmolLM2 model through the offline LLM API: transformers-identical greedy output on chat
prompts, batched/chunked/paged runs identical to one-at-a-time, stop strings, streaming text."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "Explain recursion to a child in two sentences."}],
]
N_NEW = 24


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", page_size=16, max_running_req=8)


@pytest.fixture(scope="module")
def hf_outputs(smollm2_path, llm):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, local_files_only=True).eval()
    outs = []
    with torch.no_grad():
        for chat in CHATS:
            ids = torch.tensor([llm.encode_chat(chat)])
            gen = ref.generate(ids, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def test_chat_greedy_matches_transformers(llm, hf_outputs):
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    alone = [llm.chat(c, params)[0] for c in CHATS]
    assert [o.token_ids for o in alone] == hf_outputs
    assert "Paris" in alone[0].text


@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_chunked_equals_alone(smollm2_path, hf_outputs, page_size):
    llm = LLM(smollm2_path, dtype="float32", page_size=page_size, max_running_req=3, max_extend_tokens=16,
              kv_cache_gb=0.25)
    outs = llm.chat(CHATS, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_outputs
    assert llm.scheduler.cache.num_free_pages == llm.scheduler.cache.num_total_pages


def test_stop_string_spanning_tokens(llm):
    base = llm.chat(CHATS[0], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    tok = llm.tokenizer
    # a stop string made of the tail of one token and the head of the next
    pieces = [tok.decode([t]) for t in base.token_ids]
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i][-1:] + pieces[i + 1][:2]
    assert stop in base.text
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=N_NEW, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert out.token_ids == base.token_ids[: i + 2]


def test_eos_vs_length_finish_reason(llm):
    short = llm.chat(CHATS[0], SamplingParams(max_tokens=3))[0]
    assert short.finish_reason == "length" and short.num_output_tokens == 3
    full = llm.chat(CHATS[0], SamplingParams(max_tokens=200))[0]
    assert full.finish_reason == "stop" and full.token_ids[-1] in llm.scheduler.eos_token_ids
    assert full.num_output_tokens < 200


def test_streamed_text_equals_offline_decode(llm):
    prompt = "翻译成英文：你好，世界！🌍🚀 Then print it in Python: print('héllo')"
    params = SamplingParams(max_tokens=40, ignore_eos=True, skip_special_tokens=False)
    deltas = list(llm.stream(prompt, params))
    ids = [t for d in deltas for t in d.next_tokens]
    assert "".join(d.text for d in deltas) == llm.tokenizer.decode(ids, skip_special_tokens=False)


CODE = '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''


@pytest.mark.parametrize("pipelined", [False, True])
def test_ngram_speculation_on_real_model(smollm2_path, llm, pipelined):
    """pipelined: overlap scheduling forced on CPU, so greedy verify steps run device-resident."""
    chat = [{"role": "user", "content": "Repeat the following code exactly, with no other text:\n" + CODE * 2}]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    base = llm.chat(chat, params)[0]
    spec_llm = LLM(smollm2_path, dtype="float32", page_size=16, max_running_req=4, speculative="ngram",
                   num_speculative_tokens=4, kv_cache_gb=0.25, overlap_schedule=pipelined or None)
    out = spec_llm.chat(chat, params)[0]
    assert out.token_ids == base.token_ids and out.text == base.text
    assert out.spec_accepted >= 0.25 * out.spec_proposed > 0  # copying code: many drafts are right
    # a stop string that ends the output inside an accepted run of copied code
    stop = "a + b"
    assert stop in base.text
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop])
    want = llm.chat(chat, params)[0]
    got = spec_llm.chat(chat, params)[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)


@pytest.mark.parametrize("skip_special", [True, False])
def test_generate_text_equals_streamed_text(smollm2_path, skip_special):
    """generate() makes a request's text once the engine is done with it, stream() a step at a time: the two agree
    byte for byte, with and without stop strings, on random weights' sampled tokens (byte pieces of split
    characters and special tokens among them)."""
    llm = LLM(smollm2_path, dtype="float32", load_format="dummy", page_size=16, max_running_req=4)
    prompts = ["翻译：你好，世界！🌍", "def f(x):\n    return", "Hello there", "émoji 🚀🚀 and more"]

    def params(stop: list[str] | None = None, include: bool = False) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=11 + i, stop=stop or [],
                               include_stop_str_in_output=include, skip_special_tokens=skip_special)
                for i in range(len(prompts))]

    def streamed(ps: list[SamplingParams]) -> list[tuple[str, list[int]]]:
        texts, ids = [""] * len(prompts), [[] for _ in prompts]
        for d in llm.stream(prompts, ps):
            texts[d.index] += d.text
            ids[d.index] += d.next_tokens
        return list(zip(texts, ids))

    outs = llm.generate(prompts, params())
    assert [(o.text, o.token_ids) for o in outs] == streamed(params())
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=skip_special)
    # a stop string from the middle of the longest text: the request ends there, both ways
    text = max((o.text for o in outs), key=len)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    for include in (False, True):
        stopped = llm.generate(prompts, params([stop], include))
        assert [(o.text, o.token_ids) for o in stopped] == streamed(params([stop], include))
        assert any(o.finish_reason == "stop" and o.stop_reason == stop for o in stopped)
        for o, full in zip(stopped, outs):
            if o.finish_reason == "stop":
                assert o.text == full.text[: full.text.index(stop) + (len(stop) if include else 0)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_prefix_cache_identical(smollm2_path, page_size):
    """Conversations sharing a system prompt, turn after turn, fewer rows than conversations, chunked
    prefill: the same tokens with the prefix cache on and off; later turns take the earlier turns' pages."""
    from tests.prefix_chat import assert_all_back, assert_later_turns_hit, run_chats, token_ids

    chat = dict(num_convs=3, num_turns=3, system_len=30, new_len=6, max_tokens=6, vocab=(100, 40000))
    kw = dict(dtype="float32", page_size=page_size, max_running_req=2, max_extend_tokens=24, num_pages=400 // page_size)
    off = run_chats(LLM(smollm2_path, enable_prefix_caching=False, **kw), **chat)
    llm = LLM(smollm2_path, **kw)
    on = run_chats(llm, **chat)
    assert token_ids(on) == token_ids(off)
    assert_later_turns_hit(on, page_size)
    assert_all_back(llm)
