"""N-gram proposer against a brute-force reference; the rejection rule's output distribution (no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.model.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.ngram import NgramProposer, TokenTable
from tokenmill.spec_decode.rejection_sampler import num_accepted_one_hot, rejection_sample, salted_uniforms


def brute_force(ctx: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    L = len(ctx)
    for n in range(max_n, min_n - 1, -1):
        if L <= n:
            continue
        suffix = ctx[L - n:]
        for e in range(L - 2, n - 2, -1):            # most recent match ending before the last token
            if ctx[e - n + 1:e + 1] == suffix:
                return ctx[e + 1:e + 1 + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (5, 5)])
def test_ngram_matches_brute_force(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    table = TokenTable(8)
    ctxs = []
    for i in range(60):
        L = int(rng.integers(1, 80))
        ctx = rng.integers(0, (2, 4, 12)[i % 3], size=L).tolist()      # small alphabets: many matches
        ctxs.append(ctx)
        table.sync(f"r{i}", ctx[: L // 2], ctx[L // 2:])
    rows = [table.row_of[f"r{i}"] for i in range(60)]
    ks = rng.integers(0, 6, size=60)
    got = NgramProposer(min_n, max_n).propose(table.tokens[rows], table.lengths[rows], ks)
    want = [brute_force(c, min_n, max_n, int(k)) if k else [] for c, k in zip(ctxs, ks)]
    assert got == want
    assert any(got)


def test_token_table_incremental_sync_and_reuse():
    t = TokenTable(2)
    r = t.sync("a", [1, 2, 3], [4])
    assert t.tokens[r, :4].tolist() == [1, 2, 3, 4]
    t.sync("a", [1, 2, 3], [4, 5], [6, 7])        # output grew by one, two extra tokens
    assert t.lengths[r] == 7 and t.tokens[r, :7].tolist() == [1, 2, 3, 4, 5, 6, 7]
    t.sync("a", [1, 2, 3], [4, 5, 6, 7, 8])       # the scheduler's view caught up
    assert t.tokens[r, :8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    t.sync("a", [1, 2, 3], [9])                   # inconsistent (e.g. a new request reused the id): rewritten
    assert t.lengths[r] == 4 and t.tokens[r, :4].tolist() == [1, 2, 3, 9]
    for i in range(20):                            # rows grow beyond the initial 8
        t.sync(f"x{i}", [i], [])
    t.remove("a")
    assert "a" not in t.row_of and len(set(t.row_of.values())) == 20


def test_num_accepted_one_hot():
    sampled = np.array([5, 6, 7,   1,   4, 9, 9, 9])     # requests with 2, 0 and 3 drafts
    drafts = [[5, 6], [], [4, 8, 9]]
    assert num_accepted_one_hot(sampled, drafts).tolist() == [2, 0, 1]


def test_rejection_rule_output_is_distributed_as_target():
    """Leviathan et al. Theorem 1: whatever q, the emitted token at the first draft position follows p."""
    V, N = 6, 60_000
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = torch.tensor([0.05, 0.10, 0.20, 0.05, 0.30, 0.30])       # a poor draft distribution
    g = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, N, replacement=True, generator=g)
    params = [SamplingParams(temperature=1.0, seed=7 + i) for i in range(N)]
    idx = [0] * N
    u_acc = salted_uniforms(Sampler(), params, idx, 11)
    u_res = salted_uniforms(Sampler(), params, idx, 0)
    acc, repl = rejection_sample(p.expand(N, V), q.expand(N, V), drafts, u_acc, u_res, [1] * N)
    out = np.array([d if a == 1 else r for d, a, r in zip(drafts.tolist(), acc, repl)])
    emp = np.bincount(out, minlength=V) / N
    # acceptance rate sum(min(p, q)) and a tight match with p (5 sigma of the multinomial noise)
    assert abs(np.mean(acc) - torch.minimum(p, q).sum().item()) < 0.01
    sigma = np.sqrt(p.numpy() * (1 - p.numpy()) / N)
    assert np.all(np.abs(emp - p.numpy()) < 5 * sigma), (emp, p)
    # the draft distribution itself is far from p: a verifier that accepted everything would fail
    assert 0.5 * np.abs(q.numpy() - p.numpy()).sum() > 0.3
