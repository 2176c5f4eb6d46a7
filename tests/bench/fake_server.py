"""A small fake OpenAI-compatible streaming server for testing the benchmark.

Serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and
``/health`` on 127.0.0.1 (a free port) from a background thread, with
deterministic timing: the first chunk after ``ttft_s`` (+ ``ttft_per_prompt_token_s``
per prompt token), then one chunk every ``itl_s``. It generates ``max_tokens``
tokens (or stops after ``eos_after`` tokens unless the request sets
``ignore_eos``), and reports usage in a final chunk when asked.

Failures are injected by arrival order, so their counts are exact however
requests interleave: every ``status_429_every``-th request is refused with 429,
every ``break_every``-th request's connection is cut after ``break_after_tokens``
chunks, and every ``no_done_every``-th stream closes cleanly without
``[DONE]``. With ``max_num_seqs`` > 0 at most that many requests generate at
once and the others queue, so latency grows with load (for goodput tests).

Used by tests/bench and by benchmarks/crosscheck_bench.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


def count_prompt_tokens(text: str) -> int:
    """The fake server's 'tokenizer': whitespace-separated words."""
    return len(text.split())


@dataclass
class FakeServerConfig:
    """Behaviour of :class:`FakeOpenAIServer` (times in seconds)."""

    model: str = "fake-model"
    ttft_s: float = 0.02
    ttft_per_prompt_token_s: float = 0.0
    itl_s: float = 0.005
    tokens_per_chunk: int = 1
    eos_after: int | None = None
    status_429_every: int = 0
    break_every: int = 0
    break_after_tokens: int = 2
    no_done_every: int = 0
    role_chunk: bool = True
    send_usage: bool = True
    max_num_seqs: int = 0        # > 0: at most this many generate at once; the rest queue (TTFT grows)


@dataclass
class ServedRequest:
    """What the fake server saw and returned for one request."""

    index: int
    path: str
    body: dict[str, Any]
    outcome: str = "ok"          # ok | 429 | broken | no_done
    prompt_tokens: int = 0
    completion_tokens: int = 0


class FakeOpenAIServer:
    """Run with ``with FakeOpenAIServer(cfg) as srv: srv.base_url ...``."""

    def __init__(self, config: FakeServerConfig | None = None, port: int = 0) -> None:
        self.config = config or FakeServerConfig()
        self.requests: list[ServedRequest] = []
        self._port = port
        self._lock = threading.Lock()
        self._in_flight = 0
        self.peak_in_flight = 0
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------ control --
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeOpenAIServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start_site())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="fake-openai-server")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    # ----------------------------------------------------------- handlers --
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "owned_by": "fake"}]})

    def _every(self, n: int, index: int) -> bool:
        return n > 0 and index % n == 0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        with self._lock:
            rec = ServedRequest(index=len(self.requests) + 1, path=request.path, body=body)
            self.requests.append(rec)
        if chat:
            text = "\n".join(str(m.get("content", "")) for m in body.get("messages", []))
        else:
            text = str(body.get("prompt", ""))
        rec.prompt_tokens = count_prompt_tokens(text)
        if self._every(cfg.status_429_every, rec.index):
            rec.outcome = "429"
            return web.json_response({"error": {"message": "too many requests", "type": "rate_limit"}},
                                     status=429)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        n_tokens = max_tokens
        if cfg.eos_after is not None and not body.get("ignore_eos"):
            n_tokens = min(n_tokens, cfg.eos_after)
        breaking = self._every(cfg.break_every, rec.index)
        no_done = self._every(cfg.no_done_every, rec.index)
        rec.outcome = "broken" if breaking else "no_done" if no_done else "ok"

        with self._lock:
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
        if cfg.max_num_seqs > 0 and self._slots is None:
            self._slots = asyncio.Semaphore(cfg.max_num_seqs)
        slot = self._slots if cfg.max_num_seqs > 0 else None
        if slot is not None:
            await slot.acquire()
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            created = int(time.time())
            rid = f"cmpl-{rec.index}"

            def chunk(content: str | None, finish: str | None = None, role: bool = False) -> bytes:
                if chat:
                    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": content}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                    obj = {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": cfg.model, "choices": [choice]}
                else:
                    choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
                    obj = {"id": rid, "object": "text_completion", "created": created,
                           "model": cfg.model, "choices": [choice]}
                return f"data: {json.dumps(obj)}\n\n".encode()

            await asyncio.sleep(cfg.ttft_s + cfg.ttft_per_prompt_token_s * rec.prompt_tokens)
            if chat and cfg.role_chunk:
                await resp.write(chunk(None, role=True))
            sent = 0
            while sent < n_tokens:
                if sent > 0:
                    await asyncio.sleep(cfg.itl_s)
                k = min(cfg.tokens_per_chunk, n_tokens - sent)
                words = "".join(f" t{sent + j}" for j in range(k))
                sent += k
                finish = ("length" if n_tokens == max_tokens else "stop") if sent >= n_tokens else None
                await resp.write(chunk(words, finish))
                if breaking and sent >= cfg.break_after_tokens:
                    rec.completion_tokens = sent
                    # Cut the connection mid-stream (no terminating chunk).
                    request.transport.close()
                    return resp
            rec.completion_tokens = sent
            opts = body.get("stream_options") or {}
            if cfg.send_usage and opts.get("include_usage"):
                usage = {"prompt_tokens": rec.prompt_tokens, "completion_tokens": sent,
                         "total_tokens": rec.prompt_tokens + sent}
                obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": cfg.model, "choices": [], "usage": usage}
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
            if not no_done:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            if slot is not None:
                slot.release()
            with self._lock:
                self._in_flight -= 1


if __name__ == "__main__":  # manual use: python tests/bench/fake_server.py
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ttft", type=float, default=0.05)
    ap.add_argument("--itl", type=float, default=0.01)
    a = ap.parse_args()
    with FakeOpenAIServer(FakeServerConfig(ttft_s=a.ttft, itl_s=a.itl), port=a.port) as srv:
        print(f"fake server on {srv.base_url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
