"""The HTTP API against a real engine core process running a fake (model-free) executor.

Fast: no model is loaded. Requests go through FastAPI in-process (httpx ASGI
transport) → AsyncEngine → ZMQ → EngineCore(FakeExecutor) in a spawned process.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.server.fakes import CharTokenizer
from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.app import build_app
from tokenmill.server.launch import create_server_state

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "fake"


def _config(**kw) -> EngineConfig:
    base = dict(served_model_name=MODEL, num_kv_blocks=256, max_model_len=512, max_num_seqs=32,
                log_stats_interval=0.0)
    base.update(kw)
    return EngineConfig.from_kwargs(**base)


async def _start(config: EngineConfig, factory: str = "make_fake_executor"):
    import tests.server.fakes as fakes

    tok = CharTokenizer()
    engine = AsyncEngine(config, tok, executor_factory=getattr(fakes, factory), start_timeout=60)
    await asyncio.to_thread(engine.start)
    state = create_server_state(config, engine, tok, "/models/fake")
    app = build_app(state)
    await engine.start_background()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)
    return engine, state, client


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server():
    engine, state, client = await _start(_config())
    yield engine, state, client
    await client.aclose()
    engine.shutdown()


def _events(body: str) -> list:
    """Parse an SSE body into JSON objects (and the literal '[DONE]')."""
    out = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _expected(prompt: str, k: int) -> str:
    """What the fake model generates after ``prompt`` (letters cycle a→z)."""
    tok = CharTokenizer()
    last = tok.encode(prompt)[-1]
    out = []
    for _ in range(k):
        last = 3 + ((last - 3 + 1) % 26) if last >= 3 else 3
        out.append(last)
    return tok.decode(out)


async def test_completion_non_streamed(server):
    _, _, client = server
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == _expected("abc", 5) == "defgh"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_stream_joins_to_non_streamed_with_usage(server):
    _, _, client = server
    req = {"model": MODEL, "prompt": "hello", "max_tokens": 7, "temperature": 0}
    full = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    r = await client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = _events(r.text)
    assert ev[-1] == "[DONE]"
    usage_chunk = ev[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 7
    chunks = ev[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    finals = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1] and finals[0]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_role_comes_with_first_token(server):
    _, _, client = server
    req = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    full = (await client.post("/v1/chat/completions", json=req)).json()
    assert full["choices"][0]["message"]["role"] == "assistant"
    r = await client.post("/v1/chat/completions", json={**req, "stream": True})
    ev = _events(r.text)
    assert ev[-1] == "[DONE]"
    first = ev[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] != ""
    assert all("role" not in e["choices"][0]["delta"] for e in ev[1:-1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1])
    assert text == full["choices"][0]["message"]["content"]
    assert sum(e["choices"][0]["finish_reason"] is not None for e in ev[:-1]) == 1


async def test_multiple_prompts_and_n(server):
    _, _, client = server
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "xy"], "n": 2,
                                                   "max_tokens": 3, "stream": True})
    ev = _events(r.text)[:-1]
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for e in ev:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            finishes[c["index"]] = finishes.get(c["index"], 0) + (c["finish_reason"] is not None)
    assert texts == {0: "cde", 1: "cde", 2: "zab", 3: "zab"}
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 2,
                                                   "echo": True})
    assert [c["text"] for c in r.json()["choices"]] == ["cdef", "efg"]
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_stop_string_and_logprobs(server):
    _, _, client = server
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 10,
                                                   "stop": ["gh"], "logprobs": 2})
    c = r.json()["choices"][0]
    assert c["text"] == "def" and c["finish_reason"] == "stop" and c["stop_reason"] == "gh"
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["tokens"][:3] == ["d", "e", "f"] and lp["text_offset"][:3] == [0, 1, 2]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


async def test_body_that_is_not_a_json_object_says_what_to_send(server):
    """curl's -d without -H sends application/x-www-form-urlencoded: the 400 says to send JSON with its content
    type (it read "body: Input should be a valid dictionary or object to extract fields from")."""
    _, _, client = server
    good = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 2})
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        err = _error(await client.post("/v1/completions", content=good, headers={"content-type": ctype}), 400)
        assert "Content-Type: application/json" in err["message"] and ctype in err["message"], (ctype, err)
        assert err["param"] is None
    err = _error(await client.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)
    assert "empty" in err["message"], err
    err = _error(await client.post("/v1/chat/completions", json=[1, 2]), 400)
    assert "JSON object" in err["message"], err
    assert (await client.post("/v1/completions", content=good, headers={"content-type": "application/json"})
            ).status_code == 200


async def test_errors_then_normal_request(server):
    _, _, client = server
    ok = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
    cases = [
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "max_tokens": "many"}, 400, "max_tokens"),
        ({**ok, "n": 0}, 400, "n"),
        ({**ok, "top_p": 0}, 400, "top_p"),
        ({**ok, "priority": 3}, 400, "priority"),
        ({**ok, "prompt": []}, 400, "prompt"),
        ({**ok, "prompt": [999999]}, 400, "prompt"),
        ({**ok, "model": "other"}, 404, "model"),
        ({**ok, "stop": ["x"] * 257}, 400, "stop"),            # checked per token in the event loop
        ({**ok, "stop": ["y" * 40000, "z" * 40000]}, 400, "stop"),
        ({**ok, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ]
    for body, status, param in cases:
        err = _error(await client.post("/v1/completions", json=body), status)
        assert err["param"] == param, (body, err)
        assert (await client.post("/v1/completions", json=ok)).status_code == 200
    err = _error(await client.post("/v1/completions", content=b"{not json",
                                   headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    # Context limit: prompt + max_tokens beyond max_model_len (512), stated in the message.
    err = _error(await client.post("/v1/completions", json={**ok, "prompt": "a" * 500, "max_tokens": 20}), 400)
    assert "512" in err["message"] and "520" in err["message"] and "500" in err["message"]
    assert err["param"] == "max_tokens"
    # a prompt that alone fills the context names the prompt's field, with max_tokens given or not
    for extra in ({}, {"max_tokens": 5}, {"max_completion_tokens": 5}):
        err = _error(await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "a" * 600}], **extra}), 400)
        assert "512" in err["message"] and err["param"] == "messages", (extra, err)
    for extra in ({}, {"max_tokens": 5}):
        err = _error(await client.post("/v1/completions", json={**ok, "prompt": "a" * 600, **extra}), 400)
        assert "512" in err["message"] and err["param"] == "prompt", (extra, err)
    err = _error(await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    assert err["param"] == "messages"
    assert (await client.post("/v1/completions", json=ok)).status_code == 200


async def test_api_key(server):
    engine, state, _ = server
    cfg = state.config.replace(api_key="sekret")
    app = build_app(create_server_state(cfg, engine, state.tokenizer, "/models/fake"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        _error(await c.get("/v1/models"), 401)
        _error(await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        r = await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert (await c.get("/health")).status_code == 200  # not behind the key, as in vLLM


async def test_tokenize_detokenize_version_models(server):
    _, _, client = server
    r = (await client.post("/tokenize", json={"prompt": "abc"})).json()
    assert r["tokens"] == [3, 4, 5] and r["count"] == 3 and r["max_model_len"] == 512
    r = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})).json()
    assert "assistant" in CharTokenizer().decode(r["tokens"])
    assert (await client.post("/detokenize", json={"tokens": [3, 4, 5]})).json() == {"prompt": "abc"}
    assert "version" in (await client.get("/version")).json()
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512


async def test_metrics_move_and_parse(server):
    _, _, client = server

    def scrape(text: str) -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + s.labels["finished_reason"] + "}" if "finished_reason" in s.labels else "")
                out[key] = s.value
        return out

    before = scrape((await client.get("/metrics")).text)
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "abcd", "max_tokens": 4})
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "abcd", "max_tokens": 4})
    after = scrape((await client.get("/metrics")).text)
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 8
    assert after["tokenmill:prompt_tokens_total"] - before["tokenmill:prompt_tokens_total"] == 8
    assert after["tokenmill:request_success_total{length}"] - before["tokenmill:request_success_total{length}"] == 2
    assert after["tokenmill:e2e_request_latency_seconds_count"] - before["tokenmill:e2e_request_latency_seconds_count"] == 2
    assert after["tokenmill:time_to_first_token_seconds_count"] > before["tokenmill:time_to_first_token_seconds_count"]
    assert after["tokenmill:prefix_cache_hits_total"] <= after["tokenmill:prefix_cache_queries_total"]
    assert 0.0 <= after["tokenmill:kv_cache_usage_perc"] <= 1.0
    assert "tokenmill:scheduler_time_seconds_count" in after


async def test_abort_frees_the_request(server):
    engine, _, _ = server
    gen = engine.generate("abort-me", None, [3, 4, 5], SamplingParams(max_tokens=400, temperature=0))
    await gen.__anext__()
    await gen.__anext__()
    assert engine.get_stats().num_running >= 1
    await gen.aclose()
    for _ in range(100):
        await asyncio.sleep(0.02)
        s = engine.get_stats()
        if s.num_running == 0 and s.kv_cache_usage == 0.0:
            break
    s = engine.get_stats()
    assert s.num_running == 0 and s.kv_cache_usage == 0.0


async def test_core_rejection_is_a_400(server):
    engine, _, client = server
    # 256 blocks x 16 tokens fit; a prompt needing more blocks than the pool is rejected by the core.
    cfg = _config(num_kv_blocks=4, max_model_len=512)
    e2, s2, c2 = await _start(cfg)
    try:
        err = _error(await c2.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 200, "max_tokens": 2}), 400)
        assert err["message"]
        r = await c2.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 200, "max_tokens": 2,
                                                   "stream": True})
        _error(r, 400)
        assert (await c2.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})).status_code == 200
    finally:
        await c2.aclose()
        e2.shutdown()


async def test_a_burst_onto_an_idle_engine_fills_the_free_slots_before_counting_as_waiting():
    """--max-num-seqs 2 --max-num-waiting-requests 2, a burst of 8 from idle: 2 start at once and 2
    wait, so 4 are admitted (requests the core has not received yet take its free slots first)."""
    cfg = _config(max_num_seqs=2, max_num_waiting_requests=2)
    engine, state, client = await _start(cfg, "make_slow_fake_executor")
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 60}   # 3 s: none finishes during the burst
        codes = [r.status_code for r in await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(8)))]
        assert sorted(codes) == [200] * 4 + [429] * 4, codes
    finally:
        await client.aclose()
        engine.shutdown()


async def test_admission_control_429():
    cfg = _config(max_num_seqs=1, max_num_waiting_requests=1)
    engine, state, client = await _start(cfg, "make_slow_fake_executor")
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 30}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        assert engine.waiting_load()[0] == 1
        r = await client.post("/v1/completions", json=body)
        err = _error(r, 429)
        assert int(r.headers["Retry-After"]) >= 1 and "waiting" in err["message"]
        metrics = (await client.get("/metrics")).text
        assert 'tokenmill:request_refused_total{model_name="%s",reason="waiting_requests"} 1.0' % MODEL in metrics
        assert 'tokenmill:request_refused_total{model_name="%s",reason="waiting_tokens"} 0.0' % MODEL in metrics
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        assert (await client.post("/v1/completions", json={**body, "max_tokens": 2})).status_code == 200
    finally:
        await client.aclose()
        engine.shutdown()


async def test_dead_engine_gives_503():
    engine, state, client = await _start(_config(), "make_crashing_executor")
    try:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
        _error(r, 503)
        for _ in range(50):
            if not engine.is_healthy:
                break
            await asyncio.sleep(0.05)
        _error(await client.get("/health"), 503)
        _error(await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3}), 503)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("x", None, [3], SamplingParams(max_tokens=2)):
                pass
    finally:
        await client.aclose()
        engine.shutdown()


async def test_failing_model_step_is_500_and_engine_stays_up():
    engine, state, client = await _start(_config(), "make_raising_executor")
    try:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3,
                                                           "stream": stream})
            # The failure comes before the first token, so even a stream gets a plain JSON error.
            assert r.status_code == 500, r.text
            assert "simulated model failure" in r.json()["error"]["message"]
        assert engine.is_healthy
        assert (await client.get("/health")).status_code == 200
    finally:
        await client.aclose()
        engine.shutdown()


async def test_request_larger_than_admission_cap_is_400_not_429():
    cfg = _config().replace(max_num_waiting_requests=2)
    engine, state, client = await _start(cfg)
    try:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "n": 3})
        assert r.status_code == 400 and "max-num-waiting-requests" in r.json()["error"]["message"]
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2, "n": 2})
        assert ok.status_code == 200, ok.text
    finally:
        await client.aclose()
        engine.shutdown()


async def test_oversized_body_is_413_and_the_server_keeps_serving():
    engine, _, client = await _start(_config(max_request_body_bytes=4096))
    try:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 5000, "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        await client.aclose()
        engine.shutdown()


async def test_every_token_id_field_is_validated_with_id_and_range(server):
    """One check for prompt ids, stop_token_ids, logit_bias keys and /detokenize: 400 naming id and range."""
    _, state, client = server
    v = state.vocab_size
    ok = {"model": MODEL, "prompt": "abc", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("/v1/completions", {**ok, "prompt": [3, v]}, "prompt"),
             ("/v1/completions", {**ok, "prompt": [[3], [4, v + 5]]}, "prompt"),
             ("/v1/completions", {**ok, "stop_token_ids": [v], "min_tokens": 1}, "stop_token_ids"),
             ("/v1/completions", {**ok, "logit_bias": {str(v): 5}}, "logit_bias"),
             ("/v1/chat/completions", {**chat, "stop_token_ids": [v]}, "stop_token_ids"),
             ("/v1/chat/completions", {**chat, "logit_bias": {str(v + 1): -5}}, "logit_bias"),
             ("/detokenize", {"tokens": [3, v]}, "tokens")]
    for path, body, param in cases:
        err = _error(await client.post(path, json=body), 400)
        assert err["param"] == param, (body, err)
        assert f"[0, {v})" in err["message"] and str(v) in err["message"], err
    for path, body, param in [("/v1/completions", {**ok, "stop_token_ids": [-1]}, "stop_token_ids"),
                              ("/detokenize", {"tokens": [-2]}, "tokens")]:
        assert _error(await client.post(path, json=body), 400)["param"].startswith(param)
    # in range: accepted
    r = await client.post("/v1/completions", json={**ok, "stop_token_ids": [v - 1], "logit_bias": {"5": 1.0}})
    assert r.status_code == 200


async def test_openapi_schema_states_what_is_enforced(server):
    _, state, client = server
    schema = (await client.get("/openapi.json")).json()
    comps = schema["components"]["schemas"]
    cmpl = comps["CompletionRequest"]
    assert "prompt" in cmpl["required"]
    props = cmpl["properties"]

    def branch(p: dict, key: str) -> dict:
        return next(b for b in p.get("anyOf", [p]) if key in b)

    assert branch(props["n"], "minimum")["minimum"] == 1 and branch(props["n"], "maximum")["maximum"] == 128
    assert branch(props["temperature"], "minimum")["minimum"] == 0
    assert branch(props["top_p"], "exclusiveMinimum")["exclusiveMinimum"] == 0
    assert branch(props["logprobs"], "maximum")["maximum"] == 20
    ids = branch(props["stop_token_ids"], "items")["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == state.vocab_size - 1
    chat = comps["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["properties"]["messages"]["minItems"] == 1
    assert comps["ContentPart"]["properties"]["type"]["const"] == "text" or \
        comps["ContentPart"]["properties"]["type"].get("enum") == ["text"]
    post = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "429", "503"} <= set(post) and "422" not in post
    assert post["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    detok = comps["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert detok["maximum"] == state.vocab_size - 1


async def test_lone_surrogate_text_is_a_400_on_every_endpoint(server):
    """A lone UTF-16 surrogate ("\\ud800" in the JSON) cannot be tokenized (the Hugging Face tokenizer raised a
    TypeError: 500, and uvicorn dropped the keep-alive connection): 400 naming the field, and the server
    keeps serving."""
    _, _, client = server
    h = {"content-type": "application/json"}
    cases = [("/v1/chat/completions", '{"model": "fake", "messages": [{"role": "user", "content": "hi \\ud800"}],'
                                      ' "max_tokens": 1}', "messages"),
             ("/v1/completions", '{"model": "fake", "prompt": "\\udfff", "max_tokens": 1}', "prompt"),
             ("/tokenize", '{"prompt": "ab\\ud83d"}', "prompt"),
             ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages")]
    for path, body, param in cases:
        r = await client.post(path, content=body, headers=h)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == param and "unicode" in err["message"].lower(), err
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200
