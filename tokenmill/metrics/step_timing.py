"""Smoothed step-time measurements of the engine core, for SLO-aware admission control.

The engine core times every step and splits it into a decode part and a
prefill part with a two-term model::

    step_seconds ≈ decode_step_time(num_decode_reqs) + num_prefill_tokens × prefill_seconds_per_token

* ``decode_step_time(B)``: seconds of a step that decodes ``B`` requests (one
  token each). Learned per batch-size bucket (powers of two) as an
  exponentially weighted moving average (EWMA); the step's fixed cost (launch,
  scheduling, sampling) is part of it. Between measured buckets it is
  interpolated linearly, beyond them extrapolated.
* ``prefill_seconds_per_token``: the marginal cost of one prompt token (the
  prefill rate is its inverse, tokens/s), an EWMA ratio of seconds over tokens.

The first :data:`WARMUP_STEPS` steps are ignored, the prefill rate starts
from the median of its first :data:`PREFILL_BOOTSTRAP_SAMPLES` samples, and one step moves a
learned time by at most :data:`MAX_STEP_RATIO` (robust to a stall of a
shared machine); a new decode bucket's first step is capped at twice the nearest smaller
bucket's time scaled to the batch (or the nearest bigger bucket's, if more), so one stalled
first step does not become its value, and every bucket holds the lower median of its first
:data:`DECODE_BOOTSTRAP_SAMPLES` samples before its EWMA starts (the smallest bucket has no neighbour to cap
it). Pure-decode steps teach ``decode_step_time``; steps with prompt tokens are
split with the current estimates: when the prefill part dominates the step
(≥ half of it by the current estimate) the remainder after the decode part
teaches the prefill rate, otherwise the remainder after the prefill part
teaches the decode bucket. Under sustained load, where nearly every step mixes
a prefill chunk with decodes, both terms keep learning; at a single operating
point the split may be off but their sum — what a prediction at that point
uses — stays right. This is the iteration-time model of the latency
predictors in the serving literature (e.g. DistServe, Zhong et al., OSDI'24,
§3: prefill time linear in prompt tokens, decode time linear in batch size),
fitted online instead of profiled offline.

A third term, seeded by the start-up profile and then held fixed, charges the attention over each
prompt row's context (``prefill_seconds_per_context`` × the sum over the step's prompt rows of the
tokens before each): the linear rate alone, learnt from prompts of a few hundred tokens, under-predicts
long prompts (a 1,100-token prompt 1.26x, steps of 1,100-1,400-token prompts 1.4-1.65x on a 2-core
AVX512-BF16 EPYC, bfloat16). Steps are learnt net of it.

The core sends a :class:`StepTimingSnapshot` (plain data) to the API process
with every output batch; :mod:`tokenmill.server.admission` predicts TTFT and
TPOT from it. This module imports nothing from the engine (pure Python).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Smoothing factor of the EWMAs (weight of the newest step): ~20 steps of memory.
DEFAULT_ALPHA = 0.1
# Steps with fewer prompt tokens than this are too noisy to teach the prefill rate.
MIN_PREFILL_TOKENS = 16
# Steps ignored at start-up (the first steps build kernels, allocators and caches: seconds, not ms).
WARMUP_STEPS = 2
# One step moves a learned time by at most this factor (a stall of the machine, a step that met a
# neighbour's burst, must not wipe out what was measured; a real slowdown is still followed in a few steps).
MAX_STEP_RATIO = 4.0
# The prefill rate starts from the median of this many samples, then follows an EWMA.
PREFILL_BOOTSTRAP_SAMPLES = 3
# A decode bucket holds the lower median of its first samples (up to this many), then follows an EWMA.
DECODE_BOOTSTRAP_SAMPLES = 3
# A prefill part of at least this share of the step teaches the prefill rate; below, the decode part.
PREFILL_DOMINANT_SHARE = 0.5


def batch_bucket(batch_size: int) -> int:
    """The bucket of a decode batch size: 0 for 1, 1 for 2, 2 for 3-5, 3 for 6-11, ... (nearest power of two).

    Raises:
        ValueError: ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return int(round(math.log2(batch_size)))


@dataclass
class StepTimingSnapshot:
    """The core's smoothed step-time model at one moment (sent to the API process).

    Attributes:
        decode_points: ``[(mean batch size, seconds)]`` per measured bucket, sorted by
            batch size: EWMA of the mean decode batch size and of the step time in it.
        prefill_seconds_per_token: marginal seconds per prompt token (None: not measured yet).
        prefill_seconds_per_step: EWMA over all steps of the prefill part of the step,
            seconds (how much prompt work rides along with each decode step now).
        num_steps_observed: steps that updated the model.
        prefill_seconds_per_context: seconds per prompt row per token of context before it (the
            attention over the row's context, which grows with the prompt: a prompt of ``P`` tokens
            computed from position 0 costs ``P × prefill_seconds_per_token + P (P − 1) / 2 ×`` this);
            measured by the start-up profile (0: not measured, the rate alone).
    """

    decode_points: list[tuple[float, float]] = field(default_factory=list)
    prefill_seconds_per_token: float | None = None
    prefill_seconds_per_step: float = 0.0
    num_steps_observed: int = 0
    prefill_seconds_per_context: float = 0.0

    @property
    def ready(self) -> bool:
        """True when both terms were measured (predictions are meaningful)."""
        return bool(self.decode_points) and self.prefill_seconds_per_token is not None

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """The prefill rate, tokens/s (None: not measured yet)."""
        t = self.prefill_seconds_per_token
        return 1.0 / t if t else None

    def decode_step_time(self, batch_size: float) -> float | None:
        """Seconds of a step decoding ``batch_size`` requests (None: nothing measured yet).

        Linear interpolation between measured points; below the smallest the
        smallest point's time (the fixed cost dominates there); above the
        largest, the slope of the last two points (or, with one point, half of
        its per-request time: a step never gets cheaper per request than that
        on the machines measured, and never costlier than proportional).
        """
        pts = self.decode_points
        if not pts:
            return None
        b = max(1.0, float(batch_size))
        if b <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if b <= b1:
                return t0 + (t1 - t0) * (b - b0) / max(b1 - b0, 1e-9)
        bl, tl = pts[-1]
        if len(pts) >= 2:
            b0, t0 = pts[-2]
            slope = max(0.0, (tl - t0) / max(bl - b0, 1e-9))
        else:
            slope = 0.5 * tl / bl
        return tl + slope * (b - bl)

    def step_time(self, num_decode_reqs: int, num_prefill_tokens: int) -> float | None:
        """Predicted seconds of one step with ``num_decode_reqs`` decodes and ``num_prefill_tokens`` prompt tokens."""
        d = self.decode_step_time(max(1, num_decode_reqs))
        if d is None or self.prefill_seconds_per_token is None:
            return None
        return d + num_prefill_tokens * self.prefill_seconds_per_token


class StepTimeModel:
    """Learns :class:`StepTimingSnapshot` from timed steps (lives in the engine core).

    Args:
        alpha: EWMA weight of the newest observation, in (0, 1].

    Raises:
        ValueError: ``alpha`` outside (0, 1].
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        # bucket -> [EWMA batch size, EWMA seconds, observation count (self._n) at its last update]
        self._decode: dict[int, list[float]] = {}
        self._pf_seconds: float | None = None   # EWMA of prefill seconds in prefill-dominated steps
        self._pf_tokens: float | None = None    # EWMA of their prompt tokens
        self._pf_per_step = 0.0
        self._pf_bootstrap: list[tuple[float, float]] = []   # the first prefill samples (seconds, tokens)
        self._decode_bootstrap: dict[int, list[tuple[float, float]]] = {}   # bucket -> first (batch, seconds)
        self._n = 0
        self._seen = 0
        self._ctx_cost = 0.0                    # seconds per prompt row per context token (profiled)

    # -- learning ------------------------------------------------------------
    def seed(self, decode_points: list[tuple[float, float]], prefill_seconds_per_token: float,
             prefill_seconds_per_context: float = 0.0) -> None:
        """Start from a profile (:mod:`tokenmill.engine.step_profile`) instead of nothing.

        Replaces what was learnt: one bucket per ``(batch size, seconds)`` point, the prefill rate
        (as a finished bootstrap), and the warm-up steps counted as done (the profile paid them).
        Later steps refine the seeded values by the usual EWMA. ``prefill_seconds_per_context`` (the
        attention term, seconds per prompt row per context token) stays fixed: later steps are learnt
        net of it (:meth:`observe`'s ``prefill_context``).

        Raises:
            ValueError: no decode point, a non-positive time or rate, or a negative context term.
        """
        if not decode_points or not prefill_seconds_per_token > 0 or any(t <= 0 for _, t in decode_points):
            raise ValueError("a step-time seed needs decode points and a prefill rate, all positive")
        if not prefill_seconds_per_context >= 0 or math.isinf(prefill_seconds_per_context):
            raise ValueError("the context term of a step-time seed must be a finite number >= 0")
        self._ctx_cost = float(prefill_seconds_per_context)
        self._decode = {batch_bucket(max(1, int(round(b)))): [float(b), float(t), 0] for b, t in decode_points}
        self._decode_bootstrap = {k: [(v[0], v[1])] * DECODE_BOOTSTRAP_SAMPLES for k, v in self._decode.items()}
        tokens = 512.0
        self._pf_tokens = tokens
        self._pf_seconds = prefill_seconds_per_token * tokens
        self._pf_bootstrap = [(self._pf_seconds, tokens)] * PREFILL_BOOTSTRAP_SAMPLES
        self._pf_per_step = 0.0
        self._seen = max(self._seen, WARMUP_STEPS)
        self._n = max(self._n, 1)

    def observe(self, num_decode_reqs: int, num_prefill_tokens: int, seconds: float,
                prefill_context: int = 0) -> None:
        """Learn from one step: ``num_decode_reqs`` decoded requests, ``num_prefill_tokens`` prompt
        (or recompute) tokens, ``seconds`` of wall time (schedule + execute + update + transport);
        ``prefill_context``: the sum over the prompt rows of the context before each (their attention
        work), charged at the profiled context term before the step is split (at most half of it).

        Steps with nothing scheduled or a non-positive duration are ignored.
        """
        if seconds <= 0 or (num_decode_reqs <= 0 and num_prefill_tokens <= 0):
            return
        self._seen += 1
        if self._seen <= WARMUP_STEPS:
            return
        if self._ctx_cost and prefill_context > 0:
            seconds = max(seconds - self._ctx_cost * prefill_context, 0.5 * seconds)
        self._n += 1
        snap = self.snapshot()
        if num_prefill_tokens <= 0:
            self._update_decode(num_decode_reqs, seconds)
            self._pf_per_step += self.alpha * (0.0 - self._pf_per_step)
            return
        d = snap.decode_step_time(max(1, num_decode_reqs))
        tp = snap.prefill_seconds_per_token
        if tp is None or d is None:
            # Bootstrap one term from the other; with neither known the whole step is charged to
            # the prompt tokens (an over-estimate by the fixed cost, corrected as decodes are measured).
            # At least a tenth of the step is left to the term learned, so one noisy step cannot zero it.
            if tp is None:
                self._update_prefill(num_prefill_tokens, max(seconds - (d or 0.0), 0.1 * seconds))
            elif num_decode_reqs > 0:
                self._update_decode(num_decode_reqs, max(seconds - num_prefill_tokens * tp, 0.1 * seconds))
            else:
                self._update_prefill(num_prefill_tokens, seconds)
            self._pf_per_step += self.alpha * (seconds - self._pf_per_step)
            return
        prefill_part = num_prefill_tokens * tp
        if num_prefill_tokens >= MIN_PREFILL_TOKENS and prefill_part >= PREFILL_DOMINANT_SHARE * seconds:
            # at least a tenth of the step is left for prefill, so one noisy step cannot zero the rate
            self._update_prefill(num_prefill_tokens, max(seconds - d, 0.1 * seconds))
            prefill_part = num_prefill_tokens * (self.snapshot().prefill_seconds_per_token or tp)
        elif num_decode_reqs > 0:
            self._update_decode(num_decode_reqs, max(seconds - prefill_part, 0.1 * seconds))
        self._pf_per_step += self.alpha * (min(prefill_part, seconds) - self._pf_per_step)

    def _update_decode(self, batch: int, seconds: float) -> None:
        k = batch_bucket(max(1, batch))
        cur = self._decode.get(k)
        if cur is None:
            # A new bucket's first step is one sample with nothing of its own to clamp it: cap it at twice the
            # nearest smaller bucket's time scaled to the batch, or the nearest bigger bucket's time if that is
            # more (a decode step costs at most about proportionally more for a bigger batch; the factor 2 and
            # the bigger neighbour leave room for a machine where it costs more). In a full test-suite run one
            # stalled first step at batch 3 (367 ms against ~15 ms alone, next to 9 ms at batch 1) otherwise
            # became the bucket's value, the per-step clamp let it decay only slowly, and the run's TTFTs were
            # predicted 75% too high. A genuinely slower size is still followed by the EWMA.
            smaller = [v for kk, v in self._decode.items() if kk < k]
            bigger = [v for kk, v in self._decode.items() if kk > k]
            if smaller:
                b0, t0, _ = max(smaller, key=lambda v: v[0])
                cap = 2.0 * t0 * max(1.0, batch / max(b0, 1.0))
                if bigger:
                    cap = max(cap, min(bigger, key=lambda v: v[0])[1])
                seconds = min(seconds, cap)
            self._decode[k] = [float(batch), seconds, self._n]
            self._decode_bootstrap[k] = [(float(batch), seconds)]
            return
        boot = self._decode_bootstrap.setdefault(k, [])
        if len(boot) < DECODE_BOOTSTRAP_SAMPLES:
            # bootstrap: the lower median of the bucket's first samples (a stall only ever lengthens a step).
            # In a full test-suite run the first decode step at batch 1, the smallest bucket (nothing to cap
            # it), took 375 ms against ~13 ms alone; as the bucket's value it lifted every bigger bucket (the
            # curve is kept monotone) and the prefill rate split off the mixed steps fell 9x: TTFTs were
            # predicted 64% low for the whole run.
            boot.append((float(batch), seconds))
            ranked = sorted(t for _, t in boot)
            cur[0] = sum(b for b, _ in boot) / len(boot)
            cur[1] = ranked[(len(ranked) - 1) // 2]
            cur[2] = self._n
            return
        seconds = min(max(seconds, cur[1] / MAX_STEP_RATIO), cur[1] * MAX_STEP_RATIO)
        cur[0] += self.alpha * (batch - cur[0])
        cur[1] += self.alpha * (seconds - cur[1])
        cur[2] = self._n

    def _update_prefill(self, tokens: int, seconds: float) -> None:
        if self._pf_seconds is None or self._pf_tokens is None or \
                len(self._pf_bootstrap) < PREFILL_BOOTSTRAP_SAMPLES:
            # bootstrap: the (upper) median of the first samples, so that one stalled step (or one split
            # off too low) does not become the starting point of an EWMA that moves a few percent a step
            self._pf_bootstrap.append((seconds, float(tokens)))
            ranked = sorted(self._pf_bootstrap, key=lambda st: st[0] / st[1])
            self._pf_seconds, self._pf_tokens = ranked[len(ranked) // 2]
            return
        tp = self._pf_seconds / self._pf_tokens
        seconds = min(max(seconds, tokens * tp / MAX_STEP_RATIO), tokens * tp * MAX_STEP_RATIO)
        self._pf_seconds += self.alpha * (seconds - self._pf_seconds)
        self._pf_tokens += self.alpha * (tokens - self._pf_tokens)

    # -- reading -------------------------------------------------------------
    def snapshot(self) -> StepTimingSnapshot:
        """The current estimates as plain data (cheap: a few buckets)."""
        pts = sorted(([b, t, last] for b, t, last in self._decode.values()), key=lambda p: p[0])
        # keep the curve monotone in batch size (a noisy bucket must not make bigger batches cheaper). Where
        # a smaller batch's bucket is slower than a bigger one's and was updated less recently, it is the
        # stale one (on a contended machine a bucket visited once during a stall kept 435 ms while the
        # batch the load held, updated every step, ran at ~250 ms: lifting that one to the stale value
        # over-predicted every TPOT by 58%): it is capped at the fresher one first; what still decreases
        # is then lifted, as before.
        for i in range(len(pts) - 2, -1, -1):
            if pts[i][1] > pts[i + 1][1] and pts[i][2] < pts[i + 1][2]:
                pts[i][1] = pts[i + 1][1]
        mono: list[tuple[float, float]] = []
        for b, t, _ in pts:
            mono.append((b, max(t, mono[-1][1]) if mono else t))
        tp = None
        if self._pf_seconds is not None and self._pf_tokens:
            tp = self._pf_seconds / self._pf_tokens
        return StepTimingSnapshot(decode_points=mono, prefill_seconds_per_token=tp,
                                  prefill_seconds_per_step=self._pf_per_step, num_steps_observed=self._n,
                                  prefill_seconds_per_context=self._ctx_cost)
