"""The server with ``-tp 2 -pp 2`` (mp workers): same completions as one process; a dead worker -> 503, no strays."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil

from tests.server.server_proc import start_server
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 60))]


def _workers(sp) -> list[psutil.Process]:
    out = []
    for p in sp.children():
        try:
            if "tokenmill.engine.executor.mp" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def test_server_tp2_pp2_matches_and_fails_with_503_when_a_worker_dies(tiny_llama):
    with LLM(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=64) as llm:
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0,
                                                                                ignore_eos=True))]
    sp = start_server(tiny_llama, "--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "64",
                      "-tp", "2", "-pp", "2")
    try:
        workers = _workers(sp)
        assert len(workers) == 4, sp.log_tail()
        r = httpx.post(sp.url + "/v1/completions", timeout=60, json={
            "model": os.path.basename(tiny_llama), "prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert got == want
        workers[2].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60       # the idle core checks its workers every second; load ~20 here
        while time.monotonic() < deadline and httpx.get(sp.url + "/health", timeout=5).status_code == 200:
            time.sleep(0.2)
        health = httpx.get(sp.url + "/health", timeout=5)
        assert health.status_code == 503 and "worker rank 2" in health.text, health.text
        r = httpx.post(sp.url + "/v1/completions", timeout=30, json={
            "model": os.path.basename(tiny_llama), "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 503, r.text
        time.sleep(1)
        assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        sp.stop()
    assert not [p for p in _workers(sp)]
