"""Admission control: refuse work early (HTTP 429) instead of queueing forever.

With ``--max-num-waiting-requests N`` (and/or ``--max-num-waiting-tokens T``) a
new request is refused when admitting it would make more than N requests (T
prompt tokens) wait. The refusal carries ``Retry-After``: the seconds until
enough of the queue has drained for the request to fit, estimated from the
measured service rate (requests, resp. prompt tokens, that left the queue per
second over the last :attr:`AdmissionController.window` seconds).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.stats import IterationStats

# Bounds of the Retry-After estimate (seconds).
MIN_RETRY_AFTER = 1
MAX_RETRY_AFTER = 60


@dataclass
class Refusal:
    """Why a request was refused and when to come back.

    Attributes:
        message: human-readable reason (states the limit and the queue).
        retry_after: whole seconds, in [MIN_RETRY_AFTER, MAX_RETRY_AFTER].
        reason: which limit refused it: ``waiting_requests`` or
            ``waiting_tokens`` (the ``reason`` label of
            ``tokenmill:request_refused_total``).
    """

    message: str
    retry_after: int
    reason: str = "waiting_requests"


class ServiceRate:
    """Sliding-window rate of events (e.g. requests or tokens leaving the queue).

    Args:
        window: seconds of history kept.
    """

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0

    def add(self, amount: float, now: float | None = None) -> None:
        """Record ``amount`` units served at ``now`` (monotonic seconds)."""
        if amount <= 0:
            return
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        self._total += amount
        self._trim(now)

    def rate(self, now: float | None = None) -> float | None:
        """Units per second over the window, or None before anything was measured."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return None
        span = max(now - self._events[0][0], 1.0)
        return self._total / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window:
            self._total -= self._events.popleft()[1]


class AdmissionController:
    """Decides whether a new request may queue; implements ``StatLogger`` to learn the service rate.

    Args:
        max_waiting_requests: cap on waiting requests (None: no cap).
        max_waiting_tokens: cap on waiting prompt tokens (None: no cap).
        window: seconds over which the service rate is measured.
    """

    def __init__(self, max_waiting_requests: int | None = None, max_waiting_tokens: int | None = None,
                 window: float = 30.0) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.request_rate = ServiceRate(window)
        self.token_rate = ServiceRate(window)

    @property
    def enabled(self) -> bool:
        return self.max_waiting_requests is not None or self.max_waiting_tokens is not None

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Learn the service rate: requests (and their prompt tokens) reaching their first token."""
        if iteration is not None and iteration.time_to_first_tokens:
            now = time.monotonic()
            self.request_rate.add(len(iteration.time_to_first_tokens), now)
            self.token_rate.add(iteration.num_prompt_tokens, now)

    def check_size(self, new_requests: int, new_tokens: int) -> str | None:
        """Why a request can never be admitted, whatever the queue (a 400), or None.

        Args:
            new_requests: engine requests it adds (prompts × ``n``).
            new_tokens: prompt tokens it adds (prompts × ``n`` × prompt length).

        Returns:
            the message (it names the flag that sets the cap) or None.
        """
        if self.max_waiting_requests is not None and new_requests > self.max_waiting_requests:
            return (f"this request needs {new_requests} sequences (prompts x n) but at most "
                    f"{self.max_waiting_requests} may wait (--max-num-waiting-requests); send fewer")
        if self.max_waiting_tokens is not None and new_tokens > self.max_waiting_tokens:
            return (f"this request adds {new_tokens} prompt tokens (prompts x n) but at most "
                    f"{self.max_waiting_tokens} may wait (--max-num-waiting-tokens); send fewer")
        return None

    def check(self, num_waiting: int, num_waiting_tokens: int, new_requests: int = 1,
              new_tokens: int = 0, now: float | None = None) -> Refusal | None:
        """Return a :class:`Refusal` if the request must be refused, else None.

        Args:
            num_waiting: requests waiting now (engine queue + in flight to it).
            num_waiting_tokens: their prompt tokens.
            new_requests: engine requests the new request adds (its ``n``).
            new_tokens: prompt tokens it adds (``n`` × prompt length).
            now: monotonic seconds (for tests).
        """
        refusals: list[Refusal] = []
        if self.max_waiting_requests is not None and num_waiting + new_requests > self.max_waiting_requests:
            excess = num_waiting + new_requests - self.max_waiting_requests
            refusals.append(Refusal(
                f"server is busy: {num_waiting} requests are waiting and the limit is "
                f"{self.max_waiting_requests} (--max-num-waiting-requests); retry later",
                retry_after_seconds(excess, self.request_rate.rate(now)), "waiting_requests"))
        if self.max_waiting_tokens is not None and num_waiting_tokens + new_tokens > self.max_waiting_tokens:
            excess = num_waiting_tokens + new_tokens - self.max_waiting_tokens
            refusals.append(Refusal(
                f"server is busy: {num_waiting_tokens} prompt tokens are waiting, this request adds "
                f"{new_tokens} and the limit is {self.max_waiting_tokens} (--max-num-waiting-tokens); "
                "retry later",
                retry_after_seconds(excess, self.token_rate.rate(now)), "waiting_tokens"))
        if not refusals:
            return None
        return max(refusals, key=lambda r: r.retry_after)


def retry_after_seconds(excess: float, rate: float | None) -> int:
    """Seconds until ``excess`` units have left the queue at ``rate`` units/s, rounded up.

    Without a measured rate (nothing served yet) the answer is the minimum,
    so that clients probe again soon. Clamped to [MIN_RETRY_AFTER, MAX_RETRY_AFTER].
    """
    if not rate or rate <= 0:
        return MIN_RETRY_AFTER
    return int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(excess / rate))))
