"""Quantised KV cache (--kv-cache-dtype int8 / fp8) end to end on the real model (SmolLM2-135M, float32).

What the quantised formats promise, and how it is checked
---------------------------------------------------------
A quantised cache perturbs every attention read, so the model's next-token log-probabilities move. The
bound that follows from the format is on that movement, not on how many whole continuations happen to
stay equal: a greedy continuation flips at the first position where the reference's top-2 margin is
below the perturbation, and after that the two runs see different contexts. Counting "whole 16-token
continuations equal to the float32 cache's" (the old bound, int8 >= 6/8) measures where the near-ties
of 8 prompts fall, which moves with any ulp-level change of the reference: every one of the 8 prompts
has a position with a top-2 margin of 0.007-0.16 nats, well below int8's measured error, so each prompt
is a coin toss. Measured 2026-12-01 on the AMD EPYC (load 7-20, shared): with the AVX-512 kernels int8
4/8, fp8 4/8, fp8_e5m2 1/8; the same engine with the AVX2 kernel variant (``TOKENMILL_CPU_ISA=avx2
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) int8 6/8, fp8 3/8, fp8_e5m2 1/8, two prompts' FIRST
token flipping under e5m2 (reference margins 0.14 and 0.23 nats); before batch invariance the AVX-512 run
gave int8 6/8 and an AMX Xeon 2/8. No count holds on every CPU kind.

The check here is the one the format supports, on every CPU kind:

* accuracy, measured at the positions where both runs share the context (up to and including the first
  divergence): the change of the reference's top-2 log-probability margin, ``|(lp[a] - lp[b])_ref -
  (lp[a] - lp[b])_quant|``. Measured over the 8 prompts (57-103 positions per format and variant;
  AVX-512 / AVX2): int8 median 0.10 / 0.09, max 0.70 / 0.67; fp8 e4m3 median 0.11 / 0.10, max 0.86 /
  0.90; fp8 e5m2 median 0.27 / 0.26, max 1.28 / 1.29. The bounds (:data:`BOUNDS`) are about 2.5x the
  medians and 1.5x the maxima: these are properties of the formats' rounding of K/V, which the kernel
  variant's own float rounding hardly moves (AVX-512 against AVX2 above), unlike the whole-continuation count.
* consistency: a greedy token may differ from the reference only where the reference's margin between
  its choice and the quantised run's choice is within the format's maximal error (a larger margin cannot
  be overturned by a smaller perturbation); so no prompt may diverge at a position whose margin exceeds it.
  Measured margins at the divergences: int8 <= 0.42, fp8 <= 0.43 nats (both variants), checked against
  the maxima above. fp8_e5m2 (2 mantissa bits) has no such bound on this model: at "My favourite food
  is", position 4, it promoted a token from outside the reference's top 20 (margin >= 4.1 nats) while the
  top-2 margins it moves stay within 1.3, so for e5m2 only the margin statistics are checked.

Prefix caching, chunked prefill and preemption (recompute) must not change the quantised run's output at
all: with batch-invariant inference (the default) every path reads the same stored bytes through the same
kernels (docs/guide/batch_invariance.md): a prefix-cache hit equals the miss for int8 and fp8 (within one
engine: int8's scales come from the engine's first batch), and 32-token chunks and recompute after
preemption equal the default schedule for fp8 (scales 1.0, so across engines).
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kernel_plan import CpuKernelSwitches

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "In 1492, Columbus", "The quick brown fox", "My favourite food is"]
TOP = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=TOP)

#: --kv-cache-dtype -> (bound on the median, bound on the maximum) of the top-2 margin's change, and the
#: largest reference margin a greedy flip may overturn (None: not bounded, e5m2), in nats.
BOUNDS = {"int8": (0.25, 1.1, 1.1), "fp8": (0.25, 1.35, 1.35), "fp8_e5m2": (0.65, 1.95, None)}


def _run(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]
    return [(o.token_ids, [dict(zip(lp.top_token_ids, lp.top_logprobs)) for lp in o.logprobs]) for o in outs]


def _ids(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                                                     ignore_eos=True))]


def _float32_kernel() -> CpuKernelSwitches:
    return dataclasses.replace(CpuKernelSwitches.from_env(), invariant_kernel="float32")


def _llm(**kw) -> LLM:
    # The BOUNDS are the KV formats' error measured with float32 activations: the float32 low-bit kernel, not
    # the integer (int8-activation) batch-invariant default, whose own rounding moved the median margin to 0.31
    # nats with int8 KV (Ice Lake, 2026-12-02) and is not what this test bounds.
    return LLM(dtype="float32", kv_cache_memory="96MiB", cpu_kernels=_float32_kernel(), **kw)


def compare(ref, got) -> tuple[list[float], list[tuple[int, int, float]]]:
    """Margin changes at the shared-context positions, and per diverging prompt ``(prompt, position, the
    reference's margin between its token and the quantised run's token)`` (a lower bound of that margin
    when the quantised token is outside the reference's top ``TOP``)."""
    devs, flips = [], []
    for p, ((rt, rl), (gt, gl)) in enumerate(zip(ref, got)):
        div = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
        for i in range(min(div + 1, len(rt))):
            r, g = rl[i], gl[i]
            a, b = sorted(r, key=r.get, reverse=True)[:2]
            if a in g and b in g:
                devs.append(abs((r[a] - r[b]) - (g[a] - g[b])))
        if div < len(rt):
            r, c = rl[div], gt[div]
            flips.append((p, div, r[rt[div]] - r.get(c, min(r.values()))))
    return devs, flips


def test_quantised_kv_cache_greedy_bound_prefix_caching_and_chunking():
    ref = _run(_llm(kv_cache_dtype="float32"))   # the float32 cache (auto: bfloat16 on the CPU low-bit path)
    long_ids = {}
    for kv, (med_bound, max_bound, flip_bound) in BOUNDS.items():
        llm = _llm(kv_cache_dtype=kv)
        devs, flips = compare(ref, _run(llm))
        assert len(devs) >= 8, (kv, devs)
        assert statistics.median(devs) <= med_bound, (kv, statistics.median(devs))
        assert max(devs) <= max_bound, (kv, max(devs))
        for p, pos, margin in flips:      # a flip needs a perturbation at least as large as the margin
            assert flip_bound is None or margin <= flip_bound, (kv, PROMPTS[p], pos, margin)
        if kv in ("int8", "fp8"):
            first = _ids(llm, LONG)
            assert _ids(llm, LONG) == first              # every full prompt block now comes from the prefix cache
            long_ids[kv] = first
        del llm
    # fp8 only across engines: its scales are 1.0, while int8's come from each engine's first batch (which a
    # 32-token budget makes another batch), so two int8 engines hold different bytes; int8's hit == miss above
    # is within one engine.
    chunked = _llm(kv_cache_dtype="fp8", max_num_batched_tokens=32, enable_prefix_caching=False)
    assert _ids(chunked, LONG) == long_ids["fp8"]      # prompts in 32-token chunks read the same stored bytes
    del chunked
    # Preemption (recompute): 13 blocks of 16 hold two of the 84-token prompts, which need a 7th block each
    # before their 16th token, so one is preempted, its blocks freed and its prompt + output recomputed into
    # the 1-byte cache; the continuations must not change.
    small = LLM(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=13, block_size=16,
                enable_prefix_caching=False, cpu_kernels=_float32_kernel())
    assert _ids(small, LONG) == long_ids["fp8"]
    assert small.engine_core.scheduler.num_preemptions_total > 0
    assert small.engine_core.scheduler.kv_cache_usage == 0.0


LONG = [p + " " + "Paged attention stores keys and values in fixed-size blocks. " * 6 for p in PROMPTS[:4]]
