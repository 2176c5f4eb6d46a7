"""End-to-end: admission control (429 + Retry-After), priority scheduling, API key, and a dead
engine core (503), against a real ``tokenmill.server`` with the packaged model.

The server runs one request at a time (``--max-num-seqs 1``) with room for two
waiting ones, under ``--scheduling-policy priority`` and with an API key.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from tests.server.server_proc import ServerProc, start_server

pytestmark = pytest.mark.slow

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> ServerProc:
    sp = start_server("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--max-num-seqs", "1",
                      "--max-num-waiting-requests", "2", "--scheduling-policy", "priority", "--api-key", KEY,
                      "--served-model-name", "smol")
    yield sp
    sp.stop(signal.SIGKILL)


def test_api_key(server: ServerProc) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", headers=headers,
                       json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == 401
        r = httpx.post(server.url + "/v1/completions", headers=AUTH,
                       json={"model": "smol", "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list().data[0].id == "smol"
    assert httpx.get(server.url + "/health").status_code == 200


def test_queue_full_gives_429_and_priority_orders_the_queue(server: ServerProc) -> None:
    async def main() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        order: list[str] = []
        # A takes the only running slot, long enough (150 tokens) to still run when the third request comes
        # (0.6 s later), short enough that the two queued behind it finish within the client's 120 s at a load
        # average of 15-20 (400 tokens timed out there); the most urgent of the three: a higher-priority
        # arrival would preempt it at this full house
        a = await ac.completions.create(model="smol", prompt="Count to fifty:", max_tokens=150, stream=True,
                                        temperature=0, extra_body={"ignore_eos": True, "priority": -5})
        await a.__anext__()

        async def run(name: str, priority: int) -> None:
            await ac.completions.create(model="smol", prompt=f"Say {name}.", max_tokens=3, temperature=0,
                                        extra_body={"priority": priority, "ignore_eos": True})
            order.append(name)

        low = asyncio.create_task(run("low", 10))  # arrives first, less urgent
        await asyncio.sleep(0.3)
        high = asyncio.create_task(run("high", -1))
        await asyncio.sleep(0.3)
        # Two are waiting: the third is refused with a Retry-After hint.
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(server.url + "/v1/completions", headers=AUTH,
                             json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == 429
        async for _ in a:
            pass
        await asyncio.gather(low, high)
        # The queue has room again.
        r2 = await ac.completions.create(model="smol", prompt="Hi", max_tokens=2)
        assert r2.choices[0].text is not None
        await ac.close()
        return order

    assert asyncio.run(main()) == ["high", "low"]


def test_dead_engine_core_gives_503(server: ServerProc) -> None:
    """Runs last: kill -9 the core mid-stream; the stream ends with an error event, then 503s."""
    kids = server.children()
    assert kids
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", headers=AUTH, json={
                "model": "smol", "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            for k in kids:
                k.send_signal(signal.SIGKILL)
            rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][len("data: "):])
    assert err["error"]["code"] == 503
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503, r.text
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "model": "smol", "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert r.status_code == 503
    assert server.stop(signal.SIGTERM, timeout=20) < 15
