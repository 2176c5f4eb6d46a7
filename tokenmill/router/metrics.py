"""The router's Prometheus metrics (its own registry; names ``tokenmill:router_*``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class RouterMetrics:
    """The router's Prometheus metrics (own registry, prefix ``tokenmill:router_``).

    * ``tokenmill:router_requests_total{backend}``: requests forwarded (after retries, one per request).
    * ``tokenmill:router_routed_total{policy,reason}``: routing decisions by the reason the policy gave.
    * ``tokenmill:router_retries_total{backend,reason}``: requests moved off a backend before any byte of
      its answer reached the client: ``unreachable`` (connection refused or timed out; the backend leaves
      the rotation), ``no_response`` (the connection broke before the first body byte, e.g. the process
      hung and was killed), ``backend_dead`` (out of the rotation for ``--dead-backend-timeout`` before
      the first byte). At most ``--max-retries`` per request; never once a byte was relayed.
    * ``tokenmill:router_request_errors_total{reason}``: requests the router answered with an error
      (``unknown_model``, ``no_backend``, ``upstream``, ``bad_request``).
    * ``tokenmill:router_estimated_prefix_cache_queries_total{unit}`` / ``..._hits_total{unit}``: the
      policy's estimate of the prompt share the chosen backend has cached (tokens for kv_aware,
      characters for prefix_aware); hits / queries is the cache-hit estimate.
    * ``tokenmill:router_backend_healthy{backend}``, ``tokenmill:router_backend_in_flight{backend}``,
      ``tokenmill:router_kv_blocks{backend}`` (blocks the KV index holds),
      ``tokenmill:router_kv_event_batches_total{backend}``: per-backend state.
    * ``tokenmill:router_request_errors_total{reason="backend_dead"}``: requests failed because their
      backend was out of the rotation for ``--dead-backend-timeout``.
    * ``tokenmill:router_held_requests_total{reason}``: requests the policy held at the router
      (``prefill``: their prefix was still being computed on the chosen backend; ``busy``: every
      backend was over ``--active-decode-blocks-threshold``), ``tokenmill:router_hold_seconds``: how
      long they waited (histogram), ``tokenmill:router_hold_timeouts_total``: holds that reached
      ``--router-queue-timeout`` and were routed anyway, ``tokenmill:router_held_requests_now`` (gauge).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tokenmill:router_requests", "Requests forwarded to a backend.", ["backend"], registry=r)
        self.routed = Counter("tokenmill:router_routed", "Routing decisions by reason.", ["policy", "reason"], registry=r)
        self.retries = Counter("tokenmill:router_retries",
                               "Requests re-routed before their first byte because a backend failed them.",
                               ["backend", "reason"], registry=r)
        self.errors = Counter("tokenmill:router_request_errors", "Requests answered with an error by the router.",
                              ["reason"], registry=r)
        self.cache_queries = Counter("tokenmill:router_estimated_prefix_cache_queries",
                                     "Prompt size of routed requests (router estimate).", ["unit"], registry=r)
        self.cache_hits = Counter("tokenmill:router_estimated_prefix_cache_hits",
                                  "Prompt part the chosen backend is estimated to hold in its prefix cache.",
                                  ["unit"], registry=r)
        self.healthy = Gauge("tokenmill:router_backend_healthy", "1 when the backend is in the rotation.",
                             ["backend"], registry=r)
        self.in_flight = Gauge("tokenmill:router_backend_in_flight", "Requests open to the backend.",
                               ["backend"], registry=r)
        self.kv_blocks = Gauge("tokenmill:router_kv_blocks", "KV blocks the router's index holds for the backend.",
                               ["backend"], registry=r)
        self.kv_batches = Gauge("tokenmill:router_kv_event_batches", "KV event batches applied for the backend.",
                                ["backend"], registry=r)
        self.held = Counter("tokenmill:router_held_requests", "Requests held at the router before routing.",
                            ["reason"], registry=r)
        self.holding = Gauge("tokenmill:router_held_requests_now", "Requests held at the router now.", registry=r)
        self.hold_seconds = Histogram("tokenmill:router_hold_seconds", "Time requests were held at the router.",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                      registry=r)
        self.hold_timeouts = Counter("tokenmill:router_hold_timeouts", "Holds that reached --router-queue-timeout.",
                                     registry=r)

    def render(self, router: Any) -> bytes:  # a tokenmill.router.router.Router (not imported: no cycle)
        for b in router.backends:
            self.healthy.labels(b.name).set(1 if b.healthy else 0)
            self.in_flight.labels(b.name).set(b.in_flight)
            self.kv_blocks.labels(b.name).set(router.index.num_blocks(b.index))
            sub = router.subscribers.get(b.index)
            self.kv_batches.labels(b.name).set(sub.num_batches if sub else 0)
        return generate_latest(self.registry)
