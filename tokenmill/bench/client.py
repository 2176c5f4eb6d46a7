"""Streaming client for OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` endpoints, timed the way ``vllm bench serve`` does.

Each request is sent with ``stream: true`` and
``stream_options: {"include_usage": true}``; the server-sent events are parsed
as they arrive and timed with :func:`time.perf_counter`. Several events that
arrive in one network read share one timestamp (they really did arrive
together).

A request *fails* (and is counted, never dropped) on: a non-200 status (429
included), a connection error or timeout, an ``{"error": ...}`` event, a
stream that ends before ``data: [DONE]`` (a broken stream), or a stream
without any chunk carrying a choice.
"""

from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp

from tokenmill.bench.metrics import RequestRecord

Message = dict[str, str]

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: vLLM's ``--backend``/``endpoint_type`` names for the two endpoints.
VLLM_BACKEND_NAMES = {"completions": "openai", "chat": "openai-chat"}


def normalize_endpoint(value: str) -> str:
    """Map ``completions``/``chat``/vLLM spellings to ``"completions"`` or ``"chat"``.

    Accepts ``completions``, ``chat``, ``/v1/completions``,
    ``/v1/chat/completions``, ``openai`` and ``openai-chat``.

    Raises:
        ValueError: for anything else.
    """
    v = value.strip().lower()
    if v in ("completions", "/v1/completions", "v1/completions", "openai", "completion"):
        return "completions"
    if v in ("chat", "/v1/chat/completions", "v1/chat/completions", "openai-chat", "chat-completions"):
        return "chat"
    raise ValueError(f"unknown endpoint {value!r}: use completions or chat")


class SSEParser:
    """Incremental parser of a ``text/event-stream`` body.

    Feed raw bytes as they arrive; get back the ``data`` payloads of every
    event completed so far (comments and other fields are skipped). Handles
    ``\\n``, ``\\r\\n`` and UTF-8 characters split across reads.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the payloads of the events they completed."""
        self._buf += self._decoder.decode(chunk)
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """At end of stream: return the payload of a last unterminated event."""
        self._buf += self._decoder.decode(b"", final=True)
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[str]:
        out: list[str] = []
        buf = self._buf.replace("\r\n", "\n").replace("\r", "\n")
        lines = buf.split("\n")
        self._buf = "" if final else lines.pop()  # keep the incomplete last line
        for line in lines + ([self._buf] if final and self._buf else []):
            if line == "":
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                v = line[5:]
                self._data.append(v[1:] if v.startswith(" ") else v)
        if final and self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out


@dataclass
class EndpointConfig:
    """Where and how to send requests.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        endpoint: ``"completions"`` or ``"chat"``.
        model: model id sent in every request.
        api_key: sent as ``Authorization: Bearer``; ``None`` for none.
        ignore_eos: send vLLM's ``ignore_eos: true`` extra.
        temperature: sent when not ``None``.
        extra_body: merged into every request body (after the fields above).
        timeout_s: total time limit per request, s.
    """

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 6 * 3600.0

    @property
    def url(self) -> str:
        """Full URL of the endpoint."""
        return self.base_url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        """HTTP headers for a request."""
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def payload(self, prompt: str | Sequence[Message], max_tokens: int) -> dict[str, Any]:
        """Request body. For ``chat`` a string prompt becomes one user message;
        for ``completions`` the prompt must be a string (render chats first)."""
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                                else list(prompt))
            # vLLM's benchmark sends max_completion_tokens; older servers only
            # know max_tokens. OpenAI-compatible servers accept both.
            body["max_completion_tokens"] = max_tokens
            body["max_tokens"] = max_tokens
        else:
            if not isinstance(prompt, str):
                raise TypeError("the completions endpoint needs a text prompt")
            body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def _post_once(session: aiohttp.ClientSession, cfg: EndpointConfig, body: dict[str, Any],
                     rec: RequestRecord, state: "_StreamState") -> bool:
    """One POST and its stream into ``rec``/``state``.

    Returns True when the request failed before any response arrived on a
    connection the pool had reused (the server had closed it while idle:
    ``Can not write request body`` or a disconnect with no status line);
    such a request never reached the server, so the caller sends it once
    more on a fresh connection, the way browsers and HTTP libraries retry a
    stale keep-alive connection.
    """
    parser = SSEParser()
    try:
        async with session.post(cfg.url, json=body, headers=cfg.headers(),
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                detail = (await resp.text())[:300].strip()
                rec.error = f"HTTP {resp.status} {resp.reason or ''}: {detail}".strip()
            else:
                async for data in resp.content.iter_any():
                    ts = time.perf_counter()
                    for payload in parser.feed(data):
                        state.handle(payload, ts)
                    if rec.error:
                        break
                if not rec.error:
                    ts = time.perf_counter()
                    for payload in parser.flush():
                        state.handle(payload, ts)
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        if rec.status is None and not state.chunks:
            rec.error = f"connection error: {type(exc).__name__}: {exc}"
            return True
        rec.error = f"broken stream: {type(exc).__name__}: {exc}"
    except aiohttp.ClientPayloadError as exc:
        rec.error = f"broken stream: {type(exc).__name__}: {exc}"
    except TimeoutError:
        rec.error = f"timeout after {cfg.timeout_s:g} s"
    except aiohttp.ClientError as exc:
        rec.error = f"connection error: {type(exc).__name__}: {exc}"
    return False


async def send_request(session: aiohttp.ClientSession, cfg: EndpointConfig,
                       prompt: str | Sequence[Message], max_tokens: int, prompt_len: int = 0,
                       tokenizer: Any = None, turn: int = 0) -> RequestRecord:
    """Send one streaming request and time it.

    Args:
        session: shared aiohttp session.
        cfg: endpoint configuration.
        prompt: text, or chat messages (chat endpoint).
        max_tokens: output tokens requested.
        prompt_len: benchmark tokenizer's prompt length, tokens (kept when the
            server reports no ``usage.prompt_tokens``).
        tokenizer: counts output tokens when the server reports no usage
            (``None``: count chunks instead).
        turn: conversation turn index, copied to the record.

    Returns:
        A :class:`RequestRecord`; never raises for server or network errors.
    """
    rec = RequestRecord(prompt_len=prompt_len, turn=turn)
    body = cfg.payload(prompt, max_tokens)
    st = time.perf_counter()
    for attempt in range(2):
        state = _StreamState(rec, chat=cfg.endpoint == "chat")
        rec.start_time = state.last_ts = st
        rec.error, rec.status = "", None
        retry = await _post_once(session, cfg, body, rec, state)
        if not (retry and attempt == 0):
            break
        rec.retried = True
    rec.end_time = time.perf_counter()
    rec.generated_text = "".join(state.text)
    if state.chunks:
        rec.latency = state.last_ts - st
    if not rec.error:
        if not state.done:
            rec.error = "broken stream: ended before data: [DONE]"
        elif state.chunks == 0:
            rec.error = "no streamed chunk carried a choice"
    rec.success = not rec.error
    if not rec.usage_reported:
        if tokenizer is not None and rec.generated_text:
            rec.output_tokens = len(tokenizer.encode(rec.generated_text, add_special_tokens=False))
        else:
            rec.output_tokens = state.chunks
    return rec


class _StreamState:
    """Applies SSE payloads of one response to its :class:`RequestRecord`."""

    def __init__(self, rec: RequestRecord, chat: bool) -> None:
        self.rec = rec
        self.chat = chat
        self.chunks = 0          # chunks that carried a choice
        self.last_ts = 0.0       # perf_counter of the latest such chunk, s
        self.done = False        # saw data: [DONE]
        self.text: list[str] = []

    def handle(self, payload: str, ts: float) -> None:
        rec = self.rec
        payload = payload.strip()
        if payload == "[DONE]":
            self.done = True
            return
        if not payload or rec.error:
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            rec.error = f"malformed event: {payload[:120]!r}"
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            err = obj["error"]
            msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            rec.error = f"server error event: {msg}"
            return
        choices = obj.get("choices")
        if choices:
            if self.chunks == 0:
                rec.ttft = ts - rec.start_time
            else:
                rec.itl.append(ts - self.last_ts)
            self.chunks += 1
            self.last_ts = ts
            self.text.append(_chunk_text(choices[0], self.chat))
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            rec.usage_reported = True
            rec.output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                rec.prompt_len = int(usage["prompt_tokens"])
