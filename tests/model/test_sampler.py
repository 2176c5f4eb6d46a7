"""Sampler tests on random logits (no model, CPU, fast)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.core.sched_output import ScheduledRequest
from tokenmill.model.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

VOCAB = 64


def req(i: int = 0, prompt=(), output=(), **kw) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=f"r{i}", token_ids=[0], num_computed_tokens=0, block_ids=[0], sample=True,
        sampling_params=SamplingParams(**kw), prompt_token_ids=list(prompt), output_token_ids=list(output),
    )


def rand_logits(n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_greedy_is_argmax():
    logits = rand_logits(5)
    ids, lps = Sampler(seed=0)(logits, [req(i, temperature=0.0) for i in range(5)])
    assert ids == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_all_greedy_fast_path_equals_nan_to_num_then_argmax():
    """The all-greedy batch skips nan_to_num only where that cannot change the argmax: rows with NaN, +inf,
    only -inf, or a maximum at/below -1e30 (and -inf elsewhere) give what the full path gives."""
    inf, nan = float("inf"), float("nan")
    logits = rand_logits(9, vocab=6)
    logits[1, 2] = nan
    logits[2, [1, 4]] = inf
    logits[3] = -inf
    logits[4, 0] = -inf
    logits[5] = torch.tensor([-inf, -3e30, -2e30, -inf, -5e30, -inf])
    logits[6] = torch.tensor([nan] * 6)
    logits[7, 3] = 2e30
    reqs = [req(i, temperature=0.0) for i in range(9)]
    ids, lps = Sampler(seed=0)(logits.clone(), reqs)
    assert ids == torch.nan_to_num(logits, nan=-1e30, posinf=1e30, neginf=-1e30).argmax(-1).tolist()
    assert ids[1] != 2 and ids[2] == 1 and ids[5] == 0 and ids[7] == 3 and lps == [None] * 9
    # one row of each kind alone (the fast path serves the clean ones)
    for r in range(9):
        one = Sampler(seed=0)(logits[r:r + 1].clone(), reqs[:1])[0]
        assert one == [ids[r]]


@pytest.mark.parametrize("vocab", [6, 33, 49152])
def test_greedy_c_argmax_gives_the_torch_argmax_tokens(vocab, monkeypatch):
    """The float32 CPU argmax kernel (``fused_cpu.argmax_rows``) serves the all-greedy path and the greedy rows
    of a mixed batch; the tokens are the torch ops' (``argmax_rows`` switched off) on ties (the lowest id),
    -0.0/+0.0, NaN, +inf, all -inf and <= -1e30 rows, alone and in batches."""
    from tokenmill.model.layers import fused_cpu

    if fused_cpu.load() is None:
        pytest.skip("no C compiler for the fused CPU kernels")
    inf, nan = float("inf"), float("nan")
    logits = rand_logits(12, vocab=vocab, seed=3).round()          # rounded: many tied maxima
    logits[1, vocab // 2] = nan
    logits[2, [1, vocab - 1]] = inf
    logits[3] = -inf
    logits[4] = -1e30
    logits[5] = 0.0
    logits[5, 1::2] = -0.0
    logits[6, :] = 2.0
    logits[7, vocab - 1] = 99.0
    calls = []
    real = fused_cpu.argmax_rows
    monkeypatch.setattr(fused_cpu, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    batches = [[req(i, temperature=0.0) for i in range(12)],
               [req(i, temperature=0.0 if i % 3 else 0.8, seed=i) for i in range(12)]]
    got = [Sampler(seed=0)(logits.clone(), reqs)[0] for reqs in batches]
    alone = [Sampler(seed=0)(logits[r:r + 1].clone(), batches[0][:1])[0][0] for r in range(12)]
    assert calls     # the kernel ran
    monkeypatch.setattr(fused_cpu, "argmax_rows", lambda x: None)
    want = [Sampler(seed=0)(logits.clone(), reqs)[0] for reqs in batches]
    assert got == want and alone == want[0]
    assert want[0][6] == 0 and want[0][7] == vocab - 1 and want[0][3] == 0


def test_top_k_1_and_tiny_top_p_are_argmax():
    logits = rand_logits(6, seed=1)
    reqs = [req(i, temperature=1.5, top_k=1) for i in range(3)] + [req(i + 3, temperature=1.5, top_p=1e-6) for i in range(3)]
    s = Sampler(seed=1)
    for _ in range(20):
        ids, _ = s(logits, reqs)
        assert ids == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = rand_logits(2, seed=2)
    s = Sampler(seed=2)
    allowed = [set(logits[i].topk(5).indices.tolist()) for i in range(2)]
    for _ in range(200):
        ids, _ = s(logits, [req(0, top_k=5), req(1, top_k=5, top_p=0.99)])
        assert ids[0] in allowed[0] and ids[1] in allowed[1]


def test_top_p_keeps_smallest_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps {0, 1}; top_p=0.85 keeps {0, 1, 2}.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    s = Sampler(seed=3)
    seen_07, seen_085 = set(), set()
    for _ in range(400):
        seen_07.add(s(logits, [req(top_p=0.7)])[0][0])
        seen_085.add(s(logits, [req(top_p=0.85)])[0][0])
    assert seen_07 == {0, 1}
    assert seen_085 == {0, 1, 2}


def test_min_p_filters_relative_to_top():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.07, 0.03]])
    logits = probs.log()
    s = Sampler(seed=4)
    seen = set()
    for _ in range(500):
        seen.add(s(logits, [req(min_p=0.25)])[0][0])  # threshold 0.1
    assert seen == {0, 1, 2}
    # Also exercised through the truncation step directly.
    out = Sampler._truncate(logits.clone(), [SamplingParams(min_p=0.6)])  # threshold 0.24
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    prompt, output = [0, 1], [2, 2, 3]
    r = req(prompt=prompt, output=output, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = Sampler._apply_penalties(logits, [r])
    expected = torch.tensor([[
        2.0 / 2,                 # prompt, positive -> divided
        -1.0 * 2,                # prompt, negative -> multiplied
        0.5 / 2 - 2 * 0.5 - 0.25,  # output twice
        -0.5 * 2 - 1 * 0.5 - 0.25,  # output once
        3.0,                     # unseen
        1.0,
    ]])
    torch.testing.assert_close(got, expected)
    # Mixed batch: a row without penalties is unchanged, padding never leaks.
    plain = req(1, prompt=[4, 5], output=[5])
    got2 = Sampler._apply_penalties(torch.cat([logits, logits]), [r, plain])
    torch.testing.assert_close(got2[0:1], expected)
    torch.testing.assert_close(got2[1:2], logits)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    ids, _ = Sampler()(logits, [req(output=[0], temperature=0.0, frequency_penalty=2.0)])
    assert ids == [1]


def test_seeded_is_batch_independent():
    torch.manual_seed(0)
    target = rand_logits(1, seed=10)
    alone_sampler = Sampler(seed=123)
    out = [4, 5]
    alone = alone_sampler(target, [req(0, output=out, seed=777, temperature=1.0)])[0][0]
    others = rand_logits(4, seed=11)
    for pos in range(5):
        rows = list(others)
        rows.insert(pos, target[0])
        batch_logits = torch.stack(rows)
        reqs = [req(9, seed=5), req(8), req(7, temperature=0.0), req(6, top_k=3)]
        reqs.insert(pos, req(0, output=out, seed=777, temperature=1.0))
        ids, _ = Sampler(seed=pos)(batch_logits, reqs)
        assert ids[pos] == alone


def test_seed_and_k_determine_token():
    logits = torch.zeros(1, 1000)  # uniform: any token equally likely
    s1, s2 = Sampler(seed=1), Sampler(seed=2)
    a = [s1(logits, [req(output=[0] * k, seed=42)])[0][0] for k in range(8)]
    b = [s2(logits, [req(output=[0] * k, seed=42)])[0][0] for k in range(8)]
    assert a == b  # recomputation after preemption reproduces the same tokens
    assert len(set(a)) > 4  # different k, different draws
    c = [s1(logits, [req(output=[0] * k, seed=43)])[0][0] for k in range(8)]
    assert c != a


def test_unseeded_reproducible_with_engine_seed():
    logits = torch.zeros(4, 1000)
    reqs = [req(i) for i in range(4)]
    s1, s2, s3 = Sampler(seed=9), Sampler(seed=9), Sampler(seed=10)
    a = [s1(logits, reqs)[0] for _ in range(3)]
    b = [s2(logits, reqs)[0] for _ in range(3)]
    c = [s3(logits, reqs)[0] for _ in range(3)]
    assert a == b and a != c


@pytest.mark.parametrize("kind", ["unseeded", "seeded"])
def test_empirical_distribution_matches_softmax(kind):
    logits = torch.tensor([[1.0, 0.0, -0.5, 2.0, 0.3]])
    temperature = 1.3
    expected = torch.softmax(logits[0] / temperature, -1)
    n = 4000
    s = Sampler(seed=7)
    batch = torch.cat([logits] * n)
    if kind == "unseeded":
        reqs = [req(i, temperature=temperature) for i in range(n)]
    else:  # distinct seeds: each token's noise is independent
        reqs = [req(i, temperature=temperature, seed=i) for i in range(n)]
    ids, _ = s(batch, reqs)
    freq = torch.bincount(torch.tensor(ids), minlength=5).float() / n
    # 4 standard errors of a binomial proportion.
    tol = 4 * torch.sqrt(expected * (1 - expected) / n)
    assert (freq - expected).abs().le(tol).all(), (freq, expected)


def test_logprobs_values_and_ranks():
    logits = rand_logits(3, seed=20)
    reqs = [req(0, temperature=0.0, logprobs=5), req(1, temperature=0.7, logprobs=3), req(2, temperature=0.7)]
    ids, lps = Sampler(seed=0)(logits, reqs)
    assert lps[2] is None
    # Greedy row: raw distribution, sampled token ranked first.
    raw = torch.log_softmax(logits[0], -1)
    g = lps[0]
    assert g.rank == 1 and g.top_token_ids[0] == ids[0]
    assert math.isclose(g.logprob, raw[ids[0]].item(), rel_tol=1e-5)
    assert len(g.top_token_ids) == 5 and g.top_logprobs == sorted(g.top_logprobs, reverse=True)
    torch.testing.assert_close(torch.tensor(g.top_logprobs), raw.topk(5).values)
    assert math.isclose(raw.exp().sum().item(), 1.0, rel_tol=1e-5)
    # Sampled row: by default (raw_logprobs) the model's own distribution, rank consistent with top list.
    lp1 = torch.log_softmax(logits[1], -1)
    t = lps[1]
    assert math.isclose(t.logprob, lp1[ids[1]].item(), rel_tol=1e-5, abs_tol=1e-6)
    assert t.rank == int((lp1 > lp1[ids[1]]).sum()) + 1
    assert t.top_token_ids == lp1.topk(3).indices.tolist()
    if t.rank <= 3:
        assert t.top_token_ids[t.rank - 1] == ids[1]


def test_logprobs_zero_returns_only_sampled():
    ids, lps = Sampler(seed=0)(rand_logits(1), [req(logprobs=0)])
    assert lps[0].top_token_ids == [] and lps[0].top_logprobs == []
    assert lps[0].logprob <= 0 and lps[0].rank >= 1


def test_bad_shape_raises():
    with pytest.raises(ValueError):
        Sampler()(rand_logits(2), [req()])


def test_device_argument_and_inference_mode():
    s = Sampler(seed=0, device="cpu")
    logits = rand_logits(3)
    with torch.inference_mode():
        ids, _ = s(logits, [req(0, seed=1), req(1), req(2, temperature=0.0, repetition_penalty=1.2, prompt=[1])])
    assert len(ids) == 3 and all(0 <= t < VOCAB for t in ids)


def _reference_keep(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Brute force: top-k, then the smallest top-p nucleus, then min-p, on one row."""
    order = row.argsort(descending=True).tolist()
    if 0 < p.top_k < len(order):
        order = order[: p.top_k]
    probs = torch.softmax(row[order], -1).tolist()
    kept, mass = [], 0.0
    for tok, pr in zip(order, probs):
        if kept and mass >= p.top_p:
            break
        kept.append(tok)
        mass += pr
    top = max(row[kept]).item()
    if p.min_p > 0:
        kept = [t for t in kept if row[t].item() >= top + math.log(p.min_p)]
    return set(kept)


@pytest.mark.parametrize("candidates", [1024, 30])
@pytest.mark.parametrize("vocab", [50, 3000])
def test_truncation_matches_brute_force_mixed_batch(vocab, candidates, monkeypatch):
    monkeypatch.setattr(Sampler, "TOP_P_CANDIDATES", candidates)  # exercise fast path and fallback
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: sorts.append(1) or real_sort(self, *a, **kw))
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1] *= 0.01  # nearly flat: the top-0.9 nucleus exceeds the 1024 candidates
    logits[4] *= 8  # peaked
    params = [
        SamplingParams(top_p=0.8),
        SamplingParams(top_p=0.9),
        SamplingParams(),  # no truncation at all
        SamplingParams(top_k=7, top_p=0.6),
        SamplingParams(top_k=20, min_p=0.1),
        SamplingParams(top_k=2000, top_p=0.95),
    ]
    out = Sampler._truncate(logits.clone(), params)
    for i, p in enumerate(params):
        got = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert got == _reference_keep(logits[i], p), i
    # Without the flat row every nucleus fits in the candidates: no full sort.
    sorts.clear()
    rest = [i for i in range(6) if i != 1]
    out = Sampler._truncate(logits[rest], [params[i] for i in rest])
    for j, i in enumerate(rest):
        assert set(torch.isfinite(out[j]).nonzero().flatten().tolist()) == _reference_keep(logits[i], params[i])
    if vocab > max(candidates, 2000):
        assert not sorts


def test_inverse_cdf_edges_never_pick_zero_probability():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    lo = Sampler._inverse_cdf(probs, torch.tensor([0.0, 0.0], dtype=torch.float64))
    hi = Sampler._inverse_cdf(probs, torch.tensor([1 - 2**-53, 1 - 2**-53], dtype=torch.float64))
    mid = Sampler._inverse_cdf(probs, torch.tensor([0.29, 0.5], dtype=torch.float64))
    assert lo.tolist() == [1, 2] and hi.tolist() == [3, 2] and mid.tolist() == [1, 2]


def test_raw_logprobs_do_not_depend_on_sampling_parameters():
    """vLLM's default: top_logprobs are the model's distribution whatever temperature, penalties or top-k say."""
    logits = rand_logits(1, seed=21).repeat(4, 1)
    reqs = [req(0, temperature=0.0, logprobs=5), req(1, temperature=0.2, logprobs=5),
            req(2, temperature=1.5, top_k=3, logprobs=5),
            req(3, temperature=0.7, repetition_penalty=1.5, output=[int(logits[0].argmax())], logprobs=5)]
    _, lps = Sampler(seed=0)(logits, reqs)
    raw = torch.log_softmax(logits[0], -1)
    for lp in lps:
        assert lp.top_token_ids == raw.topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), raw.topk(5).values)


def test_logprobs_modes():
    logits = rand_logits(1, seed=22)
    r = req(0, temperature=0.5, top_k=4, logprobs=6)
    raw = logits[0]
    ids, lps = Sampler(seed=0, logprobs_mode="raw_logits")(logits, [r])
    torch.testing.assert_close(torch.tensor(lps[0].top_logprobs), raw.topk(6).values)
    assert math.isclose(lps[0].logprob, raw[ids[0]].item(), rel_tol=1e-6)
    # processed: temperature 0.5 then top-k 4; the two entries past k are -inf
    ids, lps = Sampler(seed=0, logprobs_mode="processed_logprobs")(logits, [r])
    proc = torch.log_softmax(raw / 0.5, -1)
    kept = (raw / 0.5).topk(4).values
    expected = torch.log_softmax(kept, -1)
    torch.testing.assert_close(torch.tensor(lps[0].top_logprobs[:4]), expected)
    assert lps[0].top_logprobs[4:] == [float("-inf")] * 2
    assert lps[0].logprob > proc[ids[0]].item()  # renormalised over the 4 kept tokens
    ids, lps = Sampler(seed=0, logprobs_mode="processed_logits")(logits, [r])
    torch.testing.assert_close(torch.tensor(lps[0].top_logprobs[:4]), kept)
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="bogus")


def test_logit_bias_steers_sampling_but_not_raw_logprobs():
    logits = rand_logits(2, seed=23)
    worst = int(logits[0].argmin())
    reqs = [req(0, temperature=0.0, logit_bias={worst: 100.0}, logprobs=1), req(1, temperature=0.0)]
    ids, lps = Sampler(seed=0)(logits, reqs)
    assert ids[0] == worst and ids[1] == int(logits[1].argmax())
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(lps[0].logprob, raw[worst].item(), rel_tol=1e-5)   # raw: before the bias
    _, lps = Sampler(seed=0, logprobs_mode="processed_logits")(logits, reqs)
    assert math.isclose(lps[0].logprob, logits[0, worst].item() + 100.0, rel_tol=1e-5)
