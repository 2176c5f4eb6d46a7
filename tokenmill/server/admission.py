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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tokenmill import envs
from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.stats import IterationStats
from tokenmill.server.slo_predictor import judge, max_decode_batch, predict

if TYPE_CHECKING:
    from tokenmill.server.slo_predictor import SLO, InflightWork, Prediction

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


# -- SLO-aware admission (--slo) ------------------------------------------------
# Pending requests older than this (seconds) are forgotten (their streams never started).
PENDING_MAX_AGE_S = 600.0
# Requests admitted before the engine has measured its step times (no prediction), at most. A cold
# engine's first loaded steps also pay one-time costs (kernels, weight packing for new shapes), so a
# whole batch admitted blind under a burst misses the SLO and teaches the learnt margins a cold-start
# slowdown (measured: 33 requests admitted blind at 30 req/s ran at 3.5 s TTFT and 4x the predicted
# TPOT, and the TPOT margin stayed at its 4x bound for the rest of the run). A few are enough to
# time a prefill and a decode step.
BLIND_MAX_REQUESTS = 8
# Slow start: a request is admitted into a decode batch of at most this many times the largest batch
# the engine has measured (or BLIND_MAX_REQUESTS, or the batch running now), so the step-time model is never trusted far beyond
# what it measured: right after start-up it knows batches of one or two, and extrapolating their step
# time to a burst's 30 sequences under-predicted TPOT 4x (the cold engine's first loaded steps also pay
# one-time costs). Only with a TPOT target (a TTFT prediction is dominated by the prefill rate,
# measured from the first prefill step). The measured range doubles as the batch grows, as TCP's slow start (Jacobson,
# "Congestion Avoidance and Control", SIGCOMM'88, §2) grows its window.
SLOW_START_FACTOR = 2.0
# EWMA weight of one request in the TPOT model's workload means (P̄: prompt tokens of admitted
# sequences, D̄: tokens generated by finished ones): ~32 requests of memory.
WORKLOAD_ALPHA = 1.0 / 32


class ErrorCalibration:
    """A safety margin learnt from the predictor's observed error (conformal-style calibration).

    Keeps the last ``window`` observations of an error statistic of admitted
    requests and returns its ``quantile``: added to a TTFT prediction (signed
    error, measured − predicted, seconds) or multiplied into a TPOT prediction
    (ratio measured / predicted), it makes the corrected prediction an upper
    bound for that share of recent requests, whatever the model misses (batch
    growth after admission, prefill of later arrivals riding along with the
    decode steps, neighbours on a shared machine). This is split conformal
    prediction's rule (Angelopoulos & Bates, "A Gentle Introduction to Conformal
    Prediction", arXiv 2107.07511, §1) over a sliding window, as latency
    predictors under drift use it.

    Args:
        quantile: in (0, 1): the share of recent requests the margin covers.
        window: observations kept.
        min_samples: below this many the margin is ``neutral``.
        neutral: margin with no data (0 for an additive margin, 1 for a factor).
        lo, hi: bounds of the margin.
    """

    def __init__(self, quantile: float = 0.9, window: int = 64, min_samples: int = 8, neutral: float = 0.0,
                 lo: float = -math.inf, hi: float = math.inf, max_age: float = 60.0) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.neutral = neutral
        self.lo, self.hi = lo, hi
        self.max_age = max_age
        self.samples: deque[float] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)

    def add(self, value: float, now: float | None = None) -> None:
        if math.isfinite(value):
            self.samples.append(value)
            self._times.append(time.monotonic() if now is None else now)

    def margin(self, now: float | None = None) -> float:
        """The ``quantile`` of the recent observations (``neutral`` with too few), within [lo, hi].

        Observations older than ``max_age`` seconds are dropped: a margin that makes the server
        refuse everything gets no new observations, and must not outlive the burst that set it.
        """
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.max_age:
            self._times.popleft()
            self.samples.popleft()
        if len(self.samples) < self.min_samples:
            return self.neutral
        xs = sorted(self.samples)
        k = min(len(xs) - 1, max(0, math.ceil(self.quantile * len(xs)) - 1))
        return min(self.hi, max(self.lo, xs[k]))


@dataclass
class PendingRequest:
    """An admitted interactive request that has not produced its first token (what may be displaced).

    Attributes:
        request_id: the engine request id (its choices are ``{id}-{i}`` in the core).
        priority: its priority (lower first under ``--scheduling-policy priority``).
        arrival: ``time.time()`` when it arrived.
        prompt_tokens: prompt tokens it prefills (× n).
        predicted_ttft: predicted seconds from arrival to first token, updated
            when higher-priority requests are admitted ahead of it.
        predicted_start: ``time.time()`` when its prefill is predicted to start.
        limit: the TTFT it is held to, seconds (the SLO, or 1.5 × its idle TTFT if larger).
    """

    request_id: str
    priority: int
    arrival: float
    prompt_tokens: int
    predicted_ttft: float
    predicted_start: float
    limit: float


class SLOAdmission:
    """``--slo``: refuse (429) requests predicted to miss the TTFT/TPOT target, before any work is spent.

    The prediction (:func:`tokenmill.server.slo_predictor.predict`) uses the
    engine's queue state and step-time model from the latest
    :class:`EngineStats` plus the requests this process sent that the core
    has not seen. Under ``--scheduling-policy priority`` a new request is
    predicted only behind work of its own or higher priority, so it is
    admitted where a lower-priority one would be refused; admitting it delays
    the queued lower-priority requests, and those now predicted to miss are
    *displaced*: :meth:`displaced_by` names them, the server aborts them in
    the engine and answers 429 on their pending responses (they have sent
    nothing yet).

    Implements ``StatLogger``: on each first token it observes the prediction
    error and forgets the request.

    Args:
        slo: the targets.
        policy: the scheduling policy (``fcfs`` or ``priority``).
        metrics: optional sink with ``observe_ttft_prediction(predicted_s)``,
            ``observe_ttft_prediction_error(measured_s - predicted_s)`` and, when present,
            ``observe_tpot_prediction(predicted_s)``, ``observe_tpot_prediction_error(measured_s - predicted_s)``,
            ``set_slo_decode_batch_limit(sequences)``.
        calibrate: judge predictions with the safety margins learnt from their observed error
            (:class:`ErrorCalibration`); None: on unless ``TOKENMILL_SLO_CALIBRATION=0``.
    """

    # share of recent admitted requests the learnt safety margins cover (above the 90% goodput target)
    CALIBRATION_QUANTILE = 0.95
    # The TTFT margin before it has observations (a fresh server's first burst, or after they expired), as
    # a share of the TTFT target: the learnt margin's prior. Without it the first burst is judged by the
    # point prediction, and a burst admitted up to the limit lands on it: on a 2-core AVX512-BF16 EPYC
    # (bfloat16, quiet) the burst of 40 x ~450 tokens admitted 13-14 (the most that can meet
    # 3 s: 14), whose shared last prefill step ended at 2.98-3.26 s (the start-up profile's prefill rate
    # within ~6-8% of the burst's 450-token prompts, plus the API process's work on the burst):
    # 64-100% met. A tenth of the target covers that error.
    COLD_TTFT_MARGIN = 0.1

    def __init__(self, slo: "SLO", policy: str = "fcfs", metrics: object | None = None,
                 calibrate: bool | None = None) -> None:
        self.slo = slo
        self.policy = policy
        self.metrics = metrics
        self.pending: dict[str, PendingRequest] = {}
        # learnt safety margins (ErrorCalibration): TTFT error in seconds (within half the SLO either way,
        # so an idle server still admits),
        # TPOT ratio measured / predicted (0.5x .. 4x); ``calibrate=False`` judges the raw model
        # (default: on, unless the environment sets TOKENMILL_SLO_CALIBRATION=0, the ablation switch)
        if calibrate is None:
            calibrate = envs.TOKENMILL_SLO_CALIBRATION
        self.calibrate = calibrate
        bound = slo.ttft if slo.ttft is not None else 1.0
        self.ttft_margin = ErrorCalibration(self.CALIBRATION_QUANTILE, neutral=self.COLD_TTFT_MARGIN * bound,
                                            lo=-0.5 * bound, hi=0.5 * bound)
        self.tpot_factor = ErrorCalibration(self.CALIBRATION_QUANTILE, neutral=1.0, lo=0.5, hi=4.0)
        self._predicted_tpot: dict[str, float] = {}
        # requests admitted before the engine had measured its step times (no prediction), until their
        # first token: while the model is not ready at most BLIND_MAX_REQUESTS are admitted (see check())
        self._blind: dict[str, float] = {}
        # the TPOT model's workload means (EWMA): prompt tokens per admitted interactive sequence (P̄)
        # and tokens generated per finished sequence (D̄); None until the first one
        self.mean_prompt_tokens: float | None = None
        self.mean_decode_tokens: float | None = None
        # recent prefix-cache hit rate (EWMA over the core's cumulative counters' increments)
        self.prefix_hit_rate = 0.0
        self._last_queries = 0
        self._last_hits = 0

    def check(self, engine_stats: EngineStats, inflight: "InflightWork | None", prompt_tokens: int,
              priority: int, arrival: float, now: float | None = None, num_seqs: int = 1,
              max_tokens: int | None = None) -> tuple["Prediction | None", Refusal | None]:
        """Predict a new interactive request and judge it against the SLO.

        Args:
            engine_stats: the core's latest snapshot (``queue`` and ``step_timing`` set).
            inflight: requests sent to the core that it has not reported yet.
            prompt_tokens: the new request's prompt tokens (× n).
            priority: its priority.
            arrival: ``time.time()`` when it arrived (time since then counts).
            now: ``time.time()`` (tests).
            num_seqs: sequences it adds to the decode batch (prompts × n).
            max_tokens: its ``max_tokens`` per sequence (None: unknown).

        Returns:
            ``(prediction, refusal)``: the prediction (None before the engine
            measured its step times: then the request is admitted) and a
            :class:`Refusal` with ``reason="slo"`` when it is predicted to miss.
        """
        now = time.time() if now is None else now
        q, t = engine_stats.queue, engine_stats.step_timing
        pred = predict(q, t, prompt_tokens, priority, self.policy, inflight, self.prefix_hit_rate,
                       num_seqs=num_seqs, max_tokens=max_tokens, mean_prompt_tokens=self.mean_prompt_tokens,
                       mean_decode_tokens=self.mean_decode_tokens,
                       context_ahead=self._context_ahead(priority))
        if pred is None:
            # no basis for a prediction yet (a cold engine has not timed a prefill and a decode step, and
            # no start-up profile seeded it; before its first stats even the queue is unknown): admit a
            # small batch blind (enough to measure both), not a whole burst
            for rid in [r for r, a in self._blind.items() if now - a > PENDING_MAX_AGE_S]:
                del self._blind[rid]
            blind_cap = max(1, min(q.max_num_seqs, BLIND_MAX_REQUESTS) if q is not None else BLIND_MAX_REQUESTS)
            if len(self._blind) >= blind_cap:
                return None, Refusal(
                    f"server is warming up: {len(self._blind)} requests are running before the engine has "
                    f"measured its step times (--slo admits {blind_cap} until then); retry later",
                    MIN_RETRY_AFTER, "slo")
        elapsed = max(0.0, now - arrival)
        if pred is not None and t.decode_points and self.slo.tpot is not None:
            measured = max(b for b, _ in t.decode_points)
            # the batch already running is measured within a step (batch-lane decodes, say): trusted too
            running = q.num_decoding + q.running_prefill[0] + q.batch_running_prefill[0]
            trusted = max(BLIND_MAX_REQUESTS, int(SLOW_START_FACTOR * measured), running)
            if pred.decode_batch > trusted:
                return pred, Refusal(
                    f"server is warming up: this request would make a decode batch of {pred.decode_batch} "
                    f"sequences and the engine has measured batches up to {measured:.0f} (--slo grows the "
                    "batch as it measures it); retry later", MIN_RETRY_AFTER, "slo")
        factor = self.tpot_factor.margin() if self.calibrate else 1.0
        if pred is not None and self.metrics is not None:
            self.metrics.observe_ttft_prediction(elapsed + pred.ttft)
            observe = getattr(self.metrics, "observe_tpot_prediction", None)
            if observe is not None:
                observe(pred.tpot)
            cap_setter = getattr(self.metrics, "set_slo_decode_batch_limit", None)
            if cap_setter is not None and self.slo.tpot is not None and q is not None:
                cap_setter(max_decode_batch(t, self.slo.tpot, pred, q.max_num_seqs, factor))
        setter = getattr(self.metrics, "set_slo_margins", None)
        if setter is not None and self.calibrate:
            setter(self.ttft_margin.margin(), factor)
        verdict = judge(self.slo, self.calibrated(pred), elapsed, q, t, factor)
        if not verdict.admit:
            return pred, Refusal(verdict.message, verdict.retry_after, "slo")
        hurt = self._would_delay(pred, priority, now) if pred is not None else None
        if hurt is not None:
            p, late = hurt
            wait = max(0.0, p.arrival + p.predicted_ttft - now)
            return pred, Refusal(
                f"server is busy: this request's prefill would share a step with admitted requests still "
                f"waiting for their first token and push one to {late * 1000:.0f} ms, past its time-to-first-"
                f"token limit of {p.limit * 1000:.0f} ms (--slo); retry later",
                int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(wait)))), "slo")
        return pred, None

    def _context_ahead(self, priority: int) -> float:
        """Attention work of the admitted prompts still waiting for their first token that are served
        before a new request of ``priority`` (fcfs: all): ``Σ P (P − 1) / 2`` (a prompt partly prefilled
        counts whole: an over-estimate of at most one step's share)."""
        return float(sum(p.prompt_tokens * (p.prompt_tokens - 1) / 2 for p in self.pending.values()
                         if self.policy != "priority" or p.priority <= priority))

    def _sharing(self, pred: "Prediction", priority: int, now: float) -> list[PendingRequest]:
        """Admitted requests still waiting for their first token whose last prefill step a new request
        (``pred``, ``priority``) would join: served before it (fcfs: all; priority: same or higher
        priority) and predicted to get their first token after its prefill starts."""
        start = now + max(0.0, pred.ttft - pred.ttft_idle)
        return [p for p in self.pending.values()
                if (self.policy != "priority" or p.priority <= priority) and p.arrival + p.predicted_ttft > start]

    def _would_delay(self, pred: "Prediction", priority: int, now: float
                     ) -> tuple[PendingRequest, float] | None:
        """The first admitted request a new one would push past its TTFT limit, with its new TTFT, or None.

        A step runs every scheduled prompt chunk together, so a prompt that joins the step in which an
        earlier request's prefill ends delays that request's first token by its own prefill (at most
        ``pred.ttft_idle``); the new request's own prediction does not show it when it is judged against a
        larger limit than theirs (one infeasible alone, held to 1.5 x its idle TTFT) or arrived later (their
        limits run from their own arrival). Sarathi-Serve's chunked batches (Agrawal et al., arXiv 2403.02310,
        §4) put several prompts in one step; this is the cost of joining one.
        """
        if self.slo.ttft is None:
            return None
        for p in self._sharing(pred, priority, now):
            late = p.predicted_ttft + pred.ttft_idle
            if late > p.limit:
                return p, late
        return None

    def calibrated(self, pred: "Prediction | None") -> "Prediction | None":
        """``pred`` with the learnt safety margins applied (TTFT + margin, TPOT × factor)."""
        if pred is None or not self.calibrate:
            return pred
        m, f = self.ttft_margin.margin(), self.tpot_factor.margin()
        if m == 0.0 and f == 1.0:
            return pred
        return replace(pred, ttft=max(0.0, pred.ttft + m), tpot=pred.tpot * f)

    def track(self, request_id: str, pred: "Prediction | None", priority: int, arrival: float,
              prompt_tokens: int, now: float | None = None, delay_others: bool = True) -> PendingRequest | None:
        """Remember an admitted request until its first token (for the error metric and displacement;
        one admitted without a prediction counts against the cold-start batch, see :meth:`check`).

        ``delay_others``: move the predictions of the admitted requests whose last prefill step it joins
        (see :meth:`_would_delay`); False for the second and later choices of one request."""
        if pred is None:
            self._blind[request_id] = time.time() if now is None else now
            return None
        now = time.time() if now is None else now
        elapsed = max(0.0, now - arrival)
        limit = max(self.slo.ttft, 1.5 * pred.ttft_idle) if self.slo.ttft is not None else math.inf
        own = pred.ttft_idle
        p = PendingRequest(request_id, priority, arrival, prompt_tokens, elapsed + pred.ttft,
                           now + max(0.0, pred.ttft - own), limit)
        # the earlier requests whose last prefill step it joins get their first token that much later
        # (once per request: its choices, tracked one after another, do not delay each other)
        if delay_others:
            for q in self._sharing(pred, priority, now):
                q.predicted_ttft += own
        self.pending[request_id] = p
        self._predicted_tpot[request_id] = pred.tpot
        if len(self.pending) > 64 and len(self.pending) % 64 == 0:
            # a request whose stream never started leaves no first token nor finish: forget stale ones
            for rid in [r for r, q in self.pending.items() if now - q.arrival > PENDING_MAX_AGE_S]:
                del self.pending[rid]
        if len(self._predicted_tpot) > 4096:   # finishes never reported (should not happen): bound the memory
            for rid in list(self._predicted_tpot)[:2048]:
                del self._predicted_tpot[rid]
        return p

    def note_admitted(self, prompt_tokens: int, num_seqs: int) -> None:
        """Learn ``P̄`` (mean prompt tokens per sequence) from one admitted interactive request.

        Args:
            prompt_tokens: its prompt tokens (prompts × n × length).
            num_seqs: its sequences (prompts × n).
        """
        per_seq = prompt_tokens / max(1, num_seqs)
        self.mean_prompt_tokens = float(per_seq) if self.mean_prompt_tokens is None else \
            self.mean_prompt_tokens + WORKLOAD_ALPHA * (per_seq - self.mean_prompt_tokens)

    def displaced_by(self, new: PendingRequest, pred: "Prediction", now: float | None = None
                     ) -> list[tuple[str, Refusal]]:
        """Queued lower-priority requests that the admitted ``new`` request pushes past their TTFT limit.

        Only under the priority policy (under fcfs a new request queues behind
        everyone). A pending request whose prefill is predicted to have started
        is left alone (running requests are served before waiting ones). The
        others' predictions move back by ``new``'s own prefill time; those past
        their limit are returned (and forgotten) with a 429 :class:`Refusal`
        whose Retry-After is the predicted excess.
        """
        if self.policy != "priority" or self.slo.ttft is None:
            return []
        now = time.time() if now is None else now
        delay = pred.ttft_idle
        out: list[tuple[str, Refusal]] = []
        for rid, p in list(self.pending.items()):
            if rid == new.request_id or p.priority <= new.priority or p.predicted_start <= now:
                continue
            p.predicted_ttft += delay
            p.predicted_start += delay
            if p.predicted_ttft > p.limit:
                del self.pending[rid]
                excess = p.predicted_ttft - p.limit
                out.append((rid, Refusal(
                    f"server is busy: displaced by higher-priority requests; predicted time to first token "
                    f"{p.predicted_ttft * 1000:.0f} ms exceeds the SLO of {self.slo.ttft * 1000:.0f} ms (--slo); "
                    "retry later", int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(excess)))), "slo")))
        return out

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (finished, aborted or refused)."""
        self.pending.pop(request_id, None)
        self._predicted_tpot.pop(request_id, None)
        self._blind.pop(request_id, None)

    def record(self, engine_stats: EngineStats | None, iteration: IterationStats | None) -> None:
        """Observe the prediction error of requests that got their first token; forget finished ones;
        follow the prefix-cache hit rate."""
        if engine_stats is not None:
            dq = engine_stats.prefix_cache_queries - self._last_queries
            dh = engine_stats.prefix_cache_hits - self._last_hits
            if dq > 0 and 0 <= dh <= dq:
                w = min(1.0, dq / 4096)        # weight by the tokens looked up (~4k-token memory)
                self.prefix_hit_rate += w * (dh / dq - self.prefix_hit_rate)
            self._last_queries = engine_stats.prefix_cache_queries
            self._last_hits = engine_stats.prefix_cache_hits
        if iteration is None:
            return
        for rid, ttft in getattr(iteration, "first_tokens", ()):
            self._blind.pop(rid, None)
            p = self.pending.pop(rid, None)
            if p is not None:
                self.ttft_margin.add(ttft - p.predicted_ttft)
                if self.metrics is not None:
                    self.metrics.observe_ttft_prediction_error(ttft - p.predicted_ttft)
        for f in iteration.finished:
            rid = getattr(f, "request_id", "")
            if rid:
                self.pending.pop(rid, None)
                self._blind.pop(rid, None)
                predicted = self._predicted_tpot.pop(rid, None)
                # per choice: an n > 1 request decodes its choices side by side in one decode time
                tokens = f.num_generation_tokens / max(1, getattr(f, "num_choices", 1))
                if predicted is not None and f.finish_reason in ("stop", "length") and tokens > 0:
                    self.mean_decode_tokens = tokens if self.mean_decode_tokens is None else \
                        self.mean_decode_tokens + WORKLOAD_ALPHA * (tokens - self.mean_decode_tokens)
                # TPOT as the benchmark defines it: decode time over the tokens after the first
                if predicted and f.finish_reason in ("stop", "length") and tokens > 1:
                    measured = f.decode_time / (tokens - 1)
                    self.tpot_factor.add(measured / predicted)
                    observe = getattr(self.metrics, "observe_tpot_prediction_error", None)
                    if observe is not None:
                        observe(measured - predicted)
