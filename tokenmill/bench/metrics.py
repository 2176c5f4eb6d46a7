"""Benchmark metric math: per-request timings → the figures users compare.

Definitions follow ``vllm bench serve`` (``vllm/benchmarks/serve.py``) so that
numbers are comparable across tools:

* **TTFT** (s): time from sending the request to the first SSE chunk that
  carries a ``choices`` entry (its text may be empty).
* **ITL** (s): gaps between successive chunks that carry a choice; one list per
  request, flattened over all successful requests for the statistics.
* **E2EL** (s): time from sending the request to the last chunk that carries a
  choice.
* **TPOT** (s): ``(E2EL - TTFT) / (output_tokens - 1)``. A request with at most
  one output token has TPOT 0 for the goodput test, and (as in vLLM) is left
  out of the TPOT statistics.
* **Output tokens**: ``usage.completion_tokens`` of the streamed usage chunk.
* **Goodput** (req/s): requests that meet *every* SLO limit given, divided by
  the benchmark duration (DistServe, arXiv 2401.09670, §1; vLLM's
  ``request_goodput``). A failed request is never good.
* **SLO attainment** (fraction): good requests / all requests sent, failed ones
  included (DistServe §2.2 calls this the SLO attainment; tokenmill reports it
  next to goodput).

All statistics are reported in milliseconds under vLLM's JSON key names:
``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ...
Percentiles use :func:`numpy.percentile` (linear interpolation), as vLLM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

#: The metrics that have mean/median/std/percentile statistics.
PERCENTILE_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
#: The keys accepted by ``--goodput KEY:MS``.
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")
#: Human-readable names of the metrics, for tables and plots.
METRIC_NAMES: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestRecord:
    """What the load generator measured for one request.

    Times are ``time.perf_counter()`` readings or durations, in seconds.

    Attributes:
        success: the stream completed with HTTP 200 and a ``[DONE]`` marker and
            at least one chunk carrying a choice.
        error: why the request failed (``""`` on success).
        status: HTTP status code (``None`` when no response arrived).
        prompt_len: input tokens: ``usage.prompt_tokens`` when the server
            reported it, else the benchmark tokenizer's count of the prompt.
        output_tokens: output tokens: ``usage.completion_tokens`` when reported,
            else the tokenizer's count of the generated text (see
            ``usage_reported``).
        usage_reported: whether the server sent a usage chunk.
        ttft: time to first token, s (0 when no chunk arrived).
        itl: inter-token latencies, s (one per chunk after the first).
        latency: E2EL, s: send → last chunk carrying a choice.
        start_time: ``perf_counter`` when the request was sent, s.
        end_time: ``perf_counter`` when the request finished or failed, s.
        generated_text: concatenated streamed text.
        turn: 0 for a first turn, 1 for a follow-up turn of a conversation.
        retried: sent a second time because the first attempt died on a stale
            keep-alive connection before any response (see
            :func:`tokenmill.bench.client.send_request`).
    """

    success: bool = False
    error: str = ""
    status: int | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    end_time: float = 0.0
    generated_text: str = ""
    turn: int = 0
    retried: bool = False

    @property
    def tpot(self) -> float:
        """Time per output token after the first, s; 0 when ≤ 1 output token."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return 0.0

    def chunk_times(self) -> list[float]:
        """Absolute ``perf_counter`` times (s) of the chunks that carried a choice."""
        if self.ttft <= 0.0 and not self.itl:
            return []
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


def parse_goodput(specs: Iterable[str] | None) -> dict[str, float]:
    """Parse ``--goodput`` arguments such as ``["ttft:500", "tpot:50"]``.

    Args:
        specs: ``KEY:VALUE`` strings, KEY in :data:`SLO_KEYS`, VALUE in ms.

    Returns:
        ``{key: limit_ms}``; empty when ``specs`` is empty or ``None``.

    Raises:
        ValueError: on an unknown key, a malformed item or a negative limit.
    """
    slos: dict[str, float] = {}
    for spec in specs or ():
        for item in str(spec).replace(",", " ").split():
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(
                    f"Invalid --goodput item {item!r}: expected KEY:MS with KEY in {', '.join(SLO_KEYS)}")
            try:
                limit = float(value)
            except ValueError:
                raise ValueError(f"Invalid --goodput value in {item!r}: not a number of ms") from None
            if limit < 0 or math.isnan(limit):
                raise ValueError(f"Invalid --goodput value in {item!r}: must be ≥ 0 ms")
            slos[key] = limit
    return slos


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a request meets every SLO limit given (limits in ms, inclusive).

    A failed request is never good. TPOT of a ≤ 1-token output counts as 0.
    """
    if not record.success:
        return False
    values_s = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all(values_s[key] * 1000.0 <= limit for key, limit in slos_ms.items())


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 → ``"99"``, 99.9 → ``"99.9"``."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    """Mean, median, std and percentiles of ``values_s`` (seconds), in ms.

    Empty input gives zeros, as vLLM does (``np.mean(x or 0)``).

    Returns:
        ``{"mean": ms, "median": ms, "std": ms, "percentiles": [(p, ms), ...]}``.
    """
    arr = np.asarray(values_s, dtype=np.float64) if len(values_s) else np.zeros(1)
    return {
        "mean": float(np.mean(arr)) * 1000.0,
        "median": float(np.median(arr)) * 1000.0,
        "std": float(np.std(arr)) * 1000.0,
        "percentiles": [(float(p), float(np.percentile(arr, p)) * 1000.0) for p in percentiles],
    }


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Largest number of requests in flight at one instant (send → finish/fail).

    Exact sweep over start/end events; a request ending at the instant another
    starts does not overlap it. (vLLM's ``max_concurrent_requests`` counts the
    requests active at any time within each 1-second bucket, which can only be
    larger.)
    """
    events: list[tuple[float, int]] = []
    for r in records:
        events.append((r.start_time, 1))
        events.append((max(r.end_time, r.start_time), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends (-1) before starts (+1) at ties
    peak = cur = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def output_tokens_timeline(records: Sequence[RequestRecord], t0: float,
                           bucket_s: float = 1.0) -> np.ndarray:
    """Output tokens per second in consecutive buckets from ``t0``.

    Each successful request's ``output_tokens`` are spread evenly over its
    chunks (a chunk may carry several tokens), so the buckets add up to the
    total output tokens exactly.

    Args:
        records: per-request measurements.
        t0: ``perf_counter`` time (s) of bucket 0's start (the benchmark start).
        bucket_s: bucket width, s.

    Returns:
        ``[num_buckets]`` array of tokens/s.
    """
    per_bucket: dict[int, float] = {}
    for r in records:
        if not r.success:
            continue
        times = r.chunk_times()
        if not times or r.output_tokens <= 0:
            continue
        weight = r.output_tokens / len(times)
        for t in times:
            b = max(0, int((t - t0) // bucket_s))
            per_bucket[b] = per_bucket.get(b, 0.0) + weight
    if not per_bucket:
        return np.zeros(0)
    out = np.zeros(max(per_bucket) + 1)
    for b, v in per_bucket.items():
        out[b] = v / bucket_s
    return out


@dataclass
class BenchmarkMetrics:
    """Aggregate figures of one benchmark run.

    Counts are requests or tokens; throughputs are per second of benchmark
    duration; ``stats[metric]`` holds ``summarize`` output in ms for each of
    :data:`PERCENTILE_METRICS`.
    """

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    request_goodput: float | None
    good_requests: int | None
    slo_attainment: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, dict[str, Any]]
    percentiles: list[float]
    goodput_config: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """Flat dict with vLLM's key names (``p99_ttft_ms`` etc.)."""
        d: dict[str, Any] = {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "request_throughput": self.request_throughput,
            "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
            "goodput_config": dict(self.goodput_config) or None,
            "good_requests": self.good_requests,
            "slo_attainment": self.slo_attainment,
        }
        for m in PERCENTILE_METRICS:
            s = self.stats[m]
            d[f"mean_{m}_ms"] = s["mean"]
            d[f"median_{m}_ms"] = s["median"]
            d[f"std_{m}_ms"] = s["std"]
            for p, v in s["percentiles"]:
                d[f"p{percentile_key(p)}_{m}_ms"] = v
        return d


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Sequence[float] = (90.0, 99.0),
                    goodput_config: dict[str, float] | None = None,
                    t0: float | None = None) -> BenchmarkMetrics:
    """Aggregate per-request records into :class:`BenchmarkMetrics`.

    Args:
        records: one per request sent (successful and failed).
        duration_s: benchmark duration, s (first send → last completion).
        percentiles: percentiles to report, e.g. ``[90, 99]``.
        goodput_config: SLO limits in ms (``parse_goodput`` output); when empty,
            ``request_goodput`` and ``slo_attainment`` are ``None``.
        t0: benchmark start (``perf_counter``, s) for the tokens/s timeline;
            default: the earliest request start.

    Returns:
        The metrics. Throughputs divide by ``duration_s``.
    """
    slos = dict(goodput_config or {})
    ok = [r for r in records if r.success]
    failed = len(records) - len(ok)
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    dur = duration_s if duration_s > 0 else float("nan")
    good = sum(1 for r in ok if is_good(r, slos)) if slos else None
    if t0 is None:
        t0 = min((r.start_time for r in records), default=0.0)
    timeline = output_tokens_timeline(records, t0)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=failed,
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=len(ok) / dur,
        request_goodput=(good / dur) if good is not None else None,
        good_requests=good,
        slo_attainment=(good / len(records) if records else 0.0) if good is not None else None,
        output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        max_output_tokens_per_s=float(timeline.max()) if timeline.size else 0.0,
        max_concurrent_requests=peak_concurrency(records),
        stats={"ttft": summarize(ttfts, percentiles), "tpot": summarize(tpots, percentiles),
               "itl": summarize(itls, percentiles), "e2el": summarize(e2els, percentiles)},
        percentiles=[float(p) for p in percentiles],
        goodput_config=slos,
    )


def per_request_fields(records: Sequence[RequestRecord], t0: float) -> dict[str, list[Any]]:
    """Per-request arrays for the result JSON, aligned with the requests sent.

    vLLM's keys (``input_lens``, ``output_lens``, ``ttfts``, ``itls``,
    ``generated_texts``, ``errors``; seconds) plus tokenmill's ``e2els``,
    ``tpots`` (s), ``start_times`` (s since benchmark start), ``successes``,
    ``status_codes`` and ``turns``. Failed requests have output length 0.
    """
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [list(r.itl) for r in records],
        "e2els": [r.latency for r in records],
        "tpots": [r.tpot if r.success else 0.0 for r in records],
        "start_times": [r.start_time - t0 for r in records],
        "successes": [r.success for r in records],
        "status_codes": [r.status for r in records],
        "turns": [r.turn for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
