"""Predict a new request's TTFT and TPOT from the engine's queue and measured step times.

The API process gets, with every engine output batch, the scheduler's queue
state (tokens still to prefill, by lane and priority; see
:class:`tokenmill.core.scheduler.QueueState`) and the smoothed step-time model
(:class:`tokenmill.metrics.step_timing.StepTimingSnapshot`). For a new
interactive request of ``P`` prompt tokens and priority ``p`` it predicts:

**TTFT** — the request's first token comes out of the step that computes its
last prompt token. Ahead of it are ``W`` prompt tokens: those running
interactive requests still have to prefill, plus waiting interactive requests
served before it (all of them under ``fcfs``; priority ≤ ``p`` under
``priority``), plus requests this process sent that the core has not seen
yet. Steps serve decodes first, so each step has ``M − B`` prompt tokens of
budget (``M`` = ``--max-num-batched-tokens``, ``B`` decoding requests);
getting through ``W + P`` tokens takes ``k = ⌈(W + P) / (M − B)⌉`` steps of
``decode_step_time(B̄) + chunk × prefill_seconds_per_token`` each, where the
batch ``B̄`` grows as the requests ahead start decoding. Add the expected
residual of the step in progress (half a step) and, when all
``--max-num-seqs`` seats are taken, the wait for a seat: the ``j``-th
soonest-finishing running request (by tokens it may still generate) at the
current TPOT. This is the chunked-prefill iteration model of Sarathi-Serve
(Agrawal et al., arXiv 2403.02310, §4) with the linear step-time model of
DistServe (Zhong et al., OSDI'24, §3), fitted online.

**TPOT** — the mean step time of the batch it would join:
``decode_step_time(B_join) + prefill_seconds_per_step`` (the prompt work that
currently rides along with each decode step).

**Batch lane** — batch requests are scheduled only with what interactive work
leaves, so their waiting tokens do not count ahead of an interactive request;
they count only as far as they block it: the batch prefill chunk a step may
already be running when it arrives, and their decodes in ``B``.

Retry-After (seconds until the request would fit): for a TTFT miss, the
excess over the limit (the work ahead drains in real time); for a TPOT miss,
the time until enough running requests finish that the batch is small enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

# Bounds of Retry-After (seconds), as the fixed-cap refusals.
MIN_RETRY_AFTER = 1
MAX_RETRY_AFTER = 60
SLO_KEYS = ("ttft", "tpot")


@dataclass(frozen=True)
class SLO:
    """Latency targets of ``--slo`` (either may be None: not enforced).

    Attributes:
        ttft: time-to-first-token limit, seconds.
        tpot: time-per-output-token limit, seconds.
    """

    ttft: float | None = None
    tpot: float | None = None

    @property
    def enabled(self) -> bool:
        return self.ttft is not None or self.tpot is not None

    @classmethod
    def parse(cls, specs: str | Iterable[str] | None) -> "SLO":
        """Parse ``--slo`` items, the syntax of ``bench --goodput``: ``ttft:MS``, ``tpot:MS`` (ms).

        ``specs`` may be one string (``"ttft:500 tpot:50"``, commas allowed) or a list of items.

        Raises:
            ValueError: an unknown key (e2el is a benchmark-only target), a malformed item,
                or a limit that is not a positive number of ms.
        """
        if specs is None:
            return cls()
        if isinstance(specs, str):
            specs = [specs]
        limits: dict[str, float] = {}
        for spec in specs:
            for item in str(spec).replace(",", " ").split():
                key, sep, value = item.partition(":")
                key = key.strip().lower()
                if not sep or key not in SLO_KEYS:
                    raise ValueError(f"invalid --slo item {item!r}: expected KEY:MS with KEY in "
                                     f"{', '.join(SLO_KEYS)} (e.g. --slo ttft:500 tpot:50)")
                try:
                    ms = float(value)
                except ValueError:
                    raise ValueError(f"invalid --slo value in {item!r}: not a number of ms") from None
                if not ms > 0 or math.isinf(ms):
                    raise ValueError(f"invalid --slo value in {item!r}: must be a positive number of ms")
                limits[key] = ms / 1000.0
        return cls(ttft=limits.get("ttft"), tpot=limits.get("tpot"))

    def __str__(self) -> str:
        parts = [f"{k}:{v * 1000:g}" for k, v in (("ttft", self.ttft), ("tpot", self.tpot)) if v is not None]
        return " ".join(parts) or "none"


@dataclass
class InflightWork:
    """Requests this process sent that the engine core has not reported yet (interactive lane).

    Attributes:
        by_priority: ``{priority: (requests, prompt tokens)}``.
    """

    by_priority: dict[int, tuple[int, int]]

    def ahead_of(self, priority: int | None) -> tuple[int, int]:
        """(requests, tokens) served before a new request of ``priority`` (None: all, fcfs)."""
        n = t = 0
        for p, (k, tok) in self.by_priority.items():
            if priority is None or p <= priority:
                n += k
                t += tok
        return n, t


@dataclass
class Prediction:
    """What the predictor expects for one request, seconds.

    Attributes:
        ttft: time to first token, from now (add the time already spent since arrival).
        tpot: time per output token.
        ttft_idle: TTFT the request would have on an idle server (its own prefill only).
        tokens_ahead: prompt tokens to prefill before its own.
        requests_ahead: requests served before it.
        seat_wait: seconds until a running seat frees (0: one is free).
        step_time: the current step time (decode batch plus its prefill share), seconds.
    """

    ttft: float
    tpot: float
    ttft_idle: float
    tokens_ahead: int
    requests_ahead: int
    seat_wait: float
    step_time: float


def predict(queue: Any, timing: Any, prompt_tokens: int, priority: int, policy: str,
            inflight: InflightWork | None = None, prefix_hit_rate: float = 0.0) -> Prediction | None:
    """Predict TTFT and TPOT of a new interactive request (see the module docstring for the model).

    Args:
        queue: the engine's :class:`~tokenmill.core.scheduler.QueueState`.
        timing: the engine's :class:`~tokenmill.metrics.step_timing.StepTimingSnapshot`.
        prompt_tokens: the request's prompt length (× ``n``: its choices all prefill), tokens.
        priority: the request's priority (lower first under ``policy == "priority"``).
        policy: ``fcfs`` or ``priority``.
        inflight: requests sent to the core but not yet in ``queue``.
        prefix_hit_rate: recent share of prompt tokens found in the prefix cache, in [0, 1):
            prompts not yet scheduled (waiting, in flight, this one) are discounted by it
            (running prefills are already net of their hits).

    Returns:
        the :class:`Prediction`, or None while the step-time model has not
        measured both a decode step and the prefill rate (no basis: admit).
    """
    if queue is None or timing is None or not timing.ready:
        return None
    tp = timing.prefill_seconds_per_token
    p_limit = priority if policy == "priority" else None
    wait_reqs = wait_tokens = 0
    for p, (k, tok) in queue.waiting_by_priority.items():
        if p_limit is None or p <= p_limit:
            wait_reqs += k
            wait_tokens += tok
    inf_reqs, inf_tokens = (inflight.ahead_of(p_limit) if inflight is not None else (0, 0))
    run_pf_reqs, run_pf_tokens = queue.running_prefill
    keep = 1.0 - min(max(prefix_hit_rate, 0.0), 0.95)
    wait_tokens = int(wait_tokens * keep)
    inf_tokens = int(inf_tokens * keep)
    prompt_tokens = max(1, int(prompt_tokens * keep))
    tokens_ahead = run_pf_tokens + wait_tokens + inf_tokens
    requests_ahead = run_pf_reqs + wait_reqs + inf_reqs
    budget = max(1, queue.max_num_batched_tokens)
    max_seqs = max(1, queue.max_num_seqs)
    b_now = queue.num_decoding
    # prompt tokens per step: decodes take one token each from the budget
    per_step = max(1, budget - min(b_now, budget - 1))
    work = tokens_ahead + prompt_tokens
    k = max(1, math.ceil(work / per_step))
    # the decode batch grows as the requests ahead start decoding; on average by half of them
    b_mean = min(max_seqs, b_now + (run_pf_reqs + wait_reqs + inf_reqs) / 2.0)
    queue_time = k * timing.decode_step_time(max(1.0, b_mean)) + work * tp
    # the step in progress: decodes plus whatever prefill is pending now (interactive, or batch
    # filling the budget interactive work leaves); on average half of it is still to run
    pending_pf = run_pf_tokens + wait_tokens + queue.batch_running_prefill[1] + queue.batch_waiting[1]
    current_step = timing.decode_step_time(max(1, b_now)) + min(pending_pf, per_step) * tp
    queue_time += 0.5 * current_step if (b_now or pending_pf) else 0.0
    # seats: batch requests give theirs up to interactive ones (the scheduler preempts them)
    seat_wait = 0.0
    num_running_interactive = (b_now + run_pf_reqs + queue.batch_running_prefill[0]) - queue.num_batch_running
    need = num_running_interactive + wait_reqs + inf_reqs + 1 - max_seqs
    tpot_now = timing.decode_step_time(max(1, b_now)) + timing.prefill_seconds_per_step
    if need > 0:
        rem = queue.remaining_output_tokens
        j = min(need, len(rem)) - 1
        seat_wait = (rem[j] if j >= 0 else 0) * tpot_now
        own = timing.decode_step_time(max(1, b_now)) + prompt_tokens * tp
        queue_time = max(queue_time, seat_wait + own)
    b_join = min(max_seqs, b_now + requests_ahead + 1)
    tpot = timing.decode_step_time(b_join) + timing.prefill_seconds_per_step
    ttft_idle = timing.decode_step_time(1) * math.ceil(prompt_tokens / budget) + prompt_tokens * tp
    return Prediction(ttft=queue_time, tpot=tpot, ttft_idle=ttft_idle, tokens_ahead=tokens_ahead,
                      requests_ahead=requests_ahead, seat_wait=seat_wait, step_time=tpot_now)


@dataclass
class SLOVerdict:
    """The SLO check of one request.

    Attributes:
        admit: False when the request is predicted to miss.
        which: the target it misses (``ttft`` or ``tpot``), None when admitted.
        retry_after: whole seconds until it would fit (only when refused).
        message: why (states the prediction and the limit).
    """

    admit: bool
    which: str | None = None
    retry_after: int = 0
    message: str = ""


def judge(slo: SLO, pred: Prediction | None, elapsed: float, queue: Any, timing: Any,
          tpot_scale: float = 1.0) -> SLOVerdict:
    """Admit or refuse against ``slo`` given a :class:`Prediction` (None: admit).

    A request whose own prefill comes near the TTFT limit (it would miss on an
    almost idle server) is judged against 1.5 × its idle TTFT instead, i.e.
    admitted only when little is ahead of it: retrying would never help it. Likewise the TPOT
    limit is not enforced when even a batch of one would miss it (the limit is
    unattainable on this machine; refusing everything would serve nobody).

    Args:
        slo: the targets.
        pred: the prediction (from :func:`predict`).
        elapsed: seconds since the request arrived (tokenization, queueing in this process).
        queue, timing: the engine snapshot the prediction came from (for Retry-After).
        tpot_scale: the factor ``pred.tpot`` was calibrated with (the batch-of-one check uses it too).
    """
    if pred is None:
        return SLOVerdict(True)
    if slo.ttft is not None:
        limit = max(slo.ttft, pred.ttft_idle * 1.5)
        ttft = elapsed + pred.ttft
        if ttft > limit:
            return SLOVerdict(False, "ttft", _clamp(ttft - limit),
                              f"server is busy: predicted time to first token {ttft * 1000:.0f} ms exceeds "
                              f"the SLO of {slo.ttft * 1000:.0f} ms (--slo; {pred.tokens_ahead} prompt tokens "
                              f"queued ahead); retry later")
    if slo.tpot is not None and \
            (timing.decode_step_time(1) + timing.prefill_seconds_per_step) * tpot_scale <= slo.tpot:
        if pred.tpot > slo.tpot:
            return SLOVerdict(False, "tpot", _clamp(_tpot_retry(slo.tpot, pred, queue, timing)),
                              f"server is busy: predicted time per output token {pred.tpot * 1000:.1f} ms "
                              f"exceeds the SLO of {slo.tpot * 1000:.1f} ms (--slo); retry later")
    return SLOVerdict(True)


def _tpot_retry(limit: float, pred: Prediction, queue: Any, timing: Any) -> float:
    """Seconds until enough running requests finish that joining the batch meets ``limit``."""
    b_join = min(queue.max_num_seqs, queue.num_decoding + pred.requests_ahead + 1)
    rem = queue.remaining_output_tokens
    for j in range(1, b_join):
        if timing.decode_step_time(b_join - j) + timing.prefill_seconds_per_step <= limit:
            return rem[j - 1] * pred.step_time if j - 1 < len(rem) else MAX_RETRY_AFTER
    return MAX_RETRY_AFTER


def _clamp(seconds: float) -> int:
    return int(min(MAX_RETRY_AFTER, max(MIN_RETRY_AFTER, math.ceil(seconds))))
