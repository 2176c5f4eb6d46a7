"""End to end: two real ``tokenmill serve`` replicas publishing KV events behind the kv_aware router."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.router.fake_backend import RouterThread
from tokenmill.router.app import RouterConfig
from tokenmill.router.local import LocalReplica
from tokenmill.router.prompt import PromptTokenizer

pytestmark = pytest.mark.slow


def _replicas(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    reps = [LocalReplica(["--num-kv-blocks", "64", "--max-model-len", "1024", "--max-num-seqs", "8"],
                         log_path=str(logs / f"r{i}.log")) for i in range(2)]
    try:
        for r in reps:
            r.start()
        for r in reps:
            r.wait_healthy(300)
        yield reps
    finally:
        for r in reps:
            r.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    yield from _replicas(tmp_path_factory)


@pytest.fixture(scope="module")
def prompt_tokenizer():
    return PromptTokenizer.load(None)


def _complete(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": _model(url), "prompt": prompt, "max_tokens": 2,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


_MODELS: dict[str, str] = {}


def _model(url: str) -> str:
    if url not in _MODELS:
        _MODELS[url] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return _MODELS[url]


def test_router_tokenizes_like_the_server(replicas, prompt_tokenizer):
    url = replicas[0].url
    text = "The quick brown fox jumps over the lazy dog. " * 3
    srv = httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]
    assert prompt_tokenizer.token_ids("/v1/completions", {"prompt": text}) == srv
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    srv = httpx.post(url + "/tokenize", json={"messages": msgs, "add_generation_prompt": True}).json()["tokens"]
    assert prompt_tokenizer.token_ids("/v1/chat/completions", {"messages": msgs}) == srv


_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_router_renders_tools_like_the_server(replicas, prompt_tokenizer):
    """A request with tools (and a second turn carrying a call and its result) hashes the tokens the backend
    prompts with: the tools' system text, the call in the fallback syntax, the result as a tool response."""
    url = replicas[0].url
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    body = {"messages": msgs, "tools": _TOOLS}
    srv = httpx.post(url + "/tokenize", json=body).json()["tokens"]
    ids = prompt_tokenizer.token_ids("/v1/chat/completions", body)
    assert ids == srv
    assert ids != prompt_tokenizer.token_ids("/v1/chat/completions", {"messages": msgs})   # the tools count
    # tool_choice "required" adds its instructions: the prompt the chat endpoint runs, counted by its usage
    body = {"model": _model(url), "messages": msgs[:1], "tools": _TOOLS, "tool_choice": "required",
            "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(prompt_tokenizer.token_ids("/v1/chat/completions", body)) == r.json()["usage"]["prompt_tokens"]


def test_kv_aware_sends_a_repeated_prefix_to_the_replica_that_holds_it(replicas, prompt_tokenizer, tmp_path):
    log = tmp_path / "decisions.jsonl"
    router = RouterThread(RouterConfig(backends=[r.spec for r in replicas], policy="kv_aware",
                                       health_check_interval=0.5, decision_log=str(log)), prompt_tokenizer).start()
    try:
        rt = router.router
        deadline = time.monotonic() + 10
        while not all(b.healthy for b in rt.backends) and time.monotonic() < deadline:
            time.sleep(0.1)
        prefix_a = "You are a meticulous assistant for the harbour master's office. " * 12
        prefix_b = "Answer as a medieval poet who only writes about mountains and snow. " * 12
        first_a = _complete(router.url, prefix_a + "Question: how many ships?")
        # wait until the KV events of the first request reached the router's index
        deadline = time.monotonic() + 10
        while sum(rt.index.num_blocks(b.index) for b in rt.backends) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        holder_a = [b.index for b in rt.backends if rt.index.num_blocks(b.index) > 0]
        assert len(holder_a) == 1, "the first prompt's blocks are on exactly one replica"
        first_b = _complete(router.url, prefix_b + "Question: which peak?")
        assert first_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert first_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 10
        while min(rt.index.num_blocks(b.index) for b in rt.backends) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # prefix B went to the other replica (same load, no overlap -> the lower load wins)
        assert all(rt.index.num_blocks(b.index) > 0 for b in rt.backends)
        served_before = {b.index: _requests(router.url, b.url) for b in rt.backends}
        for q in ("Question: what tide?", "Question: which berth?"):
            out = _complete(router.url, prefix_a + q)
            n_prefix = len(prompt_tokenizer.token_ids("/v1/completions", {"prompt": prefix_a}))
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= (n_prefix // 16 - 1) * 16, (cached, n_prefix)
        served_after = {b.index: _requests(router.url, b.url) for b in rt.backends}
        assert served_after[holder_a[0]] - served_before[holder_a[0]] == 2
        metrics = httpx.get(router.url + "/metrics").text
        assert 'tokenmill:router_routed_total{policy="kv_aware",reason="kv_overlap"} 2.0' in metrics
    finally:
        router.stop()
    # --decision-log: one line per request; the router's overlap estimate is what the backend found cached
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(recs) == 4
    assert [r["backend"] for r in recs[2:]] == [holder_a[0]] * 2 and recs[2]["best_overlap"] == [holder_a[0]]
    for r in recs:
        assert r["cached_tokens"] is not None and r["est_cached_tokens"] == r["cached_tokens"], r
        assert r["ttft_s"] > 0 and set(r["candidates"]) == {"0", "1"}
    assert recs[0]["cached_tokens"] == 0 and recs[3]["cached_tokens"] > 0
    assert all(r["event_lag_s"] is not None for r in recs[2:])


def _requests(router_url: str, backend_url: str) -> float:
    for line in httpx.get(router_url + "/metrics").text.splitlines():
        if line.startswith(f'tokenmill:router_requests_total{{backend="{backend_url}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_kv_aware_holds_a_concurrent_follower_until_its_prefix_is_computed(replicas, prompt_tokenizer, tmp_path):
    """Two requests of a new prefix at once: the second must not be prefilled next to the first (the engine
    shares computed blocks only); the router holds it until the first one's KV events arrive, and it then
    finds the whole prefix cached on the same replica. The replicas' pools already hold blocks from the
    module's earlier tests: a router that learnt the pool size from events (BlockRemoved without their
    BlockStored) took it for far smaller and its busy hold sent the follower to the other replica; the
    size now comes from each replica's /metrics (cache_config_info)."""
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "decisions.jsonl"
    router = RouterThread(RouterConfig(backends=[r.spec for r in replicas], policy="kv_aware",
                                       health_check_interval=0.5, decision_log=str(log)), prompt_tokenizer).start()
    try:
        rt = router.router
        deadline = time.monotonic() + 10
        while not all(b.healthy for b in rt.backends) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [rt.index.pool_size(b.index) for b in rt.backends] == [64, 64], "pool sizes from /metrics"
        prefix = "Summarise the customs ledger for the night clerk, line by line, in the harbour's own words. " * 28
        n_prefix = len(prompt_tokenizer.token_ids("/v1/completions", {"prompt": prefix}))
        before = {b.index: _requests(router.url, b.url) for b in rt.backends}
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(_complete, router.url, prefix + q) for q in ("Question: first?", "Question: second?")]
            outs = [f.result() for f in futs]
        after = {b.index: _requests(router.url, b.url) for b in rt.backends}
        if sorted(after[i] - before[i] for i in after) != [0, 2]:
            time.sleep(1)
            subs = {i: (x.last_seq, x.num_batches, x.num_gaps, x.num_replayed, x.num_resets, x.replay_endpoint)
                    for i, x in rt.subscribers.items()}
            raise AssertionError(f"both went to one replica {subs} blocks "
                                 f"{[rt.index.num_blocks(b.index) for b in rt.backends]}\n" + log.read_text())
        cached = sorted(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
        held = [line for line in httpx.get(router.url + "/metrics").text.splitlines()
                if line.startswith("tokenmill:router_held_requests_total")]
        # one computed the prefix, the other found it cached (held until the events came, or sent after)
        assert cached[0] == 0 and cached[1] >= (n_prefix // 16 - 1) * 16, (cached, n_prefix, held)
    finally:
        router.stop()


def test_constraints_and_tool_calls_pass_through_the_router(replicas, prompt_tokenizer):
    """The router relays constrained requests and their streamed tool-call deltas unchanged (kv_aware: it
    tokenizes the chat to route it). The schema's key and const are words the model would not write
    unconstrained, so a valid object shows the replica applied the constraint it was sent."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    router = RouterThread(RouterConfig(backends=[r.spec for r in replicas], policy="kv_aware",
                                       health_check_interval=0.5), prompt_tokenizer).start()
    try:
        rt = router.router
        deadline = time.monotonic() + 10
        while not all(b.healthy for b in rt.backends) and time.monotonic() < deadline:
            time.sleep(0.1)
        url, model = router.url, _model(replicas[0].url)
        schema = {"type": "object", "properties": {"zqx": {"const": "plugh"}, "n": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 9}},
                  "required": ["zqx", "n"], "additionalProperties": False}
        msgs = [{"role": "user", "content": "Give me a number."}]
        # compact JSON: the longest object the schema allows is 24 bytes, so 40 tokens always finish it
        NO_WS = {"disable_any_whitespace": True}
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": msgs, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            "structured_outputs": NO_WS})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop", ch
        jsonschema.validate(json.loads(ch["message"]["content"]), schema)
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "A code:", "max_tokens": 12, "temperature": 0,
            "structured_outputs": {"regex": "QZ-[0-9]{3}"}})
        assert r.status_code == 200 and re.fullmatch("QZ-[0-9]{3}", r.json()["choices"][0]["text"]), r.text
        # a named tool call, streamed: OpenAI's delta order arrives through the relay, ending "stop"
        tools = [{"type": "function", "function": {"name": "set_level", "parameters": schema}}]
        body = {"model": model, "messages": msgs, "tools": tools, "max_tokens": 40, "temperature": 0,
                "tool_choice": {"type": "function", "function": {"name": "set_level"}}, "stream": True,
                "structured_outputs": NO_WS}
        args, header, finish = "", None, []
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[6:])["choices"][0]
                for tc in c["delta"].get("tool_calls") or []:
                    if header is None:
                        header = tc
                        assert tc["id"] and tc["function"]["name"] == "set_level" and tc["index"] == 0, tc
                    else:
                        assert "id" not in tc and "name" not in tc["function"], tc
                    args += tc["function"].get("arguments") or ""
                if c["finish_reason"]:
                    finish.append(c["finish_reason"])
        assert header is not None and finish == ["stop"]
        jsonschema.validate(json.loads(args), schema)
    finally:
        router.stop()
