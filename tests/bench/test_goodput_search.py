"""The DistServe goodput search on synthetic attainment curves."""

from __future__ import annotations

import pytest

from tokenmill.bench.goodput_search import Probe, probe_from_metrics, search_goodput


def step_probe(threshold: float, calls: list[float]):
    """Attainment 1 up to ``threshold`` req/s, falling linearly to 0 at 2×threshold."""
    def probe(rate: float) -> Probe:
        calls.append(rate)
        att = 1.0 if rate <= threshold else max(0.0, 1.0 - (rate - threshold) / threshold)
        return Probe(rate, att, 10.0 * rate, rate, rate, rate * att, 5 * rate, 100, 0)
    return probe


@pytest.mark.parametrize("threshold, initial", [(13.7, 1.0), (13.7, 40.0), (0.3, 1.0), (5.0, 5.0)])
def test_brackets_then_bisects_to_precision(threshold, initial):
    calls: list[float] = []
    res = search_goodput(step_probe(threshold, calls), target=0.9, initial_rate=initial, precision=0.05)
    # attainment >= 0.9 up to 1.1 × threshold
    true = 1.1 * threshold
    assert res.goodput <= true + 1e-9
    assert res.lowest_failing_rate is not None and res.lowest_failing_rate > true
    assert res.lowest_failing_rate - res.goodput <= 0.05 * res.goodput + 1e-9
    assert all(p.passed == (p.slo_attainment >= 0.9) for p in res.probes)
    assert len(calls) == len(res.probes) <= 16
    curve = res.curve()
    assert [c["request_rate"] for c in curve] == sorted(calls)
    assert "metrics" not in curve[0]


def test_doubling_sequence_from_initial_rate():
    calls: list[float] = []
    search_goodput(step_probe(13.7, calls), initial_rate=1.0, precision=0.1)
    # attainment at 16 req/s is 0.83 < 0.9: the bracket is [8, 16] ...
    assert calls[:5] == [1, 2, 4, 8, 16]
    # ... then bisection stays inside it: 12, 14, 15 (15.07 is the true answer) ...
    assert calls[5:] == [12, 14, 15]


def test_all_pass_up_to_max_rate():
    res = search_goodput(step_probe(1e9, []), initial_rate=1.0, max_rate=10.0)
    assert res.goodput == 10.0 and res.lowest_failing_rate is None
    assert "max-rate" in res.note


def test_nothing_passes():
    res = search_goodput(step_probe(1e-6, []), initial_rate=1.0, min_rate=0.1)
    assert res.goodput == 0.0
    assert "min-rate" in res.note
    assert min(p.request_rate for p in res.probes) >= 0.1


def test_max_probes_caps_runs():
    calls: list[float] = []
    res = search_goodput(step_probe(13.7, calls), initial_rate=1.0, precision=1e-6, max_probes=7)
    assert len(calls) == 7 and "max-probes" in res.note
    assert res.goodput > 0


def test_noisy_pass_above_failure_is_not_the_answer():
    # 8 fails but (noise) 12 passes: the answer must stay below the lowest failing rate.
    table = {1.0: 1.0, 2.0: 1.0, 4.0: 1.0, 8.0: 0.5, 6.0: 1.0, 7.0: 0.95, 7.5: 0.95}
    res = search_goodput(lambda r: Probe(r, table.get(r, 0.0), 0, 0, 0, 0, 0, 1, 0), initial_rate=1.0,
                         precision=0.1)
    assert res.lowest_failing_rate == 8.0 and res.goodput == 7.5


def test_invalid_arguments():
    with pytest.raises(ValueError):
        search_goodput(step_probe(1, []), target=0.0)
    with pytest.raises(ValueError):
        search_goodput(step_probe(1, []), precision=0)


def test_probe_from_metrics():
    m = {"slo_attainment": 0.95, "p99_ttft_ms": 12.0, "p99_tpot_ms": 3.0, "request_throughput": 2.0,
         "request_goodput": 1.9, "output_throughput": 50.0, "completed": 10, "failed": 0}
    p = probe_from_metrics(2.0, m)
    assert (p.slo_attainment, p.p99_ttft_ms, p.request_goodput) == (0.95, 12.0, 1.9)
    with pytest.raises(ValueError):
        probe_from_metrics(2.0, {**m, "slo_attainment": None})
