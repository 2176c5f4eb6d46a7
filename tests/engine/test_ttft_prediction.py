"""The SLO predictor against measured TTFT, real model, steady workload (slow).

A steady Poisson stream (seeded) of mixed-length prompts runs through the
engine core in-process; at each arrival the TTFT is predicted from the core's
exported queue state and step-time model (exactly what the API process does
under ``--slo``) and compared with the measured time to the first token.

Stated error: after a warm-up (kernels built, 7 requests run) and 4 more, the median absolute error is at
most 35% of the median measured TTFT (or 40 ms, whichever is larger), and the
predictions are not biased by more than 30% either way (mean signed error), plus three standard errors
of that mean (with a few dozen requests a few long waits move the mean by more than the model's own
error: the allowance shrinks as 1/sqrt(n)). On the batch-invariant default every prompt row runs the
decode attention kernel over its own context, which the step-time model's prefill rate averages
over the run's prompts. Quiet 2-core AVX-512 machine (the CPU to itself): median |error| 21%, bias +2%.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest

from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.slo_predictor import predict

pytestmark = pytest.mark.slow

WARMUP = 4


def _timing_summary(t) -> str:
    """The step-time model's terms in one line (a failure then says which one went wrong)."""
    pts = ", ".join(f"B{b:.1f}: {s * 1e3:.1f} ms" for b, s in t.decode_points)
    tp = t.prefill_seconds_per_token
    return f"prefill {tp * 1e3:.3f} ms/token, decode [{pts}], {t.num_steps_observed} steps" if tp else f"decode [{pts}]"


def _steady_run(core, seed: int):
    """One steady Poisson run on a warmed core: (pairs of (predicted, measured) TTFT in s, solo s, arrivals,
    step-time model summary before the run)."""
    rng = random.Random(seed)
    lens = [rng.choice([24, 48, 96, 200, 400]) for _ in range(40)]
    n = len(lens)

    def prompt(k: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(k)]

    # one request alone, timed
    t = time.perf_counter()
    core.add_request(EngineCoreRequest(f"solo{seed}", prompt(150), SamplingParams(max_tokens=8, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    solo = time.perf_counter() - t
    # Steady Poisson arrivals at one request per solo service time (batching keeps the queue short);
    # on a slow (busy) machine fewer requests, so the arrivals span at most ~40 s.
    rate = 1.0 / solo
    timing_before = _timing_summary(core.get_stats().step_timing)
    n = max(16, min(n, int(40 * rate)))
    gaps = [rng.expovariate(rate) for _ in range(n)]
    arrivals, predicted, measured = {}, {}, {}
    t0 = time.perf_counter()
    due = t0
    i = 0
    while i < n or core.has_unfinished_requests():
        now = time.perf_counter()
        while i < n and now >= due:
            rid = f"s{seed}r{i}"
            st = core.get_stats()
            p = predict(st.queue, st.step_timing, lens[i], 0, "fcfs")
            if p is not None:
                predicted[rid] = p.ttft
            arrivals[rid] = time.perf_counter()
            core.add_request(EngineCoreRequest(rid, prompt(lens[i]),
                                               SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)))
            i += 1
            due += gaps[i - 1] if i < n else 0
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, min(due - time.perf_counter(), 0.05)))
            continue
        for out in core.step():
            if out.new_token_ids and out.req_id not in measured:
                measured[out.req_id] = time.perf_counter() - arrivals[out.req_id]
    pairs = [(predicted[r], measured[r]) for r in (f"s{seed}r{k}" for k in range(WARMUP, n)) if r in predicted]
    assert len(pairs) >= n - WARMUP - 2, f"{len(predicted)} predictions, {len(measured)} measured"
    return pairs, solo, n, timing_before


def _judged(pairs, scale: float) -> tuple[list[float], float, float, float, bool]:
    """(errors, median |error|, relative bias, its standard error, within the bounds), predictions x scale."""
    med_ttft = statistics.median(m for _, m in pairs)
    mean_ttft = statistics.mean(m for _, m in pairs)
    e = [scale * p - m for p, m in pairs]
    mab = statistics.median(abs(x) for x in e)
    b, s = statistics.mean(e) / mean_ttft, statistics.stdev(e) / math.sqrt(len(e)) / mean_ttft
    return e, mab, b, s, mab <= max(0.35 * med_ttft, 0.040) and abs(b) <= 0.30 + 3 * s


def test_predicted_ttft_tracks_measured_ttft_on_a_steady_workload():
    from tokenmill import LLM

    # the default (batch-invariant) paths; the step-latency budget off, as under --slo (whose predictor this is)
    llm = LLM(max_num_seqs=32, max_num_batched_tokens=512, target_step_latency_ms=0)
    core = llm.engine_core
    # as the server's start-up does (engine.step_profile): the background weight packing must not share the
    # two cores with the steps that teach the step-time model
    from tokenmill.model.layers.linear import wait_for_packing
    assert wait_for_packing(getattr(core.executor, "runner", core.executor).model, timeout=120.0)
    rng = random.Random(0)
    lens = [rng.choice([24, 48, 96, 200, 400]) for _ in range(6)]
    # Warm-up (kernels built, step-time model taught).
    for k in range(6):
        ids = [rng.randrange(100, 40000) for _ in range(lens[k])]
        core.add_request(EngineCoreRequest(f"w{k}", ids, SamplingParams(max_tokens=8, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    assert core.get_stats().step_timing.ready
    # The bias allowance grows with the run's noise (3 standard errors): a run must still reject a predictor
    # off by 2x either way, or it was too noisy to judge the model. Such a run (a machine whose speed drifted
    # mid-run: seen on a shared VM) is measured once more with the next seed; the second is judged whatever it
    # shows. The bounds themselves are never widened.
    for attempt in range(2):
        pairs, solo, n, timing_before = _steady_run(core, attempt)
        med_ttft = statistics.median(m for _, m in pairs)
        errs, med_abs, bias, se, _ = _judged(pairs, 1.0)
        report = (f"median TTFT {med_ttft * 1e3:.0f} ms, median |error| {med_abs * 1e3:.0f} ms "
                  f"({med_abs / med_ttft:.0%}), bias {bias:+.0%} (standard error {se:.0%}), p90 |error| "
                  f"{sorted(abs(e) for e in errs)[int(0.9 * len(errs))] * 1e3:.0f} ms; solo {solo * 1e3:.0f} ms, "
                  f"{n} arrivals; step-time model before the run: {timing_before}, after: "
                  f"{_timing_summary(core.get_stats().step_timing)}")
        print(f"run {attempt}: {report}")
        if not any(_judged(pairs, scale)[4] for scale in (2.0, 0.5)):
            break
    assert med_abs <= max(0.35 * med_ttft, 0.040), report
    assert abs(bias) <= 0.30 + 3 * se, report
    for scale in (2.0, 0.5):
        assert not _judged(pairs, scale)[4], \
            f"the bounds would pass every prediction x{scale} too: too noisy to judge (two runs); {report}"
