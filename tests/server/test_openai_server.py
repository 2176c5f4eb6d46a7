"""End-to-end: a real ``tokenmill.server`` process with the packaged SmolLM2 model, driven by the
official ``openai`` client and raw HTTP.

One server per module (started by the fixture on a free port); small max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_proc import ServerProc, start_server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server() -> ServerProc:
    # float32 throughout, KV cache included: these tests compare runs of one prompt whose steps differ (a prefix-cache
    # hit, a batch of 16), which float32 keeps equal; --kv-cache-dtype auto would pick bfloat16 for this float32
    # model on the CPU low-bit path, and rounding K/V to 8 mantissa bits turns the paths' last-digit differences
    # into logprob differences in the 4th digit (its own bound: tests/model/test_kv_cache_bf16_default.py)
    sp = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB",
                      "--max-num-seqs", "32", "--dtype", "float32", "--kv-cache-dtype", "float32")
    yield sp
    sp.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def model(server: ServerProc) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(server: ServerProc) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in fam.samples:
            extra = s.labels.get("finished_reason") or s.labels.get("le")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def test_openai_client_sync(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    text = r.choices[0].text
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == text

    msgs = [{"role": "user", "content": "Name a fruit."}]
    c = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10, temperature=0)
    content = c.choices[0].message.content
    assert content and c.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == content
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks[:-1]) == 1


def test_openai_client_async(server: ServerProc, model: str) -> None:
    async def main() -> None:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = await ac.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6, temperature=0)
        s = await ac.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6, temperature=0, stream=True)
        assert "".join([c.choices[0].text async for c in s]) == r.choices[0].text
        msgs = [{"role": "user", "content": "Say hello."}]
        c = await ac.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=2)
        assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in c.choices[0].logprobs.content)
        s = await ac.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True)
        assert "".join([ch.choices[0].delta.content or "" async for ch in s]) == c.choices[0].message.content
        await ac.close()

    asyncio.run(main())


PROMPTS16 = [f"Write one sentence about the number {i}." for i in range(8)] + [
    "List three animals:", "The opposite of hot is", "Translate 'good morning' to Spanish:", "2 + 2 =",
    "The largest planet is", "A haiku about rain:", "def add(a, b):", "Once upon a time"]


def test_16_concurrent_streams_equal_solo(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    solo = [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS16]

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        s = await ac.completions.create(model=model, prompt=p, max_tokens=12, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in s])

    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(ac, p) for p in PROMPTS16))
        finally:
            await ac.close()

    assert asyncio.run(main()) == solo


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(e)
    return e


def test_error_statuses_then_success(server: ServerProc, model: str) -> None:
    url = server.url + "/v1/completions"
    ok = {"model": model, "prompt": "Hi", "max_tokens": 2}

    def good() -> None:
        r = httpx.post(url, json=ok, timeout=60)
        assert r.status_code == 200, r.text

    _err(httpx.post(url, json={**ok, "temperature": -1}), 400)
    good()
    _err(httpx.post(url, content=b"{oops", headers={"content-type": "application/json"}), 400)
    good()
    _err(httpx.post(url, json={**ok, "max_tokens": "lots"}), 400)
    good()
    e = _err(httpx.post(url, json={**ok, "max_tokens": MAX_MODEL_LEN}), 400)
    assert str(MAX_MODEL_LEN) in e["message"] and str(MAX_MODEL_LEN + 1) in e["message"]
    good()
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    e = _err(httpx.post(server.url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": long_prompt}]}), 400)
    assert str(MAX_MODEL_LEN) in e["message"]
    good()
    _err(httpx.post(url, json={**ok, "model": "no-such-model"}), 404)
    good()
    _err(httpx.post(url, json={**ok, "priority": 5}), 400)  # fcfs server
    good()


def test_disconnect_mid_stream_frees_everything(server: ServerProc, model: str) -> None:
    idle = _metrics(server)
    body = {"model": model, "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            n = 0
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    n += 1
                if n >= 3:
                    # Scrape while still connected (leaving the loop closes the connection).
                    mid = _metrics(server)
                    break
            assert mid["tokenmill:num_requests_running"] == 1
            assert mid["tokenmill:kv_cache_usage_perc"] > idle["tokenmill:kv_cache_usage_perc"]
            lines.close()  # disconnect mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(server)
        if (m["tokenmill:num_requests_running"] == idle["tokenmill:num_requests_running"]
                and m["tokenmill:kv_cache_usage_perc"] == idle["tokenmill:kv_cache_usage_perc"]):
            break
        time.sleep(0.1)
    assert m["tokenmill:num_requests_running"] == idle["tokenmill:num_requests_running"] == 0
    assert m["tokenmill:kv_cache_usage_perc"] == idle["tokenmill:kv_cache_usage_perc"]
    assert m["tokenmill:request_success_total{abort}"] == idle["tokenmill:request_success_total{abort}"] + 1
    # Generation stopped: far fewer than 400 tokens were produced.
    assert m["tokenmill:generation_tokens_total"] - idle["tokenmill:generation_tokens_total"] < 100


def test_metrics_move_with_requests(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    before = _metrics(server)
    prompt = "Paged attention splits the KV cache into blocks. " * 6
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    after = _metrics(server)
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 8
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    assert after["tokenmill:request_success_total{length}"] - before["tokenmill:request_success_total{length}"] == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert after[f"tokenmill:{h}_count"] - before[f"tokenmill:{h}_count"] >= 2, h
    assert after["tokenmill:inter_token_latency_seconds_count"] > before["tokenmill:inter_token_latency_seconds_count"]
    assert after["tokenmill:prefix_cache_hits_total"] > before["tokenmill:prefix_cache_hits_total"]
    assert after["tokenmill:prefix_cache_hits_total"] <= after["tokenmill:prefix_cache_queries_total"]
    assert 0.0 <= after["tokenmill:kv_cache_usage_perc"] <= 1.0
    assert after["tokenmill:num_requests_waiting"] == 0
    assert "tokenmill:num_preemptions_total" in after and "tokenmill:scheduler_time_seconds_count" in after


UNICODE_PROMPTS = ["Reply with three emoji about the sea: 🌊", "Write the Japanese word for cat (猫) and a cat emoji.",
                   "用中文写一句关于月亮的话。", "Say 'héllo wörld' and add 😀."]


def test_stream_equals_non_stream_for_emoji_and_cjk(server: ServerProc, client: openai.OpenAI, model: str) -> None:
    for p in UNICODE_PROMPTS:
        msgs = [{"role": "user", "content": p}]
        full = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
        text = full.choices[0].message.content
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
                "model": model, "messages": msgs, "max_tokens": 24, "temperature": 0, "stream": True}) as r:
            raw = b"".join(r.iter_bytes())
        pieces = []
        for block in raw.decode("utf-8").split("\n\n"):
            if block.startswith("data: ") and block != "data: [DONE]":
                ch = json.loads(block[6:])
                pieces.append(ch["choices"][0]["delta"].get("content") or "")
        assert "".join(pieces) == text, p
        # No replacement characters from split UTF-8 sequences inside the streamed text.
        body = "".join(pieces)
        assert "\ufffd" not in (body[:-1] if full.choices[0].finish_reason == "length" else body), p
        assert all("\ufffd" not in x for x in pieces[:-1]), p


def test_tokenize_detokenize_health_version(server: ServerProc, model: str) -> None:
    t = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == MAX_MODEL_LEN
    d = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, model: str, server: ServerProc) -> None:
    """lm-eval style loglikelihood: echo + max_tokens 0 + logprobs returns the prompt with each
    token's logprob (the first None) and nothing generated; the same values come back with
    generation, in vLLM's prompt_logprobs field, in a stream, and for chat."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(lp.tokens) == r.usage.prompt_tokens and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scores = lp.token_logprobs[1:]
    assert all(isinstance(x, float) and x <= 0 for x in scores)
    assert scores[-1] > -5          # "Paris" after "The capital of France is" is likely
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])

    r2 = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0,
                                   extra_body={"ignore_eos": True})
    lp2 = r2.choices[0].logprobs
    n = r.usage.prompt_tokens
    assert len(lp2.tokens) == n + 3 and r2.usage.completion_tokens == 3
    assert lp2.token_logprobs[:n][0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp2.token_logprobs[1:n], scores))
    assert all(x is not None for x in lp2.token_logprobs[n:])

    raw = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"]
    assert plp[0] is None and len(plp) == len(ids)
    for t in range(1, len(ids)):
        entry = plp[t][str(ids[t])]
        assert abs(entry["logprob"] - scores[t - 1]) < 1e-4 and entry["rank"] >= 1 and entry["decoded_token"]
        assert len(plp[t]) in (2, 3)   # the two top tokens, plus the prompt token when not among them

    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(first.token_logprobs[1:n], scores))

    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]

    bad = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    bad = httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_top_logprobs_are_raw_and_do_not_change_with_temperature(client: openai.OpenAI, model: str) -> None:
    """vLLM's default --logprobs-mode raw_logprobs: the model's distribution, whatever the temperature."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    tops = []
    for t in (0.0, 0.2, 1.0):
        c = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=1, temperature=t,
                                           logprobs=True, top_logprobs=3, seed=1)
        tops.append([(e.token, round(e.logprob, 3)) for e in c.choices[0].logprobs.content[0].top_logprobs])
    assert tops[0] == tops[1] == tops[2], tops
    assert tops[0][0][1] > -5 and tops[0][1][1] < tops[0][0][1]   # a real distribution, not a sharpened one


def test_sigint_shuts_down_promptly_and_leaves_no_child(server: ServerProc, model: str) -> None:
    """Runs last: Ctrl-C with a stream open ends the stream and both processes within seconds."""
    kids = server.children()
    assert kids, "engine core process not found"
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json={
                "model": model, "prompt": "Count forever:", "max_tokens": 500, "ignore_eos": True,
                "stream": True}) as r:
            it = r.iter_lines()
            next(it)
            took = server.stop(signal.SIGINT, timeout=20)
            rest = list(it)
    assert took < 15, server.log_tail()
    assert server.proc.returncode is not None
    assert rest == [] or rest[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in rest
    for k in kids:
        assert not k.is_running() or k.status() == "zombie"
