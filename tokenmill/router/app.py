"""``tokenmill router``: one OpenAI-compatible endpoint in front of many backends.

Request path: read the body → pick the model's pool (the healthy backends
whose ``/v1/models`` lists the request's ``model``) → the pool's policy picks a
backend → forward the body unchanged → relay the backend's status, headers and
bytes as they arrive (SSE streams unbuffered; errors, 429 and ``Retry-After``
as the backend sent them).

* A request that never reached a backend (connection refused or timed out)
  is sent to another one of the pool (``--max-retries``) and the failed
  backend leaves the rotation until a health check passes.
* A client that disconnects, before or during the response, closes the
  upstream connection, which makes a tokenmill (or vLLM) backend abort the
  request and free its KV blocks.
* ``GET /v1/models`` is the union of the healthy backends' models; a request
  for a model no backend serves gets OpenAI's 404; one whose backends are all
  down gets 503.
* ``GET /health``: 200 while at least one backend is healthy, else 503.
  ``GET /metrics``: the router's Prometheus metrics (:class:`RouterMetrics`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import tokenmill
from tokenmill.server.body_limit import BodySizeLimitMiddleware
from tokenmill.router.backends import Backend, BackendSpec, HealthChecker
from tokenmill.router.kv_index import KVEventSubscriber, KVIndex
from tokenmill.router.policies import Policy, RouteDecision, RouteInput, make_policy
from tokenmill.router.prompt import PromptTokenizer, block_hash_chain, prompt_text

logger = logging.getLogger(__name__)

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}
_DROP_RESPONSE = _HOP_BY_HOP - {"content-length"} | {"server", "date"}
# Prompts longer than this (characters) are tokenized in a worker thread.
_INLINE_TOKENIZE_CHARS = 4096


@dataclass
class RouterConfig:
    """Settings of ``tokenmill router`` (see ``tokenmill router --help`` for units and defaults)."""

    backends: list[BackendSpec] = field(default_factory=list)
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8080
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26
    kv_overlap_score_weight: float = 1.0
    kv_eviction_weight: float = 1.0
    kv_recompute_weight: float = 1.0
    router_temperature: float = 0.0
    block_size: int = 16
    tokenizer: str | None = None
    kv_events_topic: str = ""
    health_check_interval: float = 1.0
    health_check_timeout: float = 2.0
    health_failure_threshold: int = 3
    max_request_body_bytes: int = 16 * 2**20
    connect_timeout: float = 2.0
    max_retries: int = 2
    seed: int | None = None
    load_source: str = "inflight"
    backend_api_key: str | None = None
    pd_disaggregation: bool = False
    prefill: list[BackendSpec] = field(default_factory=list)
    decode: list[BackendSpec] = field(default_factory=list)
    decision_log: str | None = None
    kv_prefill_wait: bool = True
    active_decode_blocks_threshold: float | None = 1.0
    router_queue_timeout: float = 30.0
    dead_backend_timeout: float = 30.0


def _error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    types = {400: "BadRequestError", 404: "NotFoundError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}
    return JSONResponse({"error": {"message": message, "type": types.get(status, "APIError"), "param": param,
                                   "code": status}}, status_code=status, headers=headers)


class RouterMetrics:
    """The router's Prometheus metrics (own registry, prefix ``tokenmill:router_``).

    * ``tokenmill:router_requests_total{backend}``: requests forwarded (after retries, one per request).
    * ``tokenmill:router_routed_total{policy,reason}``: routing decisions by the reason the policy gave.
    * ``tokenmill:router_retries_total{backend}``: requests moved off a backend they could not reach.
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
        self.retries = Counter("tokenmill:router_retries", "Requests re-routed because a backend could not be reached.",
                               ["backend"], registry=r)
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

    def render(self, router: "Router") -> bytes:
        for b in router.backends:
            self.healthy.labels(b.name).set(1 if b.healthy else 0)
            self.in_flight.labels(b.name).set(b.in_flight)
            self.kv_blocks.labels(b.name).set(router.index.num_blocks(b.index))
            sub = router.subscribers.get(b.index)
            self.kv_batches.labels(b.name).set(sub.num_batches if sub else 0)
        return generate_latest(self.registry)


class Router:
    """State of the router process: backends, health checks, KV event subscribers, policies, HTTP client."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None = None) -> None:
        if config.pd_disaggregation:
            if not config.prefill or not config.decode:
                raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
            if config.backends:
                raise ValueError("--pd-disaggregation takes --prefill and --decode servers, not --backend")
            config.backends = [*config.prefill, *config.decode]
        if not config.backends:
            raise ValueError("the router needs at least one backend (--backend URL or --backend-file)")
        self.config = config
        self.backends = [Backend(spec, i) for i, spec in enumerate(config.backends)]
        # --pd-disaggregation: backend indices of the prefill pool; the rest decode
        self.prefill_indices = set(range(len(config.prefill))) if config.pd_disaggregation else set()
        self.index = KVIndex()
        self.metrics = RouterMetrics()
        self.tokenizer = tokenizer
        self.policies: dict[str | None, Policy] = {}
        make_policy(config.policy, index=self.index, load_source=config.load_source,  # validate now
                    overlap_weight=config.kv_overlap_score_weight, temperature=config.router_temperature,
                    eviction_weight=config.kv_eviction_weight, recompute_weight=config.kv_recompute_weight,
                    prefill_wait=config.kv_prefill_wait, busy_threshold=config.active_decode_blocks_threshold)
        if config.router_queue_timeout < 0:
            raise ValueError(f"--router-queue-timeout must be >= 0, got {config.router_queue_timeout}")
        self.subscribers: dict[int, KVEventSubscriber] = {}
        self.client: httpx.AsyncClient | None = None
        self.health: HealthChecker | None = None
        self._decision_log = open(config.decision_log, "a", buffering=1) if config.decision_log else None
        self._t0 = time.monotonic()
        self._changed: asyncio.Event | None = None   # set (and replaced) when held requests should look again
        self.loop: asyncio.AbstractEventLoop | None = None
        self._dead: dict[int, asyncio.Event] = {}

    def _notify(self) -> None:
        """Wake the requests held at the router: a request ended or got its first byte, a KV event batch
        arrived, a backend changed health."""
        ev = self._changed
        if ev is not None:
            self._changed = asyncio.Event()
            ev.set()

    # -- life cycle ------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP client, run a first health round, start checks and KV event subscribers."""
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout, read=None, write=None, pool=None),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))
        self.health = HealthChecker(self.backends, self.client, c.health_check_interval, c.health_check_timeout,
                                    unhealthy_after=c.health_failure_threshold, api_key=c.backend_api_key,
                                    scrape_metrics=c.load_source == "metrics",
                                    read_pool_size=c.policy == "kv_aware")
        self.health.on_change = self._on_health_change
        self.health.on_round = self._after_health_round
        self._changed = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        await self.health.check_all()
        self._sync_pool_sizes()
        self.health.start()
        if c.policy == "kv_aware":
            for b in self.backends:
                if b.spec.kv_events:
                    sub = KVEventSubscriber(b.index, b.spec.kv_events, self.index, b.spec.replay,
                                            topic=c.kv_events_topic)
                    sub.on_batch = self._notify
                    self.index.expect_events(b.index)
                    sub.start()
                    self.subscribers[b.index] = sub
                else:
                    logger.warning("backend %s has no kv_events endpoint: kv_aware routes it by load only", b.url)

    async def stop(self) -> None:
        if self.health is not None:
            await self.health.stop()
        for s in self.subscribers.values():
            await s.stop()
        if self.client is not None:
            await self.client.aclose()
        if self._decision_log is not None:
            self._decision_log.close()
            self._decision_log = None

    def dead_event(self, b: Backend) -> asyncio.Event:
        """Set when ``b`` has been out of the rotation for ``--dead-backend-timeout``: its requests fail."""
        ev = self._dead.get(b.index)
        if ev is None:
            ev = self._dead[b.index] = asyncio.Event()
        return ev

    def _after_health_round(self) -> None:
        self._sync_pool_sizes()
        self._fail_dead_backends()

    def _sync_pool_sizes(self) -> None:
        """Give the KV index the pool sizes the backends report (kv_aware's busy hold and eviction term)."""
        for b in self.backends:
            self.index.set_pool_size(b.index, b.pool_blocks)

    def _fail_dead_backends(self) -> None:
        """After each health round: fail the in-flight requests of backends down for too long (a hung or
        unreachable machine would hold them forever; a killed process already reset their connections)."""
        now = time.monotonic()
        for b in self.backends:
            if (not b.healthy and b.down_since is not None
                    and now - b.down_since >= self.config.dead_backend_timeout):
                ev = self.dead_event(b)
                if not ev.is_set():
                    if b.in_flight:
                        logger.warning("backend %s down for %.0f s: failing its %d requests in flight", b.url,
                                       now - b.down_since, b.in_flight)
                    ev.set()

    def _on_health_change(self, b: Backend) -> None:
        if b.healthy and self._dead.get(b.index) is not None and self._dead[b.index].is_set():
            self._dead[b.index] = asyncio.Event()   # back: new requests wait on a fresh event
        self._notify()
        if not b.healthy:
            for p in self.policies.values():
                p.on_backend_down(b)

    # -- routing ---------------------------------------------------------------
    def policy_for(self, model: str | None) -> Policy:
        """One policy object per model pool (each keeps its own rotation / trees)."""
        p = self.policies.get(model)
        if p is None:
            c = self.config
            p = self.policies[model] = make_policy(
                c.policy, index=self.index, cache_threshold=c.cache_threshold,
                balance_abs_threshold=c.balance_abs_threshold, balance_rel_threshold=c.balance_rel_threshold,
                max_tree_size=c.max_tree_size, overlap_weight=c.kv_overlap_score_weight,
                temperature=c.router_temperature, block_size=c.block_size, seed=c.seed, load_source=c.load_source,
                eviction_weight=c.kv_eviction_weight, recompute_weight=c.kv_recompute_weight,
                prefill_wait=c.kv_prefill_wait, busy_threshold=c.active_decode_blocks_threshold)
        return p

    def all_models(self, healthy_only: bool = True) -> list[str]:
        seen: dict[str, None] = {}
        for b in self.backends:
            if b.healthy or not healthy_only:
                for m in b.models:
                    seen.setdefault(m, None)
        return list(seen)

    def pool(self, model: str | None, role: str | None = None) -> list[Backend] | JSONResponse:
        """Healthy backends serving ``model`` (all healthy ones when None), or the error response.

        ``role`` (``"prefill"`` / ``"decode"``, with ``--pd-disaggregation``) restricts it to that pool.
        """
        backends = self.backends
        if role is not None:
            backends = [b for b in backends if (b.index in self.prefill_indices) == (role == "prefill")]
            res = self._pool_of(backends, model)
            if isinstance(res, JSONResponse) and res.status_code == 503:
                return _error(503, f"no {role} server is available for this request", "model")
            return res
        return self._pool_of(backends, model)

    def _pool_of(self, backends: list[Backend], model: str | None) -> list[Backend] | JSONResponse:
        healthy = [b for b in backends if b.healthy]
        if model is None:
            return healthy or _error(503, "no backend is available", None)
        pool = [b for b in healthy if model in b.models]
        if pool:
            return pool
        if any(model in b.models for b in backends):
            return _error(503, f"every backend serving model `{model}` is down", "model")
        if not healthy:
            return _error(503, "no backend is available", None)
        return _error(404, f"The model `{model}` does not exist. Available models: "
                           f"{', '.join(self.all_models()) or '(none)'}.", "model")

    async def route_input(self, policy: Policy, path: str, body: dict[str, Any]) -> RouteInput:
        rin = RouteInput(text=prompt_text(path, body))
        if policy.needs_tokens and self.tokenizer is not None and path.endswith("completions"):
            if len(rin.text) > _INLINE_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(self.tokenizer.token_ids, path, body)
            else:
                ids = self.tokenizer.token_ids(path, body)
            if ids:
                salt = body.get("cache_salt")
                rin.num_prompt_tokens = len(ids)
                rin.block_hashes = block_hash_chain(ids, policy.block_size,  # type: ignore[attr-defined]
                                                    salt if isinstance(salt, str) else None)
        return rin

    def _begin(self, b: Backend, d: RouteDecision) -> None:
        d.started = time.monotonic()
        if d.detail is not None:
            d.detail["t"] = d.started - self._t0
        logger.debug("route -> %s (%s): overlap %d/%d tokens, costs %s, evicts %d reused blocks, in flight %d, "
                     "queued prefill %d blocks", b.url, d.reason, d.matched, d.total, d.costs, d.evicted_blocks,
                     b.in_flight, b.prefill_blocks)
        b.in_flight += 1
        b.active_blocks += d.request_blocks
        b.prefill_blocks += d.new_prefill_blocks

    def _first_byte(self, b: Backend, d: RouteDecision) -> None:
        if d.started and d.detail is not None:
            d.detail["ttft_s"] = round(time.monotonic() - d.started, 4)
        if d.started:
            logger.debug("first byte from %s after %.2f s (%d new prefill blocks)", b.url,
                         time.monotonic() - d.started, d.new_prefill_blocks)
            d.started = 0.0
        b.prefill_blocks -= d.new_prefill_blocks
        d.new_prefill_blocks = 0
        self._notify()

    def _end(self, b: Backend, d: RouteDecision, policy: Policy | None = None,
             cached_tokens: int | None = None) -> None:
        if self._decision_log is not None and d.detail is not None:
            self._write_decision(b, d, cached_tokens)
        if policy is not None:
            policy.on_finish(d)
        self._first_byte(b, d)
        b.in_flight -= 1
        b.active_blocks -= d.request_blocks
        d.request_blocks = 0
        self._notify()

    def _write_decision(self, b: Backend, d: RouteDecision, cached_tokens: int | None) -> None:
        """One JSON line of ``--decision-log``: the policy's record plus what happened.

        Added here: ``t`` (s since the router started), ``prompt_tokens``, ``est_cached_tokens`` (the
        policy's overlap estimate) and ``cached_tokens`` (the backend's ``usage.prompt_tokens_details``,
        when the response carried one), the event lag of the chosen backend's last KV batch (s).
        """
        rec = dict(d.detail or {})
        rec.update(t=round(rec.get("t", 0.0), 4), backend=b.index, prompt_tokens=d.total,
                   est_cached_tokens=d.matched, cached_tokens=cached_tokens,
                   event_lag_s=round(self.index.last_lag[b.index], 4) if b.index in self.index.last_lag else None)
        d.detail = None
        try:
            self._decision_log.write(json.dumps(rec) + "\n")  # type: ignore[union-attr]
        except (OSError, ValueError) as e:
            logger.warning("decision log write failed: %s", e)

    async def proxy(self, request: Request, path: str) -> Response:
        """Route one POST request and relay the answer (see module docstring)."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.metrics.errors.labels("bad_request").inc()
            return _error(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            self.metrics.errors.labels("bad_request").inc()
            return _error(400, "request body must be a JSON object")
        model = body.get("model")
        model = model if isinstance(model, str) else None
        pool = self.pool(model)
        if isinstance(pool, JSONResponse):
            self.metrics.errors.labels("unknown_model" if pool.status_code == 404 else "no_backend").inc()
            return pool
        policy = self.policy_for(model)
        rin = await self.route_input(policy, path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        watcher = asyncio.create_task(_wait_disconnect(request))
        return await self.send_to_pool(raw, headers, path, pool, policy, rin, watcher)

    async def send_to_pool(self, raw: bytes, headers: dict[str, str], path: str, pool: list[Backend],
                           policy: Policy, rin: RouteInput, watcher: asyncio.Task) -> Response:
        """Send ``raw`` to the backend ``policy`` picks from ``pool`` (retrying unreachable ones) and relay it.

        ``watcher`` ends when the client disconnects; the relay owns it afterwards (it is cancelled here
        when no relay started).
        """
        tried: set[int] = set()
        last_error = "no backend is available"
        held_since: float | None = None
        held_reason = None
        # only before the first try (a retry after an unreachable backend goes at once); timeout 0: never
        may_hold = self.config.router_queue_timeout > 0
        try:
            for _ in range(self.config.max_retries + 1):
                cands = [b for b in pool if b.healthy and b.index not in tried]
                if not cands:
                    break
                while may_hold:   # the policy may hold the request here until a backend suits it
                    reason, use = policy.hold(cands, rin)
                    if reason is None:
                        cands = list(use)
                        break
                    now = time.monotonic()
                    if held_since is None:
                        held_since, held_reason = now, reason
                        self.metrics.held.labels(reason).inc()
                    left = self.config.router_queue_timeout - (now - held_since)
                    if left <= 0:
                        self.metrics.hold_timeouts.inc()
                        cands = list(use)
                        break
                    assert self._changed is not None
                    change = asyncio.ensure_future(self._changed.wait())
                    self.metrics.holding.inc()
                    # a deadline inside the policy (e.g. events overdue); duck-typed policies may lack it
                    recheck_in = getattr(policy, "recheck_in", None)
                    recheck = recheck_in() if recheck_in is not None else None
                    wait_s = left if recheck is None else min(left, recheck + 0.001)
                    try:
                        await asyncio.wait({change, watcher}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        self.metrics.holding.dec()
                        change.cancel()
                    if watcher.done():   # the client left while its request was held
                        self.metrics.hold_seconds.observe(time.monotonic() - held_since)
                        return Response(status_code=499)
                    cands = [b for b in pool if b.healthy and b.index not in tried]
                    if not cands:
                        break
                if not cands:
                    break
                held_s = None
                if may_hold and held_since is not None:
                    held_s = time.monotonic() - held_since
                    self.metrics.hold_seconds.observe(held_s)
                may_hold = False
                d = policy.select(cands, rin)
                if d.detail is not None and held_s is not None:
                    d.detail.update(held_reason=held_reason, held_s=round(held_s, 4))
                b = d.backend
                tried.add(b.index)
                assert self.client is not None
                req = self.client.build_request("POST", b.url + path, content=raw, headers=headers)
                self._begin(b, d)
                send = asyncio.create_task(self.client.send(req, stream=True))
                dead = asyncio.ensure_future(self.dead_event(b).wait())
                try:
                    done, _ = await asyncio.wait({send, watcher, dead}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    dead.cancel()
                if send not in done:  # the client left, or the backend died, while it was still working
                    send.cancel()
                    try:
                        await send
                    except BaseException:  # noqa: BLE001
                        pass
                    self._end(b, d, policy)
                    if watcher.done():
                        return Response(status_code=499)
                    self.metrics.errors.labels("backend_dead").inc()
                    return _error(502, f"backend {b.url} stopped answering (out of the rotation for "
                                       f"{self.config.dead_backend_timeout:g} s): {b.last_error}")
                try:
                    resp = send.result()
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                    self._end(b, d, policy)
                    last_error = f"backend {b.url} unreachable: {type(e).__name__}: {e}"
                    b.mark_down(last_error)
                    self._on_health_change(b)
                    self.metrics.retries.labels(b.name).inc()
                    continue
                except httpx.HTTPError as e:
                    self._end(b, d, policy)
                    self.metrics.errors.labels("upstream").inc()
                    return _error(502, f"backend {b.url} failed: {type(e).__name__}: {e}")
                self.metrics.requests.labels(b.name).inc()
                self.metrics.routed.labels(policy.name, d.reason).inc()
                if d.unit:
                    self.metrics.cache_queries.labels(d.unit).inc(d.total)
                    self.metrics.cache_hits.labels(d.unit).inc(d.matched)
                relay = _Relay(self, resp, b, d, watcher, policy)
                watcher = None  # owned by the relay now
                return relay
            self.metrics.errors.labels("no_backend").inc()
            return _error(503, f"no backend could take the request: {last_error}")
        finally:
            if watcher is not None:
                watcher.cancel()

    async def forward_any(self, request: Request, path: str) -> Response:
        """Forward a small request (``/tokenize``, ``/detokenize``) to the least busy backend of its pool."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}")
        model = body.get("model") if isinstance(body, dict) else None
        pool = self.pool(model if isinstance(model, str) else None)
        if isinstance(pool, JSONResponse):
            return pool
        b = min(pool, key=lambda x: (x.in_flight, x.index))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        assert self.client is not None
        try:
            r = await self.client.post(b.url + path, content=raw, headers=headers)
        except httpx.HTTPError as e:
            return _error(502, f"backend {b.url} failed: {type(e).__name__}: {e}")
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items() if k.lower() not in _DROP_RESPONSE})

    async def list_models(self) -> dict[str, Any]:
        """Union of the healthy backends' ``/v1/models`` (re-read from one backend per model)."""
        cards: dict[str, dict[str, Any]] = {}
        for m in self.all_models():
            cards[m] = {"id": m, "object": "model", "created": int(time.time()), "owned_by": "tokenmill",
                        "root": m, "parent": None, "permission": []}
        return {"object": "list", "data": list(cards.values())}


async def _wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body was already read, so only that message remains)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class _Relay(Response):
    """Relays an upstream response as it arrives; closes it when the client goes away."""

    def __init__(self, router: Router, resp: httpx.Response, backend: Backend, decision: RouteDecision,
                 watcher: asyncio.Task, policy: Policy) -> None:
        super().__init__(status_code=resp.status_code)
        self.policy = policy
        self.router = router
        self.resp = resp
        self.backend = backend
        self.decision = decision
        self.watcher = watcher
        self.status_code = resp.status_code
        self.background = None
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
                            if k.lower() not in _DROP_RESPONSE]
        # --decision-log: the tail of the stream, to read usage.prompt_tokens_details.cached_tokens
        self._tail: bytes | None = b"" if router._decision_log is not None and decision.detail is not None else None

    async def _end_with_error(self, send: Any, message: str) -> None:
        """End a relayed body the backend will not finish: on a stream, a 502 error event and ``[DONE]``
        (what a tokenmill server sends when its engine dies mid-stream); otherwise just the end."""
        sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)
        body = b""
        if sse:
            err = json.dumps({"error": {"message": message, "type": "BadGatewayError", "param": None,
                                        "code": 502}}).encode()
            body = b"data: " + err + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        first = True
        it = self.resp.aiter_raw().__aiter__()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                dead = asyncio.ensure_future(self.router.dead_event(self.backend).wait())
                try:
                    done, _ = await asyncio.wait({nxt, self.watcher, dead}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    dead.cancel()
                if nxt not in done:  # client disconnected or backend dead: stop reading, close upstream below
                    nxt.cancel()
                    try:
                        await nxt
                    except BaseException:  # noqa: BLE001
                        pass
                    if not self.watcher.done():   # the backend died mid-answer: say so, then end the body
                        self.router.metrics.errors.labels("backend_dead").inc()
                        await self._end_with_error(send, f"backend {self.backend.url} stopped answering (out of "
                                                         f"the rotation for {self.router.config.dead_backend_timeout:g} s)")
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                if first:
                    first = False
                    self.router._first_byte(self.backend, self.decision)
                if self._tail is not None:
                    self._tail = (self._tail + chunk)[-2048:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (httpx.HTTPError, OSError) as e:
            logger.warning("relay from %s ended early: %s", self.backend.url, e)
            if not self.watcher.done():   # the connection to the backend broke (it crashed): say so
                self.router.metrics.errors.labels("backend_dead").inc()
                try:
                    await self._end_with_error(send, f"backend {self.backend.url} closed the connection "
                                                     f"mid-answer: {type(e).__name__}")
                except OSError:   # the client went away as well
                    pass
        finally:
            self.watcher.cancel()
            await self.resp.aclose()
            self.router._end(self.backend, self.decision, self.policy, _cached_tokens(self._tail))


_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def _cached_tokens(tail: bytes | None) -> int | None:
    """The last ``"cached_tokens": N`` in a response's tail (None when absent)."""
    if not tail:
        return None
    found = _CACHED_TOKENS.findall(tail)
    return int(found[-1]) if found else None


def build_app(router: Router) -> FastAPI:
    """The router's FastAPI app (starts and stops the router with the app's lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="tokenmill router", version=tokenmill.__version__, lifespan=lifespan)
    # as `tokenmill serve`: a huge body is refused (413) before it is read and parsed
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=router.config.max_request_body_bytes)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await router.list_models()

    if router.config.pd_disaggregation:
        from tokenmill.router.pd import proxy_pd

        def forward(request: Request, path: str):  # noqa: ANN202 - a coroutine returning a Response
            return proxy_pd(router, request, path)
    else:
        forward = router.proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.forward_any(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.forward_any(request, "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        if router.config.pd_disaggregation:
            pre = any(b.healthy for b in router.backends if b.index in router.prefill_indices)
            dec = any(b.healthy for b in router.backends if b.index not in router.prefill_indices)
            if pre and dec:
                return Response(status_code=200)
            return _error(503, "no healthy " + ("prefill" if not pre else "decode") + " server")
        if any(b.healthy for b in router.backends):
            return Response(status_code=200)
        return _error(503, "no backend is healthy")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(router), media_type=CONTENT_TYPE_LATEST)

    @app.get("/backends")
    async def backends() -> dict[str, Any]:
        return {"policy": router.config.policy, "backends": [
            {"url": b.url, "healthy": b.healthy,
             "role": ("prefill" if b.index in router.prefill_indices else "decode")
             if router.config.pd_disaggregation else None, "models": b.models, "in_flight": b.in_flight,
             "kv_events": b.spec.kv_events, "kv_blocks": router.index.num_blocks(b.index),
             "last_error": b.last_error} for b in router.backends]}

    return app


def run_router(config: RouterConfig) -> None:
    """Load the tokenizer (kv_aware), then serve until SIGINT/SIGTERM."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request otherwise
    logging.getLogger("httpcore").setLevel(logging.WARNING)  # its DEBUG lines drown the routing decisions
    tok = None
    if config.policy == "kv_aware":
        t0 = time.perf_counter()
        tok = PromptTokenizer.load(config.tokenizer)
        logger.info("router tokenizer loaded in %.1fs", time.perf_counter() - t0)
    router = Router(config, tok)
    logger.info("tokenmill router on http://%s:%d, policy %s, %d backends%s", config.host, config.port,
                config.policy, len(router.backends),
                f" (P/D disaggregation: {len(config.prefill)} prefill, {len(config.decode)} decode)"
                if config.pd_disaggregation else "")
    uvicorn.run(build_app(router), host=config.host, port=config.port, log_level="warning",
                timeout_keep_alive=30)
