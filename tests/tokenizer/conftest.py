"""Tokenizers for the tokenizer tests: the real SmolLM2 one (byte-level BPE) and two tiny
SentencePiece-style ones (byte fallback, "▁" spaces) trained here on a few sentences, so leading-space
and byte-fallback behaviour is tested without a hub."""

from __future__ import annotations

import json

import pytest

from freetoken_core.tokenizer import Tokenizer, load_tokenizer

CORPUS = [
    "Hello world, this is a small test.",
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 0\n",
    "Streaming text must equal the offline decode.",
    "你好 世界",  # a few CJK characters become tokens; the rest of CJK text goes through byte pieces
] * 20


def build_sentencepiece_style(style: str) -> Tokenizer:
    """A byte-fallback BPE with SentencePiece spaces. `legacy`: Llama-2 layout (normalizer prepends "▁",
    decoder strips one leading space); `metaspace`: Metaspace pre-tokenizer and decoder (prepend "first")."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rt = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "legacy":
        rt.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        rt.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    elif style == "metaspace":
        rt.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        rt.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:
        raise ValueError(style)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    rt.train_from_iterator(CORPUS, trainer)
    # byte pieces <0x00>..<0xFF> as ordinary vocabulary entries, as in Llama's tokenizer
    spec = json.loads(rt.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    rt = RustTokenizer.from_str(json.dumps(spec))
    hf = PreTrainedTokenizerFast(tokenizer_object=rt, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    return Tokenizer(hf)


@pytest.fixture(scope="session")
def smol_tok(smollm2_path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def sp_legacy_tok() -> Tokenizer:
    return build_sentencepiece_style("legacy")


@pytest.fixture(scope="session")
def sp_metaspace_tok() -> Tokenizer:
    return build_sentencepiece_style("metaspace")


@pytest.fixture(params=["smollm2", "sp_legacy", "sp_metaspace"])
def any_tok(request) -> Tokenizer:
    name = {"smollm2": "smol_tok", "sp_legacy": "sp_legacy_tok", "sp_metaspace": "sp_metaspace_tok"}[request.param]
    return request.getfixturevalue(name)
