"""The load generator: sends a workload at a request rate and collects timings.

Arrival times come from :mod:`tokenmill.bench.arrivals` (gamma gaps, precomputed
from the seed so every run of the same workload sends at the same offsets);
``max_concurrency`` caps requests in flight (a request that arrives while the
cap is reached waits, and its TTFT includes the wait — as in vLLM). Follow-up
turns of a conversation are sent as soon as the previous answer completes.

Duration (s) is measured from the benchmark start (just before the first
arrival, after warm-up) to the completion of the last request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Sequence

import aiohttp
from tqdm import tqdm

from tokenmill.bench.arrivals import arrival_offsets
from tokenmill.bench.client import EndpointConfig, send_request
from tokenmill.bench.datasets import SampleRequest, chat_prompt_len, render_chat
from tokenmill.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics

logger = logging.getLogger(__name__)


@dataclass
class LoadConfig:
    """How to send a workload.

    Attributes:
        request_rate: mean arrivals per second (``inf``: all at once).
        burstiness: gamma shape of the inter-arrival gaps (1 = Poisson).
        max_concurrency: cap on requests in flight (``None``: no cap).
        seed: seed of the arrival process.
        num_warmups: requests sent (and discarded) before the benchmark.
        disable_tqdm: hide the progress bar.
        percentiles: percentiles to report, e.g. ``[90, 99]``.
        goodput: SLO limits in ms, e.g. ``{"ttft": 500, "tpot": 50}``.
    """

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 0
    disable_tqdm: bool = False
    percentiles: list[float] = field(default_factory=lambda: [90.0, 99.0])
    goodput: dict[str, float] = field(default_factory=dict)


@dataclass
class BenchmarkResult:
    """Records and metrics of one run.

    Attributes:
        records: one per request sent, in send order of the samples (a
            conversation's turns follow each other).
        metrics: aggregated figures.
        duration_s: benchmark duration, s.
        t0: ``perf_counter`` at the benchmark start, s.
        date: wall-clock start, ``YYYYMMDD-HHMMSS``.
    """

    records: list[RequestRecord]
    metrics: BenchmarkMetrics
    duration_s: float
    t0: float
    date: str


def _chat_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


async def _run_sample(session: aiohttp.ClientSession, cfg: EndpointConfig, sample: SampleRequest,
                      tokenizer: Any, limiter: Any, pbar: tqdm | None) -> list[RequestRecord]:
    """Send one sample's requests (all turns) and return their records."""
    records: list[RequestRecord] = []
    prompt: str | list[dict[str, str]] = sample.prompt
    history = _chat_messages(sample.prompt)
    prompt_len = sample.prompt_len
    for turn in range(sample.num_requests):
        if turn > 0:
            prev = records[-1]
            if not prev.success:
                # Without the previous answer the conversation cannot go on;
                # the remaining turns are counted as failed, not dropped.
                for t in range(turn, sample.num_requests):
                    now = time.perf_counter()
                    records.append(RequestRecord(error="skipped: previous turn of the conversation failed",
                                                 start_time=now, end_time=now, turn=t))
                    if pbar is not None:
                        pbar.update(1)
                break
            history = history + [{"role": "assistant", "content": prev.generated_text},
                                 {"role": "user", "content": sample.follow_ups[turn - 1]}]
            prompt = history
            prompt_len = chat_prompt_len(tokenizer, history) if tokenizer is not None else 0
        send_prompt: Any = prompt
        if cfg.endpoint == "completions" and not isinstance(prompt, str):
            send_prompt = render_chat(tokenizer, prompt)
        async with limiter:
            rec = await send_request(session, cfg, send_prompt, sample.expected_output_len,
                                     prompt_len, tokenizer, turn)
        records.append(rec)
        if pbar is not None:
            pbar.update(1)
    return records


def _session(max_concurrency: int | None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=max_concurrency or 0,
                                     keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, trust_env=False)


async def run_benchmark(samples: Sequence[SampleRequest], endpoint: EndpointConfig,
                        load: LoadConfig, tokenizer: Any = None) -> BenchmarkResult:
    """Send ``samples`` to ``endpoint`` under ``load`` and measure them.

    Args:
        samples: the workload (see :mod:`tokenmill.bench.datasets`).
        endpoint: where to send.
        load: arrival process, concurrency cap, warm-up, reporting.
        tokenizer: renders chats for the completions endpoint and counts
            tokens when the server reports no usage.

    Returns:
        All records (successful and failed) and their metrics.
    """
    num_requests = sum(s.num_requests for s in samples)
    offsets = arrival_offsets(len(samples), load.request_rate, load.burstiness, load.seed)
    limiter: Any = (asyncio.Semaphore(load.max_concurrency) if load.max_concurrency
                    else contextlib.nullcontext())
    async with _session(load.max_concurrency) as session:
        if load.num_warmups > 0 and samples:
            logger.info("warming up with %d requests", load.num_warmups)
            warm = [SampleRequest(samples[i % len(samples)].prompt, samples[i % len(samples)].prompt_len,
                                  samples[i % len(samples)].expected_output_len)
                    for i in range(load.num_warmups)]
            await asyncio.gather(*(_run_sample(session, endpoint, s, tokenizer, limiter, None)
                                   for s in warm))
        pbar = None if load.disable_tqdm else tqdm(total=num_requests, desc="requests", unit="req")
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        t0 = time.perf_counter()

        async def scheduled(i: int) -> list[RequestRecord]:
            delay = t0 + float(offsets[i]) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await _run_sample(session, endpoint, samples[i], tokenizer, limiter, pbar)

        try:
            per_sample = await asyncio.gather(*(scheduled(i) for i in range(len(samples))))
        finally:
            if pbar is not None:
                pbar.close()
        duration = time.perf_counter() - t0
    records = [r for recs in per_sample for r in recs]
    metrics = compute_metrics(records, duration, load.percentiles, load.goodput, t0=t0)
    return BenchmarkResult(records, metrics, duration, t0, date)


async def fetch_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> list[str]:
    """Model ids listed by ``GET {base_url}/v1/models``.

    Raises:
        RuntimeError: when the server cannot be reached or answers badly.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession(trust_env=False) as s:
            async with s.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                r.raise_for_status()
                data = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise RuntimeError(f"could not list models at {url}: {exc}") from exc
    return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
