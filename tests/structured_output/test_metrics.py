"""Structured-output series on /metrics, from the engine's cumulative counters."""

from __future__ import annotations

from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import EngineStats
from tokenmill.structured_output.manager import StructuredOutputStats


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:") and ("grammar" in line or "structured" in line):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_structured_output_series_advance_with_the_counters():
    st = StructuredOutputStats(requests_by_kind={"json": 3, "regex": 1}, cache_queries=4, cache_hits=2,
                               mask_fill_time=0.5, forced_draft_tokens=10, forced_accepted_tokens=7,
                               num_waiting_for_grammar=2)
    for t in (0.002, 0.3):
        st.observe_compile(t)
    p = PrometheusStatLogger("m", 1024)
    p.record(EngineStats(structured_outputs=st), None)
    st.requests_by_kind["json"] = 5
    st.cache_queries, st.num_waiting_for_grammar = 6, 0
    st.observe_compile(0.01)
    p.record(EngineStats(structured_outputs=st), None)
    p.record(EngineStats(structured_outputs=st), None)          # an unchanged snapshot adds nothing
    s = _series(p.render().decode())
    lv = '{engine="0",model_name="m"}'
    assert s['tokenmill:structured_output_requests_total{engine="0",kind="json",model_name="m"}'] == 5
    assert s['tokenmill:structured_output_requests_total{engine="0",kind="regex",model_name="m"}'] == 1
    assert s["tokenmill:grammar_compile_time_seconds_count" + lv] == 3
    assert abs(s["tokenmill:grammar_compile_time_seconds_sum" + lv] - 0.312) < 1e-9
    assert s['tokenmill:grammar_compile_time_seconds_bucket{engine="0",le="0.005",model_name="m"}'] == 1
    assert s["tokenmill:grammar_cache_queries_total" + lv] == 6 and s["tokenmill:grammar_cache_hits_total" + lv] == 2
    assert s["tokenmill:grammar_bitmask_fill_seconds_total" + lv] == 0.5
    assert s["tokenmill:grammar_forced_accepted_tokens_total" + lv] == 7
    assert s["tokenmill:num_grammar_queue_reqs" + lv] == 0


def test_no_series_before_a_constrained_request():
    p = PrometheusStatLogger("m", 1024)
    p.record(EngineStats(), None)
    assert not any(v for k, v in _series(p.render().decode()).items())
