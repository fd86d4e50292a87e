"""N-gram prompt-lookup drafter ("prompt lookup decoding", vLLM's `[ngram]` method).

The draft for a request is what followed the most recent earlier occurrence of its last n tokens
(prompt + output so far), trying n = max_ngram down to min_ngram: a longer match is better
evidence, and among matches of one length the latest is the one most like what comes next.

State is incremental: a table per n maps each n-gram to the start of the continuation after its
latest occurrence. A token enters the table only once the token after it exists, so the current
suffix (which has no continuation yet) never matches itself. Appending a token costs
O(max_ngram^2) and `propose()` costs O(max_ngram^2 + k), whatever the sequence length.
"""

from __future__ import annotations


class NgramProposer:
    """Per-request prompt-lookup drafter.

    `extend(tokens)` with the tokens committed each step (never the rejected drafts);
    `propose(max_tokens_left)` returns 0..min(k, max_tokens_left) draft tokens.
    """

    def __init__(self, prompt_ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.k = k
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # tables[n - min_ngram]: n-gram -> index of the token that followed its latest occurrence
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram - min_ngram + 1)]
        self.extend(prompt_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        toks = self.tokens
        for t in new_tokens:
            pos = len(toks)  # index of t: it is the continuation of every n-gram ending at pos - 1
            toks.append(int(t))
            for n in range(self.min_ngram, min(self.max_ngram, pos) + 1):
                self.tables[n - self.min_ngram][tuple(toks[pos - n : pos])] = pos

    def propose(self, max_tokens_left: int | None = None) -> list[int]:
        """Up to min(k, max_tokens_left) tokens that followed the latest earlier match of the suffix.

        When the continuation runs into the suffix itself (a repeating pattern close to the end)
        it keeps copying what it has just proposed, i.e. it extends the period: "a b c a b" proposes
        "c a b c ...". That is the same rule applied to the sequence as extended by the draft.
        """
        limit = self.k if max_tokens_left is None else min(self.k, max_tokens_left)
        toks = self.tokens
        size = len(toks)
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, size), self.min_ngram - 1, -1):
            start = self.tables[n - self.min_ngram].get(tuple(toks[size - n :]))
            if start is None:
                continue
            out: list[int] = []
            for i in range(limit):
                j = start + i
                out.append(toks[j] if j < size else out[j - size])
            return out
        return []
