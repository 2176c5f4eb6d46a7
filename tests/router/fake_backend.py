"""Fake OpenAI-compatible backends and an in-thread router, for router tests (no model).

:class:`FakeBackend` serves ``/health``, ``/v1/models``, ``/v1/completions``
and ``/v1/chat/completions`` on 127.0.0.1 from its own thread. Each answer
names the backend (``"backend": name``), so tests see where a request went;
it can stream slowly, refuse with 429 + ``Retry-After``, report itself
unhealthy, die before its headers or mid-stream, and it counts requests whose client went away mid-answer
(``disconnects``). It can be stopped and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeBackend:
    def __init__(self, name: str, models: list[str] | None = None, port: int | None = None,
                 chunks: int = 3, itl_s: float = 0.01) -> None:
        self.name = name
        self.models = models or ["fake-model"]
        self.port = port or free_port()
        self.chunks = chunks
        self.itl_s = itl_s
        self.healthy = True
        self.health_delay_s = 0.0     # /health answers after this long (a busy machine: checks time out)
        self.drop_after: int | None = None   # streams: close the connection after this many chunks (a crash)
        self.refuse_429 = False
        # completions: take the request, answer nothing for this long, then close the connection (a process
        # that hung and was killed before it sent its headers)
        self.die_before_headers_s: float | None = None
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0
        self.completed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeBackend":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start_site())
            ready.set()
            self._loop.run_forever()
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=f"fake-backend-{self.name}")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake backend did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(text="ok") if self.healthy else web.Response(status=503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "fake"} for m in self.models]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"backend": self.name, "count": len(str(body.get("prompt", "")).split())})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.refuse_429:
            return web.json_response({"error": {"message": "server is full", "type": "RateLimitError",
                                                "param": None, "code": 429}}, status=429,
                                     headers={"Retry-After": "7"})
        if self.die_before_headers_s is not None:
            await asyncio.sleep(self.die_before_headers_s)
            request.transport.close()
            return web.Response(status=500)    # never sent: the connection is gone
        if body.get("model") is not None and body.get("model") not in self.models:
            return web.json_response({"error": {"message": "unknown model", "code": 404}}, status=404)
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.itl_s * self.chunks)
                self.completed += 1
                return web.json_response({"backend": self.name, "object": "text_completion",
                                          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                if self.drop_after is not None and i == self.drop_after:
                    request.transport.close()    # the process died mid-answer: no [DONE], no end of body
                    return resp
                obj = {"backend": self.name, "i": i, "t": time.time(),
                       "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
                await asyncio.sleep(self.itl_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            raise


class RouterThread:
    """``tokenmill router`` (the real app) served by uvicorn in a background thread."""

    def __init__(self, config, tokenizer=None) -> None:
        from tokenmill.router.app import Router

        self.port = free_port()
        config.port = self.port
        self.router = Router(config, tokenizer)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RouterThread":
        import uvicorn

        from tokenmill.router.app import build_app

        cfg = uvicorn.Config(build_app(self.router), host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="on")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="router")
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("router did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = None
