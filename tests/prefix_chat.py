"""Multi-turn conversations for the prefix-cache tests: every conversation opens with one shared system
prompt; each turn's prompt is the previous prompt + its output + new user tokens; all conversations'
turns run together (interleaved in the scheduler)."""

from __future__ import annotations

import random

from freetoken_core import LLM, SamplingParams
from freetoken_core.llm import RequestOutput


def run_chats(llm: LLM, num_convs: int, num_turns: int, system_len: int, new_len: int, max_tokens: int,
              vocab: tuple[int, int], seed: int = 0, sampled: bool = False) -> list[list[RequestOutput]]:
    """Outputs per turn per conversation. Token ids drawn from [vocab[0], vocab[1]); `sampled` draws with
    a per-request seed instead of greedily."""
    rng = random.Random(seed)
    lo, hi = vocab
    system = [rng.randrange(lo, hi) for _ in range(system_len)]
    prompts = [system + [rng.randrange(lo, hi) for _ in range(new_len)] for _ in range(num_convs)]
    turns = []
    for t in range(num_turns):
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                 **(dict(temperature=0.8, top_p=0.9, seed=100 * t + c) if sampled else {}))
                  for c in range(num_convs)]
        outs = llm.generate(prompts, params)
        turns.append(outs)
        prompts = [p + o.token_ids + [rng.randrange(lo, hi) for _ in range(new_len)] for p, o in zip(prompts, outs)]
    return turns


def token_ids(turns: list[list[RequestOutput]]) -> list[list[list[int]]]:
    return [[o.token_ids for o in outs] for outs in turns]


def assert_later_turns_hit(turns: list[list[RequestOutput]], page_size: int) -> None:
    """From turn 2 on, the cache serves at least the previous turn's prompt rounded down to a page."""
    for t in range(1, len(turns)):
        for prev, cur in zip(turns[t - 1], turns[t]):
            want = len(prev.prompt_token_ids) // page_size * page_size
            assert cur.num_cached_tokens >= want, f"turn {t + 1}: {cur.num_cached_tokens} cached, want >= {want}"


def random_traffic(llm: LLM, vocab: tuple[int, int], steps: int = 160, seed: int = 7) -> None:
    """Requests over a few shared prefixes arrive and are aborted at random; the cache's invariants are checked
    after every step; every request ends with exactly one final message; at the end everything is back."""
    rng = random.Random(seed)
    sched, cache = llm.scheduler, llm.scheduler.cache
    lo, hi = vocab
    prefixes = [[rng.randrange(lo, hi) for _ in range(24)] for _ in range(3)]
    finals = submitted = 0
    for step in range(steps):
        if rng.random() < 0.4 and step < steps * 3 // 4:
            prompt = rng.choice(prefixes)[: rng.randrange(4, 24)] + [rng.randrange(lo, hi)] * rng.randrange(1, 6)
            sched.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True))
            submitted += 1
        if rng.random() < 0.15 and sched.running + list(sched.waiting):
            sched.abort(rng.choice(sched.running + list(sched.waiting)).uid)
        finals += sum(m.finished for m in sched.step())
        cache.check()
    while sched.has_work():
        finals += sum(m.finished for m in sched.step())
        cache.check()
    assert finals == submitted
    assert_all_back(llm)


def assert_all_back(llm: LLM) -> None:
    """Accounting: free pages + evictable cached pages == the pool, snapshot slots likewise (what /metrics shows),
    the trie and the rows agree."""
    cache = llm.scheduler.cache
    cache.check()
    assert cache.num_free_pages == cache.num_total_pages
    stats = llm.scheduler.stats()
    assert stats.prefix_snapshot_slots_free == stats.prefix_snapshot_slots_total == cache.num_total_snapshots
    assert not llm.scheduler.running and not llm.scheduler.waiting
