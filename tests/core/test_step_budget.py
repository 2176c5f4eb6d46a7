"""Step-latency budget (tokenmill.core.step_budget) and the scheduler under it: seats follow the step-time
model; off (target 0, or no model) is the token-budget-only schedule."""

from __future__ import annotations

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.step_budget import MAX_HOLD_S, MIN_TARGET_FACTOR, decode_time_bound, plan_step
from tokenmill.core.scheduler import Scheduler
from tokenmill.metrics.step_timing import StepTimingSnapshot

from tests.core.test_scheduler import FakeRunner, make_req

# A CPU-like model: decode step 9 ms + 1.4 ms per request (linear from 8 on, flat below), 0.9 ms per prompt token.
POINTS = [(1.0, 0.016), (8.0, 0.0202), (32.0, 0.0538), (64.0, 0.0986), (128.0, 0.1882)]
SNAP = StepTimingSnapshot(decode_points=POINTS, prefill_seconds_per_token=0.0009, num_steps_observed=100)


def test_plan_step_off_or_unmeasured_is_none():
    assert plan_step(SNAP, 0.0, 128) is None
    assert plan_step(None, 85.0, 128) is None
    assert plan_step(StepTimingSnapshot(decode_points=POINTS), 85.0, 128) is None   # no prefill rate yet


def test_plan_step_seats_from_the_model():
    b = plan_step(SNAP, 85.0, 128)
    # largest B with decode_step_time(B) <= 85 ms: 32 + (85 - 53.8) / 1.4 = 54.3 -> 54
    assert b.max_running == 54
    assert SNAP.decode_step_time(54) <= 0.085 < SNAP.decode_step_time(55)
    assert plan_step(SNAP, 85.0, 20).max_running == 20                  # never above max_num_seqs
    assert plan_step(SNAP, 200.0, 128).max_running == 128


def test_plan_step_target_at_least_a_few_single_steps():
    slow = StepTimingSnapshot(decode_points=[(1.0, 0.2), (16.0, 0.4)], prefill_seconds_per_token=0.01)
    b = plan_step(slow, 85.0, 128)
    assert b.target_s == pytest.approx(MIN_TARGET_FACTOR * 0.2)
    assert b.max_running > 16           # batches up to ~4 single steps, not one request at a time


def test_a_stalled_bucket_does_not_hold_the_batch():
    """A bucket that kept a stall's time (756 ms at batch 3 beside 7 ms at 2: seen in a loaded suite run) is
    capped proportionally from the smaller points, so the batch still grows into it and the EWMA corrects it."""
    stalled = StepTimingSnapshot(decode_points=[(1.0, 0.0071), (2.0, 0.0071), (3.2, 0.7564)],
                                 prefill_seconds_per_token=0.0012)
    assert stalled.decode_step_time(3) > 0.085           # the raw model would stop at 2
    b = plan_step(stalled, 85.0, 128)
    assert b.max_running >= 20                            # 7.1 ms x 24 / 2 = 85 ms
    assert decode_time_bound(stalled, 3) == pytest.approx(0.0071 * 3 / 2)


def make_sched(target_ms: float, snap: StepTimingSnapshot | None = SNAP, max_num_seqs=128, chunked=True):
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                  enable_chunked_prefill=chunked, target_step_latency_ms=target_ms),
                  CacheConfig(block_size=16, enable_prefix_caching=False), max_model_len=1024, num_kv_blocks=4096)
    if snap is not None:
        s.step_timing = lambda: snap
    s._clock = lambda: 0.0        # a still clock: no request is ever held back past MAX_HOLD_S (see the hold test)
    return s


def run(s: Scheduler, steps: int) -> tuple[int, list[tuple[int, int]]]:
    """Most running requests seen, and (decodes, prompt tokens) of every step."""
    most, shapes = 0, []
    runner = FakeRunner()
    for _ in range(steps):
        so = s.schedule()
        if so.is_empty:
            break
        dec = sum(1 for r in so.scheduled if len(r.token_ids) == 1 and not r.new)
        shapes.append((dec, so.total_num_scheduled_tokens - dec))
        s.update_from_output(so, runner(so))
        most = max(most, s.num_running)
    return most, shapes


def add(s: Scheduler, n: int, prompt: int = 40, max_tokens: int = 30) -> None:
    for i in range(n):
        s.add_request(make_req(f"r{i}", prompt, arrival=float(i), max_tokens=max_tokens))


def test_seats_capped_by_predicted_decode_step():
    old = make_sched(0.0)                  # off: every request runs at once (the old default)
    add(old, 80, max_tokens=300)
    assert run(old, 1000)[0] == 80
    new = make_sched(85.0)
    add(new, 80, max_tokens=300)
    for _ in range(60):
        new.update_from_output(so := new.schedule(), FakeRunner()(so))
    q = new.queue_state()     # the seats of the step budget, for --slo's predictions
    assert q.max_num_seqs == 54 and q.max_num_batched_tokens == 2048
    most, shapes = run(new, 2000)
    assert most == 54
    assert not new.has_unfinished_requests()   # the excess waited, then ran: everything finished


def test_prompt_chunks_keep_the_token_budget():
    """Prompt tokens per step are not cut by the step budget (32-token trickles cost 29% of the c=64 throughput)."""
    s = make_sched(85.0)
    add(s, 10, prompt=600, max_tokens=40)
    _, shapes = run(s, 400)
    assert max(p for _, p in shapes) > 1000      # the token budget alone decides: 2048-token mixed steps


def test_no_model_or_no_chunking_keeps_the_token_budget_schedule():
    s = make_sched(85.0, snap=None)
    add(s, 80, max_tokens=300)
    assert run(s, 1000)[0] == 80
    s = make_sched(85.0, chunked=False)    # seats still capped without chunked prefill
    add(s, 80, prompt=200, max_tokens=300)
    most, shapes = run(s, 2000)
    assert most == 54 and max(p for _, p in shapes) >= 200


def test_a_request_is_held_back_at_most_max_hold_s():
    clock = [0.0]
    s = make_sched(85.0)
    s._clock = lambda: clock[0]
    add(s, 80, max_tokens=300)
    most, _ = run(s, 200)
    assert most == 54 and s.num_waiting == 26          # the budget holds 26 back
    clock[0] = MAX_HOLD_S / 2
    assert run(s, 5)[0] == 54                          # not yet held long enough
    clock[0] = MAX_HOLD_S + 0.01
    most, _ = run(s, 200)
    assert most == 80                                  # held longer than MAX_HOLD_S: admitted anyway
    s2 = make_sched(85.0, max_num_seqs=60)
    s2._clock = lambda: clock[0]
    clock[0] = 0.0
    add(s2, 80, max_tokens=300)
    run(s2, 200)
    clock[0] = 10.0
    assert run(s2, 200)[0] == 60                       # never past max_num_seqs


def test_target_must_be_finite_and_non_negative():
    with pytest.raises(ValueError):
        SchedulerConfig(target_step_latency_ms=-1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(target_step_latency_ms=float("nan"))
