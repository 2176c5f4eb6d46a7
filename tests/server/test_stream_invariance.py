"""Batch invariance through the HTTP server: a seeded ``n=3`` completion streamed equals the same request
non-streamed (token logprobs bit for bit, texts), with other requests running beside one of them.

Both become the same three child requests (seed + i) in the engine; only their schedules differ (issue #31
saw streamed choices differ on a bfloat16 CPU before batch invariance). Real engine on the tiny all-low-bit
GGUF of tests/model/test_batch_invariance.py, in-process ASGI (no port). With ``batch_invariant=False`` in the
config the same test fails on the logprobs' low bits (checked 2026-12-02 on the EPYC, both dtypes).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.model.test_batch_invariance import write_lowbit_gguf

BODY = {"model": "tiny", "prompt": [5, 9, 14, 3, 77, 21, 40, 8, 19, 60, 61, 62], "max_tokens": 12, "n": 3,
        "seed": 17, "temperature": 0.9, "top_p": 0.95, "logprobs": 2, "ignore_eos": True}


def _choices_plain(body) -> dict[int, tuple[str, list]]:
    return {c["index"]: (c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"])
            for c in body["choices"]}


async def _streamed(client) -> dict[int, tuple[str, list]]:
    text: dict[int, str] = {}
    lps: dict[int, list] = {}
    tops: dict[int, list] = {}
    async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                i = c["index"]
                text[i] = text.get(i, "") + c["text"]
                if c.get("logprobs"):
                    lps.setdefault(i, []).extend(c["logprobs"]["token_logprobs"])
                    tops.setdefault(i, []).extend(c["logprobs"]["top_logprobs"])
    return {i: (text[i], lps[i], tops[i]) for i in text}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_streamed_n3_seeded_equals_non_streamed(dtype, tmp_path):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.model.layers.linear import lowbit_max_tokens
    from tokenmill.server.app import build_app
    from tokenmill.server.launch import create_server_state
    from tokenmill.tokenizer import load_tokenizer

    import torch

    if not lowbit_max_tokens("cpu", getattr(torch, dtype)):
        pytest.skip(f"no low-bit path for {dtype} on this machine")
    path = tmp_path / "tiny-lowbit.gguf"
    write_lowbit_gguf(path)
    config = EngineConfig.from_kwargs(model=str(path), served_model_name="tiny", dtype=dtype, max_model_len=256,
                                      num_kv_blocks=96, block_size=16, max_num_batched_tokens=16,
                                      log_stats_interval=0.0)
    tok = load_tokenizer(str(path))
    engine = AsyncEngine(config, tok, start_timeout=120)
    await asyncio.to_thread(engine.start)
    try:
        state = create_server_state(config, engine, tok, str(path))
        await engine.start_background()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t",
                                     timeout=120) as client:
            r = await client.post("/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            plain = _choices_plain(r.json())
            # streamed, beside two other requests (other batches, chunk budget 16)
            others = [client.post("/v1/completions", json={**BODY, "prompt": [30 + i] * (20 + 9 * i), "n": 1,
                                                           "seed": None, "temperature": 0.0})
                      for i in range(2)]
            streamed, *rest = await asyncio.gather(_streamed(client), *others)
            assert all(x.status_code == 200 for x in rest)
    finally:
        engine.shutdown()
    assert sorted(plain) == [0, 1, 2]
    assert len({plain[i][0] for i in plain}) > 1, "the choices must draw with different seeds"
    assert streamed == plain
