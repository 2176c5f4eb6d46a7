"""Step-latency budget: how many requests may run, from the measured decode step time.

The token budget (``max_num_batched_tokens``) and the seat cap (``max_num_seqs``) bound a step's size;
neither bounds its *time*. On a CPU the decode step grows linearly with the batch past a few requests
(2-core AVX2 EPYC, SmolLM2-135M float32 with int8 GEMMs: ≈ 9 ms + 1.4 ms per decoding request), so
a server admitting up to ``max_num_seqs`` = 128 lets a Poisson burst grow the batch to ~100 and every
running request's time per output token to ~140 ms, while the throughput bought by the bigger batch is
a few percent (the fixed part of the step is already amortised). A prompt chunk in the same step adds
its own time on top (≈ 0.9 ms per prompt token there).

:func:`plan_step` reads the engine's online step-time model
(:class:`~tokenmill.metrics.step_timing.StepTimingSnapshot`: decode step time per batch size, learnt from
every step) and returns a :class:`StepBudget` for the next step: ``max_running``, the largest batch
``B ≤ max_num_seqs`` whose predicted decode step is within ``target_step_latency_ms``. New requests are
admitted only below it; the excess waits in the queue (the queue wait is paid once, by one request; a
slower step by every token of every running request), but at most :data:`MAX_HOLD_S`: a request that
waited longer is admitted anyway (up to ``max_num_seqs``), so under sustained overload the wait stays
bounded and the batch grows as it would without the budget, instead of the queue growing without end (the
first A/B: at 6.56 req/s MT-bench, where the unbudgeted batch still met the TPOT limit, an unbounded hold
let the queue reach 5 s).

Prompt tokens per step are *not* limited by the budget (the token budget ``max_num_batched_tokens`` and
``long_prefill_token_threshold`` still apply). A first version also cut each step's prompt tokens to the
target's slack over its decodes (Sarathi-Serve's stall-free batching, arXiv 2403.02310 §4.3), at least 32:
on this CPU that cost 29% of the random-workload c=64 throughput and 14% on MT-bench (2-core AVX2 EPYC,
2026-12-03): prompt rows in 32-token trickles cost more per token than in large chunks, and MT-bench's
TPOT misses came from the batch size, not from prompt chunks (docs/benchmarks/2026-12-03-goodput-avx2.md).

The target is at least :data:`MIN_TARGET_FACTOR` × the single-request decode step: on a machine (or a
model) where one decode step alone takes most of the target, no batch could meet it, and the batch
then still grows to where batching stops being nearly free (a step at most that factor above the
single-request one: ≥ 75% of the linear model's asymptotic throughput).

Scheduling never changes a request's tokens (batch-invariant kernels: the batch, its composition and
the chunking do not change any row's bits); the budget only decides *when* tokens are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StepTiming(Protocol):
    """What the budget reads of the step-time model (duck-typed: ``core`` imports no ``metrics``;
    :class:`tokenmill.metrics.step_timing.StepTimingSnapshot` is the one the engine hands over)."""

    prefill_seconds_per_token: float | None
    decode_points: list[tuple[float, float]]

    @property
    def ready(self) -> bool: ...

    def decode_step_time(self, batch_size: float) -> float | None: ...

#: The effective target is at least this many single-request decode steps (see the module docstring).
MIN_TARGET_FACTOR = 4.0
#: The seat cap holds a waiting request back at most this long (s); then it is admitted (up to max_num_seqs).
MAX_HOLD_S = 1.0


@dataclass(frozen=True)
class StepBudget:
    """Limits of one step from the step-latency target.

    Attributes:
        max_running: requests that may be running after admissions (≤ ``max_num_seqs``, ≥ 1).
        target_s: the effective target, seconds.
    """

    max_running: int
    target_s: float


def decode_time_bound(snapshot: StepTiming, batch: int) -> float:
    """Predicted decode step seconds at ``batch``, at most proportional to every smaller measured point.

    ``decode_step_time`` reads per-bucket EWMAs; a bucket visited once during a stall of a shared machine
    keeps that time (and the snapshot lifts every bigger bucket to it), and a budget that trusted it
    would never grow the batch into the bucket again to correct it (a full test-suite run: batch 3's
    bucket at 756 ms beside 7 ms at batch 2 held the batch at 2). A decode step costs at most
    proportionally more for a bigger batch (the weights are read once for all rows), so the prediction
    is capped at ``t_i × batch / b_i`` for each measured point ``(b_i, t_i)`` with ``b_i ≤ batch``.
    """
    t = snapshot.decode_step_time(batch) or 0.0
    for b_i, t_i in snapshot.decode_points:
        if b_i <= batch:
            t = min(t, t_i * batch / max(b_i, 1.0))
    return t


def plan_step(snapshot: StepTiming | None, target_ms: float, max_num_seqs: int) -> StepBudget | None:
    """The step's seat limit for a predicted decode step within ``target_ms``.

    Args:
        snapshot: the engine's step-time model now (a ``StepTimingSnapshot``; None, or not yet ``ready``:
            nothing measured, no limit).
        target_ms: step-latency target, ms (≤ 0: off, no limit).
        max_num_seqs: the seat cap (upper bound of ``max_running``).

    Returns:
        the :class:`StepBudget`, or None when off or the model is not ready.

    Algorithm: the decode step time (:func:`decode_time_bound`) is non-decreasing in the batch (the
    snapshot keeps its points monotone and extrapolates with a slope ≥ 0; each proportional cap grows
    with the batch), so ``max_running`` is found by bisection over ``[1, max_num_seqs]``.
    """
    if target_ms <= 0 or snapshot is None or not snapshot.ready:
        return None
    if snapshot.decode_step_time(1) is None:
        return None
    target = max(target_ms / 1e3, MIN_TARGET_FACTOR * decode_time_bound(snapshot, 1))
    lo, hi = 1, max(1, max_num_seqs)
    while lo < hi:                       # largest B with decode_time_bound(B) <= target (at least 1)
        mid = (lo + hi + 1) // 2
        if decode_time_bound(snapshot, mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return StepBudget(max_running=lo, target_s=target)
