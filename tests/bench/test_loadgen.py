"""The load generator end to end against the fake OpenAI-compatible server."""

from __future__ import annotations

from collections import Counter

import pytest

from tokenmill.bench.client import EndpointConfig
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.loadgen import LoadConfig, fetch_models, run_benchmark
from tokenmill.bench.report import failure_breakdown


def samples(n: int, max_tokens: int = 6) -> list[SampleRequest]:
    return [SampleRequest(f"prompt number {i} with some words", 6, max_tokens) for i in range(n)]


def endpoint(srv, kind: str = "completions", **kw) -> EndpointConfig:
    return EndpointConfig(base_url=srv.base_url, endpoint=kind, model=srv.config.model, **kw)


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_exact_accounting_with_injected_failures(fake_server, kind):
    srv = fake_server(ttft_s=0.01, itl_s=0.002, status_429_every=4, break_every=5, no_done_every=7)
    res = await run_benchmark(samples(30), endpoint(srv, kind), LoadConfig(disable_tqdm=True))
    m = res.metrics
    served = Counter(r.outcome for r in srv.requests)
    # requests 4,8,...,28 -> 429 (7); 5,10,15,25,30 -> cut (20 is a 429); 7,14,21 -> no [DONE] (28 is a 429)
    assert served == {"ok": 15, "429": 7, "broken": 5, "no_done": 3}
    assert len(res.records) == 30 == m.completed + m.failed
    assert m.completed == 15 and m.failed == 15
    kinds = failure_breakdown(res.records)
    assert kinds == {"HTTP 429": 7, "broken stream": 8}
    assert sum(r.status == 429 for r in res.records) == 7
    # token counts come from the server's usage
    ok_served = [r for r in srv.requests if r.outcome == "ok"]
    assert m.total_output == sum(r.completion_tokens for r in ok_served) == 15 * 6
    assert m.total_input == sum(r.prompt_tokens for r in ok_served)
    assert all(r.usage_reported for r in res.records if r.success)


async def test_timings_match_server_delays(fake_server):
    srv = fake_server(ttft_s=0.05, itl_s=0.02)
    res = await run_benchmark(samples(4, max_tokens=5), endpoint(srv), LoadConfig(disable_tqdm=True))
    m = res.metrics
    assert m.completed == 4
    assert 48 <= m.stats["ttft"]["median"] <= 90
    assert 19 <= m.stats["itl"]["median"] <= 35
    assert 19 <= m.stats["tpot"]["median"] <= 35
    for r in res.records:
        assert len(r.itl) == 4 and r.output_tokens == 5
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
        assert r.tpot == pytest.approx((r.latency - r.ttft) / 4)


async def test_multi_token_chunks_count_usage_not_chunks(fake_server):
    srv = fake_server(ttft_s=0.0, itl_s=0.001, tokens_per_chunk=3)
    res = await run_benchmark(samples(3, max_tokens=10), endpoint(srv), LoadConfig(disable_tqdm=True))
    for r in res.records:
        assert r.output_tokens == 10 and len(r.itl) == 3     # 4 chunks: 3+3+3+1 tokens


async def test_missing_usage_falls_back_to_tokenizer(fake_server, tokenizer):
    srv = fake_server(ttft_s=0.0, itl_s=0.0, send_usage=False)
    res = await run_benchmark(samples(2, max_tokens=4), endpoint(srv), LoadConfig(disable_tqdm=True),
                              tokenizer=tokenizer)
    for r in res.records:
        assert r.success and not r.usage_reported
        assert r.output_tokens == len(tokenizer.encode(r.generated_text, add_special_tokens=False))


async def test_max_concurrency_is_respected(fake_server):
    srv = fake_server(ttft_s=0.02, itl_s=0.005)
    res = await run_benchmark(samples(12), endpoint(srv), LoadConfig(max_concurrency=3, disable_tqdm=True))
    assert res.metrics.completed == 12
    assert srv.peak_in_flight == 3
    assert res.metrics.max_concurrent_requests == 3


async def test_request_rate_spreads_arrivals(fake_server):
    srv = fake_server(ttft_s=0.0, itl_s=0.0)
    res = await run_benchmark(samples(10, max_tokens=1), endpoint(srv),
                              LoadConfig(request_rate=25.0, disable_tqdm=True, seed=1))
    starts = sorted(r.start_time - res.t0 for r in res.records)
    assert starts[-1] == pytest.approx(10 / 25.0, abs=0.05)   # last arrival at num/rate
    assert res.duration_s >= 0.4


async def test_ignore_eos_is_forwarded(fake_server):
    srv = fake_server(ttft_s=0.0, itl_s=0.0, eos_after=2)
    stop = await run_benchmark(samples(2, max_tokens=8), endpoint(srv), LoadConfig(disable_tqdm=True))
    full = await run_benchmark(samples(2, max_tokens=8), endpoint(srv, ignore_eos=True),
                               LoadConfig(disable_tqdm=True))
    assert stop.metrics.total_output == 4 and full.metrics.total_output == 16
    assert srv.requests[-1].body["ignore_eos"] is True


async def test_multi_turn_resends_history_with_answer(fake_server, tokenizer):
    srv = fake_server(ttft_s=0.0, itl_s=0.0)
    conv = [SampleRequest([{"role": "user", "content": "first question"}], 10, 3, ("second question",))]
    res = await run_benchmark(conv, endpoint(srv, "chat"), LoadConfig(disable_tqdm=True), tokenizer)
    assert [r.turn for r in res.records] == [0, 1] and all(r.success for r in res.records)
    msgs = srv.requests[1].body["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[1]["content"] == res.records[0].generated_text == " t0 t1 t2"
    assert msgs[2]["content"] == "second question"
    # completions endpoint: the conversation is rendered with the chat template
    res = await run_benchmark(conv, endpoint(srv, "completions"), LoadConfig(disable_tqdm=True), tokenizer)
    prompt = srv.requests[-1].body["prompt"]
    assert "first question" in prompt and " t0 t1 t2" in prompt and prompt.rstrip().endswith("assistant")


async def test_follow_up_after_failed_turn_is_counted_failed(fake_server, tokenizer):
    srv = fake_server(ttft_s=0.0, itl_s=0.0, status_429_every=1)
    conv = [SampleRequest([{"role": "user", "content": "q"}], 3, 3, ("q2", "q3"))]
    res = await run_benchmark(conv, endpoint(srv, "chat"), LoadConfig(disable_tqdm=True), tokenizer)
    assert len(res.records) == 3 and res.metrics.failed == 3
    assert len(srv.requests) == 1
    assert res.records[1].error.startswith("skipped")


async def test_unreachable_server_counts_failures():
    cfg = EndpointConfig(base_url="http://127.0.0.1:9", model="x", timeout_s=5)
    res = await run_benchmark(samples(3), cfg, LoadConfig(disable_tqdm=True))
    assert res.metrics.failed == 3
    assert all(r.error.startswith("connection error") for r in res.records)


async def test_fetch_models(fake_server):
    srv = fake_server()
    assert await fetch_models(srv.base_url) == ["fake-model"]
    with pytest.raises(RuntimeError):
        await fetch_models("http://127.0.0.1:9", timeout_s=2)


async def test_warmups_are_not_counted(fake_server):
    srv = fake_server(ttft_s=0.0, itl_s=0.0)
    res = await run_benchmark(samples(3), endpoint(srv), LoadConfig(num_warmups=2, disable_tqdm=True))
    assert len(srv.requests) == 5 and len(res.records) == 3
