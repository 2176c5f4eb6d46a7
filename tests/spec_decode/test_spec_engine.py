"""Speculative decoding end to end on tiny random-weight models (float32): lossless greedy and sampled output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = [
    [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6],                 # repetitive: the n-gram proposer finds matches
    [1, 3, 4, 9, 10, 11, 3, 4, 9],
    [1, 12, 13],
    [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 4, 5],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _llm(folder, spec=None, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(folder, dtype="float32", speculative_config=spec, **kw)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _spec_cfg(name, target, draft):
    if name == "ngram":
        return NGRAM
    return {"method": "draft_model", "num_speculative_tokens": 3, "model": draft if name == "draft" else target}


@pytest.mark.parametrize("method", ["ngram", "draft", "self_draft"])
def test_greedy_identical_with_and_without_speculation(tiny_models, method):
    target, draft = tiny_models
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = _llm(target)
    want_single = [_ids(base.generate(p, greedy))[0] for p in PROMPTS]
    # mixed batch: the greedy requests share steps with sampled ones and with a penalised one
    mixed_params = [greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3), greedy]
    want_mixed = _ids(base.generate(PROMPTS, mixed_params))
    llm = _llm(target, _spec_cfg(method, target, draft))
    got_single = [_ids(llm.generate(p, greedy))[0] for p in PROMPTS]
    got_mixed = _ids(llm.generate(PROMPTS, mixed_params))
    assert got_single == want_single
    assert got_mixed[0] == want_mixed[0] and got_mixed[2:] == want_mixed[2:]
    st = llm.engine_core.scheduler.spec_stats
    assert st.num_draft_tokens > 0
    if method == "self_draft":
        # the draft is the target itself: every greedy draft must be accepted (its own KV cache is in sync)
        greedy_only = _llm(target, _spec_cfg(method, target, draft))
        greedy_only.generate(PROMPTS, greedy)
        s2 = greedy_only.engine_core.scheduler.spec_stats
        assert s2.num_accepted_tokens == s2.num_draft_tokens > 0


def test_seeded_sampling_identical_with_ngram(tiny_models):
    """For one-hot drafts verification samples every row as the plain sampler would (same seeded uniform per
    output index), so seeded outputs, penalties, min_tokens and logprobs equal those without speculation."""
    target, _ = tiny_models
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, logprobs=2,
                             **extra)
              for s, extra in enumerate([{}, {"top_k": 5}, {"repetition_penalty": 1.5},
                                         {"frequency_penalty": 0.7, "presence_penalty": 0.3}])]
    params.append(SamplingParams(temperature=0.7, seed=11, max_tokens=16, min_tokens=6, stop_token_ids=[5, 6]))
    prompts = PROMPTS + [PROMPTS[0]]
    base = _llm(target).generate(prompts, params)
    llm = _llm(target, NGRAM)
    got = llm.generate(prompts, params)
    assert _ids(got) == _ids(base)
    for g, b in zip(got, base):
        assert g.outputs[0].finish_reason == b.outputs[0].finish_reason
        if g.outputs[0].logprobs:
            for lg, lb in zip(g.outputs[0].logprobs, b.outputs[0].logprobs):
                assert lg.rank == lb.rank and lg.top_token_ids == lb.top_token_ids
                assert math.isclose(lg.logprob, lb.logprob, abs_tol=1e-4)
    assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
    # batch-independent: the same seeded request alone gives the same tokens
    alone = llm.generate(prompts[1], params[1])
    assert _ids(alone)[0] == _ids(base)[1]


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(exp[~small], exp[small].sum())
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _exact_distribution(folder, prompt, steps, temperature):
    """P(t_0 .. t_{steps-1}) under the target at ``temperature``, by enumeration with the HF model."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    V = model.config.vocab_size
    seqs = torch.tensor([prompt])
    logp = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(steps):
            lp = torch.log_softmax(model(seqs).logits[:, -1].double() / temperature, dim=-1)   # [S, V]
            logp = (logp[:, None] + lp).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return logp.exp().numpy().reshape((V,) * steps)


def test_sampled_distribution_matches_target_with_draft_model(tiny_models):
    """The rejection rule with a draft model that disagrees with the target: the empirical distribution of
    the tokens verified from drafts matches the target's exact one.

    1500 seeded requests of 4 tokens at temperature 1; tokens 2..4 come from a step verifying 2 drafts.
    Chi-square goodness of fit of the marginals of tokens 2, 3 and 4 and of the pair (2, 3) against the exact
    distribution (enumerated with transformers); fixed seeds make the test deterministic, and p > 1e-3
    is a loose bar for a correct sampler (a verifier that accepted every draft gives p < 1e-30, checked).
    """
    target, draft = tiny_models
    prompt = [1, 5, 9, 3]
    N, T = 1500, 1.0
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = _llm(target, spec, max_num_seqs=256, num_kv_blocks=2048)
    params = [SamplingParams(temperature=T, seed=1000 + i, max_tokens=4, ignore_eos=True) for i in range(N)]
    outs = np.array(_ids(llm.generate([prompt] * N, params)))
    st = llm.engine_core.scheduler.spec_stats
    assert st.num_draft_tokens >= N and 0.05 < st.acceptance_rate < 0.95   # drafts really verified, some rejected
    exact = _exact_distribution(target, prompt, 4, T)                     # [V, V, V, V]
    V = exact.shape[0]
    for pos in (1, 2, 3):
        marg = exact.sum(axis=tuple(a for a in range(4) if a != pos))
        counts = np.bincount(outs[:, pos], minlength=V)
        assert _chi2_pvalue(counts, marg) > 1e-3, pos
    pair = exact.sum(axis=(0, 3)).reshape(-1)
    counts = np.bincount(outs[:, 1] * V + outs[:, 2], minlength=V * V)
    assert _chi2_pvalue(counts, pair) > 1e-3
    # power: the draft model's own distribution (what accepting every draft would give) is rejected
    draft_exact = _exact_distribution(draft, prompt, 2, T)
    fake = np.random.default_rng(0).choice(V * V, size=N, p=draft_exact.reshape(-1) / draft_exact.sum())
    assert _chi2_pvalue(np.bincount(fake, minlength=V * V),
                        exact.sum(axis=(2, 3)).reshape(-1)) < 1e-30
