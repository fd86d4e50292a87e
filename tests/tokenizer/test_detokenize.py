"""Incremental detokenizer: streamed deltas equal tokenizer.decode byte for byte, the stateless
step (Triton detokenizer) equals the stateful one, stop strings are caught across tokens."""

from __future__ import annotations

import random

import pytest

from freetoken_core.tokenizer import DetokWindow, IncrementalDetokenizer, decode_step, window_anchors

TEXTS = {
    "chinese": "你好，世界！这是一个测试，包含标点和罕见字：龘靐。",
    "emoji": "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 end",
    "code": "def f(x):\n    if x:\n        return  x  # two spaces\n\treturn None\n",
    "leading_spaces": "   three leading spaces",
    "multi_spaces": "multiple     spaces   between\twords",
    "newlines": "line one\n\nline two\r\n\n\nline three\n",
    "mixed": "Mixé: naïve café — 100 € ≠ ¥; “quotes” ‘x’ ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
}
CHUNKS = [1, 2, 3, 7]


def chunks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)] or [[]]


def stream_stateful(tok, ids, size, **kw) -> list[str]:
    """Deltas of one response per chunk, the last response flagged finished (like the scheduler's)."""
    d = IncrementalDetokenizer(tok, **kw)
    parts = chunks(ids, size)
    return [d.add(c, finished=(i == len(parts) - 1)) for i, c in enumerate(parts)]


def stream_stateless(tok, ids, size, stop=(), **kw) -> list[str]:
    """What the engine + the stateless Triton detokenizer do: the engine keeps a DetokWindow and sends
    the context ids with each response; decode_step sees nothing else."""
    window = DetokWindow(tok.anchors, window_anchors(stop))
    sent: list[int] = []
    out = []
    parts = chunks(ids, size)
    for i, c in enumerate(parts):
        ctx = sent[window.start() :]
        res = decode_step(tok, ctx, c, stop=stop, finished=(i == len(parts) - 1), **kw)
        out.append(res.text)
        window.push(c)
        sent.extend(c)
        if res.stopped:
            break
    return out


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode(any_tok, name, skip):
    ids = any_tok.encode(TEXTS[name], add_special_tokens=False)
    expected = any_tok.decode(ids, skip_special_tokens=skip)
    for size in CHUNKS:
        deltas = stream_stateful(any_tok, ids, size, skip_special_tokens=skip)
        assert "".join(deltas) == expected, (name, size)
        # no delta before the last ends inside a character (valid text never needs U+FFFD)
        assert all("\ufffd" not in d for d in deltas), (name, size, deltas)
        assert stream_stateless(any_tok, ids, size, skip_special_tokens=skip) == deltas, (name, size)


def test_add_then_finish_equals_decode(any_tok):
    """The offline LLM adds every response and calls finish() at the end."""
    ids = any_tok.encode(TEXTS["emoji"] + TEXTS["chinese"], add_special_tokens=False)
    d = IncrementalDetokenizer(any_tok)
    text = "".join(d.add([t]) for t in ids) + d.finish()
    assert text == any_tok.decode(ids) == d.text


def test_byte_pieces_held_until_character_completes(sp_legacy_tok):
    """A character split over byte pieces is emitted once, whole, with the piece that completes it."""
    tok = sp_legacy_tok
    ids = tok.encode("a 龘", add_special_tokens=False)
    pieces = tok.hf.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["<0xE9>", "<0xBE>", "<0x98>"], pieces  # 龘 is not in the tiny vocabulary
    deltas = stream_stateful(tok, ids, 1)
    assert deltas[-3:] == ["", "", "龘"]


def test_unfinished_character_flushed_at_finish(smol_tok):
    """A stream cut inside a character (length limit) ends with what decode gives: U+FFFD."""
    ids = smol_tok.encode("ok 😀", add_special_tokens=False)[:-1]
    full = smol_tok.decode(ids)
    assert full.endswith("\ufffd")
    d = IncrementalDetokenizer(smol_tok)
    streamed = "".join(d.add([t]) for t in ids)
    assert not streamed.endswith("\ufffd")
    assert streamed + d.finish() == full


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(any_tok, skip):
    specials = sorted(any_tok.special_ids)
    words = any_tok.encode(" Hello world, this is", add_special_tokens=False)
    ids = [specials[0]] + words[:2] + [specials[-1], specials[-1]] + words[2:] + [specials[1]]
    for size in CHUNKS:
        deltas = stream_stateful(any_tok, ids, size, skip_special_tokens=skip)
        assert "".join(deltas) == any_tok.decode(ids, skip_special_tokens=skip)
        assert stream_stateless(any_tok, ids, size, skip_special_tokens=skip) == deltas
    shown = "".join(stream_stateful(any_tok, ids, 1, skip_special_tokens=skip))
    assert (any_tok.hf.convert_ids_to_tokens(specials[-1]) in shown) is (not skip)


def test_random_token_streams_smollm2(smol_tok):
    """Random ids (what a random-weight model emits): partial UTF-8 sequences, invalid bytes, special
    tokens. Byte-level decoding is exact even then."""
    rng = random.Random(0)
    for trial in range(60):
        ids = [rng.randrange(smol_tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        skip = trial % 2 == 0
        size = rng.choice(CHUNKS)
        deltas = stream_stateful(smol_tok, ids, size, skip_special_tokens=skip)
        assert "".join(deltas) == smol_tok.decode(ids, skip_special_tokens=skip), ids
        assert stream_stateless(smol_tok, ids, size, skip_special_tokens=skip) == deltas


def test_random_pieces_sentencepiece(any_tok):
    """Random non-byte pieces (SentencePiece spaces in every position, lone "▁" tokens)."""
    rng = random.Random(1)
    ordinary = [i for i in range(any_tok.vocab_size) if any_tok.anchors[i] or i in any_tok.special_ids]
    for _ in range(40):
        ids = [rng.choice(ordinary) for _ in range(rng.randrange(1, 30))]
        size = rng.choice(CHUNKS)
        deltas = stream_stateful(any_tok, ids, size)
        assert "".join(deltas) == any_tok.decode(ids)
        assert stream_stateless(any_tok, ids, size) == deltas


# ---- stop strings -----------------------------------------------------------------------------------


def expected_stop_text(full: str, stop: list[str], include: bool) -> str | None:
    """The text before the stop string that ends first (through its end when include)."""
    best = None
    for s in stop:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[0]):
            best = ((i + len(s), -len(s)), i, s)
    if best is None:
        return None
    _, i, s = best
    return full[: i + len(s)] if include else full[:i]


STOP_CASES = [
    # (text, stop strings)
    ("Hello world, this is a small test.", ["world"]),
    ("Hello world, this is a small test.", ["lo wor"]),  # spans a token boundary
    ("Hello world, this is a small test.", ["Hel"]),  # at the very start
    ("Hello world, this is a small test.", ["H"]),  # the very first character
    ("Hello world, this is a small test.", ["is a", "small", "world, t"]),  # first to END wins
    ("The quick brown fox", ["quick brown", "brown"]),  # ends at the same place: the longer one
    ("你好，世界！这是一个测试。", ["世界"]),
    ("emoji 😀🎉 done", ["🎉"]),  # a stop string inside multi-byte pieces
    ("def f(x):\n    return x\n\nprint(1)", ["\n\n"]),
    ("aaab", ["aab"]),  # the held prefix "aa" must not swallow a restart
]


@pytest.mark.parametrize("text,stop", STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(any_tok, text, stop, include):
    ids = any_tok.encode(text, add_special_tokens=False)
    full = any_tok.decode(ids)
    want = expected_stop_text(full, stop, include)
    assert want is not None
    # the scheduler: commit token by token, stop at the token that completes a stop string
    checker = IncrementalDetokenizer(any_tok, stop=stop, include_stop_str_in_output=include)
    idx = checker.check_stop(ids)
    assert idx is not None and checker.stopped and checker.matched_stop in stop
    committed = ids[: idx + 1]
    assert expected_stop_text(any_tok.decode(committed), stop, include) == want  # ...and completes at idx
    assert expected_stop_text(any_tok.decode(committed[:-1]), stop, include) is None  # ...not before
    assert checker.text == want
    assert checker.finish() == "" and checker.add(ids) == ""  # nothing after a stop
    for size in CHUNKS:
        # the stateful stream of the committed tokens (the offline LLM) and the stateless one (Triton)
        deltas = stream_stateful(any_tok, committed, size, stop=stop, include_stop_str_in_output=include)
        assert "".join(deltas) == want, (size, deltas)
        assert stream_stateless(any_tok, committed, size, stop=stop, include_stop_str_in_output=include) == deltas
        # no delta ever shows the beginning of a stop string that then gets dropped
        shown = ""
        for dlt in deltas:
            shown += dlt
            assert want.startswith(shown)


@pytest.mark.parametrize("size", CHUNKS)
def test_stop_prefix_that_never_completes(any_tok, size):
    """Text that starts like a stop string is held back, then released when the stop cannot happen."""
    text = "Hello world, friends of the world"
    stop = ["world peace", "friendship"]
    ids = any_tok.encode(text, add_special_tokens=False)
    full = any_tok.decode(ids)
    d = IncrementalDetokenizer(any_tok, stop=stop)
    assert d.check_stop(ids) is None and not d.stopped
    # "world" at the end is still held: it may become "world peace"
    assert d.text == full[: full.rindex("world")]
    assert d.text + d.finish() == full
    deltas = stream_stateful(any_tok, ids, size, stop=stop)
    assert "".join(deltas) == full
    assert stream_stateless(any_tok, ids, size, stop=stop) == deltas


def test_stop_prefix_held_across_responses(smol_tok):
    ids = smol_tok.encode("Hello world", add_special_tokens=False)
    assert len(ids) == 2
    d = IncrementalDetokenizer(smol_tok, stop=["Hello there"])
    assert d.add(ids[:1]) == ""  # "Hello" may begin the stop string
    assert d.add(ids[1:]) == "Hello world"


def test_stop_check_index_in_a_speculative_chunk(smol_tok):
    """Several tokens committed at once (speculative decoding): the index of the completing token."""
    ids = smol_tok.encode("one two three four five", add_special_tokens=False)
    d = IncrementalDetokenizer(smol_tok, stop=["three"])
    assert d.check_stop(ids[:2]) is None
    idx = d.check_stop(ids[2:])
    assert ids[2:][idx] == ids[2] and smol_tok.decode(ids[: 3]).endswith("three")
    assert d.text == "one two "


def test_bad_stop_strings(smol_tok):
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(smol_tok, stop=[""])
