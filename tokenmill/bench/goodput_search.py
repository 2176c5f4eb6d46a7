"""Goodput search: the highest request rate at which a target share of requests
meets the SLO.

DistServe (Zhong et al., arXiv 2401.09670, §1 and §2.2) defines goodput as the
maximum request rate that can be served while at least a target fraction
(e.g. 90%) of requests meet their TTFT and TPOT limits (SLO attainment).

The search (:func:`search_goodput`) runs one full benchmark ("probe") per rate,
each with the same workload and seed:

1. **Bracket**: probe ``initial_rate``; if it meets the target, double the rate
   until a probe misses it (or ``max_rate`` is reached); otherwise halve until a
   probe meets it (or the rate falls below ``min_rate``: no goodput).
2. **Bisect** between the highest passing and lowest failing rate until the
   bracket is narrower than ``precision`` × the passing rate.

It assumes attainment falls as the rate rises; measurement noise near the
threshold can make single probes disagree, so the answer is the highest rate
*observed* to pass below the lowest rate observed to fail.

The probes send the same seeded prompts, so on one server every probe after
the first finds them in the server's prefix cache (and llama-server's slot
cache) and only the first runs cold (``benchmarks/compare_engines.py
--goodput-fresh-server`` restarts the server per probe instead; with the
16-request probes of ``--quick`` one cold pair of long prompts then decided
every probe).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class Probe:
    """One benchmark run at a fixed request rate.

    Attributes:
        request_rate: offered rate, req/s.
        slo_attainment: fraction of requests (failed included) meeting the SLO.
        p99_ttft_ms, p99_tpot_ms: 99th percentiles, ms.
        request_throughput: completed requests/s.
        request_goodput: good requests/s.
        output_throughput: output tokens/s.
        completed, failed: request counts.
        passed: ``slo_attainment ≥ target``.
        metrics: the run's full metric dict (vLLM keys), optional.
    """

    request_rate: float
    slo_attainment: float
    p99_ttft_ms: float
    p99_tpot_ms: float
    request_throughput: float
    request_goodput: float
    output_throughput: float
    completed: int
    failed: int
    passed: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The probe without its full metrics (one row of the curve)."""
        d = asdict(self)
        d.pop("metrics")
        return d


@dataclass
class SearchResult:
    """Outcome of :func:`search_goodput`.

    Attributes:
        goodput: highest passing rate found, req/s (0 when none passed).
        lowest_failing_rate: lowest rate that missed the target, req/s
            (``None`` when every probe passed).
        probes: all probes in the order they ran.
        note: why the search stopped.
    """

    goodput: float
    lowest_failing_rate: float | None
    probes: list[Probe]
    note: str

    def curve(self) -> list[dict[str, Any]]:
        """Probe summaries sorted by rate."""
        return [p.summary() for p in sorted(self.probes, key=lambda p: p.request_rate)]


def search_goodput(probe: Callable[[float], Probe], *, target: float = 0.9,
                   initial_rate: float = 1.0, precision: float = 0.1,
                   max_rate: float = 1024.0, min_rate: float = 1.0 / 64,
                   max_probes: int = 16,
                   on_probe: Callable[[Probe], None] | None = None) -> SearchResult:
    """Find the goodput by doubling/halving then bisection (see module docstring).

    Args:
        probe: runs a benchmark at a rate (req/s) and returns its :class:`Probe`.
        target: SLO attainment target, fraction in (0, 1].
        initial_rate: first rate probed, req/s.
        precision: stop when (fail − pass) ≤ precision × pass (relative).
        max_rate: never probe above this rate, req/s.
        min_rate: give up (goodput 0) below this rate, req/s.
        max_probes: hard cap on probes.
        on_probe: called after each probe (progress reporting).

    Returns:
        The :class:`SearchResult`.

    Raises:
        ValueError: on invalid arguments.
    """
    if not 0 < target <= 1:
        raise ValueError("--attainment must be in (0, 1]")
    if not (initial_rate > 0 and precision > 0 and max_rate >= min_rate > 0):
        raise ValueError("rates and precision must be positive, with max_rate ≥ min_rate")
    probes: list[Probe] = []
    lo: float | None = None   # highest passing rate
    hi: float | None = None   # lowest failing rate

    def run(rate: float) -> bool:
        nonlocal lo, hi
        p = probe(rate)
        p.request_rate = rate
        p.passed = p.slo_attainment >= target
        probes.append(p)
        if on_probe:
            on_probe(p)
        if p.passed:
            lo = rate if lo is None else max(lo, rate)
        else:
            hi = rate if hi is None else min(hi, rate)
        return p.passed

    rate = min(max(initial_rate, min_rate), max_rate)
    note = ""
    if run(rate):
        while hi is None:
            if rate >= max_rate:
                note = f"met the target up to --max-rate {max_rate:g} req/s"
                break
            if len(probes) >= max_probes:
                note = "stopped at --max-probes while bracketing"
                break
            rate = min(rate * 2.0, max_rate)
            run(rate)
    else:
        while lo is None:
            nxt = rate / 2.0
            if nxt < min_rate:
                note = f"no rate ≥ --min-rate {min_rate:g} req/s met the target"
                break
            if len(probes) >= max_probes:
                note = "stopped at --max-probes while bracketing"
                break
            rate = nxt
            run(rate)
    while lo is not None and hi is not None and not note:
        if hi - lo <= precision * lo:
            note = f"bracket [{lo:.4g}, {hi:.4g}] req/s within precision {precision:g}"
            break
        if len(probes) >= max_probes:
            note = "stopped at --max-probes while bisecting"
            break
        run((lo + hi) / 2.0)
    # Noise can make a probe above a failing rate pass; report the highest
    # passing rate below the lowest failing one.
    passing = [p.request_rate for p in probes if p.passed and (hi is None or p.request_rate < hi)]
    goodput = max(passing) if passing else 0.0
    return SearchResult(goodput=goodput, lowest_failing_rate=hi, probes=probes, note=note)


def probe_from_metrics(rate: float, metrics: dict[str, Any]) -> Probe:
    """Build a :class:`Probe` from a run's metric dict (vLLM key names).

    ``metrics`` must hold ``slo_attainment`` (so the run had ``--goodput``).
    """
    att = metrics.get("slo_attainment")
    if att is None:
        raise ValueError("goodput search needs --goodput SLOs")
    return Probe(request_rate=rate, slo_attainment=float(att),
                 p99_ttft_ms=float(metrics.get("p99_ttft_ms", math.nan)),
                 p99_tpot_ms=float(metrics.get("p99_tpot_ms", math.nan)),
                 request_throughput=float(metrics["request_throughput"]),
                 request_goodput=float(metrics.get("request_goodput") or 0.0),
                 output_throughput=float(metrics["output_throughput"]),
                 completed=int(metrics["completed"]), failed=int(metrics["failed"]),
                 metrics=dict(metrics))
