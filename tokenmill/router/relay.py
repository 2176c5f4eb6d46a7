"""Relaying a backend's answer to the client, shared by the plain router and the P/D orchestration.

* :data:`HOP_BY_HOP` / :data:`DROP_RESPONSE`: headers not forwarded (RFC 9110 §7.6.1 hop-by-hop
  fields, and the ones the router's own server sets).
* :func:`error_response`: an OpenAI-style error body with its HTTP status.
* :func:`wait_disconnect`: a task that ends when the client goes away.
* :func:`race`: await a future unless the client leaves or the backend is declared dead first.
* :class:`Relay`: the response object that streams the backend's bytes as they arrive, its first
  chunk already read by the router (until then a failed backend may be retried elsewhere; after it,
  never), and ends the body with an error event when the backend dies mid-answer.

This module knows the router only through :class:`RelayHost` (a protocol), so it imports neither
:mod:`tokenmill.router.router` nor :mod:`tokenmill.router.pd`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterator, Protocol

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
DROP_RESPONSE = (HOP_BY_HOP - {"content-length"}) | {"server", "date"}

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 502: "BadGatewayError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": param,
                                   "code": status}}, status_code=status, headers=headers)


def forward_headers(request: Request) -> dict[str, str]:
    """The client's request headers minus the hop-by-hop ones (what a backend gets)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}


def response_headers(resp: httpx.Response) -> dict[str, str]:
    """A buffered backend response's headers to pass on."""
    return {k: v for k, v in resp.headers.items() if k.lower() not in DROP_RESPONSE}


async def wait_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body was already read, so only that message remains)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def race(fut: asyncio.Future, watcher: asyncio.Task, dead: asyncio.Event) -> str:
    """Wait for ``fut`` unless the client leaves (``watcher`` ends) or the backend is declared dead.

    Returns:
        ``"done"`` (``fut`` finished; read its result), ``"client_gone"`` or ``"dead"``; in the last two
        cases ``fut`` is cancelled and awaited.
    """
    d = asyncio.ensure_future(dead.wait())
    try:
        done, _ = await asyncio.wait({fut, watcher, d}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        d.cancel()
    if fut in done:
        return "done"
    fut.cancel()
    try:
        await fut
    except BaseException:  # noqa: BLE001 - cancelled, or it failed meanwhile: either way it is over
        pass
    return "client_gone" if watcher.done() else "dead"


class RelayHost(Protocol):
    """What a :class:`Relay` needs from the router."""

    metrics: Any            # RouterMetrics (``errors`` counter)
    dead_backend_timeout: float
    decision_log_on: bool

    def dead_event(self, backend: Any) -> asyncio.Event: ...

    def first_byte(self, backend: Any, decision: Any) -> None: ...

    def end(self, backend: Any, decision: Any, policy: Any = None, cached_tokens: int | None = None) -> None: ...


class Relay(Response):
    """Relays an upstream response as it arrives; closes it when the client goes away.

    Args:
        host: the router (bookkeeping at the first byte and the end, the dead-backend events, metrics).
        resp: the backend's streamed response (headers received).
        chunks: its raw body iterator, positioned after ``first``.
        first: the body's first chunk, already read (None: the body ended before any byte).
        backend, decision, policy: where it went and why (handed back to ``host.end``).
        watcher: the client-disconnect task (owned by the relay from now on).
    """

    def __init__(self, host: RelayHost, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes | None,
                 backend: Any, decision: Any, watcher: asyncio.Task, policy: Any) -> None:
        super().__init__(status_code=resp.status_code)
        self.host = host
        self.policy = policy
        self.resp = resp
        self.chunks = chunks
        self.first = first
        self.backend = backend
        self.decision = decision
        self.watcher = watcher
        self.status_code = resp.status_code
        self.background = None
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
                            if k.lower() not in DROP_RESPONSE]
        # --decision-log: the tail of the stream, to read usage.prompt_tokens_details.cached_tokens
        self._tail: bytes | None = b"" if host.decision_log_on and decision.detail is not None else None
        self._closed = False

    async def close(self) -> None:
        """Close the upstream response and do the end-of-request bookkeeping (once; for a relay never served)."""
        if self._closed:
            return
        self._closed = True
        self.watcher.cancel()
        await self.resp.aclose()
        self.host.end(self.backend, self.decision, self.policy, cached_tokens(self._tail))

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
        host = self.host
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self.first is not None:
                if self._tail is not None:
                    self._tail = self.first[-2048:]
                await send({"type": "http.response.body", "body": self.first, "more_body": True})
                while True:
                    nxt = asyncio.ensure_future(self.chunks.__anext__())
                    how = await race(nxt, self.watcher, host.dead_event(self.backend))
                    if how == "client_gone":
                        return
                    if how == "dead":   # the backend died mid-answer: say so, then end the body
                        host.metrics.errors.labels("backend_dead").inc()
                        await self._end_with_error(send, f"backend {self.backend.url} stopped answering (out of "
                                                         f"the rotation for {host.dead_backend_timeout:g} s)")
                        return
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        break
                    if self._tail is not None:
                        self._tail = (self._tail + chunk)[-2048:]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (httpx.HTTPError, OSError) as e:
            logger.warning("relay from %s ended early: %s", self.backend.url, e)
            if not self.watcher.done():   # the connection to the backend broke (it crashed): say so
                host.metrics.errors.labels("backend_dead").inc()
                try:
                    await self._end_with_error(send, f"backend {self.backend.url} closed the connection "
                                                     f"mid-answer: {type(e).__name__}")
                except OSError:   # the client went away as well
                    pass
        finally:
            await self.close()


_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def cached_tokens(tail: bytes | None) -> int | None:
    """The last ``"cached_tokens": N`` in a response's tail (None when absent)."""
    if not tail:
        return None
    found = _CACHED_TOKENS.findall(tail)
    return int(found[-1]) if found else None
