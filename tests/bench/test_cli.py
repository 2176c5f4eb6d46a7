"""``bench serve`` and ``bench goodput`` through the CLI, against the fake server."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tokenmill.bench import cli
from tokenmill.bench.tokenizer import default_gguf_path


def test_add_bench_subparsers_and_vllm_aliases():
    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers(dest="command")
    cli.add_bench_subparsers(sub)
    args = parser.parse_args(["bench", "serve", "--dataset-name", "prefix-repetition", "--random-input-len", "7",
                              "--percentiles", "50,99.9", "--goodput", "ttft:5", "tpot:1", "--backend",
                              "openai-chat", "--save-result"])
    assert args.func is cli.run_serve
    assert args.dataset == "prefix-repetition" and args.input_len == 7
    assert args.metric_percentiles == [50.0, 99.9] and args.goodput == ["ttft:5", "tpot:1"]
    assert args.save_result == "" and math.isinf(args.request_rate)
    g = parser.parse_args(["bench", "goodput", "--goodput", "ttft:100"])
    assert g.func is cli.run_goodput and g.attainment == 0.9 and g.num_prompts == 100
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--percentile-metrics", "ttft,bogus"])


def test_serve_end_to_end(fake_server, tmp_path, capsys):
    srv = fake_server(ttft_s=0.01, itl_s=0.002, status_429_every=5)
    out = tmp_path / "res.json"
    png = tmp_path / "res.png"
    rc = cli.main(["serve", "--base-url", srv.base_url, "--tokenizer", str(default_gguf_path()),
                   "--num-prompts", "10", "--input-len", "24", "--output-len", "5", "--ignore-eos",
                   "--request-rate", "100", "--goodput", "ttft:1000", "tpot:1000", "--save-result", str(out),
                   "--plot", str(png), "--disable-tqdm", "--metadata", "run=ci"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "HTTP 429:" in text and "P99 TTFT (ms):" in text
    assert "Request goodput (req/s):" in text and "Peak concurrent requests:" in text
    d = json.loads(out.read_text())
    assert d["completed"] == 8 and d["failed"] == 2 and d["num_prompts"] == 10
    assert d["model_id"] == "fake-model" and d["endpoint_type"] == "openai" and d["run"] == "ci"
    assert d["total_output_tokens"] == 8 * 5
    assert d["slo_attainment"] == pytest.approx(0.8)
    assert d["request_goodput"] == pytest.approx(8 / d["duration"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "p99_ttft_ms",
                "p90_tpot_ms", "median_itl_ms", "mean_e2el_ms", "max_concurrent_requests", "ttfts",
                "itls", "output_lens", "input_lens", "errors", "e2els", "start_times", "request_rate"):
        assert key in d, key
    assert len(d["ttfts"]) == 10 and d["failure_breakdown"] == {"HTTP 429": 2}
    assert all(b["ignore_eos"] is True for b in (r.body for r in srv.requests))
    assert png.stat().st_size > 10_000


def test_serve_chat_mt_bench_multi_turn(fake_server, tmp_path):
    srv = fake_server(ttft_s=0.0, itl_s=0.0)
    out = tmp_path / "r.json"
    rc = cli.main(["serve", "--base-url", srv.base_url, "--endpoint", "chat", "--dataset", "mt-bench",
                   "--multi-turn", "--num-prompts", "6", "--output-len", "3", "--disable-tqdm",
                   "--tokenizer", str(default_gguf_path()), "--save-result", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["completed"] == 6 and d["turns"] == [0, 1, 0, 1, 0, 1]
    assert d["endpoint_type"] == "openai-chat"
    assert [len(r.body["messages"]) for r in srv.requests].count(3) == 3


def test_serve_bad_arguments_return_2(fake_server, capsys):
    srv = fake_server()
    assert cli.main(["serve", "--base-url", srv.base_url, "--goodput", "itl:5"]) == 2
    assert cli.main(["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert cli.main(["goodput", "--base-url", srv.base_url]) == 2
    assert "error:" in capsys.readouterr().err


def test_goodput_search_end_to_end(fake_server, tmp_path, capsys):
    # One generation slot: 4 tokens take ~50 ms (capacity ~20 req/s); 16 near-regular arrivals at 64 req/s
    # queue ~0.5 s behind one another, so the p90 TTFT passes 300 ms somewhere between 16 and 64 req/s.
    # 300 ms leaves a loaded 2-core machine's HTTP/tokenizer overhead room at the low rates (a 30 ms SLO
    # failed every rate at load 18); if 8 req/s still misses, the search halves, hence the lower bound 2.
    srv = fake_server(ttft_s=0.02, itl_s=0.01, max_num_seqs=1)
    out = tmp_path / "g.json"
    png = tmp_path / "g.png"
    rc = cli.main(["goodput", "--base-url", srv.base_url, "--tokenizer", str(default_gguf_path()),
                   "--num-prompts", "16", "--input-len", "8", "--output-len", "4", "--ignore-eos",
                   "--goodput", "ttft:300", "--initial-rate", "8", "--burstiness", "100", "--precision", "0.25",
                   "--max-probes", "8", "--disable-tqdm", "--save-result", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Goodput:" in text
    d = json.loads(out.read_text())
    curve = d["curve"]
    assert 3 <= len(curve) <= 8 and len(d["probes"]) == len(curve)
    assert all(c["completed"] + c["failed"] == 16 for c in curve)
    assert 2 <= d["goodput_request_rate"] < 64
    passing = [c for c in curve if c["passed"]]
    assert max(c["request_rate"] for c in passing) == d["goodput_request_rate"]
    assert d["goodput_config"] == {"ttft": 300.0} and d["target_attainment"] == 0.9
    assert png.stat().st_size > 10_000
