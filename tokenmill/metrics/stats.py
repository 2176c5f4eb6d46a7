"""Front-end statistics: what the API process measures per batch of core outputs.

The engine core reports its own state (:class:`EngineStats`:
queue lengths, KV usage, prefix-cache counters); the front end adds what only
it sees — tokens streamed, time to first token, inter-token latency and
per-request phase times — as one :class:`IterationStats` per output batch. Stat
loggers (the Prometheus exporter, the periodic log line, admission control)
implement :class:`StatLogger` and receive both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.core.scheduler import QueueState
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.core.spec_decode_stats import SpecDecodingStats


@dataclass
class EngineStats:
    """A snapshot of the core for metrics and admission control.

    Attributes:
        num_running: requests in the running set.
        num_waiting: requests queued (including preempted ones).
        num_waiting_tokens: prompt tokens of waiting requests.
        kv_cache_usage: fraction of KV blocks referenced, in [0, 1].
        num_preemptions_total: preemptions since start.
        prefix_cache_queries: prompt tokens looked up in the prefix cache since start.
        prefix_cache_hits: of those, tokens found.
        num_steps: engine steps executed since start.
        last_step_time: seconds of the most recent step (schedule + execute + update).
        last_schedule_time: seconds spent in schedule() + update in that step.
        num_kv_blocks, block_size: pool geometry.
        queue: the scheduler's queues in tokens still to compute, by lane and
            priority, for admission control (None from an engine that does not report it).
        step_timing: the smoothed step-time model: decode step time vs batch
            size and the prefill rate (None likewise).
        spec_decoding: cumulative speculative-decoding counters (None when
            speculative decoding is off).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    last_step_time: float = 0.0
    last_schedule_time: float = 0.0
    num_kv_blocks: int = 0
    block_size: int = 0
    queue: QueueState | None = None
    step_timing: StepTimingSnapshot | None = None
    spec_decoding: SpecDecodingStats | None = None


@dataclass
class FinishedRequestStats:
    """Timings of one finished request (all seconds; 0 when a phase was never reached).

    Attributes:
        finish_reason: 'stop', 'length', 'abort' or 'error'.
        e2e_latency: arrival → finish.
        queued_time: arrival → first scheduled.
        prefill_time: first scheduled → first token.
        decode_time: first token → finish.
        num_prompt_tokens: prompt length in tokens.
        num_generation_tokens: tokens generated over all choices.
        max_tokens_param: the request's max_tokens (None: unbounded).
        request_id: the front end's request id ("" when unknown).
    """

    finish_reason: str
    e2e_latency: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    request_id: str = ""


@dataclass
class IterationStats:
    """What one batch of core outputs did, as seen by the front end.

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token.
        num_generation_tokens: tokens generated in this batch.
        time_to_first_tokens: seconds, arrival → first token, one per request.
        inter_token_latencies: seconds between consecutive token batches of a request.
        finished: requests that finished.
        timestamp: ``time.time()`` when the batch was processed.
        first_tokens: ``(request id, seconds arrival → first token)`` of the
            requests that produced their first token (same values as
            ``time_to_first_tokens``, with ids, e.g. to score TTFT predictions).
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    timestamp: float = 0.0
    first_tokens: list[tuple[str, float]] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives the core's snapshot and the front end's iteration stats."""

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Called from the event loop after each output batch; must not block."""
        ...
