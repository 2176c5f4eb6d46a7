"""benchmarks/crosscheck_bench.py: comparison logic and missing-guidellm handling
(the full guidellm run takes ~30 s, so it is run by hand; see docs/benchmarks/crosscheck.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "crosscheck_bench.py"


@pytest.fixture(scope="module")
def xc():
    spec = importlib.util.spec_from_file_location("crosscheck_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def figures(scale: float = 1.0) -> dict[str, float]:
    return {"ttft_mean_ms": 50 * scale, "ttft_median_ms": 49 * scale, "itl_mean_ms": 10 * scale,
            "output_throughput": 300 * scale, "request_throughput": 9 * scale}


def test_compare_within_and_beyond_tolerance(xc):
    rows, ok = xc.compare(figures(1.05), figures(), 0.10)
    assert ok and all(r["rel_diff"] == pytest.approx(0.05) for r in rows)
    rows, ok = xc.compare(figures(1.2), figures(), 0.10)
    assert not ok and not any(r["ok"] for r in rows)
    md = xc.markdown(rows, "header")
    assert md.startswith("header") and "| TTFT mean (ms) | 60.00 | 50.00 | 20.0% ✗ |" in md


def test_missing_guidellm_exits_2(xc, tmp_path):
    assert xc.main(["--guidellm", str(tmp_path / "nope"), "--fake-server"]) == 2


def test_mean_runs_averages_figures_and_sums_counts(xc):
    a = {**figures(1.0), "completed": 8, "failed": 0, "total_output_tokens": 100.0}
    b = {**figures(1.2), "completed": 7, "failed": 1, "total_output_tokens": 90.0}
    m = xc.mean_runs([a, b])
    assert m["ttft_mean_ms"] == pytest.approx(55.0) and m["output_throughput"] == pytest.approx(330.0)
    assert m["completed"] == 15 and m["failed"] == 1 and m["total_output_tokens"] == 190.0
