"""Prefill-decode disaggregation in the router (``tokenmill router --pd-disaggregation``).

Each completion or chat request goes through two servers (the flow of vLLM's disaggregated-serving
proxy; DistServe, arXiv 2401.09670, §3):

1. **Prefill**: a copy of the request with ``max_tokens: 1``, no streaming, and
   ``kv_transfer_params: {"do_remote_decode": true}`` goes to a prefill server (one started with
   ``--kv-transfer-config`` role ``kv_producer``). It computes the prompt, keeps the prompt's KV
   blocks, and answers with ``kv_transfer_params`` saying where they are. Its one token is dropped.
2. **Decode**: the original request plus those ``kv_transfer_params`` goes to a decode server
   (``kv_consumer``), which loads the KV instead of computing the prompt (or recomputes it when the
   load fails) and generates. Its response, streamed or not, is relayed to the client unbuffered.

The prefill server frees the blocks once the decode server pulled them. When the decode leg fails
(the decode server refuses the request with a 4xx/5xx, no decode server is reachable, the relay
breaks, or the client leaves before the decode finished) the router tells the prefill server at once
(``POST /kv_transfer/release`` with the ``kv_transfer_params``, in the background): the kept blocks
are freed then, not after the prefill server's ``abort_timeout_s`` (a release that comes after the
pull, or during it, frees nothing the pull still needs). Errors of either server (4xx/5xx) reach the
client with their status and body. A client that disconnects during the prefill cancels it (the
prefill server aborts the request and keeps nothing); during the decode it closes the decode stream,
which aborts the request there.
A server that fails a leg before any byte of its answer (unreachable, or the connection broke
before it answered, e.g. a process that hung and was killed) is retried on another of its pool
(``--max-retries``, counted in ``tokenmill:router_retries_total{reason}``); a decode answer that
started reaching the client is never retried. Both pools are routed
with the router's ``--policy``, each pool by its own policy object. Requests with ``n > 1``, or that
carry their own ``kv_transfer_params``, go straight to a decode server (which then computes the prompt).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.kv_transfer.notify import release_remote
from tokenmill.router.relay import Relay, error_response, forward_headers, response_headers, wait_disconnect
from tokenmill.router.router import Router

logger = logging.getLogger(__name__)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, not streamed, KV kept for a decode server."""
    pre = dict(body)
    pre["max_tokens"] = 1
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre["stream"] = False
    pre.pop("stream_options", None)
    pre.pop("min_tokens", None)
    pre["n"] = 1
    pre["kv_transfer_params"] = {"do_remote_decode": True}
    return pre


async def proxy_pd(router: Router, request: Request, path: str) -> Response:
    """Serve one request through a prefill server and then a decode server (see the module docstring)."""
    raw = await request.body()
    parsed = router.parse_body(raw)
    if isinstance(parsed, JSONResponse):
        return parsed
    body, model = parsed
    pools = {}
    for role in ("prefill", "decode"):
        pool = router.pool(model, role)
        if isinstance(pool, JSONResponse):
            router.metrics.errors.labels("unknown_model" if pool.status_code == 404 else "no_backend").inc()
            _release_client_kv(body)
            return pool
        pools[role] = pool
    headers = forward_headers(request)
    watcher = asyncio.create_task(wait_disconnect(request))
    if body.get("n", 1) != 1 or body.get("kv_transfer_params") is not None:
        # n > 1 choices share one prompt on the decode server (one KV load serves one request), and a
        # client that manages kv_transfer_params itself is not second-guessed: straight to decode
        policy = router.policy_for(("decode", model))  # type: ignore[arg-type]
        rin = await router.route_input(policy, path, body)
        resp = await router.send_to_pool(raw, headers, path, pools["decode"], policy, rin, watcher)
        if resp.status_code >= 500 or resp.status_code == 499:   # no decode server took it (a 4xx: it released)
            _release_client_kv(body)
        return resp
    try:
        got = await _prefill(router, path, body, headers, pools["prefill"], model, watcher)
    except BaseException:
        watcher.cancel()
        raise
    if isinstance(got, Response):
        watcher.cancel()
        return got
    pre, prefill_url = got
    dec = dict(body)
    if pre is not None:
        dec["kv_transfer_params"] = pre
    policy = router.policy_for(("decode", model))  # type: ignore[arg-type]
    try:
        rin = await router.route_input(policy, path, dec)
        resp = await router.send_to_pool(json.dumps(dec).encode(), headers, path, pools["decode"], policy, rin,
                                         watcher)
    except BaseException:
        if pre is not None:
            _release_soon(router, prefill_url, pre, headers)
        raise
    if pre is None:
        return resp
    if isinstance(resp, Relay) and resp.status_code == 200:
        return _ReleasingRelay(resp, lambda: _release_soon(router, prefill_url, pre, headers))
    # refused (4xx/5xx), unreachable (503), or the client left before the decode answered (499)
    _release_soon(router, prefill_url, pre, headers)
    return resp


class _ReleasingRelay(Response):
    """A decode relay that asks the prefill server to free the kept KV when it does not end cleanly."""

    def __init__(self, relay: Relay, on_broken) -> None:  # noqa: ANN001 - a callable of no argument
        super().__init__(status_code=relay.status_code)
        self.relay = relay
        self.on_broken = on_broken
        self.raw_headers = relay.raw_headers
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ended = False

        async def watch(msg: dict) -> None:
            nonlocal ended
            await send(msg)
            if msg.get("type") == "http.response.body" and not msg.get("more_body", False):
                ended = True

        try:
            await self.relay(scope, receive, watch)
        finally:
            if not ended:     # client gone or upstream broke: the decode server may never pull the KV
                self.on_broken()


_release_tasks: set[asyncio.Task] = set()


def _release_client_kv(body: dict[str, Any]) -> None:
    """A client-managed ``do_remote_prefill`` request the router ends before a decode server admitted it:
    free the producer's KV through its side channel (:func:`tokenmill.kv_transfer.notify.release_remote`)."""
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        fut = asyncio.get_running_loop().run_in_executor(None, release_remote, dict(params))
        _release_tasks.add(fut)  # type: ignore[arg-type]
        fut.add_done_callback(_release_tasks.discard)  # type: ignore[arg-type]


def _release_soon(router: Router, prefill_url: str, params: dict[str, Any], headers: dict[str, str]) -> None:
    """In the background: ``POST /kv_transfer/release`` to the prefill server that keeps ``params``' KV."""
    task = asyncio.create_task(_release(router, prefill_url, params, headers))
    _release_tasks.add(task)            # keep a reference until it is done
    task.add_done_callback(_release_tasks.discard)


async def _release(router: Router, prefill_url: str, params: dict[str, Any], headers: dict[str, str]) -> None:
    """Ask the prefill server to free the KV it keeps for ``params``; failures are logged (the prefill
    server's ``abort_timeout_s`` frees it then)."""
    assert router.client is not None
    auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
    try:
        r = await router.client.post(prefill_url + "/kv_transfer/release", json={"kv_transfer_params": params},
                                     headers=auth, timeout=10.0)
        if r.status_code != 200:
            logger.warning("prefill server %s refused to release the KV of %s: %s %s", prefill_url,
                           params.get("remote_request_id"), r.status_code, r.text[:200])
    except httpx.HTTPError as e:
        logger.warning("could not ask prefill server %s to release the KV of %s (%s: %s); it frees it after "
                       "its abort_timeout_s", prefill_url, params.get("remote_request_id"), type(e).__name__, e)


async def _prefill(router: Router, path: str, body: dict[str, Any], headers: dict[str, str], pool: list,
                   model: str | None, watcher: asyncio.Task) -> tuple[dict[str, Any] | None, str] | Response:
    """Run the prefill step; ``(kv_transfer_params, prefill server URL)`` (params None: the server kept
    no KV), or the response to give the client (an error, or 499 when it disconnected)."""
    policy = router.policy_for(("prefill", model))  # type: ignore[arg-type]
    pre = prefill_body(body)
    rin = await router.route_input(policy, path, pre)
    raw = json.dumps(pre).encode()
    tried: set[int] = set()
    last_error = "no prefill server is available"
    last_status = 503
    assert router.client is not None
    for _ in range(router.config.max_retries + 1):
        cands = [b for b in pool if b.healthy and b.index not in tried]
        if not cands:
            break
        d = policy.select(cands, rin)
        b = d.backend
        tried.add(b.index)
        router.begin(b, d)
        send = asyncio.create_task(router.client.post(b.url + path, content=raw, headers=headers))
        try:
            done, _ = await asyncio.wait({send, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if send not in done:   # the client left: closing the connection aborts the prefill there
                send.cancel()
                try:
                    await send
                except BaseException:  # noqa: BLE001
                    pass
                return Response(status_code=499)
            try:
                resp = send.result()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                last_error = f"prefill server {b.url} unreachable: {type(e).__name__}: {e}"
                b.mark_down(last_error)
                router.on_health_change(b)
                router.metrics.retries.labels(b.name, "unreachable").inc()
                continue
            except httpx.HTTPError as e:
                # it took the prefill and broke the connection before answering (e.g. hung, then killed):
                # nothing reached the client and it kept no KV for anyone, so another prefill server may
                # take it; its decode leg is retried the same way in send_to_pool
                last_error = f"prefill server {b.url} failed before answering: {type(e).__name__}: {e}"
                last_status = 502
                router.metrics.retries.labels(b.name, "no_response").inc()
                continue
        finally:
            router.end(b, d, policy)
        router.metrics.requests.labels(b.name).inc()
        router.metrics.routed.labels(policy.name, d.reason).inc()
        if resp.status_code != 200:    # the client's error (400, 404, 429...) or the server's: pass it on
            router.metrics.errors.labels("upstream").inc()
            return Response(resp.content, status_code=resp.status_code,
                            headers=response_headers(resp))
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if params is None:
            logger.warning("prefill server %s returned no kv_transfer_params (is it started with "
                           "--kv-transfer-config kv_producer?); the decode server computes the prompt", b.url)
        return params, b.url
    if last_status == 502:
        router.metrics.errors.labels("upstream").inc()
        return error_response(502, last_error)
    router.metrics.errors.labels("no_backend").inc()
    return error_response(503, f"no prefill server could take the request: {last_error}")
