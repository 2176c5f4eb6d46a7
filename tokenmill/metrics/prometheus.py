"""Prometheus exporter: vLLM's metric names with the ``tokenmill:`` prefix.

Every metric carries the label ``model_name`` and, except the API process's own (``request_refused_total``, the ``--slo`` prediction histograms),
``engine`` (the engine core's index; one per core under ``--data-parallel-size``). Names, meanings and histogram
bucket boundaries follow vLLM's v1 Prometheus logger so that dashboards and
alerts written for vLLM work after replacing the ``vllm:`` prefix:

* gauges ``num_requests_running``, ``num_requests_waiting``,
  ``kv_cache_usage_perc`` (fraction 0–1);
* counters ``num_preemptions_total``, ``prompt_tokens_total``,
  ``generation_tokens_total``, ``prefix_cache_queries_total`` and
  ``prefix_cache_hits_total`` (tokens), ``request_success_total{finished_reason}``;
* counter ``request_refused_total{reason}`` (tokenmill-specific: requests
  refused with HTTP 429 by admission control, ``reason`` =
  ``waiting_requests``, ``waiting_tokens`` or ``slo``; vLLM has no admission control);
* histograms ``predicted_ttft_seconds``, ``ttft_prediction_error_seconds``
  (measured − predicted, signed) and ``ttft_prediction_abs_error_seconds``, gauges
  ``slo_ttft_margin_seconds`` and ``slo_tpot_margin_factor`` (the learnt safety
  margins), histograms ``predicted_tpot_seconds``, ``tpot_prediction_error_seconds``
  and ``tpot_prediction_abs_error_seconds`` (TPOT of finished requests), gauge
  ``slo_decode_batch_limit`` (the largest decode batch predicted to meet the TPOT
  target) (tokenmill-specific: SLO admission control, ``--slo``);
* histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
  ``request_prefill_time_seconds``, ``request_decode_time_seconds``,
  ``request_inference_time_seconds``, ``request_prompt_tokens``,
  ``request_generation_tokens``, ``request_params_max_tokens`` and
  ``scheduler_time_seconds`` (per-step scheduling time, from
  ``EngineStats.last_schedule_time``; tokenmill-specific);
* with structured outputs (after the first constrained request): counter
  ``structured_output_requests_total{kind}`` (json, regex, choice, grammar, json_object, structural_tag),
  histogram ``grammar_compile_time_seconds``, counters ``grammar_cache_queries_total`` /
  ``grammar_cache_hits_total`` (compile-cache lookups, vLLM's query/hit pattern), ``grammar_compile_failures_total``
  (invalid constraints), ``grammar_compile_timeouts_total``, gauge ``num_grammar_queue_reqs`` (SGLang's name:
  requests waiting for their grammar), counters ``grammar_bitmask_fill_seconds_total`` (filling masks, on a
  thread overlapping the forward), ``grammar_bitmask_wait_seconds_total`` (the part the step waited for),
  ``grammar_forced_draft_tokens_total`` / ``grammar_forced_accepted_tokens_total`` (grammar-forced drafts);
* counters ``spec_decode_num_drafts``,
  ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` (on every server, at 0
  without ``--speculative-config``) and, with it,
  ``spec_decode_num_accepted_tokens_per_pos{position}`` (0-based draft position).
* with ``--enable-eplb`` (tokenmill-specific; vLLM only logs "balancedness"):
  gauge ``eplb_expert_load{layer,expert}`` (assignments routed to each logical
  expert over the load window; ``layer="all"`` sums the layers when layers x
  experts exceed ``EPLB_MAX_LOAD_SERIES``, so series stay bounded), gauges
  ``eplb_imbalance_ratio`` (busiest / mean expert-parallel rank load, measured
  since the last rebalance), ``eplb_expert_imbalance_ratio`` (most / mean
  loaded expert), ``eplb_imbalance_ratio_before_rebalance`` (measured before the
  last rebalance) and ``eplb_imbalance_ratio_after_rebalance`` (predicted for
  the placement chosen then), counters ``eplb_rebalances_total``,
  ``eplb_placement_changes_total``, ``eplb_moved_experts_total`` and
  ``eplb_rebalance_seconds_total``.
* counter ``prompt_tokens_by_source_total{source}``: prompt tokens by where their K/V came from
  (``local_compute``, ``local_cache_hit``, ``external_kv_transfer``), as vLLM's;
* with ``--kv-transfer-config`` (prefill-decode disaggregation): counters
  ``kv_transfer_bytes_total{direction}`` (``sent`` by a producer, ``received`` by a consumer),
  ``kv_transfer_failed_total`` (loads that failed or timed out),
  ``kv_transfer_recomputed_requests_total`` (requests that recomputed their prompt instead),
  ``kv_transfer_expired_total`` (KV a producer kept that no consumer pulled in time),
  ``kv_transfer_released_total`` (KV a producer kept and freed early on ``POST /kv_transfer/release``), and the
  histogram ``kv_transfer_time_seconds`` (one completed load, consumer side).
* with ``--kv-offloading-backend`` (the disk tier, :mod:`tokenmill.kv_transfer.offloading`): vLLM's
  counters ``external_prefix_cache_queries_total`` / ``external_prefix_cache_hits_total`` (prompt
  tokens looked up in the tier / loaded from it), and tokenmill's ``kv_offload_blocks_total{direction}``
  and ``kv_offload_bytes_total{direction}`` (``store``: written to the tier, ``load``: read back),
  ``kv_offload_seconds_total{direction}`` (``store``, ``load``, ``copy``: the engine loop's copy out of
  the pool), ``kv_offload_evicted_blocks_total`` (LRU), ``kv_offload_discarded_blocks_total`` (corrupt or
  another configuration), ``kv_offload_dropped_saves_total``, ``kv_offload_write_errors_total``,
  ``kv_offload_failed_loads_total``, and gauges ``kv_offload_usage_bytes``, ``kv_offload_capacity_bytes``,
  ``kv_offload_resident_blocks``, ``kv_offload_writes_paused`` (1 after a failed write, e.g. a full disk);
  with a host-memory tier in front of the files (``--kv-offloading-host-size``, default on CUDA):
  ``kv_offload_host_blocks_total{direction}`` (``store``: put into host memory, ``load``: loaded from it
  instead of a file, ``evict``: dropped from it, LRU) and gauges ``kv_offload_host_usage_bytes``,
  ``kv_offload_host_capacity_bytes``, ``kv_offload_host_resident_blocks``.

Each exporter has its own :class:`prometheus_client.CollectorRegistry`, so
several servers (or tests) in one process do not collide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

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
# Signed TTFT prediction error (measured - predicted), seconds.
PREDICTION_ERROR_BUCKETS = [-10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0,
                            0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
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


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family, declared: the exporter builds every family from these tables.

    Attributes:
        key: where the exporter keeps it (a key of the engine families, or an attribute for the API's).
        kind: ``Gauge``, ``Counter`` or ``Histogram`` (a counter's name gets ``_total`` from the client).
        name: the name after :data:`PREFIX` (vLLM's, where vLLM has the metric).
        doc: the ``# HELP`` text.
        labels: labels after the scope's own (``model_name``, and ``engine`` for an engine's metrics).
        buckets: histogram boundaries; ``"tokens"``: 1-2-5 buckets up to the context limit.
    """

    key: str
    kind: type
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | str | None = None

    def build(self, registry: CollectorRegistry, scope: tuple[str, ...], token_buckets: list[int]):
        """The family in ``registry``, labelled ``scope + labels``."""
        kw: dict[str, Any] = {"registry": registry}
        if self.kind is Histogram:
            kw["buckets"] = token_buckets if self.buckets == "tokens" else list(self.buckets or ())
        return self.kind(PREFIX + self.name, self.doc, [*scope, *self.labels], **kw)


def _g(key: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(key, Gauge, name, doc, labels)


def _c(key: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(key, Counter, name, doc, labels)


def _h(key: str, name: str, doc: str, buckets: list[float] | str) -> MetricSpec:
    return MetricSpec(key, Histogram, name, doc, (), buckets if isinstance(buckets, str) else tuple(buckets))


#: Every engine core's families (labels ``model_name``, ``engine``), in export order.
ENGINE_METRICS: tuple[MetricSpec, ...] = (
    _g("num_running", "num_requests_running", "Number of requests in the running batch."),
    _g("num_waiting", "num_requests_waiting", "Number of requests waiting to be scheduled."),
    _g("kv_usage", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."),
    _c("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    _c("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    _c("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    _c("prefix_queries", "prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up."),
    _c("prefix_hits", "prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached."),
    _c("spec_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    _c("spec_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    _c("spec_accepted", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    _c("spec_accepted_per_pos", "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
       ("position",)),
    _g("eplb_expert_load", "eplb_expert_load",
       "Assignments (token, expert) routed to each logical MoE expert over the EPLB load window; layer=\"all\" "
       "sums the layers when there are too many series.", ("layer", "expert")),
    _g("eplb_imbalance", "eplb_imbalance_ratio",
       "Busiest / mean expert-parallel rank load (summed over MoE layers), measured since the last EPLB rebalance "
       "(1 = balanced)."),
    _g("eplb_expert_imbalance", "eplb_expert_imbalance_ratio",
       "Most / mean loaded logical expert over the EPLB window (routing skew)."),
    _g("eplb_before", "eplb_imbalance_ratio_before_rebalance",
       "eplb_imbalance_ratio measured just before the last rebalance."),
    _g("eplb_after", "eplb_imbalance_ratio_after_rebalance",
       "Imbalance ratio predicted for the placement chosen at the last rebalance, on the same window."),
    _c("eplb_rebalances", "eplb_rebalances", "EPLB rebalances computed."),
    _c("eplb_changes", "eplb_placement_changes", "EPLB rebalances that changed the expert placement."),
    _c("eplb_moved", "eplb_moved_experts", "Expert replicas copied into a new slot by EPLB (all ranks)."),
    _c("eplb_seconds", "eplb_rebalance_seconds", "Seconds spent rebalancing (placement + weight moves)."),
    _c("kvx_sources", "prompt_tokens_by_source", "Prompt tokens by where their KV came from.", ("source",)),
    _c("kvx_bytes", "kv_transfer_bytes", "KV cache bytes moved by the KV connector.", ("direction",)),
    _c("kvx_failed", "kv_transfer_failed", "KV loads that failed or timed out."),
    _c("kvx_recomputed", "kv_transfer_recomputed_requests",
       "Requests that recomputed their prompt because their KV could not be loaded."),
    _c("kvx_expired", "kv_transfer_expired", "Requests whose kept KV no consumer pulled before the timeout."),
    _c("kvx_released", "kv_transfer_released",
       "Requests whose kept KV was freed early because no consumer would pull it."),
    _h("kvx_time", "kv_transfer_time_seconds", "Histogram of the time of one KV load in seconds.", TTFT_BUCKETS),
    _c("kvo_queries", "external_prefix_cache_queries",
       "External prefix cache queries (KV offloading tier), in prompt tokens looked up."),
    _c("kvo_hits", "external_prefix_cache_hits", "External prefix cache hits (KV offloading tier), in prompt tokens loaded."),
    _c("kvo_blocks", "kv_offload_blocks", "KV blocks written to / loaded from the offloading tier.", ("direction",)),
    _c("kvo_bytes", "kv_offload_bytes", "Bytes written to / loaded from the offloading tier.", ("direction",)),
    _c("kvo_seconds", "kv_offload_seconds", "Seconds spent storing, loading and copying blocks for the offloading tier.",
       ("direction",)),
    _c("kvo_evicted", "kv_offload_evicted_blocks", "Tier files removed to stay within its size (LRU)."),
    _c("kvo_discarded", "kv_offload_discarded_blocks", "Tier files discarded: corrupt, or written under another configuration."),
    _c("kvo_dropped", "kv_offload_dropped_saves", "Blocks not saved (writer behind, or writes paused)."),
    _c("kvo_write_errors", "kv_offload_write_errors", "Tier writes that failed (e.g. a full disk)."),
    _c("kvo_failed_loads", "kv_offload_failed_loads", "Tier loads that failed (the prompt was recomputed)."),
    _g("kvo_usage", "kv_offload_usage_bytes", "Bytes of files in the offloading tier."),
    _g("kvo_capacity", "kv_offload_capacity_bytes", "Size limit of the offloading tier in bytes."),
    _g("kvo_resident", "kv_offload_resident_blocks", "KV blocks held by the offloading tier."),
    _g("kvo_paused", "kv_offload_writes_paused", "1 while tier writes are paused after a failed write."),
    _c("kvo_host_blocks", "kv_offload_host_blocks",
       "KV blocks put into / loaded from / evicted from the offloading tier's host memory.", ("direction",)),
    _g("kvo_host_usage", "kv_offload_host_usage_bytes", "Bytes of blocks in the offloading tier's host memory."),
    _g("kvo_host_capacity", "kv_offload_host_capacity_bytes", "Size of the offloading tier's host memory in bytes."),
    _g("kvo_host_resident", "kv_offload_host_resident_blocks", "KV blocks held in the offloading tier's host memory."),
    _c("so_requests", "structured_output_requests", "Constrained requests by constraint kind.", ("kind",)),
    _h("so_compile_time", "grammar_compile_time_seconds", "Histogram of grammar compile time in seconds.",
       [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    _c("so_cache_queries", "grammar_cache_queries", "Grammar compile-cache lookups."),
    _c("so_cache_hits", "grammar_cache_hits", "Grammar compile-cache lookups served without compiling."),
    _c("so_failures", "grammar_compile_failures", "Constraints the grammar backend refused (HTTP 400)."),
    _c("so_timeouts", "grammar_compile_timeouts", "Requests failed because their grammar compiled too long."),
    _c("so_fill", "grammar_bitmask_fill_seconds", "Seconds filling token bitmasks (overlapping the forward)."),
    _c("so_wait", "grammar_bitmask_wait_seconds", "Seconds the model step waited for its token bitmask."),
    _c("so_forced", "grammar_forced_draft_tokens", "Grammar-forced tokens verified as draft tokens."),
    _c("so_forced_acc", "grammar_forced_accepted_tokens", "Grammar-forced draft tokens accepted."),
    _g("so_queue", "num_grammar_queue_reqs", "Requests waiting for their grammar to compile."),
    _c("success", "request_success", "Count of finished requests by finish reason.", ("finished_reason",)),
    _h("ttft", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    _h("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    _h("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    _h("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
       REQUEST_LATENCY_BUCKETS),
    _h("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
       REQUEST_LATENCY_BUCKETS),
    _h("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
       REQUEST_LATENCY_BUCKETS),
    _h("inference", "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
       REQUEST_LATENCY_BUCKETS),
    _h("req_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    _h("req_gen_tokens", "request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    _h("req_max_tokens", "request_params_max_tokens", "Histogram of the max_tokens request parameter.", "tokens"),
    _h("sched_time", "scheduler_time_seconds", "Histogram of per-step scheduling time (schedule + update) in seconds.",
       SCHEDULER_TIME_BUCKETS),
)

#: The API process's own families (label ``model_name``; no ``engine``), in export order. Those without
#: extra labels are kept as their one child (``self.predicted_ttft.observe(...)``).
API_METRICS: tuple[MetricSpec, ...] = (
    _c("_refused", "request_refused",
       "Requests refused by admission control (HTTP 429), by the limit that refused them.", ("reason",)),
    # --slo admission: TTFT / TPOT predictions, their error and the learnt margins
    _h("predicted_ttft", "predicted_ttft_seconds", "Histogram of the TTFT predicted by SLO admission control "
       "(--slo) for each request it judged, in seconds.", TTFT_BUCKETS),
    _h("ttft_pred_error", "ttft_prediction_error_seconds", "Histogram of measured minus predicted TTFT of admitted "
       "requests (--slo), in seconds (negative: the prediction was pessimistic).", PREDICTION_ERROR_BUCKETS),
    _h("ttft_pred_abs_error", "ttft_prediction_abs_error_seconds", "Histogram of |measured - predicted| TTFT of "
       "admitted requests (--slo), in seconds.", TTFT_BUCKETS),
    _h("predicted_tpot", "predicted_tpot_seconds", "Histogram of the TPOT predicted by SLO admission control (--slo) "
       "for each request it judged (the decode batch it would run in), in seconds.", ITL_BUCKETS),
    _h("tpot_pred_error", "tpot_prediction_error_seconds", "Histogram of measured minus predicted TPOT of admitted "
       "requests at finish (--slo), in seconds (negative: the prediction was pessimistic).", PREDICTION_ERROR_BUCKETS),
    _h("tpot_pred_abs_error", "tpot_prediction_abs_error_seconds", "Histogram of |measured - predicted| TPOT of "
       "admitted requests (--slo), in seconds.", ITL_BUCKETS),
    _g("slo_decode_batch_limit", "slo_decode_batch_limit", "Largest decode batch (sequences) whose predicted TPOT "
       "meets the --slo target, at the latest prediction."),
    _g("slo_ttft_margin", "slo_ttft_margin_seconds", "Safety margin --slo adds to TTFT predictions, learnt from "
       "their observed error (seconds; negative when the model is pessimistic)."),
    _g("slo_tpot_factor", "slo_tpot_margin_factor", "Factor --slo applies to TPOT predictions, learnt from measured "
       "/ predicted TPOT of finished requests."),
)

#: vLLM's cache_config_info: one series per engine whose labels carry the KV cache configuration (value 1); the
#: router reads each backend's pool size (num_gpu_blocks) from it.
CACHE_CONFIG_INFO = _g("_cache_config", "cache_config_info", "Information of the KV cache configuration (labels; "
                       "value 1). num_gpu_blocks is the engine's KV pool size in blocks (on any device).",
                       ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"))


class _EngineSeries:
    """The labelled children of one engine (label values ``model_name``, ``engine``) and its counter baselines."""

    def __init__(self, fams: dict, model_name: str, engine: str) -> None:
        lv = (model_name, engine)
        for name, fam in fams.items():
            if name not in ("success",) and not name.startswith(("spec_", "eplb_", "kvx_", "kvo_", "so_")):
                setattr(self, name, fam.labels(*lv))
        self.success = {r: fams["success"].labels(*lv, r) for r in ("stop", "length", "abort", "error")}
        self._success_fam, self._lv = fams["success"], lv
        self.last_preemptions = 0
        self.last_queries = 0
        self.last_hits = 0
        self.last_steps = 0
        self._fams = fams
        # speculative-decoding counters exist at 0 on every server (a dashboard panel over them shows 0, not
        # "no data", where no draft model runs); the per-position children appear with the first drafts
        self.spec: dict | None = {n: fams[n].labels(*lv) for n in ("spec_drafts", "spec_draft_tokens", "spec_accepted")}
        self.eplb: dict | None = None      # EPLB children, created on the first EPLB stats
        self.last_eplb = (0, 0, 0, 0.0)
        self.last_spec = (0, 0, 0)
        self.last_spec_pos: list[int] = []
        self.last_sources: dict[str, int] = {}
        self.kvx: dict | None = None       # KV-transfer children, created on the first KV-transfer stats
        self.last_kvx = (0, 0, 0, 0, 0, 0)
        self.last_kvx_transfers = 0
        self.kvo: dict | None = None       # KV offloading children, created on the first tier stats
        self.last_kvo: dict[str, float] = {}
        self.so: dict | None = None        # structured-output children, created on the first such stats
        self.last_so: dict[str, float] = {}

    def record_sources(self, by_source: dict[str, int]) -> None:
        """Advance ``prompt_tokens_by_source`` to the core's cumulative counts."""
        for src, total in by_source.items():
            self.last_sources[src] = _inc(self._fams["kvx_sources"].labels(*self._lv, src), total,
                                          self.last_sources.get(src, 0))

    def record_kv_transfer(self, kt) -> None:
        """Advance the ``kv_transfer_*`` series to the core's cumulative :class:`KVTransferStats`."""
        f, lv = self._fams, self._lv
        if self.kvx is None:
            self.kvx = {"sent": f["kvx_bytes"].labels(*lv, "sent"), "received": f["kvx_bytes"].labels(*lv, "received"),
                        "failed": f["kvx_failed"].labels(*lv), "recomputed": f["kvx_recomputed"].labels(*lv),
                        "expired": f["kvx_expired"].labels(*lv), "released": f["kvx_released"].labels(*lv),
                        "time": f["kvx_time"].labels(*lv)}
        totals = (kt.bytes_sent, kt.bytes_received, kt.num_failed, kt.num_recomputed, kt.num_expired, kt.num_released)
        self.last_kvx = tuple(_inc(self.kvx[n], t, last) for n, t, last in
                              zip(("sent", "received", "failed", "recomputed", "expired", "released"), totals,
                                  self.last_kvx))
        new = kt.num_transfers - self.last_kvx_transfers
        if new > 0:
            for v in kt.recent_times[-new:]:
                self.kvx["time"].observe(v)
        self.last_kvx_transfers = kt.num_transfers

    def record_kv_offload(self, st) -> None:
        """Advance the ``kv_offload_*`` / ``external_prefix_cache_*`` series to the tier's :class:`KVOffloadStats`."""
        f, lv = self._fams, self._lv
        if self.kvo is None:
            self.kvo = {"queries": f["kvo_queries"].labels(*lv), "hits": f["kvo_hits"].labels(*lv),
                        "evicted": f["kvo_evicted"].labels(*lv), "discarded": f["kvo_discarded"].labels(*lv),
                        "dropped": f["kvo_dropped"].labels(*lv), "write_errors": f["kvo_write_errors"].labels(*lv),
                        "failed": f["kvo_failed_loads"].labels(*lv)}
            for d in ("store", "load"):
                self.kvo["blocks_" + d] = f["kvo_blocks"].labels(*lv, d)
                self.kvo["bytes_" + d] = f["kvo_bytes"].labels(*lv, d)
            for d in ("store", "load", "copy"):
                self.kvo["seconds_" + d] = f["kvo_seconds"].labels(*lv, d)
        totals = {"queries": st.queries, "hits": st.hits, "evicted": st.blocks_evicted,
                  "discarded": st.blocks_discarded, "dropped": st.saves_dropped, "write_errors": st.write_errors,
                  "failed": st.num_failed_loads, "blocks_store": st.blocks_stored, "blocks_load": st.blocks_loaded,
                  "bytes_store": st.bytes_stored, "bytes_load": st.bytes_loaded, "seconds_store": st.store_seconds,
                  "seconds_load": st.load_seconds, "seconds_copy": st.copy_seconds}
        for name, total in totals.items():
            self.last_kvo[name] = _inc(self.kvo[name], total, self.last_kvo.get(name, 0))
        f["kvo_usage"].labels(*lv).set(st.resident_bytes)
        f["kvo_capacity"].labels(*lv).set(st.capacity_bytes)
        f["kvo_resident"].labels(*lv).set(st.resident_blocks)
        f["kvo_paused"].labels(*lv).set(1 if st.writes_paused else 0)
        if getattr(st, "host_capacity_bytes", 0):
            for d, total in (("store", st.host_blocks_stored), ("load", st.host_blocks_loaded),
                             ("evict", st.host_blocks_evicted)):
                key = "host_" + d
                if key not in self.kvo:
                    self.kvo[key] = f["kvo_host_blocks"].labels(*lv, d)
                self.last_kvo[key] = _inc(self.kvo[key], total, self.last_kvo.get(key, 0))
            f["kvo_host_usage"].labels(*lv).set(st.host_resident_bytes)
            f["kvo_host_capacity"].labels(*lv).set(st.host_capacity_bytes)
            f["kvo_host_resident"].labels(*lv).set(st.host_resident_blocks)
    def record_structured(self, st) -> None:
        """Advance the structured-output series to the core's cumulative
        :class:`~tokenmill.structured_output.manager.StructuredOutputStats`."""
        f, lv = self._fams, self._lv
        if self.so is None:
            self.so = {n: f[n].labels(*lv) for n in _SO_COUNTERS}
            self.so["so_compile_time"] = f["so_compile_time"].labels(*lv)
            self.so["so_queue"] = f["so_queue"].labels(*lv)
        for n, attr in _SO_COUNTERS.items():
            self.last_so[n] = _inc(self.so[n], getattr(st, attr), self.last_so.get(n, 0))
        for kind, total in st.requests_by_kind.items():
            key = "kind:" + kind
            self.last_so[key] = _inc(f["so_requests"].labels(*lv, kind), total, self.last_so.get(key, 0))
        new = st.compile_count - int(self.last_so.get("compiles", 0))
        if new > 0:
            for v in st.recent_compile_times[-new:]:
                self.so["so_compile_time"].observe(v)
        self.last_so["compiles"] = st.compile_count
        self.so["so_queue"].set(st.num_waiting_for_grammar)

    def record_spec(self, sd) -> None:
        """Advance the ``spec_decode_*`` counters to the core's cumulative :class:`SpecDecodingStats`."""
        if self.spec is None:
            self.spec = {n: self._fams[n].labels(*self._lv)
                         for n in ("spec_drafts", "spec_draft_tokens", "spec_accepted")}
        totals = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens)
        self.last_spec = tuple(_inc(self.spec[n], t, last) for n, t, last in
                               zip(("spec_drafts", "spec_draft_tokens", "spec_accepted"), totals, self.last_spec))
        pos = sd.num_accepted_tokens_per_pos
        self.last_spec_pos += [0] * (len(pos) - len(self.last_spec_pos))
        for i, total in enumerate(pos):
            self.last_spec_pos[i] = _inc(self._fams["spec_accepted_per_pos"].labels(*self._lv, str(i)), total,
                                         self.last_spec_pos[i])

    def record_eplb(self, st) -> None:
        """Update the ``eplb_*`` series from the core's :class:`~tokenmill.metrics.stats.EplbStats`."""
        if self.eplb is None:
            self.eplb = {n: self._fams[n].labels(*self._lv)
                         for n in ("eplb_imbalance", "eplb_expert_imbalance", "eplb_before", "eplb_after",
                                   "eplb_rebalances", "eplb_changes", "eplb_moved", "eplb_seconds")}
        e = self.eplb
        e["eplb_imbalance"].set(st.imbalance_ratio)
        e["eplb_expert_imbalance"].set(st.expert_imbalance_ratio)
        if st.imbalance_before is not None:
            e["eplb_before"].set(st.imbalance_before)
        if st.imbalance_after is not None:
            e["eplb_after"].set(st.imbalance_after)
        last = self.last_eplb
        self.last_eplb = (_inc(e["eplb_rebalances"], st.num_rebalances, last[0]),
                          _inc(e["eplb_changes"], st.num_placement_changes, last[1]),
                          _inc(e["eplb_moved"], st.num_experts_moved, last[2]),
                          _inc(e["eplb_seconds"], st.rebalance_seconds_total, last[3]))
        fam = self._fams["eplb_expert_load"]
        for layer, row in zip(st.load_layers, st.expert_load):
            for expert, v in enumerate(row):
                fam.labels(*self._lv, layer, str(expert)).set(v)

    def finished(self, reason: str):
        c = self.success.get(reason)
        if c is None:
            c = self.success[reason] = self._success_fam.labels(*self._lv, reason)
        return c


class PrometheusStatLogger:
    """Keeps the ``tokenmill:`` metrics up to date from engine and iteration stats.

    Every engine-side series carries the labels ``model_name`` and ``engine``
    (the engine core's index, ``"0"`` for a single core; one per core under
    ``--data-parallel-size``), as vLLM labels them; ``request_refused_total``
    is the API process's and has no ``engine`` label.

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: context limit in tokens (sets the token-count buckets).
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        # No *_created series (as vLLM): they double the output and no dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self._fams = {s.key: s.build(self.registry, ("model_name", "engine"), token_buckets) for s in ENGINE_METRICS}
        for s in API_METRICS:
            metric = s.build(self.registry, ("model_name",), token_buckets)
            setattr(self, s.key, metric.labels(model_name) if not s.labels else metric)
        for reason in ("waiting_requests", "waiting_tokens", "slo"):
            self._refused.labels(model_name, reason)
        # LoRA (--enable-lora): vLLM's lora_requests_info (value: the update's Unix time; vLLM's labels, no
        # model_name) and requests per adapter
        self._lora_info = Gauge(PREFIX + "lora_requests_info", "Running stats on LoRA requests: adapters of "
                                "running and waiting requests (comma-separated) and max_lora.",
                                ["running_lora_adapters", "max_lora", "waiting_lora_adapters"], registry=self.registry)
        self._lora_requests = Counter(PREFIX + "lora_requests", "Requests added per LoRA adapter.",
                                      ["model_name", "lora_name"], registry=self.registry)
        self._lora_last: dict[tuple[int, str], int] = {}     # (engine core, adapter) -> its count seen
        self._lora_snap: dict[int, dict] = {}                 # engine core -> its last LoRA snapshot
        self.slo_tpot_factor.set(1.0)
        self._cache_config = CACHE_CONFIG_INFO.build(self.registry, ("model_name", "engine"), token_buckets)
        self._engines: dict[int, _EngineSeries] = {}
        self.engine(0)  # export engine 0's zeros from the start

    def engine(self, index: int) -> _EngineSeries:
        """The series of engine core ``index`` (created on first use)."""
        e = self._engines.get(index)
        if e is None:
            e = self._engines[index] = _EngineSeries(self._fams, self.model_name, str(index))
        return e

    def set_cache_config(self, index: int, num_blocks: int, block_size: int, cache_dtype: str,
                         enable_prefix_caching: bool) -> None:
        """Export engine core ``index``'s KV cache configuration as ``tokenmill:cache_config_info``.

        Args:
            num_blocks: the core's KV pool size in blocks (label ``num_gpu_blocks``, vLLM's name).
            block_size: tokens per block.
            cache_dtype: ``--kv-cache-dtype`` as configured (``auto``, ``bfloat16``, ``fp8``, ...).
            enable_prefix_caching: ``--enable-prefix-caching``.
        """
        self._cache_config.labels(self.model_name, str(index), str(block_size), cache_dtype,
                                  str(bool(enable_prefix_caching)), str(int(num_blocks))).set(1)

    def observe_ttft_prediction(self, seconds: float) -> None:
        """One TTFT prediction of SLO admission control (admitted or refused request), seconds."""
        self.predicted_ttft.observe(max(0.0, seconds))

    def observe_ttft_prediction_error(self, seconds: float) -> None:
        """Measured minus predicted TTFT of one admitted request, seconds."""
        self.ttft_pred_error.observe(seconds)
        self.ttft_pred_abs_error.observe(abs(seconds))

    def observe_tpot_prediction(self, seconds: float) -> None:
        """One TPOT prediction of SLO admission control (admitted or refused request), seconds."""
        self.predicted_tpot.observe(max(0.0, seconds))

    def observe_tpot_prediction_error(self, seconds: float) -> None:
        """Measured minus predicted TPOT of one finished admitted request, seconds."""
        self.tpot_pred_error.observe(seconds)
        self.tpot_pred_abs_error.observe(abs(seconds))

    def set_slo_decode_batch_limit(self, sequences: int) -> None:
        """The largest decode batch predicted to meet the TPOT target (sequences)."""
        self.slo_decode_batch_limit.set(sequences)

    def set_slo_margins(self, ttft_margin: float, tpot_factor: float) -> None:
        """The safety margins --slo currently judges with (TTFT: + seconds; TPOT: × factor)."""
        self.slo_ttft_margin.set(ttft_margin)
        self.slo_tpot_factor.set(tpot_factor)

    def record_refusal(self, reason: str) -> None:
        """Count one request refused by admission control (``reason``: the limit that refused it)."""
        self._refused.labels(self.model_name, reason).inc()

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Update engine 0's gauges from the core snapshot and counters/histograms from the iteration."""
        self.record_engine(0, engine_stats, iteration)

    def record_engine(self, index: int, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Like :meth:`record`, for engine core ``index`` (``--data-parallel-size``)."""
        e = self.engine(index)
        if engine_stats is not None:
            s = engine_stats
            e.num_running.set(s.num_running)
            e.num_waiting.set(s.num_waiting)
            e.kv_usage.set(min(1.0, max(0.0, s.kv_cache_usage)))
            e.last_preemptions = _inc(e.num_preemptions, s.num_preemptions_total, e.last_preemptions)
            e.last_queries = _inc(e.prefix_queries, s.prefix_cache_queries, e.last_queries)
            e.last_hits = _inc(e.prefix_hits, s.prefix_cache_hits, e.last_hits)
            if s.spec_decoding is not None:
                e.record_spec(s.spec_decoding)
            if s.eplb is not None:
                e.record_eplb(s.eplb)
            if s.prompt_tokens_by_source is not None:
                e.record_sources(s.prompt_tokens_by_source)
            if s.kv_transfer is not None:
                e.record_kv_transfer(s.kv_transfer)
            if getattr(s, "kv_offload", None) is not None:
                e.record_kv_offload(s.kv_offload)
            if getattr(s, "structured_outputs", None) is not None:
                e.record_structured(s.structured_outputs)
            if getattr(s, "lora", None) is not None:
                self.record_lora(s.lora, index)
            if s.num_steps > e.last_steps:
                e.last_steps = s.num_steps
                e.sched_time.observe(s.last_schedule_time)
        if iteration is not None:
            e.prompt_tokens.inc(iteration.num_prompt_tokens)
            e.generation_tokens.inc(iteration.num_generation_tokens)
            for v in iteration.time_to_first_tokens:
                e.ttft.observe(v)
            for v in iteration.inter_token_latencies:
                e.itl.observe(v)
            for f in iteration.finished:
                e.finished(f.finish_reason).inc()
                e.e2e.observe(f.e2e_latency)
                e.queue.observe(f.queued_time)
                e.prefill.observe(f.prefill_time)
                e.decode.observe(f.decode_time)
                e.inference.observe(f.prefill_time + f.decode_time)
                e.req_prompt_tokens.observe(f.num_prompt_tokens)
                e.req_gen_tokens.observe(f.num_generation_tokens)
                if f.max_tokens_param is not None:
                    e.req_max_tokens.observe(f.max_tokens_param)

    def record_lora(self, lora: dict, index: int = 0) -> None:
        """``lora_requests_info`` and ``lora_requests`` from engine core ``index``'s LoRA snapshot
        (:attr:`EngineStats.lora`); with ``--data-parallel-size`` the info series shows the adapters running
        and waiting on any core and the counter sums the cores' counts."""
        self._lora_snap[index] = lora
        snaps = list(self._lora_snap.values())
        self._lora_info.clear()
        self._lora_info.labels(",".join(sorted({n for x in snaps for n in x["running"]})), str(lora["max_lora"]),
                               ",".join(sorted({n for x in snaps for n in x["waiting"]}))).set(time.time())
        for name, total in lora["requests_total"].items():
            self._lora_last[(index, name)] = _inc(self._lora_requests.labels(self.model_name, name), total,
                                                  self._lora_last.get((index, name), 0))

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


# structured-output counter family -> StructuredOutputStats attribute
_SO_COUNTERS = {"so_cache_queries": "cache_queries", "so_cache_hits": "cache_hits", "so_failures": "compile_failures",
                "so_timeouts": "compile_timeouts", "so_fill": "mask_fill_time", "so_wait": "mask_wait_time",
                "so_forced": "forced_draft_tokens", "so_forced_acc": "forced_accepted_tokens"}


def _inc(counter: Counter, total: int, last: int) -> int:
    """Advance ``counter`` to the core's cumulative ``total``; returns the new baseline."""
    if total > last:
        counter.inc(total - last)
    return total  # (a smaller total means the core restarted: rebase)
