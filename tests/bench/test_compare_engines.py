"""benchmarks/compare_engines.py: table, ratio and JSON assembly (no servers, no model)."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench.benchmark_module import load_benchmark

ce = load_benchmark("compare_engines")
hf = load_benchmark("hf_server")


def _metrics(tok_s: float, ttft: float, tpot: float, goodput: float, completed: int = 8, failed: int = 0,
             good: int = 4) -> dict:
    return {"completed": completed, "failed": failed, "duration": 10.0, "output_throughput": tok_s,
            "request_throughput": completed / 10.0, "request_goodput": goodput, "good_requests": good,
            "slo_attainment": good / (completed + failed), "total_output_tokens": int(tok_s * 10),
            "mean_ttft_ms": ttft / 2, "p99_ttft_ms": ttft, "mean_tpot_ms": tpot / 2, "p99_tpot_ms": tpot}


def test_default_num_prompts():
    assert ce.default_num_prompts(1) == 8
    assert ce.default_num_prompts(4) == 8
    assert ce.default_num_prompts(16) == 32
    assert ce.default_num_prompts(64) == 128
    assert ce.default_num_prompts(64, minimum=4, per_slot=1) == 64


def test_cell_from_metrics_counts_requests_and_copies_keys():
    c = ce.cell_from_metrics("tokenmill", "random", 4, _metrics(100.0, 500.0, 40.0, 0.8, completed=7, failed=1))
    assert (c["engine"], c["workload"], c["concurrency"]) == ("tokenmill", "random", 4)
    assert c["num_requests"] == 8 and c["completed"] == 7 and c["failed"] == 1
    assert c["output_throughput"] == 100.0 and c["p99_ttft_ms"] == 500.0 and c["p99_tpot_ms"] == 40.0
    assert c["request_goodput"] == 0.8


def test_ratio_edge_cases():
    assert ce.ratio(300.0, 100.0) == pytest.approx(3.0)
    assert ce.ratio(1.0, 0.0) == math.inf
    assert ce.ratio(0.0, 0.0) is None
    assert ce.ratio(None, 2.0) is None
    assert ce.ratio(float("nan"), 2.0) is None


def test_compute_ratios_pairs_by_workload_and_concurrency():
    cells = [ce.cell_from_metrics("tokenmill", "random", 64, _metrics(300.0, 1000.0, 50.0, 2.0)),
             ce.cell_from_metrics("transformers", "random", 64, _metrics(100.0, 4000.0, 200.0, 0.0)),
             ce.cell_from_metrics("transformers", "random", 1, _metrics(10.0, 100.0, 90.0, 0.1)),  # no partner
             ce.cell_from_metrics("tokenmill", "mt-bench", 64, _metrics(200.0, 800.0, 40.0, 1.0)),
             ce.cell_from_metrics("transformers", "mt-bench", 64,
                                  _metrics(0.0, 0.0, 0.0, 0.0, completed=0, failed=8, good=0))]
    rs = {(r["other"], r["workload"], r["concurrency"]): r for r in ce.compute_ratios(cells)}
    assert set(rs) == {("transformers", "random", 64), ("transformers", "mt-bench", 64)}
    r = rs[("transformers", "random", 64)]
    assert r["output_throughput"] == pytest.approx(3.0)
    assert r["p99_ttft_ms"] == pytest.approx(0.25)
    assert r["p99_tpot_ms"] == pytest.approx(0.25)
    assert r["request_goodput"] == math.inf
    # The other engine completed nothing: no ratios at all rather than misleading ones.
    assert all(rs[("transformers", "mt-bench", 64)][k] is None for k in ce.CELL_KEYS)


def test_format_tables_rows_and_ratio_lines():
    cells = [ce.cell_from_metrics("transformers", "random", 64, _metrics(100.0, 4000.0, 200.0, 0.0, good=0)),
             ce.cell_from_metrics("tokenmill", "random", 64, _metrics(300.0, 1000.0, 50.0, 2.0, good=8))]
    text = ce.format_tables(cells, ce.compute_ratios(cells), {"ttft": 2000.0, "tpot": 100.0})
    lines = text.splitlines()
    rows = [ln for ln in lines if ln.startswith("| tokenmill") or ln.startswith("| transformers")]
    # tokenmill first within a (workload, concurrency) group, then the ratio row.
    assert rows[0].startswith("| tokenmill") and "300.0" in rows[0] and "8/8" in rows[0]
    assert rows[1].startswith("| transformers") and "100.0" in rows[1] and "0/8" in rows[1]
    assert "3.00×" in rows[2] and "0.25" in rows[2] and "inf" in rows[2]
    assert "TTFT ≤ 2000 ms, TPOT ≤ 100 ms" in text


def test_build_report_is_json_serialisable_and_plot_writes_png(tmp_path):
    cells = [ce.cell_from_metrics(e, w, c, _metrics(100.0 * (3 if e == "tokenmill" else 1), 500.0, 50.0, 1.0))
             for e in ("tokenmill", "transformers") for w in ("random", "mt-bench") for c in (1, 4)]
    doc = ce.build_report(cells, {"model": "m.gguf", "dtype": "float32", "threads": 2,
                                  "slo_ms": {"ttft": 2000.0, "tpot": 100.0}})
    assert len(doc["ratios"]) == 4 and all(r["output_throughput"] == pytest.approx(3.0) for r in doc["ratios"])
    path = ce.save(doc, tmp_path)
    again = json.loads(path.read_text())
    assert again["cells"] == json.loads(json.dumps(cells))
    png = ce.plot_report(again, tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_args_lists_and_validation():
    a = ce.parse_args(["--concurrency", "16,1,4,4", "--engines", "tokenmill,transformers,llamacpp"])
    assert a.concurrency == [1, 4, 16]
    assert a.engine_list == ["tokenmill", "transformers", "llamacpp"]
    assert a.workload_list == ["random", "mt-bench"]
    assert a.dtype == ce.resolve_dtype_name("auto") and a.dtype in ("float32", "bfloat16")
    assert ce.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        ce.parse_args(["--engines", "vllm"])
    with pytest.raises(SystemExit):
        ce.parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):                       # nothing to run
        ce.parse_args(["--workloads="])
    a = ce.parse_args(["--workloads=", "--engines", "tokenmill", "--goodput-search", "tokenmill"])
    assert a.workload_list == [] and a.goodput_engines == ["tokenmill"]


def test_resolve_dtype_name_follows_tokenmill_auto():
    from tokenmill.model.loader import cpu_has_native_bf16

    assert ce.resolve_dtype_name("auto") == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert ce.resolve_dtype_name("float32") == "float32"


def test_transformers_endpoint_replaces_ignore_eos():
    rnd, chat = ce.WORKLOADS["random"], ce.WORKLOADS["mt-bench"]
    cfg = ce.endpoint_for("transformers", rnd, "http://x", "m", 10.0)
    body = cfg.payload("hi", 4)
    assert "ignore_eos" not in body and json.loads(body["generation_config"]) == {"eos_token_id": -1}
    assert body["temperature"] == 0.0
    assert ce.endpoint_for("tokenmill", rnd, "http://x", "m", 10.0).payload("hi", 4)["ignore_eos"] is True
    assert "generation_config" not in ce.endpoint_for("transformers", chat, "http://x", "m", 10.0).extra_body


# ------------------------------------------------------------ hf_server shim ---

def _run_asgi(app, bodies: list[bytes], ctype: bytes = b"text/event-stream") -> list[dict]:
    import asyncio

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        for b in bodies:
            await send({"type": "http.response.body", "body": b, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent: list[dict] = []

    async def send(msg):
        sent.append(msg)

    async def receive():  # pragma: no cover - not used
        return {"type": "http.disconnect"}

    asyncio.run(app(inner)({"type": "http"}, receive, send))
    return sent


def test_sse_shim_holds_role_chunk_and_appends_done():
    role = b'data: {"choices":[{"delta":{"role":"assistant"},"index":0}]}\n\n'
    tok = b'data: {"choices":[{"delta":{"content":"Hi"},"index":0}]}\n\n'
    sent = _run_asgi(hf.SSEFixMiddleware, [role, tok])
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[0] == role + tok                     # the role chunk travels with the first token
    assert b"".join(bodies).endswith(b"data: [DONE]\n\n")
    assert sent[-1]["more_body"] is False


def test_sse_shim_leaves_completions_and_json_alone():
    tok = b'data: {"choices":[{"text":" Paris","index":0}]}\n\n'
    bodies = [m["body"] for m in _run_asgi(hf.SSEFixMiddleware, [tok]) if m["type"] == "http.response.body"]
    assert bodies == [tok, b"data: [DONE]\n\n"]
    js = [m["body"] for m in _run_asgi(hf.SSEFixMiddleware, [b'{"a": 1}'], ctype=b"application/json")
          if m["type"] == "http.response.body"]
    assert js == [b'{"a": 1}', b""]


def test_transformers_cb_args_match_tokenmill_defaults():
    a = ce.parse_args(["--dtype", "float32"])
    assert ce.transformers_cb_args(a) == ["--cb-num-blocks", str(2**30 // (46080 * 256)),
                                          "--cb-max-batch-tokens", "2048"]
    b = ce.parse_args(["--dtype", "bfloat16", "--transformers-args=--cb-max-batch-tokens 512"])
    assert ce.transformers_cb_args(b) == ["--cb-num-blocks", str(2**30 // (23040 * 256))]


def test_goodput_search_args_and_table():
    a = ce.parse_args(["--engines", "tokenmill,llamacpp", "--goodput-search", "tokenmill,llamacpp"])
    assert a.goodput_engines == ["tokenmill", "llamacpp"] and a.goodput_workload == "mt-bench"
    with pytest.raises(SystemExit):                       # searched engine not benchmarked
        ce.parse_args(["--engines", "tokenmill", "--goodput-search", "llamacpp"])
    with pytest.raises(SystemExit):
        ce.parse_args(["--goodput-search", "tokenmill", "--goodput-workload", "sharegpt"])
    searches = {"tokenmill": {"workload": "mt-bench", "goodput_req_s": 1.5, "lowest_failing_rate": 1.75},
                "llamacpp": {"workload": "mt-bench", "goodput_req_s": 0.5, "lowest_failing_rate": 0.625}}
    text = ce.format_goodput(searches, 0.9, {"ttft": 2000.0, "tpot": 100.0})
    assert "≥ 90% of requests meeting TTFT ≤ 2000 ms and TPOT ≤ 100 ms" in text
    row = [ln for ln in text.splitlines() if ln.startswith("| llamacpp")][0]
    assert "0.500" in row and "0.625" in row and "3.00×" in row


def test_goodput_search_against_fake_server(tmp_path):
    """One engine's search end to end on the fake server (TTFT 50 ms, ITL 10 ms): every probe passes; the
    probes use --goodput-seed for their prompt sample and arrivals, and each probe's per-request results are saved."""
    from tokenmill.bench.datasets import build_dataset
    from tokenmill.bench.tokenizer import default_gguf_path, get_tokenizer

    from tests.bench.fake_server import FakeOpenAIServer, FakeServerConfig

    srv = FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01))
    srv.start()
    try:
        args = ce.parse_args(["--engines", "tokenmill", "--goodput-search", "tokenmill", "--output-len", "4",
                              "--goodput-min-prompts", "6", "--goodput-probe-s", "1",
                              "--goodput-initial-rate", "8", "--goodput-max-probes", "2", "--goodput-seed", "7"])
        wl = ce.WORKLOADS["random"]
        cfg = ce.endpoint_for("tokenmill", wl, srv.base_url, "fake", 30.0)
        tok = get_tokenizer(str(default_gguf_path()))

        seeds = []

        def samples_for(w, n, seed=0):
            seeds.append(seed)
            return build_dataset("random", tok, n, input_len=16, output_len=4, seed=seed)

        # SLO limits far above the fake service (TTFT 50 ms, ITL 10 ms): a starved test process (TPOT > 100 ms
        # at load 20) must not fail a test of the search logic
        # A fresh server for every probe but the first (--goodput-fresh-server): the second probe goes to it.
        srv2 = FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01))
        restarts = []

        def fresh():
            restarts.append(1)
            srv2.start()
            return ce.endpoint_for("tokenmill", wl, srv2.base_url, "fake", 30.0)

        doc = ce.goodput_search("tokenmill", cfg, wl, samples_for, tok, {"ttft": 5000.0, "tpot": 1000.0}, args,
                                raw_dir=tmp_path, fresh=fresh)
        first_peak = srv.peak_in_flight
    finally:
        srv.stop()
        srv2.stop()
    assert restarts == [1] and first_peak > 0 and srv2.peak_in_flight > 0
    assert [p["request_rate"] for p in doc["curve"]] == [8.0, 16.0]
    assert all(p["passed"] and p["slo_attainment"] == 1.0 and p["completed"] >= 6 for p in doc["curve"])
    assert doc["goodput_req_s"] == 16.0 and doc["lowest_failing_rate"] is None
    assert seeds == [7, 7] and doc["goodput_seed"] == 7
    raw = json.loads((tmp_path / "tokenmill-goodput-seed7-rate16.000.json").read_text())
    assert raw["goodput_seed"] == 7 and raw["request_rate"] == 16.0
    assert len(raw["ttfts"]) == len(raw["tpots"]) == raw["num_prompts"] >= 6
    assert ce.parse_args([]).goodput_seed == 0     # the default: the sample and arrivals of earlier searches
    assert not ce.parse_args([]).goodput_fresh_server and ce.parse_args(["--goodput-fresh-server"]).goodput_fresh_server


def test_quick_mode_defaults_and_isa_engines():
    a = ce.parse_args(["--quick"])
    assert a.concurrency == [1, 16, 64] and a.workload_list == ["random", "mt-bench"]
    assert (a.goodput_probe_s, a.goodput_min_prompts) == (30.0, 16)
    assert ce.parse_args(["--quick", "--goodput-probe-s", "60"]).goodput_probe_s == 60.0
    assert (a.min_prompts, a.prompts_per_slot, a.engine_list) == (4, 1, ["tokenmill", "llamacpp"])
    assert [ce.default_num_prompts(c, a.min_prompts, a.prompts_per_slot) for c in a.concurrency] == [4, 16, 64]
    a = ce.parse_args(["--quick", "--concurrency", "1", "--engines", "tokenmill,tokenmill@avx2"])
    assert a.concurrency == [1] and a.engine_list == ["tokenmill", "tokenmill@avx2"]
    with pytest.raises(SystemExit):
        ce.parse_args(["--engines", "tokenmill@sse9"])
    info = ce.machine_info()
    header = ce.isa_header(info)
    assert header.startswith("# CPU:") and "tokenmill kernels:" in header
    assert info.get("tokenmill_isa") in ("avx512", "avx2", "scalar")


def test_mean_tpot_is_a_cell_key_and_ratio():
    cells = [ce.cell_from_metrics("tokenmill", "random", 1, _metrics(100.0, 300.0, 20.0, 1.0)),
             ce.cell_from_metrics("llamacpp", "random", 1, _metrics(80.0, 900.0, 16.0, 1.0))]
    assert cells[0]["mean_tpot_ms"] == 10.0
    (r,) = ce.compute_ratios(cells)
    assert r["mean_tpot_ms"] == pytest.approx(1.25) and r["baseline"] == "tokenmill"
    text = ce.format_tables(cells, [r], {"ttft": 2000.0, "tpot": 100.0})
    assert "mean TPOT" in text and "10.00" in text and "1.25" in text


def test_baseline_engine_prefers_plain_tokenmill_then_a_variant():
    assert ce.baseline_engine(["llamacpp", "tokenmill@avx2", "tokenmill"]) == "tokenmill"
    assert ce.baseline_engine(["tokenmill@avx2", "llamacpp"]) == "tokenmill@avx2"
    assert ce.baseline_engine(["llamacpp"]) == "tokenmill"
    cells = [ce.cell_from_metrics("tokenmill@avx2", "random", 64, _metrics(300.0, 1000.0, 50.0, 2.0)),
             ce.cell_from_metrics("llamacpp", "random", 64, _metrics(100.0, 4000.0, 200.0, 0.5))]
    doc = ce.build_report(cells, {"engines": ["tokenmill@avx2", "llamacpp"]})
    assert doc["baseline"] == "tokenmill@avx2"
    assert [(r["other"], r["output_throughput"]) for r in doc["ratios"]] == [("llamacpp", pytest.approx(3.0))]


def test_evaluate_targets_met_missed_and_missing():
    cells = [
        # c=1 TPOT: tokenmill 12 ms mean vs llama 10 ms (1.2x slower) on random; 8 vs 10 on MT-bench
        ce.cell_from_metrics("tokenmill", "random", 1, _metrics(80.0, 300.0, 24.0, 1.0)),
        ce.cell_from_metrics("llamacpp", "random", 1, _metrics(70.0, 900.0, 20.0, 1.0)),
        ce.cell_from_metrics("tokenmill", "mt-bench", 1, _metrics(90.0, 300.0, 16.0, 1.0)),
        ce.cell_from_metrics("llamacpp", "mt-bench", 1, _metrics(70.0, 900.0, 20.0, 1.0)),
        # c=64: 300 vs 100 tok/s on random (3x of 5x), 600 vs 100 on MT-bench (6x)
        ce.cell_from_metrics("tokenmill", "random", 64, _metrics(300.0, 1000.0, 50.0, 2.0)),
        ce.cell_from_metrics("llamacpp", "random", 64, _metrics(100.0, 4000.0, 200.0, 0.5)),
        ce.cell_from_metrics("tokenmill", "mt-bench", 64, _metrics(600.0, 1000.0, 50.0, 2.0)),
        ce.cell_from_metrics("llamacpp", "mt-bench", 64, _metrics(100.0, 4000.0, 200.0, 0.5)),
    ]
    searches = {"tokenmill": {"workload": "mt-bench", "goodput_req_s": 4.0},
                "llamacpp": {"workload": "mt-bench", "goodput_req_s": 1.0}}
    rows = {r["key"]: r for r in ce.evaluate_targets(cells, searches)}
    assert set(rows) == {"tpot_c1_random", "tpot_c1_mt_bench", "tok_s_c64_random", "tok_s_c64_mt_bench",
                         "goodput_mt_bench"}
    r = rows["tpot_c1_random"]
    assert (r["value"], r["other_value"]) == (12.0, 10.0)
    assert r["ratio"] == pytest.approx(1.2) and not r["met"] and r["shortfall"] == pytest.approx(1.2)
    assert rows["tpot_c1_mt_bench"]["met"] and rows["tpot_c1_mt_bench"]["ratio"] == pytest.approx(0.8)
    r = rows["tok_s_c64_random"]
    assert not r["met"] and r["shortfall"] == pytest.approx(5.0 / 3.0)
    assert rows["tok_s_c64_mt_bench"]["met"] and rows["tok_s_c64_mt_bench"]["shortfall"] == pytest.approx(5 / 6)
    r = rows["goodput_mt_bench"]
    assert r["ratio"] == pytest.approx(4.0) and not r["met"] and r["shortfall"] == pytest.approx(1.25)
    text = ce.format_targets(list(rows.values()))
    assert "1.20×" in text and "no (1.20× short)" in text and "no (1.67× short)" in text
    # a missing partner cell, a failed cell or a search on another workload: that target is left out
    partial = ce.evaluate_targets(cells[:3] + [ce.cell_from_metrics(
        "llamacpp", "mt-bench", 1, _metrics(0.0, 0.0, 0.0, 0.0, completed=0, failed=4, good=0))],
        {"tokenmill": {"workload": "random", "goodput_req_s": 4.0}, "llamacpp": searches["llamacpp"]})
    assert [r["key"] for r in partial] == ["tpot_c1_random"]
    assert ce.format_targets([]).startswith("Targets: none")
    # a ratio equal to the goal up to floating-point rounding is met: the search's bisection gave llama-server
    # 0.35000000000000003 req/s, and 1.75 over it is 4.999999999999999
    (g,) = ce.evaluate_targets([], {"tokenmill": {"workload": "mt-bench", "goodput_req_s": 1.75},
                                    "llamacpp": {"workload": "mt-bench", "goodput_req_s": 0.35000000000000003}})
    assert g["ratio"] < 5.0 and g["met"]
    (g,) = ce.evaluate_targets([], {"tokenmill": {"workload": "mt-bench", "goodput_req_s": 1.74},
                                    "llamacpp": {"workload": "mt-bench", "goodput_req_s": 0.35}})
    assert not g["met"]


def test_llama_server_version_reads_version_lines(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'load_backend: x' >&2\necho 'version: 1 (0c1e570)' >&2\n"
                    "echo 'built with cc for x86_64' >&2\n")
    fake.chmod(0o755)
    assert ce.llama_server_version(fake) == "version: 1 (0c1e570); built with cc for x86_64"
    assert ce.llama_server_version(tmp_path / "missing") is None
    assert ce.llama_server_version(None) is None


def test_merge_reports_joins_cells_and_searches_later_wins():
    a = {"date": "d1", "engines": ["tokenmill", "llamacpp"], "dtype": "float32",
         "cells": [ce.cell_from_metrics("tokenmill", "random", 64, _metrics(300.0, 1000.0, 50.0, 2.0)),
                   ce.cell_from_metrics("llamacpp", "random", 64, _metrics(100.0, 4000.0, 200.0, 0.5))],
         "goodput_search": {}, "ratios": ["stale"]}
    b = {"date": "d2", "engines": ["tokenmill"], "cells": [], "goodput_search": {
        "tokenmill": {"workload": "mt-bench", "goodput_req_s": 4.0}}}
    c = {"date": "d3", "engines": ["llamacpp"], "goodput_search": {
        "llamacpp": {"workload": "mt-bench", "goodput_req_s": 0.8}},
         "cells": [ce.cell_from_metrics("llamacpp", "random", 64, _metrics(150.0, 4000.0, 200.0, 0.5))]}
    m = ce.merge_reports([a, b, c])
    assert m["engines"] == ["tokenmill", "llamacpp"] and m["dtype"] == "float32" and "ratios" not in m
    assert sorted(m["goodput_search"]) == ["llamacpp", "tokenmill"]
    assert [x["date"] for x in m["merged_from"]] == ["d1", "d2", "d3"]
    llama = [x for x in m["cells"] if x["engine"] == "llamacpp"]
    assert len(llama) == 1 and llama[0]["output_throughput"] == 150.0      # the later run's cell
    rows = {r["key"]: r for r in ce.evaluate_targets(m["cells"], m["goodput_search"])}
    assert rows["goodput_mt_bench"]["ratio"] == pytest.approx(5.0) and rows["goodput_mt_bench"]["met"]
    assert rows["tok_s_c64_random"]["ratio"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        ce.merge_reports([])
