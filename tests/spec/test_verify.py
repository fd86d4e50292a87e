"""Acceptance of drafts in a verify step: greedy equals non-speculative greedy; rejection sampling
keeps the target distribution (statistical test) and is deterministic per seed."""

from __future__ import annotations

import math

import torch

from freetoken_core.config import SamplingParams
from freetoken_core.spec import greedy_accept, rejection_accept, rejection_accept_device, verify

# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_commits_k_plus_one():
    target = torch.tensor([[5, 6, 7, 8]])
    assert greedy_accept(target, torch.tensor([[5, 6, 7]]), [3]) == [[5, 6, 7, 8]]


def test_greedy_first_rejected_commits_the_target_token():
    target = torch.tensor([[5, 6, 7, 8]])
    assert greedy_accept(target, torch.tensor([[4, 6, 7]]), [3]) == [[5]]


def test_greedy_stops_at_first_mismatch_even_if_later_drafts_match():
    target = torch.tensor([[5, 6, 7, 8]])
    assert greedy_accept(target, torch.tensor([[5, 0, 7]]), [3]) == [[5, 6]]


def test_greedy_padded_drafts_are_never_accepted():
    # padding happens to equal the target: it must still not be accepted
    target = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    drafts = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 9, 9]])
    assert greedy_accept(target, drafts, [1, 0, 2]) == [[5, 6], [1], [9, 9, 9]]
    assert greedy_accept(target, drafts, torch.tensor([1, 0, 2])) == [[5, 6], [1], [9, 9, 9]]


def test_greedy_with_no_draft_columns():
    assert greedy_accept(torch.tensor([[3], [4]]), torch.empty(2, 0, dtype=torch.long), [0, 0]) == [[3], [4]]


def test_greedy_equals_non_speculative_greedy_on_a_deterministic_model():
    # a toy "model": next token = f(previous token); speculation with any drafts reproduces its rollout
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 16, (16,), generator=g)
    plain = [3]
    for _ in range(40):
        plain.append(int(table[plain[-1]]))
    spec = [3]
    k = 4
    while len(spec) < len(plain):
        # drafts: right with probability 1/2 per position (so runs of all lengths happen)
        drafts, last = [], spec[-1]
        for _ in range(k):
            nxt = int(table[last]) if torch.rand(1, generator=g) < 0.5 else int(torch.randint(0, 16, (1,), generator=g))
            drafts.append(nxt)
            last = nxt
        rows = [spec[-1]] + drafts
        target = table[torch.tensor(rows)][None, :]
        spec += greedy_accept(target, torch.tensor([drafts]), [k])[0]
    assert spec[: len(plain)] == plain


# ---------------------------------------------------------------- rejection sampling: statistics

V = 8


def _target_probs() -> torch.Tensor:
    """[4, V] fixed distributions with zeros; row 0 peaked on token 2 (draft 0 is likely)."""
    g = torch.Generator().manual_seed(1234)
    p = torch.rand(4, V, generator=g) + 0.05
    p[0, 2] = 4.0
    p[0, 5] = 0.0
    p[1, 6] = 1.5
    p[1, 0] = 0.0
    p[1, 3] = 0.0
    p[2, 1] = 0.0
    return p / p.sum(dim=1, keepdim=True)


def _close(counts: torch.Tensor, p: torch.Tensor) -> bool:
    """Every category's frequency within 6 binomial standard deviations of p (two-sided tail per
    category ~2e-9, so a correct sampler essentially never fails; with fixed seeds it never
    flakes), and no draws at all of a zero-probability token."""
    n = int(counts.sum())
    freq = counts.double() / n
    sd = (p.double() * (1 - p.double()) / n).sqrt()
    ok_zero = bool((counts[p == 0] == 0).all())
    return ok_zero and bool(((freq - p.double()).abs() <= 6 * sd + 1.0 / n).all())


def _run(p: torch.Tensor, drafts: list[int], num_drafts: int, n: int, seed: int) -> list[list[int]]:
    probs = p[None].expand(n, -1, -1).contiguous()
    d = torch.tensor(drafts)[None].expand(n, -1).contiguous()
    return rejection_accept(probs, d, [num_drafts] * n, [None] * n, torch.Generator().manual_seed(seed))


def test_rejection_sampling_preserves_the_target_distribution():
    p = _target_probs()
    n = 40_000
    # draft 0 likely (p=0.4..), draft 1 moderately likely, draft 2 impossible (p=0): always rejected
    drafts = [2, 6, 1]
    out = _run(p, drafts, num_drafts=3, n=n, seed=7)

    first = torch.tensor([o[0] for o in out])
    counts0 = torch.bincount(first, minlength=V)
    assert _close(counts0, p[0])
    # the checker has power: the naive scheme (on rejection resample from p, draft not removed)
    # puts p0(d) + (1 - p0(d)) p0(d) on the draft
    naive = p[0] * (1 - p[0, 2])
    naive[2] += p[0, 2]
    assert not _close(counts0, naive)

    # conditional on accepting draft 0, the second token is distributed as p_1
    second = torch.tensor([o[1] for o in out if len(o) >= 2])
    assert abs(len(second) / n - float(p[0, 2])) < 6 * math.sqrt(0.25 / n)
    assert _close(torch.bincount(second, minlength=V), p[1])
    # conditional on accepting drafts 0 and 1, the third is p_2 (its draft has p=0: never accepted)
    third = torch.tensor([o[2] for o in out if len(o) >= 3])
    assert len(third) > 2000
    assert _close(torch.bincount(third, minlength=V), p[2])
    assert max(len(o) for o in out) == 3


def test_bonus_token_after_all_drafts_is_distributed_as_the_next_row():
    p = _target_probs()
    n = 20_000
    out = _run(p, [2, 6, 1], num_drafts=1, n=n, seed=11)  # one real draft; the rest is padding
    assert max(len(o) for o in out) == 2
    bonus = torch.tensor([o[1] for o in out if len(o) == 2])
    assert _close(torch.bincount(bonus, minlength=V), p[1])
    assert _close(torch.bincount(torch.tensor([o[0] for o in out]), minlength=V), p[0])


def test_zero_probability_drafts_are_always_rejected_and_certain_ones_always_accepted():
    p = torch.zeros(3, V)
    p[0, 4] = 1.0  # certain: always accepted
    p[1, 1], p[1, 2] = 0.5, 0.5  # draft 7 has p=0: always rejected, replaced by 1 or 2
    p[2, 3] = 1.0
    out = _run(p, [4, 7], num_drafts=2, n=2000, seed=3)
    assert {tuple(o) for o in out} == {(4, 1), (4, 2)}
    # a draft that carries all the mass up to rounding, the rest exactly 0: never a 0-prob token
    q = torch.zeros(2, V)
    q[0, 5] = 0.99999994
    q[1, 0] = 1.0
    out = _run(q, [5], num_drafts=1, n=2000, seed=4)
    assert all(o[0] == 5 for o in out)


def test_unnormalised_rows_and_k_up_to_8():
    g = torch.Generator().manual_seed(5)
    k = 8
    probs = torch.rand(3, k + 1, V, generator=g) * 10  # not normalised
    probs[:, :, 0] = 0
    drafts = torch.randint(0, V, (3, k), generator=g)
    out = rejection_accept(probs, drafts, [8, 5, 0], [None] * 3, torch.Generator().manual_seed(0))
    for o, nd, dr in zip(out, [8, 5, 0], drafts.tolist()):
        assert 1 <= len(o) <= nd + 1
        assert o[:-1] == dr[: len(o) - 1]
        assert 0 not in o


# ---------------------------------------------------------------- rejection sampling: seeds


def test_seeded_requests_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(9)
    k = 4
    probs = torch.rand(5, k + 1, V, generator=g).softmax(dim=-1)
    drafts = probs[:, :k].argmax(dim=-1)  # likely drafts, so acceptance runs vary

    def alone(b: int, seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        res = []
        for _ in range(20):  # 20 steps on one generator
            res.append(rejection_accept(probs[b : b + 1], drafts[b : b + 1], [k], [gen])[0])
        return res

    # request 2 with seed 42, in a batch with others (seeded and unseeded), padded to a wider k
    wide = torch.cat([drafts, torch.zeros(5, 2, dtype=torch.long)], dim=1)
    wide_probs = torch.cat([probs, probs[:, :2]], dim=1)
    gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(42), None, torch.Generator().manual_seed(3)]
    default = torch.Generator().manual_seed(0)
    order = [4, 2, 0, 1, 3]  # request 2 at another index too
    in_batch = []
    for _ in range(20):
        res = rejection_accept(wide_probs[order], wide[order], [k, k, 2, 0, k], [gens[i] for i in order], default)
        in_batch.append(res[1])
    assert in_batch == alone(2, 42)
    assert alone(2, 42) != alone(2, 43)


def test_rejection_device_result_unpacks_like_the_lists():
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(4, 4, V, generator=g).softmax(dim=-1)
    drafts = probs[:, :3].argmax(dim=-1)
    r = rejection_accept_device(probs, drafts, [3, 3, 1, 0], [None] * 4, torch.Generator().manual_seed(1))
    lists = r.to_lists()
    assert [len(x) - 1 for x in lists] == r.num_accepted.tolist()
    assert r.unpack(r.packed().tolist()) == lists


# ---------------------------------------------------------------- mixed batches from logits


def test_verify_mixed_batch_top_k_1_sampling_equals_greedy():
    g = torch.Generator().manual_seed(6)
    k = 3
    logits = torch.randn(4, k + 1, V, generator=g)
    target = logits.argmax(dim=-1)
    drafts = target[:, :k].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # request 1 rejects at draft 1
    drafts[3, 0] = (drafts[3, 0] + 1) % V
    nd = [3, 3, 2, 3]
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=1),  # one-hot distribution: same as greedy
        SamplingParams(temperature=1.3, top_k=1, seed=5),
        SamplingParams(),
    ]
    gens = [None, None, torch.Generator().manual_seed(5), None]
    got = verify(logits, drafts, nd, params, gens, torch.Generator().manual_seed(0))
    assert got == greedy_accept(target, drafts, nd)
    assert got == [target[0].tolist(), target[1, :2].tolist(), target[2, :3].tolist(), target[3, :1].tolist()]


def test_verify_sampled_rows_follow_top_p():
    # top_p keeps only the top token of each row here, so drafts outside it are always rejected
    logits = torch.tensor([[[5.0, 0.0, 0.0, 0.0], [0.0, 5.0, 0.0, 0.0]]]).expand(200, -1, -1).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 200
    out = verify(logits, torch.full((200, 1), 2), [1] * 200, params, [None] * 200, torch.Generator().manual_seed(0))
    assert all(o == [0] for o in out)
    out = verify(logits, torch.zeros(200, 1, dtype=torch.long), [1] * 200, params, [None] * 200, torch.Generator().manual_seed(0))
    assert all(o == [0, 1] for o in out)


# ---------------------------------------------------------------- CUDA


def test_cuda_verify_matches_cpu_greedy_and_is_seed_deterministic():
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(8)
    k = 5
    logits = torch.randn(6, k + 1, 1000, generator=g)
    drafts = logits[:, :k].argmax(dim=-1)
    drafts[::2, 2] = 0
    nd = [5, 4, 3, 5, 0, 1]
    greedy = [SamplingParams()] * 6
    cpu = verify(logits, drafts, nd, greedy, [None] * 6)
    assert verify(logits.to(dev), drafts.to(dev), nd, greedy, [None] * 6) == cpu
    assert verify(logits.to(dev), drafts.to(dev), torch.tensor(nd, device=dev), greedy, [None] * 6) == cpu

    sampled = [SamplingParams(temperature=0.7, top_p=0.9, seed=s) for s in range(6)]

    def run() -> list[list[int]]:
        gens = [torch.Generator(device=dev).manual_seed(s) for s in range(6)]
        return verify(logits.to(dev), drafts.to(dev), nd, sampled, gens, torch.Generator(device=dev))

    first = run()
    assert first == run()
    for o, n, dr in zip(first, nd, drafts.tolist()):
        assert 1 <= len(o) <= n + 1 and o[:-1] == dr[: len(o) - 1]
