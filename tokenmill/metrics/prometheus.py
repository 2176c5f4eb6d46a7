"""Prometheus exporter: vLLM's metric names with the ``tokenmill:`` prefix.

Every metric carries the label ``model_name``. Names, meanings and histogram
bucket boundaries follow vLLM's v1 Prometheus logger so that dashboards and
alerts written for vLLM work after replacing the ``vllm:`` prefix:

* gauges ``num_requests_running``, ``num_requests_waiting``,
  ``kv_cache_usage_perc`` (fraction 0–1);
* counters ``num_preemptions_total``, ``prompt_tokens_total``,
  ``generation_tokens_total``, ``prefix_cache_queries_total`` and
  ``prefix_cache_hits_total`` (tokens), ``request_success_total{finished_reason}``;
* counter ``request_refused_total{reason}`` (tokenmill-specific: requests
  refused with HTTP 429 by admission control, ``reason`` =
  ``waiting_requests`` or ``waiting_tokens``; vLLM has no admission control);
* histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
  ``request_prefill_time_seconds``, ``request_decode_time_seconds``,
  ``request_inference_time_seconds``, ``request_prompt_tokens``,
  ``request_generation_tokens``, ``request_params_max_tokens`` and
  ``scheduler_time_seconds`` (per-step scheduling time, from
  ``EngineStats.last_schedule_time``; tokenmill-specific).

Each exporter has its own :class:`prometheus_client.CollectorRegistry`, so
several servers (or tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the API

from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.stats import IterationStats

PREFIX = "tokenmill:"

# vLLM v1 bucket boundaries (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# Scheduling is sub-millisecond to milliseconds.
SCHEDULER_TIME_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                          0.5, 1.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """Buckets 1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (vLLM's token buckets)."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


class PrometheusStatLogger:
    """Keeps the ``tokenmill:`` metrics up to date from engine and iteration stats.

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: context limit in tokens (sets the token-count buckets).
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        # No *_created series (as vLLM): they double the output and no dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, ln, lv = self.registry, ["model_name"], [model_name]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ln, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ln, registry=r).labels(*lv)

        def hist(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(PREFIX + name, doc, ln, buckets=buckets, registry=r).labels(*lv)

        self.num_running = gauge("num_requests_running", "Number of requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Number of requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prefix cache queries, in prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.")
        self._success = Counter(PREFIX + "request_success", "Count of finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)  # export zeros from the start
        self._refused = Counter(PREFIX + "request_refused",
                                "Requests refused by admission control (HTTP 429), by the limit that refused them.",
                                ["model_name", "reason"], registry=r)
        for reason in ("waiting_requests", "waiting_tokens"):
            self._refused.labels(model_name, reason)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self.req_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                                      token_buckets)
        self.req_gen_tokens = hist("request_generation_tokens", "Number of generation tokens processed.",
                                   token_buckets)
        self.req_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                   token_buckets)
        self.sched_time = hist("scheduler_time_seconds",
                               "Histogram of per-step scheduling time (schedule + update) in seconds.",
                               SCHEDULER_TIME_BUCKETS)
        # Last cumulative core counters seen, to turn them into increments.
        self._last_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._last_steps = 0

    def record_refusal(self, reason: str) -> None:
        """Count one request refused by admission control (``reason``: the limit that refused it)."""
        self._refused.labels(self.model_name, reason).inc()

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Update gauges from the core snapshot and counters/histograms from the iteration."""
        if engine_stats is not None:
            s = engine_stats
            self.num_running.set(s.num_running)
            self.num_waiting.set(s.num_waiting)
            self.kv_usage.set(min(1.0, max(0.0, s.kv_cache_usage)))
            self._last_preemptions = _inc(self.num_preemptions, s.num_preemptions_total, self._last_preemptions)
            self._last_queries = _inc(self.prefix_queries, s.prefix_cache_queries, self._last_queries)
            self._last_hits = _inc(self.prefix_hits, s.prefix_cache_hits, self._last_hits)
            if s.num_steps > self._last_steps:
                self._last_steps = s.num_steps
                self.sched_time.observe(s.last_schedule_time)
        if iteration is not None:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
            self.generation_tokens.inc(iteration.num_generation_tokens)
            for v in iteration.time_to_first_tokens:
                self.ttft.observe(v)
            for v in iteration.inter_token_latencies:
                self.itl.observe(v)
            for f in iteration.finished:
                self._success.labels(self.model_name, f.finish_reason).inc()
                self.e2e.observe(f.e2e_latency)
                self.queue.observe(f.queued_time)
                self.prefill.observe(f.prefill_time)
                self.decode.observe(f.decode_time)
                self.inference.observe(f.prefill_time + f.decode_time)
                self.req_prompt_tokens.observe(f.num_prompt_tokens)
                self.req_gen_tokens.observe(f.num_generation_tokens)
                if f.max_tokens_param is not None:
                    self.req_max_tokens.observe(f.max_tokens_param)

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


def _inc(counter: Counter, total: int, last: int) -> int:
    """Advance ``counter`` to the core's cumulative ``total``; returns the new baseline."""
    if total > last:
        counter.inc(total - last)
    return total  # (a smaller total means the core restarted: rebase)
