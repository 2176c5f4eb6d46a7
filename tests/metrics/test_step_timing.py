"""The engine's smoothed step-time model: learns decode step time vs batch size and the prefill rate."""

from __future__ import annotations

import random

import pytest

from tokenmill.metrics.step_timing import StepTimeModel, StepTimingSnapshot, batch_bucket


def true_step(b: int, p: int) -> float:
    return 0.010 + 0.0008 * b + 0.00012 * p          # 10 ms fixed, 0.8 ms / decode, 8333 prompt tok/s


def test_batch_bucket():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 6, 11, 12, 128)] == [0, 1, 2, 2, 3, 3, 4, 7]
    with pytest.raises(ValueError):
        batch_bucket(0)


def test_learns_both_terms_from_mixed_steps_with_noise():
    rng = random.Random(0)
    m = StepTimeModel()
    for _ in range(3000):
        b = rng.randint(0, 64)
        p = rng.choice([0, 0, 0, rng.randint(1, 32), rng.randint(200, 2048)])
        if b == 0 and p == 0:
            continue
        m.observe(b, p, true_step(b, p) * rng.uniform(0.95, 1.05))
    s = m.snapshot()
    assert s.ready
    assert s.prefill_tokens_per_second == pytest.approx(1 / 0.00012, rel=0.15)
    for b in (1, 4, 16, 32, 64):
        assert s.decode_step_time(b) == pytest.approx(true_step(b, 0), rel=0.1)
    # a step at a point seen in the data is predicted within a few percent
    assert s.step_time(30, 1500) == pytest.approx(true_step(30, 1500), rel=0.08)


def test_sustained_mixed_load_keeps_the_sum_right():
    """Every step decodes ~24 requests and prefills a ~1800-token chunk (overload with chunked prefill)."""
    rng = random.Random(1)
    m = StepTimeModel()
    for _ in range(30):                                  # warm-up: some pure decode steps first
        m.observe(8, 0, true_step(8, 0))
    for _ in range(500):
        b, p = rng.randint(20, 28), rng.randint(1700, 1900)
        m.observe(b, p, true_step(b, p) * rng.uniform(0.97, 1.03))
    s = m.snapshot()
    assert s.step_time(24, 1800) == pytest.approx(true_step(24, 1800), rel=0.05)
    assert s.prefill_seconds_per_step == pytest.approx(1800 * 0.00012, rel=0.2)


def test_adapts_when_the_machine_slows_down():
    m = StepTimeModel(alpha=0.1)
    for _ in range(100):
        m.observe(4, 0, 0.02)
    for _ in range(60):                                 # a noisy neighbour doubles step times
        m.observe(4, 0, 0.04)
    assert m.snapshot().decode_step_time(4) == pytest.approx(0.04, rel=0.01)


def test_snapshot_interpolates_and_extrapolates_monotonically():
    s = StepTimingSnapshot(decode_points=[(1.0, 0.010), (8.0, 0.017), (32.0, 0.041)], prefill_seconds_per_token=1e-4)
    assert s.decode_step_time(0) == pytest.approx(0.010)
    assert s.decode_step_time(4.5) == pytest.approx(0.0135)
    assert s.decode_step_time(64) == pytest.approx(0.041 + 0.001 * 32)
    one = StepTimingSnapshot(decode_points=[(10.0, 0.02)])
    assert one.decode_step_time(20) == pytest.approx(0.03) and one.step_time(20, 5) is None
    assert StepTimingSnapshot().decode_step_time(3) is None and not StepTimingSnapshot().ready
    m = StepTimeModel()
    for _ in range(3):                                  # past the start-up steps
        m.observe(2, 0, 0.02)
    m.observe(16, 0, 0.015)                             # noise: a bigger batch measured cheaper
    pts = m.snapshot().decode_points
    assert pts[1][1] >= pts[0][1]


def test_ignores_empty_and_bad_steps():
    m = StepTimeModel()
    m.observe(0, 0, 0.01)
    m.observe(3, 0, 0.0)
    m.observe(3, 0, -1.0)
    assert m.snapshot().num_steps_observed == 0
    with pytest.raises(ValueError):
        StepTimeModel(alpha=0)


def test_learns_without_any_pure_decode_step():
    """Overload from the start: every step mixes a prompt chunk with decodes."""
    rng = random.Random(2)
    m = StepTimeModel()
    for _ in range(400):
        b = rng.randint(1, 40)
        p = rng.choice([rng.randint(100, 500), rng.randint(900, 2000)])
        m.observe(b, p, true_step(b, p) * rng.uniform(0.97, 1.03))
    s = m.snapshot()
    assert s.ready
    for b, p in ((5, 300), (20, 1500), (38, 1000)):
        assert s.step_time(b, p) == pytest.approx(true_step(b, p), rel=0.15)


def test_start_up_steps_and_stalls_do_not_wipe_out_the_estimates():
    m = StepTimeModel()
    m.observe(1, 50, 30.0)                 # first steps: kernels built, seconds not ms
    m.observe(1, 0, 12.0)
    for _ in range(50):
        m.observe(2, 0, true_step(2, 0))
        m.observe(2, 600, true_step(2, 600))
    s = m.snapshot()
    assert s.prefill_seconds_per_token == pytest.approx(0.00012, rel=0.15)
    m.observe(2, 0, 100.0)                 # the machine stalls for 100 s once
    assert m.snapshot().decode_step_time(2) < 2 * true_step(2, 0)


def test_a_stalled_first_prefill_does_not_pin_the_rate_near_zero():
    """Seen on a loaded machine: a stall during the first prompt step left the learnt prefill rate near
    0 tok/s for a long time (an EWMA started there falls by a few percent per prefill-dominated step,
    and a server whose prompts hit the prefix cache has few such steps). The rate starts from the
    median of its first samples instead."""
    m = StepTimeModel()
    m.observe(1, 0, 0.02)
    m.observe(1, 0, 0.02)                   # warm-up steps
    m.observe(0, 64, 8.0)                   # the first prompt during an 8 s stall (8 tok/s)
    for _ in range(2):
        m.observe(0, 64, true_step(0, 64))
    tp = m.snapshot().prefill_seconds_per_token
    assert tp == pytest.approx(true_step(0, 64) / 64, rel=0.01), tp   # 1/tp: thousands of tok/s, not 8


def test_a_seeded_context_term_is_charged_before_the_rate_is_learnt():
    # steps cost 10 ms + 0.2 ms per prompt token + 1 us per prompt row per context token; seeded with the
    # right terms, prompt steps of any length leave the per-token rate where it is
    m = StepTimeModel(alpha=0.5)
    m.seed([(1.0, 0.010)], 0.0002, 1e-6)
    for p in (64, 512, 1500, 200):
        m.observe(0, p, 0.010 + 0.0002 * p + 1e-6 * p * (p - 1) / 2, prefill_context=p * (p - 1) // 2)
    snap = m.snapshot()
    assert snap.prefill_seconds_per_context == 1e-6
    assert snap.prefill_seconds_per_token == pytest.approx(0.0002 * 1.0, rel=0.06)   # the 10 ms fixed cost rides on it
    # without the term the long prompts teach a higher rate (their attention), which short prompts then pay
    m0 = StepTimeModel(alpha=0.5)
    m0.seed([(1.0, 0.010)], 0.0002)
    for p in (64, 512, 1500, 200):
        m0.observe(0, p, 0.010 + 0.0002 * p + 1e-6 * p * (p - 1) / 2, prefill_context=p * (p - 1) // 2)
    assert m0.snapshot().prefill_seconds_per_token > 1.1 * snap.prefill_seconds_per_token
    with pytest.raises(ValueError):
        m.seed([(1.0, 0.010)], 0.0002, -1e-6)


def test_a_stale_slow_bucket_does_not_hold_up_the_fresher_bigger_batch():
    # batch 8 seen once during a stall (400 ms); batch 16, the load's batch, updated every step at 250 ms:
    # the stale smaller bucket is capped at the fresher one instead of lifting it (TPOT prediction follows
    # what the running batch costs); a fresher slow small bucket still lifts a stale bigger one
    m = StepTimeModel(alpha=0.5)
    m.seed([(1.0, 0.010), (16.0, 0.250)], 0.0002)
    m.observe(8, 0, 0.400)
    for _ in range(10):
        m.observe(16, 0, 0.250)
    pts = dict(m.snapshot().decode_points)
    assert pts[16.0] == pytest.approx(0.250) and pts[8.0] == pytest.approx(0.250)
    # now batch 8 is the fresher (twice: a bucket's first samples count by their lower median): the curve
    # stays monotone by lifting 16
    m.observe(8, 0, 0.400)
    m.observe(8, 0, 0.400)
    pts = dict(m.snapshot().decode_points)
    assert pts[16.0] >= pts[8.0] > 0.250


def test_a_stalled_first_step_of_the_smallest_bucket_does_not_become_its_time():
    # batch 1 is the first decode bucket: nothing smaller caps its first sample. A full test-suite run's
    # first decode step took 375 ms against ~13 ms alone; held as the bucket's value it lifted every bigger
    # bucket and drove the prefill rate split off mixed steps down 9x. The bucket starts from the lower
    # median of its first samples instead.
    m = StepTimeModel()
    for _ in range(2):                          # warm-up steps, ignored
        m.observe(1, 0, 1.0)
    m.observe(1, 0, 0.375)
    assert m.snapshot().decode_step_time(1) == pytest.approx(0.375)   # one sample: nothing else to go on
    m.observe(1, 0, 0.013)
    m.observe(1, 0, 0.014)
    assert m.snapshot().decode_step_time(1) == pytest.approx(0.014)
    # then mixed steps teach the prefill rate net of the right decode part (~1 ms per prompt token)
    for _ in range(10):
        m.observe(1, 200, 0.013 + 200 * 0.001)
    assert m.snapshot().prefill_seconds_per_token == pytest.approx(0.001, rel=0.1)
    # a genuinely slower machine is still followed once the bootstrap is over
    for _ in range(60):
        m.observe(1, 0, 0.030)
    assert m.snapshot().decode_step_time(1) == pytest.approx(0.030, rel=0.05)


def test_a_stalled_first_step_of_a_new_batch_size_is_capped():
    """The first step of a new decode-batch bucket has nothing of its own to clamp it: a stall there (367 ms at
    batch 3 next to 9 ms at batch 1, seen in a full suite run) is capped at twice the smaller bucket's time
    scaled to the batch, and later steps of that size are learnt from there."""
    m = StepTimeModel()
    for _ in range(2 + 6):                       # warm-up steps, then batch 1
        m.observe(1, 0, 0.009)
    m.observe(3, 0, 0.367)
    assert m.snapshot().decode_step_time(3) == pytest.approx(0.054)
    for _ in range(50):
        m.observe(3, 0, 0.015)
    assert m.snapshot().decode_step_time(3) == pytest.approx(0.015, rel=0.1)
    # a genuinely slower new size is still followed (the cap only bounds the first sample)
    m2 = StepTimeModel()
    for _ in range(8):
        m2.observe(1, 0, 0.009)
    for _ in range(20):
        m2.observe(8, 0, 0.200)
    assert m2.snapshot().decode_step_time(8) == pytest.approx(0.200, rel=0.1)
