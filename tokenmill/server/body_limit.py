"""Request body size limit for the HTTP front end (ASGI middleware).

uvicorn and FastAPI accept bodies of any size; a client sending a
30 MB prompt made the API process tokenize it (several GB of memory) before
the context-length check could refuse it. This middleware answers
``413 Request Entity Too Large`` in the OpenAI error shape as soon as the
``Content-Length`` header, or the bytes actually received (chunked uploads),
exceed the limit, before the application parses anything.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from tokenmill.server.protocol import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class _TooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Refuse HTTP request bodies larger than ``max_bytes`` with a 413 JSON error.

    Args:
        app: the wrapped ASGI application.
        max_bytes: largest accepted body, bytes; ``0`` or None disables the check.
    """

    def __init__(self, app: ASGIApp, max_bytes: int | None) -> None:
        self.app = app
        self.max_bytes = int(max_bytes or 0)

    def _error(self) -> bytes:
        err = APIError(f"request body exceeds the limit of {self.max_bytes} bytes (--max-request-body-bytes)", 413)
        return json.dumps(err.to_dict()).encode()

    async def _send_413(self, send: Callable[[Message], Awaitable[None]]) -> None:
        body = self._error()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await self._send_413(send)
                    return
        received = 0
        started = False
        exceeded = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _TooLarge()
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if exceeded:
                # FastAPI's body parsing (a pydantic-model endpoint) catches _TooLarge and answers 400
                # "There was an error parsing the body": answer our 413 in its place, drop its messages
                if not started:
                    started = True
                    await self._send_413(send)
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._send_413(send)
        else:
            if exceeded and not started:
                await self._send_413(send)
