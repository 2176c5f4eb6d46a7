"""The OpenAI-compatible HTTP app (FastAPI): factory, routes, API-key check, error handlers.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /version``,
``GET /metrics``, and ``POST /kv_transfer/release`` (prefill-decode disaggregation). The API process owns HTTP, tokenization, the chat template,
detokenization and SSE; the engine core runs in its own process
(:class:`~tokenmill.engine.async_engine.AsyncEngine`). The endpoints' work is
in :mod:`~tokenmill.server.serving_completion` and
:mod:`~tokenmill.server.serving_chat`; process start-up in
:mod:`~tokenmill.server.launch`.

Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "param", "code"}}``:
400 invalid parameters (malformed JSON and wrong types included) or a prompt
beyond ``--max-model-len``; 401 missing/wrong API key on ``/v1/*`` when
``--api-key`` is set; 404 unknown model; 413 body too large; 429 with
``Retry-After`` from admission control; 503 when the engine core is dead.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import envs
import tokenmill
from tokenmill.metrics.prometheus import CONTENT_TYPE_LATEST
from tokenmill.server.body_limit import BodySizeLimitMiddleware
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       ErrorResponse, KVTransferReleaseRequest, LoadLoRAAdapterRequest,
                                       TokenizeRequest, UnloadLoRAAdapterRequest,
                                       error_param_from_loc)
from tokenmill.kv_transfer.notify import release_remote
from tokenmill.lora.request import adapter_content_hash
from tokenmill.metrics.memory import top_allocation_sites
from tokenmill.server.serving import OpenAIServing, ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.streaming import with_disconnect

logger = logging.getLogger("tokenmill.server")


def _whole_body_message(content_type: str, error: dict[str, Any]) -> str:
    """The 400 message when the request body as a whole fails validation. FastAPI parses JSON only under a JSON
    ``Content-Type`` (or none), so a body sent as curl's ``-d`` default (form-urlencoded) or as text reaches
    validation as bytes; an empty body is "missing"."""
    if content_type and "json" not in content_type.lower():
        return f"send the request body as JSON with Content-Type: application/json (got {content_type!r})"
    if error.get("type") == "missing":
        return "request body is empty: send a JSON object"
    return f"request body must be a JSON object: {error.get('msg')}"


def add_error_handlers(app: FastAPI) -> None:
    """Map every error to OpenAI-shaped JSON with its HTTP status (validation errors are 400, not 422)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        param: str | None = None
        parts: list[str] = []
        seen: set[str | None] = set()
        for e in errs:
            if e.get("type") == "json_invalid":
                parts.append(f"invalid JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
                break
            if tuple(e.get("loc", ())) == ("body",):   # the body as a whole: not JSON, empty, or not an object
                parts.append(_whole_body_message(request.headers.get("content-type", ""), e))
                break
            p = error_param_from_loc(e.get("loc", ()))
            if p in seen:  # one message per field (a union reports one error per branch)
                continue
            seen.add(p)
            param = param or p
            parts.append(f"{p or 'body'}: {e.get('msg')}")
        msg = "; ".join(parts[:3]) or "invalid request"
        return JSONResponse(APIError(msg, 400, param).to_dict(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), exc.status_code)
        return JSONResponse(err.to_dict(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(APIError(f"internal error: {type(exc).__name__}: {exc}", 500).to_dict(),
                            status_code=500)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    descriptions = {400: "Invalid request (the message names the field and the limit)",
                    401: "Missing or wrong API key", 404: "Unknown model", 413: "Request body too large",
                    429: "Server busy (admission control); see Retry-After", 500: "Internal error",
                    503: "Engine core not running"}
    return {c: {"model": ErrorResponse, "description": descriptions[c]} for c in codes}


V1_ERRORS = _errors(400, 401, 404, 413, 429, 500, 503)
# 200 of the generation routes: a JSON body, or with "stream": true Server-Sent Events
GENERATION_OK = {200: {"description": "The completion (JSON), or with stream: true an SSE stream of chunks "
                                      "ending with data: [DONE]",
                       "content": {"application/json": {"schema": {"type": "object"}},
                                   # each event: data is one JSON chunk (or an error), the last is [DONE]
                                   "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                                    "properties": {"data": {"type": "string"}}}}}}}
OPEN_ERRORS = _errors(400, 404, 413, 500, 503)


def openapi_with_vocab(app: FastAPI, vocab_size: int, scheduling_policy: str = "priority") -> dict[str, Any]:
    """The app's OpenAPI schema with what the server enforces at run time filled in.

    Every token-id field (marked ``x-token-id`` in :mod:`~tokenmill.server.protocol`) gets
    ``maximum: vocab_size - 1``; ``priority`` is ``0`` only unless ``--scheduling-policy priority``;
    FastAPI's 422 responses are removed (validation errors are 400 here, documented per route).
    Cached on the app.
    """
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible API with vLLM's extras. Out-of-range values are "
                                     "400 errors naming the field.")

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("x-token-id"):
                node["maximum"] = vocab_size - 1
            if "patternProperties" in node:   # logit_bias: keys other than token ids are refused
                node.setdefault("additionalProperties", False)
            responses = node.get("responses")
            if isinstance(responses, dict):
                responses.pop("422", None)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    if scheduling_policy != "priority":
        for model in schema.get("components", {}).get("schemas", {}).values():
            prio = model.get("properties", {}).get("priority")
            if prio is not None:
                prio["enum"] = [0]
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    app.openapi_schema = schema
    return schema


def api_key_dependency(state: ServerState):
    """A FastAPI dependency that checks ``Authorization: Bearer <key>`` when ``--api-key`` is set.

    Raises:
        APIError: 401 on a missing or wrong key (compared in constant time).
    """

    async def check_api_key(request: Request) -> None:
        key = state.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401)

    return check_api_key


_kv_release_tasks: set[asyncio.Future] = set()


async def _releasing_remote_kv(state: ServerState, body: Any, handler: Any) -> Any:
    """Run a generation handler; on a decode server (``kv_consumer``), when a ``do_remote_prefill`` request
    ends without a response (refused: unknown model, validation, admission, engine rejection; or the
    client left: 499), tell its producer to free the KV it keeps for it, in the background
    (:func:`tokenmill.kv_transfer.notify.release_remote`; a no-op on the producer when it was pulled)."""
    params = getattr(body, "kv_transfer_params", None)
    kvt = state.config.cache.kv_transfer if params else None
    if kvt is None or not kvt.is_consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return await handler
    try:
        resp = await handler
    except BaseException:
        _release_remote_soon(params)
        raise
    if getattr(resp, "status_code", 200) == 499:
        _release_remote_soon(params)
    return resp


def _release_remote_soon(params: dict[str, Any]) -> None:
    fut = asyncio.get_running_loop().run_in_executor(None, release_remote, dict(params))
    _kv_release_tasks.add(fut)
    fut.add_done_callback(_kv_release_tasks.discard)


def build_app(state: ServerState) -> FastAPI:
    """Create the FastAPI app serving ``state`` (the engine must be started).

    The app's lifespan starts the engine's output task and the periodic stats
    log, and shuts the engine down when the server stops.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start_background()

        async def log_loop() -> None:
            while True:
                await asyncio.sleep(1.0)
                state.log_stats.maybe_log()

        task = asyncio.create_task(log_loop())
        try:
            yield
        finally:
            task.cancel()
            state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.config.server.max_request_body_bytes)
    app.state.tokenmill = state
    add_error_handlers(app)
    base = OpenAIServing(state)
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)

    v1 = APIRouter(dependencies=[Depends(api_key_dependency(state))])


    app.openapi = lambda: openapi_with_vocab(app, state.vocab_size,  # type: ignore[method-assign]
                                             state.config.scheduler.scheduling_policy)  # type: ignore[method-assign]

    @v1.get("/v1/models", responses=_errors(401, 500))
    async def list_models() -> dict[str, Any]:
        data = [{"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                 "root": state.model_path, "parent": None, "max_model_len": state.max_model_len, "permission": []}]
        for lr in state.lora or ():    # vLLM's shape: each adapter is a model whose parent is the base
            # (+ prefix_cache_key: what its block hashes carry, so a kv_aware router computes the same hashes)
            data.append({"id": lr.lora_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                         "root": lr.lora_path, "parent": lr.base_model_name or state.model_name,
                         "max_model_len": state.max_model_len, "permission": [],
                         "prefix_cache_key": lr.prefix_cache_key})
        return {"object": "list", "data": data}

    def runtime_lora() -> Any:
        if state.lora is None or not state.config.model.allow_runtime_lora_updating:
            raise APIError("runtime LoRA updating is off: start the server with --enable-lora "
                           "--allow-runtime-lora-updating", 404)
        if not state.engine.is_healthy:
            raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
        return state.lora

    @v1.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, 401, 404, 503))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Any:
        """Load and validate a PEFT adapter folder, then serve it as model ``lora_name`` (400 when invalid)."""
        reg = runtime_lora()

        digest = await asyncio.to_thread(adapter_content_hash, body.lora_path)   # reads the files: off the loop
        try:
            req = reg.new_request(body.lora_name, body.lora_path, content_hash=digest)
        except ValueError as e:
            raise APIError(str(e), param="lora_name") from None
        error = await state.engine.load_lora(req)
        if error is not None:
            raise APIError(error, param="lora_path")
        if reg.get(body.lora_name) is not None:    # a concurrent load of the same name won
            raise APIError(f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name")
        reg.add(req)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_errors(400, 401, 404, 503))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Any:
        """Stop serving an adapter: new requests naming it get 404; those in flight finish with it."""
        reg = runtime_lora()
        req = reg.get(body.lora_name)
        if req is None or (body.lora_int_id is not None and body.lora_int_id != req.lora_int_id):
            raise APIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404, param="lora_name")
        reg.remove(body.lora_name)
        state.engine.unload_lora(req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @v1.post("/v1/completions", responses={**GENERATION_OK, **V1_ERRORS})
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        return await _releasing_remote_kv(state, body, with_disconnect(raw, completions.create_completion(body)))

    @v1.post("/v1/chat/completions", responses={**GENERATION_OK, **V1_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        return await _releasing_remote_kv(state, body, with_disconnect(raw, chat.create_chat_completion(body)))

    @v1.post("/kv_transfer/release", responses=_errors(400, 401, 503))
    async def kv_transfer_release(body: KVTransferReleaseRequest) -> dict[str, Any]:
        """Prefill-decode disaggregation: free the KV kept for a decode server that will not pull it
        (a no-op when it was pulled, expired or is being pulled; the answer does not say which)."""
        rid, eid = body.target()
        kvt = state.config.cache.kv_transfer
        if kvt is None or not kvt.is_producer:
            raise APIError("this server keeps no KV for other servers (no --kv-transfer-config with kv_role "
                           "kv_producer or kv_both)", param="kv_transfer_params")
        if not state.engine.is_healthy:
            raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
        state.engine.release_kv(rid, eid)
        return {"object": "kv_transfer.release", "remote_request_id": rid, "status": "accepted"}

    app.include_router(v1)

    @app.post("/tokenize", responses=OPEN_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        base.check_model(body.model)
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await base.encode(body.prompt, add, param="prompt")
        else:
            text = base.render_chat(body.messages or [], body.add_generation_prompt, body.continue_final_message,
                                    tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
            ids = await base.encode(text, bool(body.add_special_tokens), param="messages")
        ts = base.token_strings
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": [ts.get(t)[0] for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize", responses=OPEN_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        base.check_model(body.model)
        base.check_token_ids(body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/health", response_class=Response,
             responses={200: {"description": "Engine core running (empty body)"}, **_errors(503)})
    async def health() -> Response:
        if not state.engine.is_healthy:
            raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
        return Response(status_code=200)

    if envs.TOKENMILL_DEBUG_ENDPOINTS:
        @app.get("/debug/invariants", include_in_schema=False)
        async def invariants() -> dict[str, Any]:
            """The engine's bookkeeping check (leaked blocks, stray requests) for tests and soak runs."""
            report = await state.engine.check_invariants()
            report["api_unfinished_requests"] = state.engine.num_unfinished_requests
            report["api_detokenizing_requests"] = getattr(state.engine, "num_detokenizing_requests", 0)
            sites = top_allocation_sites()
            if sites:
                report["api_allocation_sites"] = sites
            return report

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(content=state.prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    return app
