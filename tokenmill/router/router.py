"""The router's state and request path: backends, health checks, KV event subscribers, policies.

Request path (:meth:`Router.proxy`): read the body → pick the model's pool (the healthy backends whose
``/v1/models`` lists the request's ``model``) → the pool's policy picks a backend (it may hold the request
at the router first) → forward the body unchanged → read the answer's headers and first body chunk →
hand both to a :class:`~tokenmill.router.relay.Relay`, which streams the rest as it arrives (SSE
unbuffered; errors, 429 and ``Retry-After`` as the backend sent them).

* Until the first byte of the answer is read nothing has reached the client, so a backend that fails
  the request before that (connection refused or timed out; the connection broke before any byte, e.g.
  a process that hung and was killed; out of the rotation for ``--dead-backend-timeout``) is retried on
  another backend of the pool, at most ``--max-retries`` times, each counted in
  ``tokenmill:router_retries_total{reason}``. After the first byte, never: a failure then ends the
  client's stream with an error event.
* A request without ``model`` goes to the only model served; when several are served it is ambiguous:
  400 naming them. A request for a model no backend serves gets OpenAI's 404; one whose backends are
  all down gets 503.
* A client that disconnects, before or during the response, closes the upstream connection, which
  makes a tokenmill (or vLLM) backend abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.router.backends import Backend, BackendSpec, HealthChecker
from tokenmill.router.kv_index import KVEventSubscriber, KVIndex
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Policy, RouteDecision, RouteInput, make_policy
from tokenmill.router.prompt import PromptTokenizer, block_hash_chain, prompt_text
from tokenmill.router.relay import Relay, error_response, forward_headers, race, response_headers, wait_disconnect

logger = logging.getLogger(__name__)

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
    kv_tier_weight: float | None = None
    router_temperature: float = 0.0
    block_size: int = 16
    tokenizer: str | None = None
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
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
    kv_placement: bool = True
    kv_move_margin: float = 4.0
    prefix_placement: bool = False


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
                    prefill_wait=config.kv_prefill_wait, busy_threshold=config.active_decode_blocks_threshold,
                    placement=config.kv_placement, move_margin=config.kv_move_margin,
                    tier_weight=config.kv_tier_weight)
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
                                    read_pool_size=c.policy == "kv_aware" or (c.policy == "prefix_aware"
                                                                               and c.prefix_placement))
        self.health.on_change = self.on_health_change
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

    def on_health_change(self, b: Backend) -> None:
        """``b`` went up or down: fresh dead-event when it is back, policies forget it when it is down."""
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
                prefill_wait=c.kv_prefill_wait, busy_threshold=c.active_decode_blocks_threshold,
                placement=c.kv_placement, move_margin=c.kv_move_margin, prefix_placement=c.prefix_placement,
                tier_weight=c.kv_tier_weight)
        return p

    def all_models(self, healthy_only: bool = True) -> list[str]:
        seen: dict[str, None] = {}
        for b in self.backends:
            if b.healthy or not healthy_only:
                for m in b.models:
                    seen.setdefault(m, None)
        return list(seen)

    def request_model(self, body: dict[str, Any]) -> str | None | JSONResponse:
        """The model a request body names, or the one the router serves when it names none.

        Returns:
            the name; None when it names none and no backend has listed a model yet (the pool is then
            every healthy backend); or a 400 response: ``model`` is not a string, or it is missing while
            the backends serve several models (ambiguous: the message names them).
        """
        model = body.get("model")
        if isinstance(model, str):
            return model
        if model is not None:
            return error_response(400, f"`model` must be a string, got {type(model).__name__}", "model")
        served = self.all_models(healthy_only=False)
        if len(served) > 1:
            return error_response(400, f"The request names no `model` and this router serves several: "
                                       f"{', '.join(served)}. Say which one in `model`.", "model")
        return served[0] if served else None

    def parse_body(self, raw: bytes) -> tuple[dict[str, Any], str | None] | JSONResponse:
        """A POST body as ``(the JSON object, the model it is for)`` (:meth:`request_model`), or the 400
        response (counted under ``errors{kind="bad_request"}``): not JSON, not an object, or a bad ``model``.
        Both the plain and the prefill-decode paths validate requests here."""
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.metrics.errors.labels("bad_request").inc()
            return error_response(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            self.metrics.errors.labels("bad_request").inc()
            return error_response(400, "request body must be a JSON object")
        model = self.request_model(body)
        if isinstance(model, JSONResponse):
            self.metrics.errors.labels("bad_request").inc()
            return model
        return body, model

    def pool(self, model: str | None, role: str | None = None) -> list[Backend] | JSONResponse:
        """Healthy backends serving ``model`` (all healthy ones when None), or the error response.

        ``role`` (``"prefill"`` / ``"decode"``, with ``--pd-disaggregation``) restricts it to that pool.
        """
        backends = self.backends
        if role is not None:
            backends = [b for b in backends if (b.index in self.prefill_indices) == (role == "prefill")]
            res = self._pool_of(backends, model)
            if isinstance(res, JSONResponse) and res.status_code == 503:
                return error_response(503, f"no {role} server is available for this request", "model")
            return res
        return self._pool_of(backends, model)

    def _pool_of(self, backends: list[Backend], model: str | None) -> list[Backend] | JSONResponse:
        healthy = [b for b in backends if b.healthy]
        if model is None:
            return healthy or error_response(503, "no backend is available", None)
        pool = [b for b in healthy if model in b.models]
        if pool:
            return pool
        if any(model in b.models for b in backends):
            return error_response(503, f"every backend serving model `{model}` is down", "model")
        if not healthy:
            return error_response(503, "no backend is available", None)
        return error_response(404, f"The model `{model}` does not exist. Available models: "
                           f"{', '.join(self.all_models()) or '(none)'}.", "model")

    async def route_input(self, policy: Policy, path: str, body: dict[str, Any]) -> RouteInput:
        rin = RouteInput(text=prompt_text(path, body))
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(mt, int) and not isinstance(mt, bool) and mt >= 0:
            rin.max_tokens = mt
        if policy.needs_tokens and self.tokenizer is not None and path.endswith("completions"):
            if len(rin.text) > _INLINE_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(self.tokenizer.token_ids, path, body)
            else:
                ids = self.tokenizer.token_ids(path, body)
            if ids:
                salt = body.get("cache_salt")
                rin.num_prompt_tokens = len(ids)
                rin.block_hashes = block_hash_chain(ids, policy.block_size,  # type: ignore[attr-defined]
                                                    salt if isinstance(salt, str) else None,
                                                    self.prefix_cache_key(body.get("model")))
        return rin

    def prefix_cache_key(self, model: Any) -> str | int | None:
        """The extra key a LoRA adapter's block hashes carry (its ``/v1/models`` card's
        ``prefix_cache_key``, from the healthy backends serving it; None for a base model). Backends that
        serve the same adapter under the same name agree on it; if one differs, its blocks simply never
        match (the engine computes its own hashes, so routing, never correctness, is affected)."""
        if not isinstance(model, str):
            return None
        for b in self.backends:
            if b.healthy:
                key = (b.model_cards.get(model) or {}).get("prefix_cache_key")
                if key is not None:
                    return key
        return None

    @property
    def dead_backend_timeout(self) -> float:
        """``--dead-backend-timeout`` (s), for the relays' error messages."""
        return self.config.dead_backend_timeout

    @property
    def decision_log_on(self) -> bool:
        """True when ``--decision-log`` is on (relays then keep their answer's tail for ``cached_tokens``)."""
        return self._decision_log is not None

    def begin(self, b: Backend, d: RouteDecision) -> None:
        """``d`` was sent to ``b``: count it in flight with its blocks to prefill."""
        d.started = time.monotonic()
        if d.detail is not None:
            d.detail["t"] = d.started - self._t0
        logger.debug("route -> %s (%s): overlap %d/%d tokens, costs %s, evicts %d reused blocks, in flight %d, "
                     "queued prefill %d blocks", b.url, d.reason, d.matched, d.total, d.costs, d.evicted_blocks,
                     b.in_flight, b.prefill_blocks)
        b.in_flight += 1
        b.active_blocks += d.request_blocks
        b.prefill_blocks += d.new_prefill_blocks

    def first_byte(self, b: Backend, d: RouteDecision) -> None:
        """The first byte of ``d``'s answer came from ``b``: its prefill is over (idempotent)."""
        if d.started and d.detail is not None:
            d.detail["ttft_s"] = round(time.monotonic() - d.started, 4)
        if d.started:
            logger.debug("first byte from %s after %.2f s (%d new prefill blocks)", b.url,
                         time.monotonic() - d.started, d.new_prefill_blocks)
            d.started = 0.0
        b.prefill_blocks -= d.new_prefill_blocks
        d.new_prefill_blocks = 0
        self._notify()

    def end(self, b: Backend, d: RouteDecision, policy: Policy | None = None,
            cached_tokens: int | None = None) -> None:
        """``d``'s request on ``b`` ended (answered, failed, abandoned or retried elsewhere): tell the
        policy, write its decision record, and wake held requests."""
        if self._decision_log is not None and d.detail is not None:
            self._write_decision(b, d, cached_tokens)
        if policy is not None:
            policy.on_finish(d)
        self.first_byte(b, d)
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
        parsed = self.parse_body(raw)
        if isinstance(parsed, JSONResponse):
            return parsed
        body, model = parsed
        pool = self.pool(model)
        if isinstance(pool, JSONResponse):
            self.metrics.errors.labels("unknown_model" if pool.status_code == 404 else "no_backend").inc()
            return pool
        policy = self.policy_for(model)
        rin = await self.route_input(policy, path, body)
        headers = forward_headers(request)
        watcher = asyncio.create_task(wait_disconnect(request))
        return await self.send_to_pool(raw, headers, path, pool, policy, rin, watcher)

    async def send_to_pool(self, raw: bytes, headers: dict[str, str], path: str, pool: list[Backend],
                           policy: Policy, rin: RouteInput, watcher: asyncio.Task) -> Response:
        """Send ``raw`` to the backend ``policy`` picks from ``pool`` (retrying unreachable ones) and relay it.

        ``watcher`` ends when the client disconnects; the relay owns it afterwards (it is cancelled here
        when no relay started).
        """
        tried: set[int] = set()
        last_error = "no backend is available"
        last_status = 503
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
                got = await self._try_backend(b, d, policy, raw, headers, path, watcher)
                if isinstance(got, tuple):      # failed before the first byte: another backend may take it
                    reason, last_error, last_status = got
                    self.metrics.retries.labels(b.name, reason).inc()
                    continue
                if isinstance(got, Relay):
                    watcher = None  # owned by the relay now
                return got
            if last_status == 502:
                self.metrics.errors.labels("backend_dead" if "stopped answering" in last_error else "upstream").inc()
            else:
                self.metrics.errors.labels("no_backend").inc()
            return error_response(last_status, last_error if last_status == 502
                                  else f"no backend could take the request: {last_error}")
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _try_backend(self, b: Backend, d: RouteDecision, policy: Policy, raw: bytes, headers: dict[str, str],
                           path: str, watcher: asyncio.Task) -> Response | tuple[str, str, int]:
        """Send the request to ``b`` and read its answer's headers and first body chunk.

        Returns:
            a :class:`Relay` holding them (the answer is on its way: no retry from here on); a
            499 response when the client left first; or ``(retry_reason, message, status)`` when ``b``
            failed the request before any byte of an answer: the caller may try another backend
            (status 503 when ``b`` was unreachable, 502 when it broke or died after taking it).
        """
        assert self.client is not None
        req = self.client.build_request("POST", b.url + path, content=raw, headers=headers)
        self.begin(b, d)
        dead = self.dead_event(b)
        send = asyncio.create_task(self.client.send(req, stream=True))
        how = await race(send, watcher, dead)
        if how != "done":  # the client left, or the backend died, while it was still working
            self.end(b, d, policy)
            if how == "client_gone":
                return Response(status_code=499)
            return ("backend_dead", f"backend {b.url} stopped answering (out of the rotation for "
                                    f"{self.config.dead_backend_timeout:g} s): {b.last_error}", 502)
        try:
            resp = send.result()
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            self.end(b, d, policy)
            msg = f"backend {b.url} unreachable: {type(e).__name__}: {e}"
            b.mark_down(msg)
            self.on_health_change(b)
            return ("unreachable", msg, 503)
        except httpx.HTTPError as e:     # it took the request and broke the connection before answering
            self.end(b, d, policy)
            return ("no_response", f"backend {b.url} failed before answering: {type(e).__name__}: {e}", 502)
        # the headers are here; nothing has reached the client yet: read the first body chunk too
        chunks = resp.aiter_raw().__aiter__()
        nxt = asyncio.ensure_future(chunks.__anext__())
        how = await race(nxt, watcher, dead)
        first: bytes | None = None
        failure: tuple[str, str, int] | None = None
        if how == "client_gone":
            failure = ("", "", 499)
        elif how == "dead":
            failure = ("backend_dead", f"backend {b.url} stopped answering (out of the rotation for "
                                       f"{self.config.dead_backend_timeout:g} s): {b.last_error}", 502)
        else:
            try:
                first = nxt.result()
            except StopAsyncIteration:
                first = None
            except (httpx.HTTPError, OSError) as e:
                failure = ("no_response", f"backend {b.url} broke the connection before the first byte of its "
                                          f"answer: {type(e).__name__}: {e}", 502)
        if failure is not None:
            await resp.aclose()
            self.end(b, d, policy)
            return Response(status_code=499) if failure[2] == 499 else failure
        self.first_byte(b, d)
        self.metrics.requests.labels(b.name).inc()
        self.metrics.routed.labels(policy.name, d.reason).inc()
        if d.unit:
            self.metrics.cache_queries.labels(d.unit).inc(d.total)
            self.metrics.cache_hits.labels(d.unit).inc(d.matched)
        return Relay(self, resp, chunks, first, b, d, watcher, policy)

    async def forward_any(self, request: Request, path: str) -> Response:
        """Forward a small request (``/tokenize``, ``/detokenize``) to the least busy backend of its pool."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        model = self.request_model(body)
        if isinstance(model, JSONResponse):
            return model
        pool = self.pool(model)
        if isinstance(pool, JSONResponse):
            return pool
        b = min(pool, key=lambda x: (x.in_flight, x.index))
        headers = forward_headers(request)
        assert self.client is not None
        try:
            r = await self.client.post(b.url + path, content=raw, headers=headers)
        except httpx.HTTPError as e:
            return error_response(502, f"backend {b.url} failed: {type(e).__name__}: {e}")
        return Response(r.content, status_code=r.status_code,
                        headers=response_headers(r))

    async def list_models(self) -> dict[str, Any]:
        """Union of the healthy backends' ``/v1/models`` (re-read from one backend per model)."""
        cards: dict[str, dict[str, Any]] = {}
        for m in self.all_models():
            # a LoRA adapter keeps its parent (the base) and root (vLLM's shape), from a backend serving it
            seen = next((b.model_cards[m] for b in self.backends if b.healthy and m in b.model_cards), {})
            cards[m] = {"id": m, "object": "model", "created": int(time.time()), "owned_by": "tokenmill",
                        "root": seen.get("root") or m, "parent": seen.get("parent"), "permission": []}
        return {"object": "list", "data": list(cards.values())}
