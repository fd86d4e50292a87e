"""N-gram prompt-lookup drafter: matching rules, incremental state, limits."""

from __future__ import annotations

import random

import pytest

from freetoken_core.spec import NgramProposer


def reference_propose(toks: list[int], k: int, max_ngram: int, min_ngram: int, limit: int | None = None) -> list[int]:
    """Brute force: scan back for the latest earlier occurrence of the suffix, longest n first."""
    limit = k if limit is None else min(k, limit)
    size = len(toks)
    if limit <= 0:
        return []
    for n in range(min(max_ngram, size), min_ngram - 1, -1):
        suffix = toks[size - n :]
        for i in range(size - n - 1, -1, -1):  # i = size - n would be the suffix itself
            if toks[i : i + n] == suffix:
                ext = list(toks)
                for j in range(i + n, i + n + limit):
                    ext.append(ext[j])
                return ext[size:]
    return []


def test_match_proposes_the_continuation():
    p = NgramProposer([1, 2, 3, 4, 1, 2], k=2)
    assert p.propose() == [3, 4]


def test_no_match_proposes_nothing():
    assert NgramProposer([1, 2, 3], k=4).propose() == []
    assert NgramProposer([], k=4).propose() == []
    assert NgramProposer([7], k=4).propose() == []


def test_longest_ngram_wins_over_a_more_recent_shorter_match():
    # "7" last occurred at index 5 (followed by 1); the 3-gram "5 6 7" occurred at 0..2 (followed by 8)
    toks = [5, 6, 7, 8, 9, 7, 1, 5, 6, 7]
    assert NgramProposer(toks, k=1, max_ngram=3).propose() == [8]
    assert NgramProposer(toks, k=1, max_ngram=1).propose() == [1]


def test_most_recent_occurrence_wins():
    p = NgramProposer([1, 2, 10, 1, 2, 20, 1, 2], k=2, max_ngram=2)
    assert p.propose() == [20, 1]


def test_min_ngram_excludes_short_matches():
    toks = [4, 9, 3, 9]  # only a 1-gram match
    assert NgramProposer(toks, k=1, min_ngram=1).propose() == [3]
    assert NgramProposer(toks, k=1, min_ngram=2).propose() == []


def test_repeating_pattern_extends_its_period():
    # the continuation of the match runs into the suffix: keep copying what was just proposed
    assert NgramProposer([1, 2, 3, 1, 2], k=5).propose() == [3, 1, 2, 3, 1]
    assert NgramProposer([7, 7, 7, 7], k=4).propose() == [7, 7, 7, 7]


def test_limit_is_respected():
    p = NgramProposer([1, 2, 3, 4, 5, 1, 2], k=4)
    assert p.propose() == [3, 4, 5, 1]
    assert p.propose(2) == [3, 4]
    assert p.propose(10) == [3, 4, 5, 1]
    assert p.propose(0) == []
    assert p.propose(-3) == []
    assert NgramProposer([1, 1], k=0).propose() == []


def test_incremental_extend_equals_from_scratch_and_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 12])
        k = rng.randint(1, 8)
        max_ngram = rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        p = NgramProposer(prompt, k=k, max_ngram=max_ngram, min_ngram=min_ngram)
        toks = list(prompt)
        for _ in range(15):
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
            p.extend(chunk)
            toks += chunk
            limit = rng.choice([None, 0, 1, 3, 9])
            want = reference_propose(toks, k, max_ngram, min_ngram, limit)
            assert p.propose(limit) == want, (trial, toks, limit)
            fresh = NgramProposer(toks, k=k, max_ngram=max_ngram, min_ngram=min_ngram)
            assert fresh.propose(limit) == want
        assert len(p) == len(toks)


def test_bad_arguments_name_the_limit():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer([1], k=2, max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramProposer([1], k=2, min_ngram=0)
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer([1], k=-1)
