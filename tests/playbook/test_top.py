"""tokenmill top against a live server."""

from __future__ import annotations

import math
import subprocess
import sys

import httpx

from tokenmill.playbook.top import compute_view, histogram_quantile, parse_metrics, render


def test_histogram_quantile_matches_promql_interpolation():
    b = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, b) == 0.1          # rank 10: top of the first bucket
    assert abs(histogram_quantile(0.5, b) - 0.3) < 1e-12  # rank 20: halfway through (0.1, 0.5]
    assert abs(histogram_quantile(0.99, b) - (0.5 + 0.5 * (39.6 - 30) / 10)) < 1e-12
    assert histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 5.0)]) == 0.1  # +Inf bucket: highest finite bound
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))


def test_view_moves_with_traffic(live_server):
    before = parse_metrics(httpx.get(live_server.url + "/metrics").text, now=0.0)
    for _ in range(3):
        live_server.complete("abcdefghij", 5)
    after = parse_metrics(httpx.get(live_server.url + "/metrics").text, now=2.0)
    v = compute_view(after, before)
    assert v["generation_tok_per_s"] == 15 / 2.0
    assert v["prompt_tok_per_s"] == 30 / 2.0
    assert v["requests_per_s"] == 3 / 2.0
    assert v["e2e_count"] == 3 and v["ttft_count"] == 3
    assert 0 < v["p50_ttft_ms"] <= v["p99_ttft_ms"] < 60_000
    assert 0 <= v["prefix_hit_rate"] <= 1
    assert after.models == {"fake"}
    screen = render(v, live_server.url, after.models)
    assert "TTFT" in screen and "KV cache" in screen and "7.5 tok/s" in screen


def test_cli_prints_screens_and_fails_without_server(live_server):
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "top", "--url", live_server.url, "-n", "2",
                          "--interval", "0.2", "--no-clear"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tokenmill top") == 2 and "p99 ms" in out.stdout
    dead = subprocess.run([sys.executable, "-m", "tokenmill.cli", "top", "--url", "http://127.0.0.1:9", "-n", "1"],
                          capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "no metrics" in dead.stdout


def test_spec_decode_acceptance_shown_when_drafting():
    text = """# TYPE tokenmill:num_requests_running gauge
tokenmill:num_requests_running{model_name="m"} 2.0
# TYPE tokenmill:spec_decode_num_draft_tokens_total counter
tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
# TYPE tokenmill:spec_decode_num_accepted_tokens_total counter
tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0
"""
    v = compute_view(parse_metrics(text, now=0.0), None)
    assert v["spec_acceptance"] == 0.75 and v["running"] == 2
    assert "draft acceptance 75.0%" in render(v, "http://x")
    assert "draft acceptance" not in render(compute_view(parse_metrics(text.replace("40.0", "0.0"), 0.0), None), "x")
