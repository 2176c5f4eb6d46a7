"""SLO predictor: TTFT/TPOT from the queue state and the step-time model; verdicts and Retry-After."""

from __future__ import annotations

import pytest

from tokenmill.core.scheduler import QueueState
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.server.slo_predictor import SLO, InflightWork, judge, max_decode_batch, predict, tpot_at

TP = 1e-4  # 10k prompt tokens/s


def timing(pf_per_step=0.0):
    # decode step: 10 ms at batch 1, 26 ms at batch 17 (1 ms per request)
    return StepTimingSnapshot(decode_points=[(1.0, 0.010), (17.0, 0.026)], prefill_seconds_per_token=TP,
                              prefill_seconds_per_step=pf_per_step, num_steps_observed=100)


def queue(**kw):
    base = dict(max_num_seqs=16, max_num_batched_tokens=1000)
    base.update(kw)
    return QueueState(**base)


def test_slo_parse():
    assert SLO.parse(["ttft:500", "tpot:50"]) == SLO(0.5, 0.05)
    assert SLO.parse("tpot:25") == SLO(None, 0.025) and SLO.parse(None) == SLO()
    assert SLO.parse("ttft:200,tpot:40") == SLO(0.2, 0.04) and str(SLO(0.2, 0.04)) == "ttft:200 tpot:40"
    for bad in ("e2el:100", "ttft", "ttft:abc", "ttft:0", "ttft:-5"):
        with pytest.raises(ValueError, match="--slo"):
            SLO.parse(bad)


def test_idle_server_ttft_is_own_prefill():
    p = predict(queue(), timing(), prompt_tokens=500, priority=0, policy="fcfs")
    assert p.ttft == pytest.approx(0.010 + 500 * TP)
    # TPOT: a batch of one plus its own prompt spread over one decode lifetime (max_tokens unknown: 256)
    assert p.tpot == pytest.approx(0.010 + 500 / 256 * TP) and p.tokens_ahead == 0 and p.seat_wait == 0
    assert p.decode_batch == 1


def test_queue_ahead_adds_steps_and_prefill_time():
    # 4 decoding; 3000 tokens waiting (3 requests); budget 1000 - 4 per step
    q = queue(num_decoding=4, waiting_by_priority={0: (3, 3000)})
    p = predict(q, timing(), prompt_tokens=500, priority=0, policy="fcfs")
    steps = 4                                          # ceil(3500 / 996)
    b_mean = 4 + 3 / 2
    step_d = 0.010 + (b_mean - 1) * 0.001
    residual = 0.5 * (0.010 + 3 * 0.001 + 996 * TP)
    assert p.ttft == pytest.approx(steps * step_d + 3500 * TP + residual)
    assert p.tokens_ahead == 3000 and p.requests_ahead == 3
    # joins a batch of 4 + 3 + 1; each sequence brings its prompt (500 tokens, P̄ = its own) per lifetime
    assert p.decode_batch == 8
    assert p.tpot == pytest.approx(0.010 + 7 * 0.001 + max(8 * 500 / 256, 3500 / 256) * TP)


def test_priority_policy_counts_only_work_served_first_and_inflight():
    q = queue(waiting_by_priority={0: (1, 1000), 5: (4, 8000)}, running_prefill=(1, 200))
    inflight = InflightWork({0: (1, 300), 9: (2, 2000)})
    hi = predict(q, timing(), 100, priority=0, policy="priority", inflight=inflight)
    assert hi.tokens_ahead == 200 + 1000 + 300
    lo = predict(q, timing(), 100, priority=9, policy="priority", inflight=inflight)
    assert lo.tokens_ahead == 200 + 9000 + 2300
    fcfs = predict(q, timing(), 100, priority=0, policy="fcfs", inflight=inflight)
    assert fcfs.tokens_ahead == lo.tokens_ahead and lo.ttft > hi.ttft


def test_batch_lane_counts_only_as_one_blocking_step():
    idle = predict(queue(), timing(), 100, 0, "fcfs")
    q = queue(batch_waiting=(50, 100_000), batch_running_prefill=(2, 4000), num_batch_running=2)
    p = predict(q, timing(), 100, 0, "fcfs")
    assert p.tokens_ahead == 0
    # at most one full step of batch prefill (half of it on average) is in the way
    assert p.ttft - idle.ttft == pytest.approx(0.5 * (0.010 + 1000 * TP))


def test_full_seats_wait_for_the_soonest_finishing_request():
    q = queue(num_decoding=16, remaining_output_tokens=[3, 40, 100] + [200] * 13)
    p = predict(q, timing(), 100, 0, "fcfs")
    tpot_now = 0.010 + 15 * 0.001
    assert p.seat_wait == pytest.approx(3 * tpot_now)
    # batch requests do not hold seats against interactive ones
    qb = queue(num_decoding=16, num_batch_running=10, remaining_output_tokens=[3, 40, 100] + [200] * 13)
    assert predict(qb, timing(), 100, 0, "fcfs").seat_wait == 0


def test_not_ready_model_means_no_prediction_and_admit():
    assert predict(queue(), StepTimingSnapshot(), 10, 0, "fcfs") is None
    assert judge(SLO(0.1, 0.01), None, 0.0, queue(), StepTimingSnapshot()).admit


def test_judge_ttft_refusal_retry_after_is_the_excess():
    q = queue(num_decoding=2, waiting_by_priority={0: (20, 40_000)})
    t = timing()
    p = predict(q, t, 200, 0, "fcfs")
    assert p.ttft > 4.0
    v = judge(SLO(ttft=0.5), p, 0.0, q, t)
    assert not v.admit and v.which == "ttft"
    assert v.retry_after == int(-(-(p.ttft - 0.5) // 1))
    assert "time to first token" in v.message and "500 ms" in v.message
    assert judge(SLO(ttft=p.ttft + 0.1), p, 0.0, q, t).admit
    assert not judge(SLO(ttft=p.ttft + 0.1), p, 0.2, q, t).admit     # time already spent counts


def test_judge_long_prompt_is_judged_against_its_idle_ttft():
    t = timing()
    p = predict(queue(), t, 8000, 0, "fcfs")         # 0.8 s of prefill alone
    assert judge(SLO(ttft=0.3), p, 0.0, queue(), t).admit
    busy = queue(num_decoding=2, waiting_by_priority={0: (10, 20_000)})
    assert not judge(SLO(ttft=0.3), predict(busy, t, 8000, 0, "fcfs"), 0.0, busy, t).admit


def test_judge_tpot_refusal_and_retry_after_from_finishing_requests():
    t = timing()
    q = queue(num_decoding=15, remaining_output_tokens=[10, 20, 30] + [100] * 12)
    p = predict(q, t, 10, 0, "fcfs")
    assert p.decode_batch == 16
    assert p.tpot == pytest.approx(0.025 + 16 * 10 / 256 * TP)
    v = judge(SLO(tpot=0.023), p, 0.0, q, t)
    assert not v.admit and v.which == "tpot"
    # needs a batch of 13: 3 requests must finish, the third after 30 tokens at the current step time
    assert v.retry_after == int(-(-(30 * p.step_time) // 1))
    # an unattainable TPOT target (a batch of one misses it) is not enforced
    assert judge(SLO(tpot=0.005), p, 0.0, q, t).admit


def test_prefix_hit_rate_discounts_prompts_not_yet_scheduled():
    q = queue(waiting_by_priority={0: (4, 4000)}, running_prefill=(1, 300))
    cold = predict(q, timing(), 1000, 0, "fcfs")
    warm = predict(q, timing(), 1000, 0, "fcfs", prefix_hit_rate=0.5)
    assert cold.tokens_ahead == 4300 and warm.tokens_ahead == 300 + 2000
    assert warm.ttft < cold.ttft


def test_tpot_batch_counts_every_admitted_unfinished_sequence():
    # decoding 4, prefilling 1, waiting 3 (of any priority: they join while it decodes), in flight 2,
    # its own 2 sequences (n=2): the batch it will decode in is 12, capped by max_num_seqs
    q = queue(num_decoding=4, running_prefill=(1, 50), waiting_by_priority={0: (1, 100), 9: (2, 200)})
    inflight = InflightWork({5: (2, 100)})
    p = predict(q, timing(), 20, priority=0, policy="priority", inflight=inflight, num_seqs=2, max_tokens=16)
    assert p.decode_batch == 12 and p.requests_ahead == 2     # TTFT counts only the work served first
    capped = predict(queue(max_num_seqs=8, num_decoding=6, waiting_by_priority={0: (5, 100)}), timing(), 20,
                     0, "fcfs")
    assert capped.decode_batch == 8


def test_tpot_counts_prompt_work_riding_along_turnover_and_backlog():
    t = timing()
    # steady state: a 6-sequence batch of 15-token lifetimes with 300-token prompts: 6/15 requests join
    # per step, each with 300 prompt tokens
    q = queue(num_decoding=5, remaining_output_tokens=[3, 6, 9, 12, 15])
    p = predict(q, t, 300, 0, "fcfs", max_tokens=15, mean_prompt_tokens=300.0, mean_decode_tokens=15.0)
    assert p.prefill_per_seq == pytest.approx(300 / 15 * TP)
    assert p.tpot == pytest.approx(tpot_at(t, 6, p.prefill_per_seq, p.backlog_per_step))
    assert p.tpot == pytest.approx(0.015 + 6 * 20 * TP)
    # a committed backlog that can start now (free seats) lands on the running requests' next steps
    burst = queue(num_decoding=5, waiting_by_priority={0: (4, 8000)})
    b = predict(burst, t, 300, 0, "fcfs", mean_prompt_tokens=300.0, mean_decode_tokens=15.0)
    assert b.backlog_per_step == pytest.approx((8000 + 300) / 15 * TP)
    assert b.tpot == pytest.approx(t.decode_step_time(10) + b.backlog_per_step)
    # beyond the free seats, waiting prompts start only as seats turn over: not in the backlog
    full = queue(max_num_seqs=6, num_decoding=5, waiting_by_priority={0: (4, 8000)})
    f = predict(full, t, 300, 0, "fcfs", mean_prompt_tokens=300.0, mean_decode_tokens=15.0)
    assert f.backlog_per_step == pytest.approx(2000 / 15 * TP)
    # the prefix-cache hit rate discounts P̄
    warm = predict(q, t, 300, 0, "fcfs", prefix_hit_rate=0.5, mean_prompt_tokens=300.0, mean_decode_tokens=15.0)
    assert warm.prefill_per_seq == pytest.approx(p.prefill_per_seq / 2)


def test_admission_caps_the_decode_batch_where_predicted_tpot_meets_the_limit():
    t = timing()
    kw = dict(max_tokens=16, mean_prompt_tokens=100.0, mean_decode_tokens=16.0)
    per_seq = 100 / 16 * TP
    limit = 0.020
    probe = predict(queue(), t, 100, 0, "fcfs", **kw)
    cap = max_decode_batch(t, limit, probe, 16)
    # the largest b with 10 ms + (b - 1) ms + b * per_seq <= 20 ms
    assert cap == max(b for b in range(1, 17) if 0.010 + (b - 1) * 0.001 + b * per_seq <= limit)
    assert max_decode_batch(t, limit, probe, 16, scale=2.0) < cap   # a learnt margin lowers the cap
    # a request joining a batch at the cap is refused (it would slow the running ones too) ...
    at_cap = queue(num_decoding=cap, remaining_output_tokens=list(range(4, 4 + cap)))
    p = predict(at_cap, t, 100, 0, "fcfs", **kw)
    v = judge(SLO(tpot=limit), p, 0.0, at_cap, t)
    assert not v.admit and v.which == "tpot" and f"at most {cap}" in v.message
    # ... Retry-After: until the soonest-finishing running request is done
    assert v.retry_after == max(1, int(-(-(4 * p.step_time) // 1)))
    # ... and admitted with one seat left
    below = queue(num_decoding=cap - 1, remaining_output_tokens=list(range(4, 3 + cap)))
    assert judge(SLO(tpot=limit), predict(below, t, 100, 0, "fcfs", **kw), 0.0, below, t).admit
    # requests waiting or in flight hold their place in the batch just as running ones do
    queued = queue(num_decoding=cap - 3, waiting_by_priority={0: (2, 200)})
    assert not judge(SLO(tpot=limit), predict(queued, t, 100, 0, "fcfs", inflight=InflightWork({0: (1, 100)}),
                                              **kw), 0.0, queued, t).admit


def test_tpot_retry_after_when_the_excess_is_still_waiting():
    t = timing()
    kw = dict(max_tokens=100, mean_prompt_tokens=10.0, mean_decode_tokens=100.0)
    # 2 decoding (50 tokens left each), 14 waiting: the excess over the cap must run and finish first
    q = queue(num_decoding=2, remaining_output_tokens=[50, 50], waiting_by_priority={0: (14, 140)})
    p = predict(q, t, 10, 0, "fcfs", **kw)
    cap = max_decode_batch(t, 0.015, p, 16)
    v = judge(SLO(tpot=0.015), p, 0.0, q, t)
    assert not v.admit and v.which == "tpot"
    excess = p.decode_batch - cap
    expected = (50 + -(-(excess - 2) // cap) * 100) * p.step_time
    assert v.retry_after == min(60, max(1, int(-(-expected // 1))))


def test_the_context_term_charges_long_prompts_their_attention():
    # C seconds per prompt row per context token: a prompt of P tokens costs P*TP + C*P*(P-1)/2 more
    C = 1e-7
    t = StepTimingSnapshot(decode_points=[(1.0, 0.010), (17.0, 0.026)], prefill_seconds_per_token=TP,
                           num_steps_observed=100, prefill_seconds_per_context=C)
    p = predict(queue(), t, prompt_tokens=500, priority=0, policy="fcfs")
    assert p.ttft == pytest.approx(0.010 + 500 * TP + C * 500 * 499 / 2)
    assert p.ttft_idle == pytest.approx(p.ttft)
    # the prompts ahead's attention (their lengths come from the API process: context_ahead)
    q = queue(waiting_by_priority={0: (2, 1000)})
    base = predict(q, t, prompt_tokens=100, priority=0, policy="fcfs")
    ahead = predict(q, t, prompt_tokens=100, priority=0, policy="fcfs", context_ahead=2 * 500 * 499 / 2)
    assert ahead.ttft - base.ttft == pytest.approx(C * 500 * 499)
    assert ahead.ttft_idle == base.ttft_idle == pytest.approx(0.010 + 100 * TP + C * 100 * 99 / 2)
    # after a prefix-cache hit the rows computed attend to the cached prefix too: 250 rows from 250 on
    hit = predict(queue(), t, prompt_tokens=500, priority=0, policy="fcfs", prefix_hit_rate=0.5)
    assert hit.ttft == pytest.approx(0.010 + 250 * TP + C * (250 * 249 / 2 + 250 * 250))
    # without a measured term (0), the linear model as before
    assert predict(queue(), timing(), prompt_tokens=500, priority=0, policy="fcfs").ttft == \
        pytest.approx(0.010 + 500 * TP)
