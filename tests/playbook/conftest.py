"""A live tokenmill HTTP server (real app, real engine core process, model-free executor) on a free port."""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import httpx
import pytest

from tests.server.fakes import CharTokenizer
from tokenmill.config import EngineConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a background thread serving :func:`build_app` over an :class:`AsyncEngine` with a fake executor."""

    def __init__(self, **config_kw) -> None:
        import uvicorn

        from tokenmill.engine.async_engine import AsyncEngine
        from tokenmill.server.app import build_app
        from tokenmill.server.launch import create_server_state
        import tests.server.fakes as fakes

        base = dict(served_model_name="fake", num_kv_blocks=256, max_model_len=512, max_num_seqs=32,
                    log_stats_interval=0.0)
        base.update(config_kw)
        self.config = EngineConfig.from_kwargs(**base)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tok = CharTokenizer()
        self.engine = AsyncEngine(self.config, tok, executor_factory=fakes.make_fake_executor, start_timeout=60)
        self.engine.start()
        state = create_server_state(self.config, self.engine, tok, "/models/fake")
        app = build_app(state)  # its lifespan starts the engine's output loop on uvicorn's event loop
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("live server did not start")

    def complete(self, prompt: str = "abcd", max_tokens: int = 4) -> dict:
        r = httpx.post(self.url + "/v1/completions", json={"model": "fake", "prompt": prompt,
                                                           "max_tokens": max_tokens}, timeout=30)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    srv = LiveServer()
    try:
        yield srv
    finally:
        srv.stop()
