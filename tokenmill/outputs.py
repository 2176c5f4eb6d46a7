"""Results handed to users of the engine (offline ``LLM`` and the API server).

Plain data that imports nothing else from tokenmill, so every layer (the core
included) may use it: :class:`TokenLogprobs` travels from the sampler through
the core to the front end.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled token.

    Attributes:
        logprob: natural-log probability of the sampled token under the
            distribution the sampler used after temperature/penalties
            (for greedy: the raw softmax).
        rank: 1-based rank of the sampled token in that distribution.
        top_token_ids: ids of the top-N tokens, most likely first.
        top_logprobs: their log-probabilities, same order.
    """

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestMetrics:
    """Per-request timing, all in ``time.time()`` seconds (None when not reached).

    Attributes:
        arrival_time: when the request reached the engine.
        first_scheduled_time: when its first prefill chunk was scheduled
            (queue time = first_scheduled_time - arrival_time).
        first_token_time: when its first output token was produced (TTFT =
            first_token_time - arrival_time).
        finished_time: when it finished (E2E latency = finished_time - arrival_time).
    """

    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    last_token_time: float | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: choice index (0..n-1).
        text: generated text (cumulative, or only the new part when the caller
            asked for deltas).
        token_ids: generated token ids (cumulative or new part, as ``text``).
        logprobs: per generated token, a :class:`TokenLogprobs` (None entries
            when logprobs were not requested).
        finish_reason: 'stop', 'length', 'abort', 'error' or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, and what the async engine streams.

    Attributes:
        request_id: the request's id.
        prompt: prompt text when known.
        prompt_token_ids: ``[num_prompt_tokens]`` ids.
        outputs: one :class:`CompletionOutput` per choice.
        finished: all choices finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timing of the request.
        error: message when the request was rejected or failed.
        error_code: 400 (the request can never be served) or 500 (the engine
            failed while running it); meaningful only when ``error`` is set.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt
            token, None for the first, then its :class:`TokenLogprobs` given
            the tokens before it; set from the output that carries the first
            generated token on (None before, and when not asked for).
        kv_transfer_params: prefill-decode disaggregation: where a prefill server keeps this
            request's KV for a decode server (vLLM's response field); set on the final output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None
    error_code: int = 400
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    kv_transfer_params: dict | None = None
