"""Tokenizer wrapper: encode, chat template, EOS ids, stop words, loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from freetoken_core.tokenizer import load_tokenizer


def test_encode_decode_roundtrip(smol_tok):
    text = "The capital of France is Paris.\n  Indented 你好 😀"
    ids = smol_tok.encode(text)
    assert ids == smol_tok.hf.encode(text)
    assert smol_tok.decode(ids) == smol_tok.hf.decode(ids, skip_special_tokens=True) == text
    assert smol_tok.vocab_size == 49152
    with pytest.raises(ValueError, match="string"):
        smol_tok.encode(["not", "text"])


def test_decode_matches_transformers_with_specials(any_tok):
    ids = list(range(0, any_tok.vocab_size, max(1, any_tok.vocab_size // 300)))
    for skip in (True, False):
        assert any_tok.decode(ids, skip_special_tokens=skip) == any_tok.hf.decode(ids, skip_special_tokens=skip)


def test_chat_template(smol_tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = smol_tok.apply_chat_template(messages)
    text = smol_tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(smol_tok.hf.convert_tokens_to_ids("<|im_start|>")) == 3  # no BOS added twice
    no_prompt = smol_tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert smol_tok.apply_chat_template(parts) == ids


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "message 0 must be an object"),
        ([{"content": "hi"}], "message 0 needs a non-empty string 'role'"),
        ([{"role": "user"}], "message 0 .*has no 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], "message 1 'content' must be a string"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "content part 0"),
    ],
)
def test_malformed_chat_messages(smol_tok, messages, match):
    with pytest.raises(ValueError, match=match):
        smol_tok.apply_chat_template(messages)


def test_no_chat_template(sp_legacy_tok):
    with pytest.raises(ValueError, match="no chat template"):
        sp_legacy_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_from_tokenizer_and_generation_config(smol_tok, smollm2_path, tmp_path):
    im_end = smol_tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert smol_tok.eos_token_ids() == {im_end}  # generation_config.json says 2 = <|im_end|> too
    # a generation_config.json with a list (chat models often list several)
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for f in Path(smollm2_path).iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, model_dir / f.name)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 7]}))
    assert load_tokenizer(str(model_dir)).eos_token_ids() == {0, 2, 7, im_end}
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(str(model_dir)).eos_token_ids() == {5, im_end}
    (model_dir / "generation_config.json").unlink()
    assert load_tokenizer(str(model_dir)).eos_token_ids() == {im_end}


def test_stop_words(smol_tok):
    seqs = smol_tok.stop_words_to_ids(["\n\n", "User:"])
    assert [smol_tok.decode(s) for s in seqs] == ["\n\n", "User:"]
    arr = smol_tok.stop_words_tensor(["\n\n", "User:"])
    assert arr.dtype == np.int32 and arr.shape[0] == 2
    flat = seqs[0] + seqs[1]
    assert arr[0, : len(flat)].tolist() == flat
    assert arr[1].tolist()[:2] == [len(seqs[0]), len(flat)] and all(v == -1 for v in arr[1, 2:])
    with pytest.raises(ValueError, match="non-empty strings"):
        smol_tok.stop_words_to_ids([""])


def test_anchors(smol_tok, sp_legacy_tok):
    a = smol_tok.anchors
    assert a.dtype == bool and len(a) == smol_tok.vocab_size
    assert not any(a[i] for i in smol_tok.special_ids)
    hello = smol_tok.encode("Hello", add_special_tokens=False)[0]
    assert a[hello]
    emoji_pieces = smol_tok.encode("😀", add_special_tokens=False)
    assert len(emoji_pieces) > 1 and not a[emoji_pieces[-1]]  # a piece of a character
    byte_piece = sp_legacy_tok.hf.convert_tokens_to_ids("<0x41>")
    assert not sp_legacy_tok.anchors[byte_piece]


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(str(f))


def test_load_from_gguf_file(smollm2_path):
    from freetoken_core.models.gguf import freetoken_home

    gguf = freetoken_home() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip("the SmolLM2 GGUF is not in the cache")
    tok = load_tokenizer(str(gguf))
    ref = load_tokenizer(smollm2_path)
    text = "Hello 你好 😀\n  x"
    assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token_ids() == ref.eos_token_ids()
