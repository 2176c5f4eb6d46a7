"""SLOAdmission: refusal with reason slo, tracking, displacement under the priority policy, error metric."""

from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass, field

import pytest

from tokenmill.metrics.stats import EngineStats
from tokenmill.core.scheduler import QueueState
from tokenmill.metrics.stats import IterationStats
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.server.admission import SLOAdmission
from tokenmill.server.slo_predictor import SLO, InflightWork

TP = 1e-4


def stats(**q):
    base = dict(max_num_seqs=16, max_num_batched_tokens=1000)
    base.update(q)
    t = StepTimingSnapshot(decode_points=[(1.0, 0.010), (17.0, 0.026)], prefill_seconds_per_token=TP,
                           num_steps_observed=50)
    return EngineStats(queue=QueueState(**base), step_timing=t)


@dataclass
class Sink:
    predicted: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def observe_ttft_prediction(self, v):
        self.predicted.append(v)

    def observe_ttft_prediction_error(self, v):
        self.errors.append(v)


def test_refuses_predicted_ttft_miss_with_reason_slo():
    sink = Sink()
    adm = SLOAdmission(SLO(ttft=0.5), metrics=sink)
    pred, ref = adm.check(stats(waiting_by_priority={0: (10, 9000)}), None, 500, 0, arrival=100.0, now=100.0)
    assert ref is not None and ref.reason == "slo" and ref.retry_after >= 1
    assert sink.predicted == [pytest.approx(pred.ttft)]
    pred, ref = adm.check(stats(), None, 500, 0, arrival=100.0, now=100.0)
    assert ref is None


def test_engine_without_measurements_admits():
    adm = SLOAdmission(SLO(ttft=0.001, tpot=0.001))
    pred, ref = adm.check(EngineStats(queue=QueueState(), step_timing=StepTimingSnapshot()), None, 10, 0, 0.0, 0.0)
    assert pred is None and ref is None


def test_inflight_requests_count_ahead():
    adm = SLOAdmission(SLO(ttft=0.5))
    _, ref = adm.check(stats(), InflightWork({0: (8, 8000)}), 100, 0, 0.0, 0.0)
    assert ref is not None


def test_first_token_records_error_and_forgets():
    sink = Sink()
    adm = SLOAdmission(SLO(ttft=1.0), metrics=sink)
    pred, _ = adm.check(stats(), None, 500, 0, arrival=10.0, now=10.0)
    adm.track("r1", pred, 0, 10.0, 500, now=10.0)
    it = IterationStats()
    it.first_tokens = [("r1", pred.ttft + 0.02), ("unknown", 1.0)]
    adm.record(None, it)
    assert sink.errors == [pytest.approx(0.02)] and "r1" not in adm.pending


def test_priority_displaces_queued_lower_priority_requests_that_would_now_miss():
    adm = SLOAdmission(SLO(ttft=0.5), policy="priority")
    now = 50.0
    # two low-priority requests admitted with some margin, predicted to start later
    st = stats(num_decoding=2, waiting_by_priority={5: (2, 2000)})
    pl, ref = adm.check(st, None, 1000, 5, arrival=now, now=now)
    assert ref is None and pl.ttft < 0.5
    low = adm.track("low", pl, 5, now, 1000, now=now)
    assert low.predicted_start > now
    # a high-priority request jumps ahead: not refused (lower-priority work is not ahead of it)
    st2 = stats(num_decoding=2, waiting_by_priority={5: (3, 3000)})
    ph, ref = adm.check(st2, None, 2000, 0, arrival=now, now=now)
    assert ref is None and ph.tokens_ahead == 0
    high = adm.track("high", ph, 0, now, 2000, now=now)
    displaced = adm.displaced_by(high, ph, now=now)
    assert [rid for rid, _ in displaced] == ["low"]
    rid, refusal = displaced[0]
    assert refusal.reason == "slo" and "displaced" in refusal.message and refusal.retry_after >= 1
    assert "low" not in adm.pending and "high" in adm.pending


def test_no_displacement_under_fcfs_or_of_started_or_higher_priority_requests():
    for policy in ("fcfs", "priority"):
        adm = SLOAdmission(SLO(ttft=0.5), policy=policy)
        p, _ = adm.check(stats(waiting_by_priority={0: (2, 2000)}), None, 1000, 0, 0.0, 0.0)
        adm.track("same", p, 0, 0.0, 1000, now=0.0)
        started = adm.track("started", p, 9, 0.0, 1000, now=0.0)
        started.predicted_start = -1.0
        ph, _ = adm.check(stats(), None, 4000, 0, 0.0, 0.0)
        new = adm.track("new", ph, 0, 0.0, 4000, now=0.0)
        assert adm.displaced_by(new, ph, now=0.0) == []


def test_prefix_hit_rate_follows_the_cores_counters():
    adm = SLOAdmission(SLO(ttft=1.0))
    for k in range(1, 20):
        adm.record(EngineStats(prefix_cache_queries=4096 * k, prefix_cache_hits=2048 * k), None)
    assert adm.prefix_hit_rate == pytest.approx(0.5, abs=0.01)


def test_error_calibration_quantile_bounds_and_warm_up():
    from tokenmill.server.admission import ErrorCalibration

    c = ErrorCalibration(0.9, window=20, min_samples=5, neutral=1.0, lo=0.5, hi=3.0)
    for v in (2.0, 2.0, 2.0, 2.0):
        c.add(v)
    assert c.margin() == 1.0                      # too few observations: neutral
    for v in range(1, 21):                        # the window keeps the last 20: 1..20 -> 90% is 18
        c.add(v / 10)
    assert c.margin() == pytest.approx(1.8)
    c.add(float("nan"))
    assert len(c.samples) == 20
    for _ in range(20):
        c.add(10.0)
    assert c.margin() == 3.0                      # clamped
    for _ in range(20):
        c.add(0.1)
    assert c.margin() == 0.5
    # observations expire: with none left the margin is neutral again (a refusing server gets no new ones)
    c.add(2.0, now=0.0)
    assert c.margin(now=c.max_age + time.monotonic()) == 1.0


def test_tpot_margin_never_refuses_everything():
    # if even a batch of one misses the TPOT limit after calibration, the limit is not enforced (as unscaled)
    slo = SLO(tpot=0.030)
    adm = SLOAdmission(slo)
    for _ in range(10):
        adm.tpot_factor.add(4.0)
    _, ref = adm.check(stats(num_decoding=8), None, 10, 0, 0.0, 0.0)
    assert ref is None


def _finish(rid, decode_time, tokens):
    from tokenmill.metrics.stats import FinishedRequestStats

    return FinishedRequestStats("length", decode_time=decode_time, num_generation_tokens=tokens, request_id=rid)


def test_tpot_margin_learnt_from_finished_requests_refuses_what_the_model_admits():
    # the model predicts TPOT ~ decode(b) + prefill share; the requests really ran 2x slower (e.g. the
    # batch grew after they were admitted): after enough finishes the learnt factor refuses
    slo = SLO(tpot=0.030)
    st = stats(num_decoding=8)
    raw = SLOAdmission(slo, calibrate=False)
    adm = SLOAdmission(slo)
    pred, ref = adm.check(st, None, 10, 0, 0.0, 0.0)
    assert ref is None and 0.015 < pred.tpot < 0.020
    for i in range(10):
        adm.track(f"r{i}", pred, 0, 0.0, 10, now=0.0)
        it = IterationStats()
        it.finished = [_finish(f"r{i}", decode_time=2 * pred.tpot * 15, tokens=16)]
        adm.record(None, it)
    assert adm.tpot_factor.margin() == pytest.approx(2.0)
    _, ref = adm.check(st, None, 10, 0, 0.0, 0.0)
    assert ref is not None and ref.reason == "slo" and "time per output token" in ref.message
    assert raw.check(st, None, 10, 0, 0.0, 0.0)[1] is None     # the raw model still admits
    assert adm._predicted_tpot == {}                            # forgotten at finish


def test_ttft_margin_learnt_from_first_tokens_both_ways():
    slo = SLO(ttft=0.5)
    st = stats(waiting_by_priority={0: (3, 3000)})
    adm = SLOAdmission(slo)
    pred, ref = adm.check(st, None, 500, 0, 0.0, 0.0)
    assert ref is None and 0.3 < pred.ttft < 0.5

    def observe(err):
        for i in range(10):
            adm.track(f"t{i}", pred, 0, 0.0, 500, now=0.0)
            it = IterationStats()
            it.first_tokens = [(f"t{i}", pred.ttft + err)]
            adm.record(None, it)

    observe(0.2)                       # requests came 200 ms later than predicted: the same request now misses
    assert adm.ttft_margin.margin() == pytest.approx(0.2)
    assert adm.check(st, None, 500, 0, 0.0, 0.0)[1] is not None
    for _ in range(7):                 # ... then 200 ms earlier: the window (64) forgets the late ones
        observe(-0.2)
    assert adm.ttft_margin.margin() == pytest.approx(-0.2)
    big = stats(waiting_by_priority={0: (5, 5000)})
    assert SLOAdmission(slo).check(big, None, 500, 0, 0.0, 0.0)[1] is not None   # raw model refuses
    assert adm.check(big, None, 500, 0, 0.0, 0.0)[1] is None                     # calibrated admits


def test_cold_engine_admits_one_batch_blind_not_a_whole_burst():
    adm = SLOAdmission(SLO(ttft=0.5))
    cold = EngineStats(queue=QueueState(max_num_seqs=2), step_timing=StepTimingSnapshot())
    for rid in ("a", "b"):
        pred, ref = adm.check(cold, None, 10, 0, 0.0, 0.0)
        assert pred is None and ref is None
        adm.track(rid, pred, 0, 0.0, 10, now=0.0)
    pred, ref = adm.check(cold, None, 10, 0, 0.0, 0.0)
    assert ref is not None and ref.reason == "slo" and "warming up" in ref.message and ref.retry_after == 1
    it = IterationStats()
    it.first_tokens = [("a", 0.3)]
    adm.record(None, it)                       # one got its first token: room for one more
    assert adm.check(cold, None, 10, 0, 0.0, 0.0)[1] is None
    adm.forget("b")
    assert not adm._blind
    # once the engine has measured its steps, predictions take over
    assert adm.check(stats(), None, 10, 0, 0.0, 0.0)[0] is not None
    # a large max_num_seqs still admits only a few blind (a burst on a cold engine)
    big = SLOAdmission(SLO(ttft=0.5))
    cold64 = EngineStats(queue=QueueState(max_num_seqs=64), step_timing=StepTimingSnapshot())
    for k in range(8):
        assert big.check(cold64, None, 10, 0, 0.0, 0.0)[1] is None
        big.track(f"c{k}", None, 0, 0.0, 10, now=0.0)
    assert big.check(cold64, None, 10, 0, 0.0, 0.0)[1] is not None


def test_before_the_first_stats_the_blind_batch_is_capped_too():
    """Issue 30: an engine that has sent no stats yet (no queue state) was admitted without any cap:
    a 40-request burst on a fresh server all went in; now it is capped like any cold engine."""
    adm = SLOAdmission(SLO(ttft=3.0))
    nothing = EngineStats()
    for k in range(8):
        pred, ref = adm.check(nothing, None, 450, 0, 0.0, 0.0)
        assert pred is None and ref is None
        adm.track(f"r{k}", pred, 0, 0.0, 450, now=0.0)
    pred, ref = adm.check(nothing, None, 450, 0, 0.0, 0.0)
    assert ref is not None and "warming up" in ref.message and ref.retry_after >= 1


@dataclass
class TPOTSink(Sink):
    tpot_predicted: list = field(default_factory=list)
    tpot_errors: list = field(default_factory=list)
    caps: list = field(default_factory=list)

    def observe_tpot_prediction(self, v):
        self.tpot_predicted.append(v)

    def observe_tpot_prediction_error(self, v):
        self.tpot_errors.append(v)

    def set_slo_decode_batch_limit(self, v):
        self.caps.append(v)


def test_tpot_model_learns_workload_means_and_exports_its_prediction_and_error():
    sink = TPOTSink()
    adm = SLOAdmission(SLO(tpot=0.020), metrics=sink, calibrate=False)
    st = stats(num_decoding=4)
    pred, ref = adm.check(st, None, 40, 0, 0.0, 0.0, num_seqs=1, max_tokens=16)
    assert ref is None and sink.tpot_predicted == [pred.tpot] and sink.caps and sink.caps[-1] >= 5
    assert pred.decode_tokens == 16                       # before any finish: its own max_tokens
    adm.note_admitted(400, 2)                             # 2 sequences of 200 prompt tokens
    assert adm.mean_prompt_tokens == 200
    adm.track("a", pred, 0, 0.0, 40, now=0.0)
    it = IterationStats()
    it.finished = [_finish("a", decode_time=2 * pred.tpot * 9, tokens=10)]
    adm.record(None, it)
    assert adm.mean_decode_tokens == 10
    assert sink.tpot_errors == [pytest.approx(pred.tpot)]    # measured 2x predicted: error = +predicted
    # the learnt means enter the next prediction: 200-token prompts over 10-token lifetimes
    p2, _ = adm.check(st, None, 40, 0, 0.0, 0.0, max_tokens=16)
    assert p2.decode_tokens == 10 and p2.prefill_per_seq == pytest.approx(200 / 10 * TP)


def test_tpot_of_an_n_request_is_per_choice():
    """n choices decode side by side: 3 choices x 10 tokens in one decode time is a 10-token lifetime,
    and its TPOT is the decode time over 9 tokens, not over 29."""
    sink = TPOTSink()
    adm = SLOAdmission(SLO(tpot=0.020), metrics=sink, calibrate=False)
    pred, _ = adm.check(stats(num_decoding=4), None, 40, 0, 0.0, 0.0, num_seqs=3, max_tokens=16)
    adm.track("a", pred, 0, 0.0, 40, now=0.0)
    it = IterationStats()
    it.finished = [dataclasses.replace(_finish("a", decode_time=2 * pred.tpot * 9, tokens=30), num_choices=3)]
    adm.record(None, it)
    assert adm.mean_decode_tokens == 10
    assert sink.tpot_errors == [pytest.approx(pred.tpot)]    # measured 2x predicted, as for n = 1


def test_tpot_refuses_a_request_that_would_slow_the_running_batch():
    # 12 decoding at 10 ms + 1 ms per extra sequence; a 13th is predicted over 22 ms: refused even
    # though the queue is empty (TTFT fine); with 10 decoding it is admitted
    adm = SLOAdmission(SLO(ttft=1.0, tpot=0.0215), calibrate=False)
    _, ref = adm.check(stats(num_decoding=12, remaining_output_tokens=[5] * 12), None, 10, 0, 0.0, 0.0,
                       max_tokens=16)
    assert ref is not None and ref.reason == "slo" and "time per output token" in ref.message
    _, ref = adm.check(stats(num_decoding=10, remaining_output_tokens=[5] * 10), None, 10, 0, 0.0, 0.0,
                       max_tokens=16)
    assert ref is None


def test_slow_start_admits_only_into_batches_near_the_measured_range():
    # the engine has measured decode batches of 1-3 only: at most max(8, 2 x 3) sequences are trusted
    adm = SLOAdmission(SLO(ttft=5.0, tpot=1.0), calibrate=False)
    t = StepTimingSnapshot(decode_points=[(1.0, 0.010), (3.0, 0.012)], prefill_seconds_per_token=TP,
                           num_steps_observed=10)
    q = dict(max_num_seqs=64, max_num_batched_tokens=1000)
    ok = EngineStats(queue=QueueState(num_decoding=7, **q), step_timing=t)
    assert adm.check(ok, None, 10, 0, 0.0, 0.0)[1] is None                # a batch of 8
    far = EngineStats(queue=QueueState(num_decoding=8, **q), step_timing=t)
    _, ref = adm.check(far, None, 10, 0, 0.0, 0.0)
    assert ref is not None and "warming up" in ref.message and ref.retry_after == 1
    # a batch already running (8 decoding + 4 batch-lane prefills, all 12 seats) is trusted: the next steps
    # measure it, and a request that waits for a seat does not grow it
    seats12 = dict(max_num_seqs=12, max_num_batched_tokens=1000)
    busy = EngineStats(queue=QueueState(num_decoding=8, batch_running_prefill=(4, 400), **seats12), step_timing=t)
    assert adm.check(busy, None, 10, 0, 0.0, 0.0)[1] is None
    # with free seats, growing it past both the running batch and twice the measured one is refused
    busy64 = EngineStats(queue=QueueState(num_decoding=8, batch_running_prefill=(4, 400), **q), step_timing=t)
    assert "warming up" in adm.check(busy64, None, 10, 0, 0.0, 0.0)[1].message
    # once batches of 20 were measured, a batch of 9 is trusted (up to 40)
    t20 = StepTimingSnapshot(decode_points=[(1.0, 0.010), (20.0, 0.030)], prefill_seconds_per_token=TP,
                             num_steps_observed=50)
    assert adm.check(EngineStats(queue=QueueState(num_decoding=8, **q), step_timing=t20), None, 10, 0, 0.0,
                     0.0)[1] is None
    # without a TPOT target there is no slow start (a TTFT prediction rests on the measured prefill rate)
    ttft_only = SLOAdmission(SLO(ttft=5.0), calibrate=False)
    assert ttft_only.check(far, None, 10, 0, 0.0, 0.0)[1] is None


def test_a_prompt_that_would_push_an_admitted_request_past_its_limit_is_refused():
    """Under fcfs a newcomer's prompt joins the step in which earlier prompts end and delays their first
    token by its own prefill: an infeasible-alone prompt (held to 1.5 x its idle TTFT) must not drag a
    short one admitted just before it past the SLO; a small one may, and moves its prediction."""
    adm = SLOAdmission(SLO(ttft=0.5))
    now = 10.0
    st = stats(max_num_batched_tokens=5000)
    pa, ref = adm.check(st, None, 1000, 0, arrival=now, now=now)
    assert ref is None
    a = adm.track("a", pa, 0, now, 1000, now=now)
    first = a.predicted_ttft
    # 4000 tokens: idle TTFT 0.41 s, held to 0.615 s and predicted within it, but A would wait for it
    pb, ref = adm.check(st, InflightWork({0: (1, 1000)}), 4000, 0, arrival=now, now=now)
    assert pb.ttft <= 1.5 * pb.ttft_idle and pb.ttft_idle * 1.5 > 0.5
    assert ref is not None and ref.reason == "slo" and "share a step" in ref.message and ref.retry_after >= 1
    # a small prompt delays A by its own prefill only: admitted, and A's prediction moves by that much
    pc, ref = adm.check(st, InflightWork({0: (1, 1000)}), 500, 0, arrival=now, now=now)
    assert ref is None
    adm.track("c", pc, 0, now, 500, now=now)
    assert a.predicted_ttft == pytest.approx(first + pc.ttft_idle)
    # once A has its first token nothing admitted waits: the long prompt is judged on its own
    adm.record(None, IterationStats(first_tokens=[("a", 0.2), ("c", 0.25)]))
    _, ref = adm.check(st, None, 4000, 0, arrival=now + 1, now=now + 1)
    assert ref is None
