"""benchmarks/serve_c64_profile.py: summing an engine-core step trace (no server, no model)."""

from __future__ import annotations

import pytest

from tests.bench.benchmark_module import load_benchmark

prof = load_benchmark("serve_c64_profile")


def _row(loop, start, end, sent, decode, prefill, preemptions=0, **parts):
    return {"loop": loop, "start": start, "end": end, "sent": sent, "decode": decode, "prefill": prefill,
            "running": decode + (1 if prefill else 0), "waiting": 0, "preemptions": preemptions,
            "schedule": parts.get("schedule", 0.0), **{k: v for k, v in parts.items() if k != "schedule"}}


def test_summarise_trace_splits_steps_by_kind_and_books_the_loop_outside_them():
    rows = [
        _row(0.0, 0.0, 1.0, 1.0, 0, 0),                                 # before the window: left out
        _row(10.0, 10.0, 10.3, 10.31, 0, 256, schedule=0.01, forward=0.28),
        _row(10.31, 10.32, 11.92, 11.94, 1, 2047, schedule=0.01, forward=1.5, sample=0.05),
        _row(11.94, 11.95, 12.05, 12.06, 64, 0, preemptions=1, schedule=0.002, forward=0.08, sample=0.015),
        _row(12.06, 12.07, 12.17, 12.19, 62, 0, preemptions=3, schedule=0.002, forward=0.08, sample=0.015),
    ]
    s = prof.summarise_trace(rows, 5.0, 20.0)
    assert s["steps"] == 4
    assert s["kinds"]["prefill_only"]["n"] == 1 and s["kinds"]["prefill_only"]["s"] == pytest.approx(0.3)
    assert s["kinds"]["mixed"]["n"] == 1 and s["kinds"]["mixed"]["s"] == pytest.approx(1.6)
    assert s["kinds"]["decode_only"]["n"] == 2 and s["kinds"]["decode_only"]["mean_ms"] == pytest.approx(100.0)
    assert s["steps_s"] == pytest.approx(2.1)
    assert s["parts_s"]["send"] == pytest.approx(0.01 + 0.02 + 0.01 + 0.02)
    assert s["parts_s"]["outside"] == pytest.approx(0.01 + 0.01 + 0.01)     # send -> next step start
    assert s["parts_s"]["forward"] == pytest.approx(1.94)
    assert s["decode_only_batch"] == {"max": 64, "median": 63.0, "mean": 63.0}
    assert (s["prefill_tokens"], s["decode_tokens"], s["preemptions"]) == (2303, 127, 3)
    assert s["mixed_prefill_tokens_mean"] == 2047
    assert s["window_s"] == pytest.approx(12.19 - 10.0)


def test_summarise_trace_of_an_empty_window_is_empty():
    assert prof.summarise_trace([_row(0.0, 0.0, 1.0, 1.0, 1, 0)], 5.0, 6.0) == {}
