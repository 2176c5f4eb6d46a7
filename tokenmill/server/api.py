"""The OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of the engine core process.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /version``,
``GET /metrics``. The API process owns HTTP, tokenization, the chat template,
detokenization and SSE; the engine core runs in its own process
(:class:`~tokenmill.engine.async_engine.AsyncEngine`).

Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "param", "code"}}``:
400 invalid parameters (malformed JSON and wrong types included) or a prompt
beyond ``--max-model-len``; 401 missing/wrong API key on ``/v1/*`` when
``--api-key`` is set; 404 unknown model; 429 with ``Retry-After`` from
admission control; 503 when the engine core is dead.

Streaming (``"stream": true``) sends ``data: {json}\\n\\n`` events ending with
``data: [DONE]``. The response starts with the first generated token (so a
rejected request still gets a proper status), each chunk carries only new text,
and every choice ends with exactly one chunk whose ``finish_reason`` is set.
A client that disconnects is aborted in the engine within one step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import TokenLogprobs
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.metrics.log_stats import LoggingStatLogger
from tokenmill.metrics.prometheus import CONTENT_TYPE_LATEST, PrometheusStatLogger
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import AdmissionController
from tokenmill.server.body_limit import BodySizeLimitMiddleware
from tokenmill.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest, error_param_from_loc)

logger = logging.getLogger("tokenmill.server")

# JSON cannot carry -inf; vLLM clamps log-probabilities the same way.
_MIN_LOGPROB = -9999.0


@dataclass
class ServerState:
    """Everything the routes need.

    Attributes:
        config: the engine configuration.
        engine: the started :class:`AsyncEngine`.
        tokenizer: Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``).
        chat_template: Jinja chat template or None.
        model_name: the served model name (requests must use it or omit ``model``).
        model_path: checkpoint path (``root`` in ``/v1/models``).
        max_model_len: context limit in tokens, from the core's handshake.
        admission: admission control (429).
        prometheus: the ``/metrics`` exporter.
        log_stats: the periodic log line.
    """

    config: EngineConfig
    engine: AsyncEngine
    tokenizer: Any
    chat_template: str | None
    model_name: str
    model_path: str
    max_model_len: int
    admission: AdmissionController
    prometheus: PrometheusStatLogger
    log_stats: LoggingStatLogger
    created: int = field(default_factory=lambda: int(time.time()))
    token_strings: "TokenStrings | None" = None

    @property
    def api_key(self) -> str | None:
        return self.config.server.api_key

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


# ---------------------------------------------------------------------------
# Token strings for logprobs
# ---------------------------------------------------------------------------
def _byte_level_alphabet() -> dict[int, str]:
    """Byte → printable character map of byte-level BPE vocabularies (GPT-2 style).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in
    order, to code points 256, 257, ...
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    keep_set = set(keep)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep_set:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TokenStrings:
    """Text and raw bytes of single tokens, for logprobs (cached per id).

    For byte-level BPE vocabularies the bytes are exact (a token may hold part
    of a UTF-8 character; its text then contains U+FFFD, as in vLLM/OpenAI);
    otherwise the token is decoded on its own.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._char_to_byte = {c: b for b, c in _byte_level_alphabet().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, utf8 bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str) and piece and all(ch in self._char_to_byte for ch in piece):
            raw = bytes(self._char_to_byte[ch] for ch in piece)
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        else:
            text = self.tokenizer.decode([int(token_id)])
            out = (text, list(text.encode("utf-8")))
        if len(self._cache) < 200_000:
            self._cache[token_id] = out
        return out


def _lp(v: float) -> float:
    return max(float(v), _MIN_LOGPROB)


# ---------------------------------------------------------------------------
# Helpers shared by the routes
# ---------------------------------------------------------------------------
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{state.model_name}`.",
                       404, param="model")


def _check_token_ids(state: ServerState, ids: list[int], param: str = "prompt") -> None:
    v = state.vocab_size
    for t in ids:
        if t < 0 or t >= v:
            raise APIError(f"token id {t} is out of range [0, {v})", param=param)


def _resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None,
                        param: str = "max_tokens") -> int:
    """Check the context limit; return the max_tokens to use.

    Raises:
        APIError: 400 stating the limit and the request's token counts.
    """
    limit = state.max_model_len
    if requested is None:
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length "
                "of the prompt.", param="prompt" if param == "max_tokens" else "messages")
        return limit - prompt_len
    if prompt_len + requested > limit or prompt_len > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            f"Please reduce the length of the prompt or {param}.", param=param)
    return requested


def _check_priority(state: ServerState, priority: int) -> None:
    if priority != 0 and state.config.scheduler.scheduling_policy != "priority":
        raise APIError("priority is only supported with --scheduling-policy priority "
                       f"(this server uses {state.config.scheduler.scheduling_policy})", param="priority")


def _admit(state: ServerState, new_requests: int, new_tokens: int) -> None:
    if not state.engine.is_healthy:
        raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
    if not state.admission.enabled:
        return
    adm = state.admission
    if adm.max_waiting_requests is not None and new_requests > adm.max_waiting_requests:
        raise APIError(f"this request needs {new_requests} sequences (prompts x n) but at most "
                       f"{adm.max_waiting_requests} may wait (--max-num-waiting-requests); send fewer", param="n")
    if adm.max_waiting_tokens is not None and new_tokens > adm.max_waiting_tokens:
        raise APIError(f"this request adds {new_tokens} prompt tokens (prompts x n) but at most "
                       f"{adm.max_waiting_tokens} may wait (--max-num-waiting-tokens); send fewer", param="n")
    waiting, waiting_tokens = state.engine.waiting_load()
    refusal = state.admission.check(waiting, waiting_tokens, new_requests, new_tokens)
    if refusal is not None:
        state.prometheus.record_refusal(refusal.reason)
        raise APIError(refusal.message, 429, headers={"Retry-After": str(refusal.retry_after)})


def _request_id(prefix: str, given: str | None) -> str:
    return f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"


# Texts longer than this are tokenized in a worker thread so the event loop keeps serving
# other requests (health checks, streams) while a huge prompt is encoded.
_INLINE_ENCODE_CHARS = 4096


async def _encode(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= _INLINE_ENCODE_CHARS:
        return list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    ids = await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=add_special_tokens)
    return list(ids)


def _render_chat(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                 continue_final_message: bool, chat_template: str | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> str:
    template = chat_template or state.chat_template
    if not template:
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    msgs = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        msgs.append(d)
    try:
        out = state.tokenizer.apply_chat_template(
            msgs, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **(chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja2 errors, bad kwargs
        raise APIError(f"chat template could not be applied: {type(e).__name__}: {e}", param="messages") from None
    return out if isinstance(out, str) else str(out)


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as ``(stream index, delta)``.

    Closing (or cancelling) the merged stream cancels the readers, which aborts
    the requests. The ``finally`` never awaits, so it is safe under anyio
    cancellation.
    """
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in g:
                queue.put_nowait((i, item))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _with_disconnect(raw: Request, coro: Awaitable[Any]) -> Any:
    """Run a handler, cancelling it if the client disconnects first (aborting its requests)."""
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


class _Usage:
    """Token accounting for one API request (all prompts and choices)."""

    def __init__(self, prompt_lens: list[int], count_completion: bool = True) -> None:
        self.prompt_tokens = sum(prompt_lens)
        self.completion_tokens = 0
        self.count_completion = count_completion  # False: the generated tokens are not returned (echo only)
        self.cached: dict[int, int] = {}

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        if self.count_completion:
            self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.cached[prompt_index] = out.num_cached_tokens   # the request's latest view (min over its choices)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


async def _first_or_error(merged: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
    """Await the first delta (before any byte is sent), mapping failures to HTTP errors."""
    try:
        first = await merged.__anext__()
    except EngineDeadError as e:
        raise APIError(f"engine is not running: {e}", 503) from None
    except ValueError as e:  # e.g. a request_id that is already in use
        raise APIError(str(e), 400, param="request_id") from None
    except StopAsyncIteration:  # pragma: no cover - generate always yields a final delta
        raise APIError("request produced no output", 500) from None
    if first[1].error:
        await merged.aclose()
        raise APIError(first[1].error, first[1].error_code)
    return first


async def _collect(merged: AsyncIterator[tuple[int, RequestOutput]], usage: Any, n: int
                   ) -> tuple[dict[int, list[str]], dict[int, list[int]], dict[int, list],
                              dict[int, tuple[str | None, Any]], dict[int, list]]:
    """Drain a merged stream for a non-streamed response.

    Choice ``c`` of prompt ``i`` gets the global index ``i * n + c`` (``n``
    choices per prompt; chat has one prompt). Returns per global index the
    text pieces, token ids, logprobs and ``(finish_reason, stop_reason)``,
    and per prompt index its prompt logprobs (when the request asked).

    Raises:
        APIError: the request failed (its own status), the engine is dead
            (503), or the request id is in use (400).
    """
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    lps: dict[int, list] = {}
    finish: dict[int, tuple[str | None, Any]] = {}
    prompt_lps: dict[int, list] = {}
    try:
        async for i, out in merged:
            if out.error:
                raise APIError(out.error, out.error_code)
            usage.add(i, out)
            if out.prompt_logprobs is not None:
                prompt_lps.setdefault(i, out.prompt_logprobs)
            for c in out.outputs:
                gi = i * n + c.index
                texts.setdefault(gi, []).append(c.text)
                token_ids.setdefault(gi, []).extend(c.token_ids)
                lps.setdefault(gi, []).extend(c.logprobs or [])
                if c.finish_reason is not None:
                    finish[gi] = (c.finish_reason, c.stop_reason)
    except EngineDeadError as e:
        raise APIError(f"engine is not running: {e}", 503) from None
    except ValueError as e:  # e.g. a request_id that is already in use
        raise APIError(str(e), 400, param="request_id") from None
    finally:
        await merged.aclose()
    return texts, token_ids, lps, finish, prompt_lps


async def _close_quietly(agen: Any) -> None:
    try:
        await agen.aclose()
    except Exception:  # noqa: BLE001 - already failed; we only want the requests aborted
        pass


def _stream_response(merged: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput],
                     usage: "_Usage", head: dict[str, Any], stream_options: Any,
                     make_choices: Callable[[int, RequestOutput], list[dict[str, Any]]]) -> StreamingResponse:
    """The SSE response shared by completions and chat: one chunk per engine output with choices.

    Args:
        merged: ``(prompt index, output)`` pairs (:func:`_merge`), ``first``
            already taken from it (so errors before the first token are HTTP errors).
        usage: token accounting, updated with every output.
        head: the chunk's fixed fields (``id``, ``object``, ``created``, ``model``).
        stream_options: the request's ``stream_options`` (``include_usage``:
            a final usage chunk; ``continuous_usage_stats``: usage in every chunk).
        make_choices: the dialect's ``choices`` entries for one output (empty: no chunk).

    An error after streaming began is sent in-band as an error event; the
    stream always ends with ``data: [DONE]``.
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
                if continuous:
                    chunk["usage"] = usage.to_dict()
                yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage.to_dict()})
        except Exception as e:  # noqa: BLE001 - reported in-band once streaming started
            await _close_quietly(merged)
            yield _error_event(e)
        yield _SSE_DONE

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(e: BaseException) -> str:
    if isinstance(e, APIError):
        return _sse(e.to_dict())
    if isinstance(e, EngineDeadError):
        return _sse(APIError(f"engine is not running: {e}", 503).to_dict())
    return _sse(APIError(f"{type(e).__name__}: {e}", 500).to_dict())


# ---------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------
def _vllm_prompt_logprobs(ts: TokenStrings, prompt_ids: list[int], plps: list[TokenLogprobs | None] | None
                          ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or ``{token_id: {"logprob",
    "rank", "decoded_token"}}`` for the token itself and its top alternatives."""
    if plps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, lp in zip(prompt_ids, plps):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": _lp(v), "rank": r + 1, "decoded_token": ts.get(t)[0]}
                 for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        entry[str(tid)] = {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": ts.get(tid)[0]}
        out.append(entry)
    return out


def _completion_logprobs(ts: TokenStrings, token_ids: list[int], lps: list[TokenLogprobs | None],
                         offset: int, prompt_ids: list[int] | None = None,
                         prompt_lps: list[TokenLogprobs | None] | None = None) -> tuple[dict[str, Any], int]:
    """The legacy completions ``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) for echoed prompt tokens (their logprobs from ``prompt_lps`` when computed,
    else None) followed by generated ones; returns it and the text offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if prompt_ids:
        token_ids = list(prompt_ids) + list(token_ids)
        lps = list(prompt_lps if prompt_lps is not None else [None] * len(prompt_ids)) + list(lps)
    for tid, lp in zip(token_ids, lps):
        s = ts.get(tid)[0]
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_lp(lp.logprob))
        d = {ts.get(t)[0]: _lp(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        d.setdefault(s, _lp(lp.logprob))
        top.append(d)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}, offset


async def _completion(state: ServerState, body: CompletionRequest, raw: Request) -> Any:
    arrival = time.time()
    body.check()
    _check_model(state, body.model)
    _check_priority(state, body.priority)
    p = body.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif all(isinstance(x, int) for x in p):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    prompts: list[tuple[str | None, list[int]]] = []
    for it in items:
        if isinstance(it, str):
            prompts.append((it, await _encode(state, it, body.add_special_tokens)))
        else:
            _check_token_ids(state, it)
            prompts.append((None, list(it)))
    if any(len(ids) == 0 for _, ids in prompts):
        raise APIError("prompt must contain at least one token", param="prompt")
    plp = body.effective_prompt_logprobs
    # echo with max_tokens 0 and prompt logprobs: the engine must run the prompt; it samples one
    # token that is not returned (vLLM does the same)
    echo_only = body.echo_without_generation and plp is not None
    params_list: list[SamplingParams] = []
    for _, ids in prompts:
        mt = 1 if echo_only else _resolve_max_tokens(state, len(ids), body.max_tokens)
        params_list.append(body.sampling_params(mt, body.logprobs, plp))
    n = body.n
    _admit(state, n * len(prompts), n * sum(len(ids) for _, ids in prompts))
    rid = _request_id("cmpl", body.request_id)
    created = int(time.time())
    gens = [state.engine.generate(rid if len(prompts) == 1 else f"{rid}-p{i}", text, ids, params_list[i],
                                  body.priority, body.cache_salt, arrival)
            for i, (text, ids) in enumerate(prompts)]
    usage = _Usage([len(ids) for _, ids in prompts], count_completion=not echo_only)
    ts = state.token_strings
    assert ts is not None

    def echo_text(i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else state.tokenizer.decode(ids)

    merged = _merge(gens)
    if body.stream:
        first = await _first_or_error(merged)
        offsets: dict[int, int] = {}
        started: set[int] = set()

        def completion_choices(i: int, out: RequestOutput) -> list[dict[str, Any]]:
            choices = []
            for c in out.outputs:
                gi = i * n + c.index
                text, gen_ids, gen_lps = ("", [], []) if echo_only else (c.text, c.token_ids, c.logprobs or [])
                prompt_ids = None
                if gi not in started:
                    started.add(gi)
                    if body.echo:
                        text = echo_text(i) + text
                        prompt_ids = prompts[i][1]
                elif not text and c.finish_reason is None and body.logprobs is None:
                    continue  # nothing to show yet (e.g. half a UTF-8 character)
                lp = None
                if body.logprobs is not None:
                    lp, offsets[gi] = _completion_logprobs(ts, gen_ids, gen_lps, offsets.get(gi, 0), prompt_ids,
                                                           out.prompt_logprobs)
                fr, sr = ("length", None) if echo_only and c.finish_reason else (c.finish_reason, c.stop_reason)
                choices.append({"index": gi, "text": text, "logprobs": lp, "finish_reason": fr, "stop_reason": sr})
            return choices

        head = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
        return _stream_response(merged, first, usage, head, body.stream_options, completion_choices)

    # Non-streaming: collect everything.
    texts, token_ids, lps, finish, prompt_lps = await _collect(merged, usage, n)
    choices = []
    for gi in sorted(texts):
        i = gi // n
        if echo_only:
            texts[gi], token_ids[gi], lps[gi] = [], [], []
        text = "".join(texts[gi])
        lp = None
        if body.echo:
            text = echo_text(i) + text
        if body.logprobs is not None:
            lp, _ = _completion_logprobs(ts, token_ids[gi], lps[gi], 0, prompts[i][1] if body.echo else None,
                                         prompt_lps.get(i))
        fr, sr = ("length", None) if echo_only else finish.get(gi, (None, None))
        choice = {"index": gi, "text": text, "logprobs": lp, "finish_reason": fr, "stop_reason": sr}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(ts, prompts[i][1], prompt_lps.get(i))
        choices.append(choice)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                         "choices": choices, "usage": usage.to_dict()})


# ---------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------
def _chat_logprobs(ts: TokenStrings, token_ids: list[int], lps: list[TokenLogprobs | None],
                   top_n: int) -> list[dict[str, Any]]:
    content = []
    for tid, lp in zip(token_ids, lps):
        s, b = ts.get(tid)
        entry: dict[str, Any] = {"token": s, "logprob": _lp(lp.logprob) if lp else 0.0, "bytes": b,
                                 "top_logprobs": []}
        if lp is not None:
            for t, v in list(zip(lp.top_token_ids, lp.top_logprobs))[:top_n]:
                ts_, tb = ts.get(t)
                entry["top_logprobs"].append({"token": ts_, "logprob": _lp(v), "bytes": tb})
        content.append(entry)
    return content


async def _chat(state: ServerState, body: ChatCompletionRequest, raw: Request) -> Any:
    arrival = time.time()
    body.check()
    _check_model(state, body.model)
    _check_priority(state, body.priority)
    prompt = _render_chat(state, body.messages, body.add_generation_prompt, body.continue_final_message,
                          body.chat_template, body.chat_template_kwargs)
    ids = await _encode(state, prompt, body.add_special_tokens)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    mt = _resolve_max_tokens(state, len(ids), body.requested_max_tokens, param)
    params = body.sampling_params(mt, body.num_logprobs, body.prompt_logprobs)
    n = body.n
    _admit(state, n, n * len(ids))
    rid = _request_id("chatcmpl", body.request_id)
    created = int(time.time())
    merged = _merge([state.engine.generate(rid, prompt, ids, params, body.priority, body.cache_salt, arrival)])
    usage = _Usage([len(ids)])
    ts = state.token_strings
    assert ts is not None
    top_n = body.top_logprobs or 0

    if body.stream:
        first = await _first_or_error(merged)
        started: set[int] = set()

        def chat_choices(_: int, out: RequestOutput) -> list[dict[str, Any]]:
            choices = []
            for c in out.outputs:
                if c.index not in started:
                    # The role is announced together with the first generated token.
                    started.add(c.index)
                    delta: dict[str, Any] = {"role": "assistant", "content": c.text}
                elif not c.text and c.finish_reason is None and not body.logprobs:
                    continue  # nothing to show yet (e.g. half a UTF-8 character)
                else:
                    delta = {"content": c.text} if c.text else {}
                lp = None
                if body.logprobs:
                    lp = {"content": _chat_logprobs(ts, c.token_ids, c.logprobs or [], top_n)}
                choices.append({"index": c.index, "delta": delta, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            return choices

        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
        return _stream_response(merged, first, usage, head, body.stream_options, chat_choices)

    texts, token_ids, lps, finish, prompt_lps = await _collect(merged, usage, n=1)
    choices = []
    for idx in sorted(texts):
        fr, sr = finish.get(idx, (None, None))
        lp = {"content": _chat_logprobs(ts, token_ids[idx], lps[idx], top_n)} if body.logprobs else None
        choices.append({"index": idx, "message": {"role": "assistant", "content": "".join(texts[idx])},
                        "logprobs": lp, "finish_reason": fr, "stop_reason": sr})
    resp: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": created,
                            "model": state.model_name, "choices": choices, "usage": usage.to_dict()}
    if body.prompt_logprobs is not None:   # vLLM puts them on the response, not the choice
        resp["prompt_logprobs"] = _vllm_prompt_logprobs(ts, ids, prompt_lps.get(0))
    return JSONResponse(resp)


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------
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
    if state.token_strings is None:
        state.token_strings = TokenStrings(state.tokenizer)

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

    async def check_api_key(request: Request) -> None:
        key = state.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError("invalid or missing API key (send 'Authorization: Bearer <key>')", 401)

    v1 = APIRouter(dependencies=[Depends(check_api_key)])

    @v1.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
            "root": state.model_path, "parent": None, "max_model_len": state.max_model_len, "permission": []}]}

    @v1.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        return await _with_disconnect(raw, _completion(state, body, raw))

    @v1.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        return await _with_disconnect(raw, _chat(state, body, raw))

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        _check_model(state, body.model)
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await _encode(state, body.prompt, add)
        else:
            text = _render_chat(state, body.messages or [], body.add_generation_prompt,
                                body.continue_final_message)
            ids = await _encode(state, text, bool(body.add_special_tokens))
        ts = state.token_strings
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": [ts.get(t)[0] for t in ids] if body.return_token_strs and ts else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_healthy:
            raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=state.prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# ---------------------------------------------------------------------------
# Running the server
# ---------------------------------------------------------------------------
def _model_name(config: EngineConfig, path: str) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    base = os.path.basename(os.path.normpath(path))
    return os.path.splitext(base)[0] if base.endswith(".gguf") else base


def _resolve_model_path(config: EngineConfig) -> str:
    if config.model.model:
        return config.model.model
    from tokenmill.model.loader import default_model_path

    return default_model_path()


def create_server_state(config: EngineConfig, engine: AsyncEngine, tokenizer: Any, model_path: str) -> ServerState:
    """Assemble the :class:`ServerState` for a started engine (registers the stat loggers)."""
    assert engine.info is not None, "engine must be started"
    name = _model_name(config, model_path)
    prom = PrometheusStatLogger(name, engine.info.max_model_len)
    log_stats = LoggingStatLogger(config.server.log_stats_interval)
    admission = AdmissionController(config.scheduler.max_num_waiting_requests,
                                    config.scheduler.max_num_waiting_tokens)
    engine.stat_loggers.extend([prom, log_stats, admission])
    template = getattr(tokenizer, "chat_template", None)
    return ServerState(config=config, engine=engine, tokenizer=tokenizer,
                       chat_template=template if isinstance(template, str) else None, model_name=name,
                       model_path=model_path, max_model_len=engine.info.max_model_len, admission=admission,
                       prometheus=prom, log_stats=log_stats)


def run_server(config: EngineConfig) -> None:
    """Load the tokenizer, start the engine core process and serve HTTP until SIGINT/SIGTERM.

    The core loads the model while this process loads the tokenizer. Returns
    after shutdown; the core process is always stopped (no child is left).

    Raises:
        RuntimeError: the engine core failed to start (message from the core).
        FileNotFoundError / ValueError: bad model or tokenizer path.
    """
    import uvicorn

    level = os.environ.get("TOKENMILL_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_path = _resolve_model_path(config)
    tok_path = config.model.tokenizer or model_path
    engine = AsyncEngine(config)
    engine.launch()
    try:
        from tokenmill.engine.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        tokenizer = load_tokenizer(tok_path)
        logger.info("tokenizer loaded in %.1fs", time.perf_counter() - t0)
        if "torch" in sys.modules:
            # The API process does no tensor work; keep it from competing with the core.
            import torch

            torch.set_num_threads(1)
            logger.info("API process: torch threads=%d (engine core has its own)", torch.get_num_threads())
        engine.set_tokenizer(tokenizer)
        engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    state = create_server_state(config, engine, tokenizer, model_path)
    app = build_app(state)
    uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level="info",
                               access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    server = _make_server(uv_config, engine)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", state.model_name, config.server.host,
                config.server.port, state.max_model_len)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its own shutdown
        pass
    finally:
        engine.shutdown()
    if not server.started:
        raise RuntimeError(f"HTTP server failed to start on {config.server.host}:{config.server.port}")


def _make_server(config: Any, engine: AsyncEngine) -> Any:
    """A uvicorn.Server that stops the engine first on SIGINT/SIGTERM.

    Open streams then end at once with an error event and ``[DONE]``, so the
    graceful shutdown does not wait for long generations.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = engine._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(engine.shutdown)
            super().handle_exit(sig, frame)

    return Server(config)
