"""Streaming helpers: Server-Sent Events and client disconnects.

Streaming (``"stream": true``) sends ``data: {json}\\n\\n`` events ending with
``data: [DONE]``. The response starts with the first generated token (so a
rejected request still gets a proper status), each chunk carries only new
text, and an error after streaming began is sent in-band as one error event.
A client that disconnects is aborted in the engine within one step
(:func:`with_disconnect` for non-streamed requests; a streamed response's
generator is closed by the server, which aborts its requests).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.outputs import RequestOutput
from tokenmill.server.protocol import APIError
from tokenmill.server.serving import Usage

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    """One SSE ``data:`` event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(e: BaseException) -> str:
    """The in-band SSE error event for an exception raised after streaming began."""
    if isinstance(e, APIError):
        return sse(e.to_dict())
    if isinstance(e, EngineDeadError):
        return sse(APIError(f"engine is not running: {e}", 503).to_dict())
    return sse(APIError(f"{type(e).__name__}: {e}", 500).to_dict())


async def close_quietly(agen: Any) -> None:
    """Close an async generator (aborting its requests), ignoring errors."""
    try:
        await agen.aclose()
    except Exception:  # noqa: BLE001 - already failed; we only want the requests aborted
        pass


def stream_response(merged: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput],
                    usage: Usage, head: dict[str, Any], stream_options: Any,
                    make_choices: Callable[[int, RequestOutput], list[dict[str, Any]]]) -> StreamingResponse:
    """The SSE response shared by completions and chat: one chunk per engine output with choices.

    Args:
        merged: ``(prompt index, output)`` pairs (:func:`~tokenmill.server.serving.merge_streams`),
            ``first`` already taken from it (so errors before the first token are HTTP errors).
        usage: token accounting, updated with every output.
        head: the chunk's fixed fields (``id``, ``object``, ``created``, ``model``).
        stream_options: the request's ``stream_options`` (``include_usage``:
            a final usage chunk; ``continuous_usage_stats``: usage in every chunk).
        make_choices: the dialect's ``choices`` entries for one output (empty: no chunk).

    The stream always ends with ``data: [DONE]``.
    """
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)

    async def stream() -> AsyncIterator[str]:
        try:
            pending: list[tuple[int, RequestOutput]] = [first]
            while True:
                if pending:
                    i, out = pending.pop()
                else:
                    try:
                        i, out = await merged.__anext__()
                    except StopAsyncIteration:
                        break
                if out.error:
                    raise APIError(out.error, out.error_code)
                usage.add(i, out)
                choices = make_choices(i, out)
                if not choices:
                    continue
                chunk: dict[str, Any] = {**head, "choices": choices}
                if out.kv_transfer_params is not None and out.finished:
                    chunk["kv_transfer_params"] = out.kv_transfer_params
                if continuous:
                    chunk["usage"] = usage.to_dict()
                yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage.to_dict()})
        except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
            await close_quietly(merged)
            yield error_event(e)
        yield SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def with_disconnect(raw: Request, coro: Awaitable[Any]) -> Any:
    """Run a handler, cancelling it if the client disconnects first (aborting its requests).

    Returns:
        the handler's result, or an empty 499 response when the client left.
    """
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the client is gone; nothing to report
        pass
    return Response(status_code=499)
