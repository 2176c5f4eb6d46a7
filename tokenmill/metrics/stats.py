"""Front-end statistics: what the API process measures per batch of core outputs.

The engine core reports its own state (:class:`tokenmill.core.engine_core.EngineStats`:
queue lengths, KV usage, prefix-cache counters); the front end adds what only
it sees — tokens streamed, time to first token, inter-token latency and
per-request phase times — as one :class:`IterationStats` per output batch. Stat
loggers (the Prometheus exporter, the periodic log line, admission control)
implement :class:`StatLogger` and receive both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.core.engine_core import EngineStats


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
    """

    finish_reason: str
    e2e_latency: float = 0.0
    queued_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None


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
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    timestamp: float = 0.0


class StatLogger(Protocol):
    """Receives the core's snapshot and the front end's iteration stats."""

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Called from the event loop after each output batch; must not block."""
        ...
