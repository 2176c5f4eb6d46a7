"""Metric math against hand-computed values on synthetic timelines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.metrics import (RequestRecord, compute_metrics, is_good, output_tokens_timeline,
                                     parse_goodput, peak_concurrency, percentile_key, per_request_fields,
                                     summarize)


def rec(start: float, ttft: float, itl: list[float], out: int, ok: bool = True, prompt: int = 10,
        end: float | None = None) -> RequestRecord:
    """A successful (or failed) request starting at ``start`` s."""
    latency = ttft + sum(itl) if ok else 0.0
    r = RequestRecord(success=ok, error="" if ok else "HTTP 429 Too Many Requests: x", prompt_len=prompt,
                      output_tokens=out if ok else 0, usage_reported=ok, ttft=ttft if ok else 0.0,
                      itl=list(itl) if ok else [], latency=latency, start_time=start)
    r.end_time = end if end is not None else start + latency
    return r


def timeline() -> list[RequestRecord]:
    # A: ttft 100 ms, 4 tokens, gaps 20/30/50 ms -> e2el 200 ms, tpot (200-100)/3 = 33.33 ms
    # B: ttft 300 ms, 1 token -> e2el 300 ms, tpot 0 (excluded from TPOT stats)
    # C: ttft 50 ms, 3 tokens, gaps 10/10 -> e2el 70 ms, tpot 10 ms
    # D: failed (429) after 5 ms
    return [
        rec(0.0, 0.100, [0.020, 0.030, 0.050], 4, prompt=10),
        rec(0.5, 0.300, [], 1, prompt=20),
        rec(1.0, 0.050, [0.010, 0.010], 3, prompt=30),
        rec(1.2, 0.0, [], 0, ok=False, end=1.205),
    ]


def test_summarize_percentiles_match_hand_values():
    s = summarize([0.010, 0.020, 0.030, 0.040], [50, 90, 99, 99.9])
    assert s["mean"] == pytest.approx(25.0)
    assert s["median"] == pytest.approx(25.0)
    assert s["std"] == pytest.approx(math.sqrt(125.0))  # population std of 10,20,30,40
    got = dict(s["percentiles"])
    # linear interpolation: rank = p/100 * (n-1)
    assert got[50] == pytest.approx(25.0)
    assert got[90] == pytest.approx(37.0)     # 30 + 0.7 * 10
    assert got[99] == pytest.approx(39.7)     # 30 + 0.97 * 10
    assert got[99.9] == pytest.approx(39.97)


def test_summarize_empty_is_zero_like_vllm():
    s = summarize([], [99])
    assert s["mean"] == s["median"] == s["std"] == 0.0
    assert s["percentiles"] == [(99.0, 0.0)]


def test_tpot_definition_and_one_token_outputs():
    a, b, c, d = timeline()
    assert a.tpot == pytest.approx((0.200 - 0.100) / 3)
    assert b.tpot == 0.0                      # 1 output token
    assert c.tpot == pytest.approx(0.010)
    zero = rec(0.0, 0.1, [], 0)
    assert zero.tpot == 0.0                   # 0 output tokens
    m = compute_metrics(timeline(), duration_s=2.0, percentiles=[99])
    # TPOT statistics leave out the 1-token request (vLLM): mean of 33.33 and 10 ms
    assert m.stats["tpot"]["mean"] == pytest.approx((100.0 / 3 + 10.0) / 2)
    assert m.stats["tpot"]["median"] == pytest.approx((100.0 / 3 + 10.0) / 2)


def test_aggregates_on_synthetic_timeline():
    m = compute_metrics(timeline(), duration_s=2.0, percentiles=[90, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 60                # failed request's prompt is not counted
    assert m.total_output == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    # TTFT over successful requests: 100, 300, 50 ms
    assert m.stats["ttft"]["mean"] == pytest.approx(150.0)
    assert m.stats["ttft"]["median"] == pytest.approx(100.0)
    assert dict(m.stats["ttft"]["percentiles"])[90] == pytest.approx(260.0)  # 100 + 0.8*200
    # ITL flattened: 20, 30, 50, 10, 10 ms
    assert m.stats["itl"]["mean"] == pytest.approx(24.0)
    assert m.stats["itl"]["median"] == pytest.approx(20.0)
    # E2EL: 200, 300, 70 ms
    assert m.stats["e2el"]["mean"] == pytest.approx(190.0)
    assert dict(m.stats["e2el"]["percentiles"])[99] == pytest.approx(200 + 0.98 * 100)
    assert m.request_goodput is None and m.slo_attainment is None   # no SLO given
    d = m.to_dict()
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "p99_ttft_ms", "p90_tpot_ms", "median_itl_ms", "mean_e2el_ms", "std_ttft_ms",
                "completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
                "max_concurrent_requests", "max_output_tokens_per_s"):
        assert key in d


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 100}, 2),              # A (100 ms, inclusive) and C (50)
    ({"ttft": 99.9}, 1),             # only C
    ({"tpot": 10.5}, 2),             # B (tpot 0, 1 token) and C (10 ms)
    ({"tpot": 9}, 1),                # only B
    ({"tpot": 34}, 3),
    ({"e2el": 200}, 2),              # A (200) and C (70)
    ({"e2el": 69}, 0),
    ({"ttft": 150, "tpot": 20}, 1),  # only C meets both
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),   # never the failed one
])
def test_goodput_with_each_slo_key(slo, good):
    m = compute_metrics(timeline(), duration_s=2.0, percentiles=[99], goodput_config=slo)
    assert m.good_requests == good
    assert m.request_goodput == pytest.approx(good / 2.0)
    assert m.slo_attainment == pytest.approx(good / 4)       # failed requests count against it


def test_is_good_failed_never_good():
    d = timeline()[3]
    assert not is_good(d, {"ttft": 1e9})


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["E2EL:1000"]) == {"e2el": 1000.0}
    assert parse_goodput(["ttft:5,tpot:2.5"]) == {"ttft": 5.0, "tpot": 2.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_percentile_key_spelling():
    assert percentile_key(99) == "99"
    assert percentile_key(99.0) == "99"
    assert percentile_key(99.9) == "99.9"
    m = compute_metrics(timeline(), 2.0, percentiles=[99.9]).to_dict()
    assert "p99.9_ttft_ms" in m


def test_peak_concurrency_exact_sweep():
    recs = [rec(0.0, 0.1, [0.9], 2), rec(0.5, 0.1, [0.1], 2), rec(0.6, 0.1, [0.1], 2),
            rec(1.0, 0.1, [], 1)]   # starts exactly when the first ends: no overlap
    # in flight: [0,1.0], [0.5,0.7], [0.6,0.8], [1.0,1.1] -> peak 3 at t=0.6..0.7
    assert peak_concurrency(recs) == 3
    assert peak_concurrency([]) == 0


def test_output_tokens_timeline_adds_up():
    recs = timeline()
    tl = output_tokens_timeline(recs, t0=0.0)
    assert tl.sum() == pytest.approx(8.0)
    # A's 4 tokens are all in second 0 (chunks at 0.10..0.20 s); B's token at 0.8 s; C's at 1.05..1.07 s
    assert tl[0] == pytest.approx(5.0)
    assert tl[1] == pytest.approx(3.0)
    m = compute_metrics(recs, 2.0, t0=0.0)
    assert m.max_output_tokens_per_s == pytest.approx(5.0)


def test_per_request_fields_align_with_requests():
    recs = timeline()
    f = per_request_fields(recs, t0=0.0)
    assert len(f["ttfts"]) == len(f["errors"]) == len(f["output_lens"]) == 4
    assert f["output_lens"] == [4, 1, 3, 0]
    assert f["successes"] == [True, True, True, False]
    assert f["errors"][3].startswith("HTTP 429")
    assert np.allclose(f["start_times"], [0.0, 0.5, 1.0, 1.2])


def test_zero_requests_and_zero_duration_do_not_crash():
    m = compute_metrics([], 0.0, percentiles=[99], goodput_config={"ttft": 1})
    assert m.completed == 0 and m.failed == 0 and m.slo_attainment == 0.0
