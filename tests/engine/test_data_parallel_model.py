"""--data-parallel-size 2 with the packaged SmolLM2 model: both engine cores serve, /metrics labels them, a clean
shutdown leaves no process behind."""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import psutil
import pytest

from tests.server.server_proc import start_server

pytestmark = pytest.mark.slow


def _per_engine(text: str, name: str) -> dict[str, float]:
    """Sum of ``name``'s samples per ``engine`` label value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(r'engine="(\d+)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


def test_two_engine_cores_serve_and_shut_down_cleanly() -> None:
    sp = start_server("--data-parallel-size", "2", "--max-model-len", "512", "--kv-cache-memory", "32MiB",
                      "--max-num-seqs", "4")
    kids: list[psutil.Process] = []
    try:
        kids = sp.children()
        assert len([k for k in kids if k.is_running()]) >= 2   # two engine core processes (at least)

        async def one(client: httpx.AsyncClient, i: int) -> dict:
            r = await client.post(sp.url + "/v1/completions", timeout=180,
                                  json={"prompt": f"Request {i}: the capital of France is", "max_tokens": 8,
                                        "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        async def main() -> list[dict]:
            async with httpx.AsyncClient() as client:
                return await asyncio.gather(*(one(client, i) for i in range(6)))

        outs = asyncio.run(main())
        assert all(o["usage"]["completion_tokens"] == 8 and o["choices"][0]["text"] for o in outs)
        # greedy, same model on both cores: the same prompt gives the same text wherever it runs
        texts = {o["choices"][0]["text"] for o in asyncio.run(main())[:1] + outs[:1]}
        assert len(texts) == 1
        metrics = httpx.get(sp.url + "/metrics", timeout=10).text
        gen = _per_engine(metrics, "tokenmill:generation_tokens_total")
        assert set(gen) >= {"0", "1"}, metrics[:2000]
        assert gen["0"] > 0 and gen["1"] > 0, gen            # both cores did work
        assert sum(gen.values()) == 12 * 8                   # every request ran on exactly one core
        done = _per_engine(metrics, "tokenmill:request_success_total")
        assert done["0"] + done["1"] == 12 and min(done["0"], done["1"]) >= 1, done
    finally:
        sp.stop(signal.SIGINT, timeout=60)
    assert sp.proc.returncode == 0, sp.log_tail()
    gone, alive = psutil.wait_procs(kids, timeout=10)
    for k in alive:     # never leave a core behind, even when the assertion below fails
        k.kill()
    assert not alive, f"engine core processes left running: {[k.pid for k in alive]}"
