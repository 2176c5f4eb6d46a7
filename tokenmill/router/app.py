"""``tokenmill router``: one OpenAI-compatible endpoint in front of many backends (the HTTP app).

The modules: :mod:`~tokenmill.router.router` (the state and the request path: pools, policies,
holds, retries before the first byte), :mod:`~tokenmill.router.relay` (streaming a backend's answer
to the client; shared with :mod:`~tokenmill.router.pd`), :mod:`~tokenmill.router.metrics` (the
router's Prometheus metrics) and this one, the FastAPI app and its routes:

* ``POST /v1/completions``, ``/v1/chat/completions``: routed (:meth:`Router.proxy`, or the P/D flow
  of :func:`tokenmill.router.pd.proxy_pd` with ``--pd-disaggregation``);
* ``POST /tokenize``, ``/detokenize``: the least busy backend of the model's pool;
* ``GET /v1/models``: the union of the healthy backends' models;
* ``GET /health``: 200 while at least one backend is healthy (with P/D: one of each role), else 503;
* ``GET /metrics``: the router's metrics (:class:`~tokenmill.router.metrics.RouterMetrics`);
* ``GET /backends``: each backend's state (health, models, in flight, KV blocks indexed).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import tokenmill
from tokenmill.router.metrics import RouterMetrics
from tokenmill.server.body_limit import BodySizeLimitMiddleware
from tokenmill.router.pd import proxy_pd
from tokenmill.router.prompt import PromptTokenizer
from tokenmill.router.relay import error_response
from tokenmill.router.router import Router, RouterConfig

__all__ = ["Router", "RouterConfig", "RouterMetrics", "build_app", "run_router"]

logger = logging.getLogger(__name__)


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
            return error_response(503, "no healthy " + ("prefill" if not pre else "decode") + " server")
        if any(b.healthy for b in router.backends):
            return Response(status_code=200)
        return error_response(503, "no backend is healthy")

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
        tok = PromptTokenizer.load(config.tokenizer, config.tool_call_parser,
                                   config.exclude_tools_when_tool_choice_none)
        logger.info("router tokenizer loaded in %.1fs", time.perf_counter() - t0)
    router = Router(config, tok)
    logger.info("tokenmill router on http://%s:%d, policy %s, %d backends%s", config.host, config.port,
                config.policy, len(router.backends),
                f" (P/D disaggregation: {len(config.prefill)} prefill, {len(config.decode)} decode)"
                if config.pd_disaggregation else "")
    uvicorn.run(build_app(router), host=config.host, port=config.port, log_level="warning",
                timeout_keep_alive=30)
