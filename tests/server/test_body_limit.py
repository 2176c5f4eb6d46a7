"""Request body size limit: 413 in the OpenAI error shape before the app parses anything."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from pydantic import BaseModel

from tokenmill.server.body_limit import BodySizeLimitMiddleware


class _Body(BaseModel):
    prompt: str


def _app(limit: int) -> tuple[FastAPI, list[int]]:
    seen: list[int] = []
    app = FastAPI()
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limit)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        seen.append(len(body))
        return {"n": len(body)}

    @app.post("/model")
    async def model(body: _Body) -> dict:
        seen.append(len(body.prompt))
        return {"n": len(body.prompt)}

    return app, seen


def _run(app: FastAPI, path: str = "/echo", **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, **kw)
    return asyncio.run(go())


def test_small_body_passes_and_large_content_length_is_refused():
    app, seen = _app(100)
    r = _run(app, content=b"x" * 100)
    assert r.status_code == 200 and r.json() == {"n": 100}
    r = _run(app, content=b"x" * 101)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "RequestTooLargeError" and "100 bytes" in err["message"]
    assert seen == [100]                                     # the app never saw the large one


def test_chunked_body_without_content_length_is_counted():
    app, seen = _app(100)

    async def chunks():
        for _ in range(5):
            yield b"y" * 40

    r = _run(app, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert seen == []


def test_zero_disables_the_limit():
    app, _ = _app(0)
    assert _run(app, content=b"z" * 100_000).json() == {"n": 100_000}


def test_chunked_body_to_a_pydantic_endpoint_gets_413_not_fastapis_400():
    """FastAPI parses a model endpoint's body itself and turns any error while reading it into 400
    "There was an error parsing the body"; the limit's 413 must win (found with a 50 MB chunked upload)."""
    app, seen = _app(100)

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"y" * 40
        yield b'"}'

    r = _run(app, "/model", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError", r.text
    assert seen == []
    ok = _run(app, "/model", content=b'{"prompt": "abc"}', headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json() == {"n": 3}
