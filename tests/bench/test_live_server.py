"""End to end against a live ``tokenmill serve`` (the real SmolLM2-135M model).

Starts ``python -m tokenmill.cli serve --port PORT --max-model-len 1024`` as a
subprocess and waits for ``GET /health`` to return 200 (10–30 s to load).
Set ``TOKENMILL_BENCH_LIVE_URL=http://HOST:PORT`` to test an already running
server instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tokenmill import envs
from tokenmill.bench import cli
from tokenmill.bench.client import EndpointConfig
from tokenmill.bench.datasets import build_dataset
from tokenmill.bench.loadgen import LoadConfig, fetch_models, run_benchmark

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    if envs.TOKENMILL_BENCH_LIVE_URL:
        yield envs.TOKENMILL_BENCH_LIVE_URL
        return
    port = _free_port()
    log = tmp_path_factory.mktemp("live") / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                                 "--max-model-len", "1024"], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tokenmill serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tokenmill serve not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def test_every_request_accounted_and_tokens_match_usage(live_server, tokenizer):
    model = (await fetch_models(live_server))[0]
    samples = build_dataset("random", tokenizer, 6, input_len=32, output_len=8, seed=0)
    cfg = EndpointConfig(base_url=live_server, endpoint="completions", model=model, ignore_eos=True,
                         timeout_s=300)
    res = await run_benchmark(samples, cfg, LoadConfig(max_concurrency=4, disable_tqdm=True,
                                                       goodput={"ttft": 60_000}), tokenizer)
    m = res.metrics
    assert len(res.records) == 6 == m.completed + m.failed
    assert m.failed == 0, [r.error for r in res.records]
    for s, r in zip(samples, res.records):
        assert r.usage_reported
        assert r.output_tokens == 8                       # ignore_eos: exactly max_tokens
        # server's prompt count vs ours (a BOS token may be added by the server)
        assert s.prompt_len <= r.prompt_len <= s.prompt_len + 1
        # the streamed text re-encodes to about the reported number of tokens
        n = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
        assert abs(n - r.output_tokens) <= 2
        assert r.ttft > 0 and len(r.itl) >= 1 and r.latency >= r.ttft
    assert m.total_output == 6 * 8
    assert m.slo_attainment == 1.0


def test_cli_chat_mt_bench_against_live_server(live_server, tmp_path):
    out = tmp_path / "live.json"
    rc = cli.main(["serve", "--base-url", live_server, "--endpoint", "chat", "--dataset", "mt-bench",
                   "--multi-turn", "--num-prompts", "4", "--output-len", "8", "--max-concurrency", "2",
                   "--disable-tqdm", "--save-result", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["completed"] + d["failed"] == 4 and d["failed"] == 0, d["errors"]
    assert all(0 < n <= 8 for n in d["output_lens"])
    assert d["total_output_tokens"] == sum(d["output_lens"])
