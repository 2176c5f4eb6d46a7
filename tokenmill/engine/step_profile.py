"""Start-up profile of the step-time model, so ``--slo`` admission has a basis from the first request.

The step-time model (:mod:`tokenmill.metrics.step_timing`) learns from traffic; a fresh engine has
seen none, so without a profile the first burst after a start — exactly when a new replica joins a
fleet — is admitted blind (issue 30: 40 simultaneous ~450-token requests on a fresh ``--slo
ttft:3000`` server were all admitted and 12% met the target). With ``--slo`` the engine core runs,
before it reports ready, a short profile through its own scheduler and model runner — the path real
requests take — and seeds the model with it, as vLLM profiles memory with a dummy forward before it
serves (``determine_available_memory``):

1. a warm-up step: one :data:`WARMUP_TOKENS`-token prompt prefills (it pays the one-time costs
   of the first forward on the path prompts take: kernel set-up, weight packing, allocator), then
   one decode step of it (the first decode pays its own path's one-time costs: 295 ms against 38 ms
   for the next on a loaded machine); neither is timed. The model's background oneDNN packing runs
   beside them; the profile waits for it before timing anything (steps timed beside it measured a
   prefill rate of 320 tokens/s against ~500 afterwards, quiet 2-core AVX-512 machine);
2. :data:`DECODE_STEPS` decode steps of the warm-up request alone (batch 1);
3. for each next size of :data:`DECODE_BATCHES` (at most ``--max-num-seqs`` and what the pool
   holds), while less than :data:`PROFILE_BUDGET_S` has passed: the requests that make up the
   batch join in one step, their prompts :data:`PREFILL_TOKENS` tokens together, beside the running
   decodes, as prompts join under load. That step is a prefill sample, split as the online model
   splits a mixed step: ``(step − decode_step_time(running)) / prompt tokens``; the rate is the
   pooled ratio of the samples (their prefill seconds over their tokens). Then :data:`DECODE_STEPS`
   decode steps at the new size (its point is the median). The joins thus serve both terms. On a
   loaded machine the larger sizes are skipped and extrapolated, so start-up does not wait for them;
4. on a fast path, where every join's prefill part took under :data:`PREFILL_SAMPLE_MIN_S` (timer and
   scheduling jitter are then a large share of it), one prompt of a few hundred tokens joins alone,
   sized to take ~:data:`PREFILL_SAMPLE_S` (a sample timed more precisely), then one twice as long
   (within the time budget, seats, pool and token budget): each prompt row attends to the rows before
   it, so the two give the per-token rate and the per-context-token cost
   (``seconds = a × tokens + c × Σ context``), which the predictor charges long prompts.

The prefill samples are short prompts, so the rate holds little attention over long contexts: on the
batch-invariant default every prompt row runs the decode attention kernel over its own context, and a
512-token chunk after 1,536 cached tokens costs ~1.8x the first 512-token chunk (quiet 2-core AVX-512).
The online model re-learns the rate from real prompt steps (EWMA) and the admission's learnt TTFT
margin covers the rest.

Prompts are random token ids (nothing to share with later traffic); every block returns to the pool
and the prefix cache is reset afterwards, and the engine's counters (steps, prefix-cache queries,
prompt tokens by source) are zeroed, so nothing of the profile shows in ``/metrics``. The decode
sizes bracket the batches an SLO admits on a small CPU model; between and beyond them the model
interpolates and extrapolates (:meth:`StepTimingSnapshot.decode_step_time`) and the online EWMA
takes over from the first real step.

``--slo-calibration cache`` (the default) keeps the profile under ``$TOKENMILL_CACHE_DIR/slo_profiles``
(or ``~/.cache/tokenmill/slo_profiles``), keyed by the model file (path, size, mtime), dtype, KV
cache dtype, CPU kernel variant, threads, batch invariance, token budget, seats and the profile's version: a second
start with the same key skips the profile. ``profile`` always profiles (and refreshes the entry);
``off`` skips it (the first burst is admitted blind, at most ``BLIND_MAX_REQUESTS`` of it). A start
that takes the profile from the cache still runs one warm-up step (:func:`warm_up`): the first
forward's one-time costs (4.7 s against 1.3 s for the same 256-token step on the loaded shared
machine) would otherwise land on the first burst, which the cached step times do not predict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill import envs
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.core.request import RequestStatus
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.model.default_model import default_model_path
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROFILE_VERSION = 3
# Decode batch sizes profiled (capped at --max-num-seqs and the pool), ascending. On the batch-invariant
# default every row runs the same kernels, so a step's time is close to linear in its rows past a few
# (fixed cost + per-row cost): 1, 8 and 32 pin the fixed cost, the bend and the slope, which
# StepTimingSnapshot.decode_step_time interpolates and extrapolates; the per-step-size paths
# (--no-batch-invariant) switch kernels above 8 rows, which the same three points bracket.
DECODE_BATCHES = (1, 8, 32)
# Decode steps timed per batch size (their median is the point).
DECODE_STEPS = 2
# Prompt tokens of the requests that join to grow the batch, together, per join (capped at the token
# budget and the context): each join is a prefill sample beside the running decodes. 64 tokens make the
# prefill part ~3-6x the decode part of the step on the paths measured (so the split's error from the
# decode part's noise is a fraction of that), at ~2 ms a token on a quiet 2-core AVX-512 machine.
PREFILL_TOKENS = 64
# A join step with fewer prompt tokens than this is no prefill sample (tiny batches, tiny budgets).
MIN_PROBE_TOKENS = 8
# When every join's prefill part took less than PREFILL_SAMPLE_MIN_S (a fast path: 64 tokens are ~30 ms on
# the bfloat16 path of a 2-core AVX512-BF16 EPYC, where timer and scheduling jitter is a large share of
# them: its rates scattered 1,635-2,123 tokens/s over four starts), one more prompt joins alone, sized
# to take about PREFILL_SAMPLE_S by the joins' estimate (at most LONG_SAMPLE_MAX_TOKENS, the token budget,
# the seats and the pool), then, within the time budget, one of twice its length: the two differ in the
# attention over their own context (every prompt row attends to the rows before it: on that EPYC a
# 1,100-token prompt cost 1.26x its tokens at the short prompts' rate, and steps of ~1,100-1,400-token
# prompts 1.4-1.65x), so together they give the rate and the context term
# (StepTimingSnapshot.prefill_seconds_per_context).
PREFILL_SAMPLE_MIN_S = 0.1
PREFILL_SAMPLE_S = 0.12
LONG_SAMPLE_MAX_TOKENS = 512
# Seconds after which the profile adds no larger decode batch (the warm-up, batch 1 and the first join
# always run): on a loaded machine each step is many times slower, and start-up must not wait for it.
PROFILE_BUDGET_S = 1.0
# Prompt tokens of the warm-up request: past TOKENMILL_CPU_INT4_MAX_TOKENS (8), so the first forward
# runs (and packs) the path prompt chunks take, at the cost of few tokens.
WARMUP_TOKENS = 16
CALIBRATION_MODES = ("cache", "profile", "off")
_ID_PREFIX = "__tokenmill_step_profile"


@dataclass
class StepProfile:
    """The measured step times.

    Attributes:
        decode_points: ``[(batch size, seconds per decode step)]``, ascending batch size.
        prefill_seconds_per_token: marginal seconds per prompt token.
        prefill_seconds_per_context: seconds per prompt row per token of context before it (0: not
            measured).
        seconds: wall time the profile took (0 when loaded from the cache).
        source: ``profiled`` or ``cache``.
        key: what the cached entry is keyed by.
    """

    decode_points: list[tuple[float, float]]
    prefill_seconds_per_token: float
    seconds: float = 0.0
    prefill_seconds_per_context: float = 0.0
    source: str = "profiled"
    key: dict[str, Any] = field(default_factory=dict)


def profile_key(core: Any) -> dict[str, Any]:
    """The cache key of ``core``'s step times: model file, dtypes, kernel variant, threads, batch
    invariance (its kernels differ from the per-step-size paths'), budget, seats."""
    cfg = core.config
    path = getattr(cfg.model, "model", None)
    if not path:
        try:
            path = default_model_path()
        except Exception:  # noqa: BLE001 - the key is best effort
            path = ""
    try:
        st = os.stat(path)
        size, mtime = st.st_size, int(st.st_mtime)
    except OSError:
        size = mtime = 0
    runner = getattr(core.executor, "runner", None)
    dtype = str(getattr(runner, "dtype", None) or getattr(core.executor, "dtype", None) or cfg.model.dtype)
    kv_dtype = str(getattr(runner, "kv_cache_dtype", None) or cfg.cache.kv_cache_dtype)
    isa = ""
    if "torch" in sys.modules:
        try:
            from tokenmill.model.layers.cpu_build import cpu_isa

            isa = cpu_isa()
        except Exception:  # noqa: BLE001
            isa = ""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else 0
    sched = cfg.scheduler
    return {"version": PROFILE_VERSION, "executor": f"{type(core.executor).__module__}.{type(core.executor).__qualname__}",
            "model": os.path.abspath(path) if path else "", "size": size,
            "mtime": mtime, "dtype": dtype, "kv_cache_dtype": kv_dtype, "cpu_isa": isa, "threads": threads,
            "quantization": str(getattr(cfg.model, "quantization", None)),
            "batch_invariant": bool(getattr(cfg.model, "batch_invariant", False)),
            "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
            "block_size": cfg.cache.block_size}


def cache_path(key: dict[str, Any]) -> str:
    """The cache file of ``key`` under ``$TOKENMILL_CACHE_DIR/slo_profiles`` (or ``~/.cache/tokenmill``)."""
    root = envs.TOKENMILL_CACHE_DIR
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(root, "slo_profiles", f"{digest}.json")


def load_cached(key: dict[str, Any]) -> StepProfile | None:
    """The cached profile of ``key``, None when absent or unreadable (a bad entry is ignored with a warning)."""
    path = cache_path(key)
    try:
        with open(path) as f:
            d = json.load(f)
        if d.get("key") != key:
            return None
        pts = [(float(b), float(t)) for b, t in d["decode_points"]]
        tp = float(d["prefill_seconds_per_token"])
        ctx = float(d.get("prefill_seconds_per_context", 0.0))
        if not pts or not all(t > 0 for _, t in pts) or not tp > 0 or not ctx >= 0:
            raise ValueError("non-positive times")
        return StepProfile(pts, tp, 0.0, source="cache", key=key, prefill_seconds_per_context=ctx)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring the cached step-time profile %s (%s); profiling again", path, e)
        return None


def store(profile: StepProfile) -> None:
    """Write ``profile`` to its cache file atomically (failures are logged, never raised)."""
    path = cache_path(profile.key)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": profile.key, "decode_points": profile.decode_points,
                       "prefill_seconds_per_token": profile.prefill_seconds_per_token,
                       "prefill_seconds_per_context": profile.prefill_seconds_per_context,
                       "profile_seconds": profile.seconds, "written": time.time()}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the step-time profile at %s: %s", path, e)


def _wait_for_background_packing(core: Any) -> float:
    """Join the model's background oneDNN packing thread, if any (seconds waited).

    The packing runs beside the first steps after start-up; steps timed while it holds a core are slower
    than every later step (measured: a prefill rate of 320 tokens/s in the profile against ~500 tokens/s
    afterwards on a quiet 2-core machine), so the profile times nothing before it is done. The warm-up
    (whose one-time costs are not timed) runs first and overlaps it.
    """
    if "torch" not in sys.modules:
        return 0.0
    runner = getattr(core.executor, "runner", core.executor)
    model = getattr(runner, "model", None)
    if model is None:
        return 0.0
    t0 = time.perf_counter()
    try:
        from tokenmill.model.layers.linear import wait_for_packing

        wait_for_packing(model, timeout=60.0)
    except Exception:  # noqa: BLE001 - an executor without that model: nothing to wait for
        return 0.0
    return time.perf_counter() - t0


def _split_prompts(total: int, count: int) -> list[int]:
    """``count`` prompt lengths (each >= 1) summing to ``total`` (at least ``count``)."""
    total = max(total, count)
    return [total // count + (1 if i < total % count else 0) for i in range(count)]


def run_profile(core: Any, vocab_size: int | None = None, seed: int = 0,
                budget_s: float | None = None) -> StepProfile:
    """Profile ``core``'s decode and prefill steps with dummy requests (see the module docstring).

    Args:
        core: an idle :class:`~tokenmill.engine.engine_core.EngineCore` (no request queued).
        vocab_size: prompt ids are drawn below it (default: 1000, always valid).
        seed: of the random prompts.
        budget_s: seconds after which no further decode batch size is profiled (default
            :data:`PROFILE_BUDGET_S`); the warm-up, batch 1 and the first join always run.

    Returns:
        the :class:`StepProfile` (``key`` unset).

    Raises:
        RuntimeError: the core is not idle, or a profile request failed (its error).
    """
    sched = core.scheduler
    if sched.has_unfinished_requests():
        raise RuntimeError("the step-time profile needs an idle engine")
    budget_s = PROFILE_BUDGET_S if budget_s is None else budget_s
    t_start = time.perf_counter()
    rng = random.Random(seed)
    hi = max(2, min(vocab_size or 1000, 1000))
    block = sched.block_size
    pool = sched.kv_cache_manager.num_blocks
    budget = sched.max_num_batched_tokens
    max_tokens = 2 + (1 + DECODE_STEPS) * (len(DECODE_BATCHES) + 1)
    # the decode batches, capped by the seats and by the pool (each request holds its blocks to the end)
    per_req_blocks = -(-(max(WARMUP_TOKENS, PREFILL_TOKENS) + max_tokens) // block)
    cap = max(1, min(sched.max_num_seqs, pool // max(1, per_req_blocks)))
    batches = sorted({max(1, min(b, cap)) for b in DECODE_BATCHES})
    ids: list[str] = []
    decode: dict[int, list[float]] = {}
    samples: list[tuple[float, int, int]] = []      # (prefill seconds, prompt tokens, context) per sample
    num_long = 0                                     # single-prompt samples among them (the last ones)

    def add(n_prompt: int) -> None:
        rid = f"{_ID_PREFIX}-{len(ids)}"
        prompt = [rng.randrange(1, hi) for _ in range(max(1, n_prompt))]
        core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True)))
        ids.append(rid)

    def step() -> tuple[int, int, float, int]:
        t0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t0
        for o in outs:
            if o.finish_reason == "error":
                raise RuntimeError(f"step-time profile request failed: {o.error}")
        last = core._last_step       # (decoding requests, prefill tokens, start, end, context) of this step
        nd, npf, ctx = (last[0], last[1], last[4]) if last is not None else (0, 0, 0)
        if npf == 0 and nd > 0:
            decode.setdefault(nd, []).append(dt)
        return nd, npf, dt, ctx

    try:
        add(max(1, min(WARMUP_TOKENS, budget, core.max_model_len - max_tokens)))
        step()                      # the warm-up: the first forward's one-time costs ...
        step()                      # ... and the first decode's (its kernel path differs from a prompt's)
        waited = _wait_for_background_packing(core)   # overlapped by the warm-up; nothing timed before it ends
        decode.clear()
        for _ in range(DECODE_STEPS):   # batch 1
            step()
        if not decode:
            raise RuntimeError("the step-time profile measured no decode step")
        for b in batches:
            running = len(sched.running)
            if b <= running:
                continue
            if samples and time.perf_counter() - t_start > budget_s:
                logger.info("step-time profile: %.1f s spent, batches above %d are extrapolated",
                            time.perf_counter() - t_start, running)
                break
            # the requests that grow the batch join in one step beside the running decodes, their prompts
            # PREFILL_TOKENS together (within the budget): that step is the prefill sample, split as the
            # online model splits a mixed step: (step - decode_step_time(running)) / prompt tokens
            joining = b - running
            total = max(joining, min(PREFILL_TOKENS, budget - running, core.max_model_len - max_tokens))
            for n in _split_prompts(total, joining):
                add(n)
            d_running = statistics.median(decode[max(k for k in decode if k <= running)])
            nd, npf, dt, ctx = step()
            if npf >= MIN_PROBE_TOKENS:
                samples.append((max(dt - d_running, 0.1 * dt), npf, ctx))
            for _ in range(DECODE_STEPS):
                step()
        num_long = _long_samples(core, samples, decode, add, step, max_tokens, t_start, budget_s)
    finally:
        core._last_step = None      # the gap after the profile is no step
        _forget_profile(core, ids)
    if not samples:
        raise RuntimeError("the step-time profile measured no prefill step")
    points = [(float(n), statistics.median(ts)) for n, ts in sorted(decode.items())]
    mono: list[tuple[float, float]] = []
    for n, t in points:
        mono.append((n, max(t, mono[-1][1]) if mono else t))
    logger.debug("step-time profile: waited %.2f s for the background packing; prefill samples %s", waited,
                 [(n, c, round(sec * 1e3, 1)) for sec, n, c in samples])
    ctx_cost = _context_term(samples[-2:]) if num_long == 2 else 0.0
    # the pooled ratio net of the context term (seconds over tokens of all samples, as the online model's
    # EWMA ratio learns net of it): the longer samples, timed more precisely, weigh more
    rate = sum(max(sec - ctx_cost * c, 0.5 * sec) for sec, _, c in samples) / sum(n for _, n, _ in samples)
    return StepProfile(mono, rate, time.perf_counter() - t_start, prefill_seconds_per_context=ctx_cost)


def _context_term(samples: list[tuple[float, int, int]]) -> float:
    """Seconds per prompt row per context token from the two single-prompt samples of
    :func:`_long_samples` (not the joins: their many short prompts carry per-request costs too):
    ``seconds = a × tokens + c × context`` solved for ``c``; 0 when the solution is not positive in both
    terms (noise larger than the effect)."""
    if len(samples) != 2:
        return 0.0
    (s1, n1, c1), (s2, n2, c2) = samples[-2], samples[-1]
    if not (c1 > 0 and n2 >= 1.5 * n1 and c2 / n2 >= 32):
        return 0.0
    det = n1 * c2 - n2 * c1
    if det <= 0:
        return 0.0
    a = (s1 * c2 - s2 * c1) / det
    c = (n1 * s2 - n2 * s1) / det
    return c if (a > 0 and c > 0) else 0.0


def _long_samples(core: Any, samples: list[tuple[float, int, int]], decode: dict[int, list[float]], add: Any,
                  step: Any, max_tokens: int, t_start: float, budget_s: float) -> int:
    """Single prompts joining alone beside the running decodes, when every sample so far was shorter than
    :data:`PREFILL_SAMPLE_MIN_S` (see there): one sized to take ~:data:`PREFILL_SAMPLE_S`, then, within
    the time budget, one twice as long (for the context term); appends their samples and returns how many.

    Each is skipped past the time budget, or without a seat, blocks or token budget for it (the first:
    at least twice :data:`PREFILL_TOKENS` tokens; the second: 1.5x the first).
    """
    if not samples or max(sec for sec, _, _ in samples) >= PREFILL_SAMPLE_MIN_S:
        return 0
    sched = core.scheduler
    tp = sum(sec for sec, _, _ in samples) / sum(n for _, n, _ in samples)
    first = taken = 0
    for want in (None, 2):
        if time.perf_counter() - t_start > budget_s:
            return taken
        running = len(sched.running)
        measured = [k for k in decode if k <= running]
        if running >= sched.max_num_seqs or not measured:
            return taken
        free_tokens = (sched.kv_cache_manager.num_free_blocks - running) * sched.block_size - max_tokens
        room = min(LONG_SAMPLE_MAX_TOKENS * (want or 1), sched.max_num_batched_tokens - running,
                   core.max_model_len - max_tokens, free_tokens)
        if want is None:
            n = int(min(room, max(2 * PREFILL_TOKENS, PREFILL_SAMPLE_S / max(tp, 1e-9))))
            if n < 2 * PREFILL_TOKENS:
                return taken
        else:
            n = int(min(room, want * first))
            if n < 1.5 * first:
                return taken
        # the running batch's decode time, interpolated / extrapolated from the measured sizes as the model does
        d_running = StepTimingSnapshot(decode_points=[(float(k), statistics.median(v)) for k, v in
                                                      sorted(decode.items())]).decode_step_time(running)
        add(n)
        _, npf, dt, ctx = step()
        if npf < n:
            return taken
        samples.append((max(dt - d_running, 0.1 * dt), npf, ctx))
        first, taken = first or n, taken + 1
    return taken


def warm_up(core: Any, seed: int = 0) -> float:
    """One dummy prefill and decode step, so the first real request does not pay the first forward's
    one-time costs (kernel set-up, weight paging, packing) that a cached profile did not include.

    Returns:
        seconds it took.

    Raises:
        RuntimeError: the core is not idle, or the request failed.
    """
    sched = core.scheduler
    if sched.has_unfinished_requests():
        raise RuntimeError("the warm-up needs an idle engine")
    t0 = time.perf_counter()
    rng = random.Random(seed)
    rid = f"{_ID_PREFIX}-w"
    n = max(4, min(WARMUP_TOKENS, sched.max_num_batched_tokens, core.max_model_len - 3))
    core.add_request(EngineCoreRequest(rid, [rng.randrange(1, 1000) for _ in range(n)],
                                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
    for _ in range(8 + -(-n // sched.max_num_batched_tokens)):
        for o in core.step():
            if o.finish_reason == "error":
                raise RuntimeError(f"warm-up request failed: {o.error}")
        if not sched.has_unfinished_requests():
            break
    core._last_step = None
    _forget_profile(core, [rid])
    return time.perf_counter() - t0


def _forget_profile(core: Any, ids: list[str]) -> None:
    """Leave no trace of the profile: blocks freed, prefix cache reset, counters zeroed."""
    sched = core.scheduler
    sched.finish_requests([i for i in ids if i in sched.requests], RequestStatus.FINISHED_ABORTED)
    sched.reset_prefix_cache()
    stats = sched.kv_cache_manager.prefix_cache_stats
    for name in ("queries", "hits", "requests"):
        if hasattr(stats, name):
            setattr(stats, name, 0)
    for k in sched.prompt_tokens_by_source:
        sched.prompt_tokens_by_source[k] = 0
    sched._num_preemptions_total = 0
    core._num_steps = 0
    core._pending = []


def calibrate(core: Any, mode: str = "cache", vocab_size: int | None = None) -> StepProfile | None:
    """Seed ``core.step_time_model`` with a start-up profile (``--slo-calibration``).

    Args:
        core: an idle engine core.
        mode: ``cache`` (use a cached profile with the same key, else profile and cache it),
            ``profile`` (always profile; refresh the cache), ``off`` (nothing).
        vocab_size: bound of the dummy prompts' ids.

    Returns:
        the profile used, None with ``off`` or when profiling failed (logged; the server then starts
        with an empty model, as before).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in CALIBRATION_MODES:
        raise ValueError(f"slo_calibration must be one of {', '.join(CALIBRATION_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    key = profile_key(core)
    prof = load_cached(key) if mode == "cache" else None
    # the profile's joins are sized on purpose: the scheduler's step-latency budget stays out of them
    sched = core.scheduler
    step_timing, sched.step_timing = getattr(sched, "step_timing", None), None
    try:
        if prof is None:
            try:
                prof = run_profile(core, vocab_size)
            except Exception as e:  # noqa: BLE001 - a failed profile must not stop the server
                logger.warning("step-time profile failed (%s: %s); --slo admits the first requests blind",
                               type(e).__name__, e)
                return None
            prof.key = key
            store(prof)
        else:
            try:
                prof.seconds = warm_up(core)
            except Exception as e:  # noqa: BLE001
                logger.warning("warm-up step failed (%s: %s)", type(e).__name__, e)
    finally:
        sched.step_timing = step_timing
    core.step_time_model.seed(prof.decode_points, prof.prefill_seconds_per_token, prof.prefill_seconds_per_context)
    logger.info("step-time model %s in %.2f s: decode %s; prefill %.0f tokens/s, %.3f us per row and context token",
                "profiled" if prof.source == "profiled" else "loaded from the cache", prof.seconds,
                ", ".join(f"{1000 * t:.1f} ms at batch {b:g}" for b, t in prof.decode_points),
                1.0 / prof.prefill_seconds_per_token, 1e6 * prof.prefill_seconds_per_context)
    return prof
