"""The serving base shared by the OpenAI endpoints: server state, validation, prompt rendering, collect.

:class:`OpenAIServing` holds what every endpoint needs — model-name and token-id
checks, the context-length check, admission (503 dead engine, 400 over a cap,
429 busy), tokenization off the event loop for long texts, the chat template —
and the helpers that turn the engine's per-request streams into one
(:func:`merge_streams`) and drain it for a non-streamed response
(:func:`collect`). The completion and chat endpoints
(:mod:`~tokenmill.server.serving_completion`, :mod:`~tokenmill.server.serving_chat`)
build on it; the routes live in :mod:`~tokenmill.server.app`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.metrics.log_stats import LoggingStatLogger
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.outputs import RequestOutput, TokenLogprobs
from tokenmill.server.admission import AdmissionController, SLOAdmission
from tokenmill.server.chat_prompt import render_chat_text
from tokenmill.server.protocol import APIError, ChatMessage
from tokenmill.server.slo_predictor import InflightWork, Prediction
from tokenmill.server.tool_parsers.base import ToolParser
from tokenmill.tokenizer import TokenStrings

# JSON cannot carry -inf; vLLM clamps log-probabilities the same way.
MIN_LOGPROB = -9999.0

# Texts longer than this are tokenized in a worker thread so the event loop keeps serving
# other requests (health checks, streams) while a huge prompt is encoded.
INLINE_ENCODE_CHARS = 4096


@dataclass
class Admission:
    """An admitted request, between :meth:`OpenAIServing.admit` and :meth:`OpenAIServing.admitted`.

    Attributes:
        priority: its priority.
        batch: batch lane.
        arrival: ``time.time()`` of arrival.
        prompt_tokens: prompt tokens it adds (prompts × n).
        num_seqs: engine sequences it adds (prompts × n).
        prediction: the SLO predictor's TTFT/TPOT prediction (None without ``--slo`` or before
            the engine measured its step times).
    """

    priority: int
    batch: bool
    arrival: float
    prompt_tokens: int
    num_seqs: int = 1
    prediction: Prediction | None = None


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
        admission: admission control (400 over a cap, 429 busy).
        prometheus: the ``/metrics`` exporter.
        log_stats: the periodic log line.
        token_strings: text/bytes of single tokens for logprobs (built from the tokenizer).
        slo: SLO-aware admission control (``--slo``), None when off.
        lora: the served LoRA adapters (:class:`tokenmill.lora.registry.LoRARegistry`), None without
            ``--enable-lora``.
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
    token_strings: TokenStrings | None = None
    slo: SLOAdmission | None = None
    lora: Any = None

    def __post_init__(self) -> None:
        if self.token_strings is None:
            self.token_strings = TokenStrings(self.tokenizer)

    @property
    def api_key(self) -> str | None:
        return self.config.server.api_key

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)


def clamp_logprob(v: float) -> float:
    """A log-probability JSON can carry (``-inf`` becomes :data:`MIN_LOGPROB`)."""
    return max(float(v), MIN_LOGPROB)


def request_id(prefix: str, given: str | None) -> str:
    """``{prefix}-{given}`` or ``{prefix}-{random hex}``."""
    return f"{prefix}-{given}" if given else f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Validation, admission and prompt rendering shared by every endpoint.

    Args:
        state: the server state (engine, tokenizer, limits).
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state

    @property
    def token_strings(self) -> TokenStrings:
        assert self.state.token_strings is not None
        return self.state.token_strings

    # -- validation ----------------------------------------------------------
    def check_model(self, name: str | None) -> Any:
        """The LoRA adapter ``name`` picks (:class:`~tokenmill.lora.request.LoRARequest`), None for the base.

        Raises:
            APIError: 404 when ``name`` is given and is neither the served model nor a served adapter.
        """
        if name is None or name == self.state.model_name:
            return None
        lora = self.state.lora.get(name) if self.state.lora is not None else None
        if lora is not None:
            return lora
        also = f" and {len(self.state.lora)} LoRA adapters (GET /v1/models)" if self.state.lora else ""
        raise APIError(f"The model `{name}` does not exist. This server serves `{self.state.model_name}`{also}.",
                       404, param="model")

    def check_token_ids(self, ids: Any, param: str = "prompt") -> None:
        """Raises: APIError 400 naming the first id outside ``[0, vocab_size)`` and the range."""
        v = self.state.vocab_size
        for t in ids:
            if t < 0 or t >= v:
                raise APIError(f"token id {t} in {param} is out of range [0, {v})", param=param)

    def check_request_token_ids(self, body: Any) -> None:
        """One validation for every field of a request that carries token ids
        (``body.token_id_fields()``: prompt ids, ``stop_token_ids``, ``logit_bias`` keys).

        Raises:
            APIError: 400 naming the field, the id and the range ``[0, vocab_size)``.
        """
        for param, ids in body.token_id_fields():
            self.check_token_ids(ids, param)

    def check_priority(self, priority: int) -> None:
        """Raises: APIError 400 for a non-zero priority without ``--scheduling-policy priority``."""
        policy = self.state.config.scheduler.scheduling_policy
        if priority != 0 and policy != "priority":
            raise APIError("priority is only supported with --scheduling-policy priority "
                           f"(this server uses {policy})", param="priority")

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str = "max_tokens",
                           prompt_param: str = "prompt") -> int:
        """Check the context limit; return the max_tokens to use (the rest of the context when None).

        Args:
            prompt_len: the prompt's tokens.
            requested: the request's completion limit, or None for the rest of the context.
            param: the field ``requested`` came from (``max_tokens`` or ``max_completion_tokens``).
            prompt_param: the field the prompt came from (``prompt``; ``messages`` for chat), named when the
                prompt alone leaves no room for a completion.

        Raises:
            APIError: 400 stating the limit and the request's token counts, naming the prompt's field when
                the prompt alone fills the context, else ``param``.
        """
        limit = self.state.max_model_len
        if prompt_len >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length "
                f"of the {'messages' if prompt_param == 'messages' else 'prompt'}.", param=prompt_param)
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
                f"Please reduce the length of the prompt or {param}.", param=param)
        return requested

    def admit(self, new_requests: int, new_tokens: int, priority: int = 0, batch: bool = False,
              arrival: float | None = None, max_tokens: int | None = None) -> Admission:
        """Admission: the engine must be alive, the request within the caps, the queue not full, the
        SLO (``--slo``) predicted to be met. Batch-lane requests are never refused: they wait.

        Args:
            new_requests: engine requests it adds (prompts × ``n``).
            new_tokens: prompt tokens it adds.
            priority: its priority; batch: batch lane; arrival: ``time.time()`` of arrival.
            max_tokens: tokens each sequence may generate (the TPOT model's lifetime before any
                request finished; None: unknown).

        Returns:
            the :class:`Admission` to pass to :meth:`admitted` once the engine requests exist.

        Raises:
            APIError: 503 (engine dead), 400 (over a cap even with an empty
                queue), 429 with ``Retry-After`` (queue full, or the SLO
                predicted to be missed).
        """
        state = self.state
        if not state.engine.is_healthy:
            raise APIError(f"engine is not running: {state.engine.dead_reason}", 503)
        ticket = Admission(priority, batch, time.time() if arrival is None else arrival, new_tokens, new_requests)
        if batch:
            return ticket
        adm = state.admission
        if adm.enabled:
            too_large = adm.check_size(new_requests, new_tokens)
            if too_large is not None:
                raise APIError(too_large, param="n")
            waiting, waiting_tokens = state.engine.waiting_load()
            refusal = adm.check(waiting, waiting_tokens, new_requests, new_tokens)
            if refusal is not None:
                state.prometheus.record_refusal(refusal.reason)
                raise APIError(refusal.message, 429, headers={"Retry-After": str(refusal.retry_after)})
        if state.slo is not None:
            view = getattr(state.engine, "slo_view", None)   # data parallel: the core it would run on
            stats, inflight = view() if view is not None else (state.engine.get_stats(),
                                                                 state.engine.inflight_by_priority())
            ticket.prediction, refusal = state.slo.check(stats, InflightWork(inflight), new_tokens, priority,
                                                         ticket.arrival, num_seqs=new_requests,
                                                         max_tokens=max_tokens)
            if refusal is not None:
                state.prometheus.record_refusal(refusal.reason)
                raise APIError(refusal.message, 429, headers={"Retry-After": str(refusal.retry_after)})
        return ticket

    def admitted(self, ticket: Admission, request_ids: list[str]) -> None:
        """Track an admitted request's engine requests until their first token (``--slo``); under the
        priority policy, answer 429 on the pending responses of queued lower-priority requests it pushes
        past their TTFT target (they are aborted in the engine)."""
        slo = self.state.slo
        if slo is None or ticket.batch:
            return
        share = ticket.prompt_tokens // max(1, len(request_ids))
        slo.note_admitted(ticket.prompt_tokens, ticket.num_seqs)
        for i, rid in enumerate(request_ids):
            pending = slo.track(rid, ticket.prediction, ticket.priority, ticket.arrival, share,
                                delay_others=i == 0)
            if pending is None:
                continue
            for victim, refusal in slo.displaced_by(pending, ticket.prediction):
                self.state.prometheus.record_refusal(refusal.reason)
                self.state.engine.abort_nowait(victim, APIError(
                    refusal.message, 429, headers={"Retry-After": str(refusal.retry_after)}))

    # -- prompts -------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool, param: str | None = None) -> list[int]:
        """Token ids of ``text``; long texts are encoded in a worker thread.

        Raises:
            APIError: 400 when ``text`` is not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``
                in the JSON: the tokenizer cannot take it).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"the text is not valid Unicode ({e.reason} at position {e.start}: "
                           f"{text[e.start:e.end]!r})", param=param) from None
        tok = self.state.tokenizer
        if len(text) <= INLINE_ENCODE_CHARS:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        return list(await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                    chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, tool_format: ToolParser | None = None,
                    tool_instructions: str | None = None) -> str:
        """The prompt text of a conversation, from the request's or else the model's chat template: see
        :func:`tokenmill.server.chat_prompt.render_chat_text` (tools, earlier calls, tool results).

        Raises:
            APIError: 400 when there is no template or it fails on these messages.
        """
        return render_chat_text(self.state.tokenizer, chat_template or self.state.chat_template,
                                messages, add_generation_prompt,
                                continue_final_message, chat_template_kwargs, tools, tool_format, tool_instructions)

    # -- logprobs shared by both dialects ------------------------------------
    def vllm_prompt_logprobs(self, prompt_ids: list[int], plps: list[TokenLogprobs | None] | None
                             ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or ``{token_id: {"logprob",
        "rank", "decoded_token"}}`` for the token itself and its top alternatives."""
        if plps is None:
            return None
        ts = self.token_strings
        out: list[dict[str, dict[str, Any]] | None] = []
        for tid, lp in zip(prompt_ids, plps):
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": clamp_logprob(v), "rank": r + 1, "decoded_token": ts.get(t)[0]}
                     for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
            entry[str(tid)] = {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                               "decoded_token": ts.get(tid)[0]}
            out.append(entry)
        return out




class Usage:
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


async def merge_streams(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def first_or_error(merged: AsyncIterator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput]:
    """Await the first delta (before any byte is sent), mapping failures to HTTP errors.

    Raises:
        APIError: 503 engine dead, 400 request id in use, or the request's own error.
    """
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


@dataclass
class Collected:
    """A drained request stream, per global choice index (``prompt index * n + choice``).

    Attributes:
        texts: text pieces.
        token_ids: generated ids.
        logprobs: per generated token its :class:`TokenLogprobs` or None.
        finish: ``(finish_reason, stop_reason)``.
        prompt_logprobs: per prompt index, its prompt logprobs (when asked).
    """

    texts: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    finish: dict[int, tuple[str | None, Any]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    kv_transfer_params: dict | None = None


async def collect(merged: AsyncIterator[tuple[int, RequestOutput]], usage: Usage, n: int) -> Collected:
    """Drain a merged stream for a non-streamed response.

    Choice ``c`` of prompt ``i`` gets the global index ``i * n + c`` (``n``
    choices per prompt; chat has one prompt).

    Raises:
        APIError: the request failed (its own status), the engine is dead
            (503), or the request id is in use (400).
    """
    res = Collected()
    try:
        async for i, out in merged:
            if out.error:
                raise APIError(out.error, out.error_code)
            usage.add(i, out)
            if out.prompt_logprobs is not None:
                res.prompt_logprobs.setdefault(i, out.prompt_logprobs)
            if out.kv_transfer_params is not None:
                res.kv_transfer_params = out.kv_transfer_params
            for c in out.outputs:
                gi = i * n + c.index
                res.texts.setdefault(gi, []).append(c.text)
                res.token_ids.setdefault(gi, []).extend(c.token_ids)
                res.logprobs.setdefault(gi, []).extend(c.logprobs or [])
                if c.finish_reason is not None:
                    res.finish[gi] = (c.finish_reason, c.stop_reason)
    except EngineDeadError as e:
        raise APIError(f"engine is not running: {e}", 503) from None
    except ValueError as e:  # e.g. a request_id that is already in use
        raise APIError(str(e), 400, param="request_id") from None
    finally:
        await merged.aclose()
    return res
