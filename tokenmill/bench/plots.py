"""Benchmark plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tokenmill.bench.metrics import (METRIC_NAMES, PERCENTILE_METRICS, RequestRecord,
                                     output_tokens_timeline)


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _metric_values_ms(records: Sequence[RequestRecord], metric: str) -> np.ndarray:
    ok = [r for r in records if r.success]
    if metric == "ttft":
        v = [r.ttft for r in ok]
    elif metric == "tpot":
        v = [r.tpot for r in ok if r.output_tokens > 1]
    elif metric == "itl":
        v = [g for r in ok for g in r.itl]
    else:
        v = [r.latency for r in ok]
    return np.sort(np.asarray(v, dtype=np.float64) * 1000.0)


def in_flight_timeline(records: Sequence[RequestRecord], t0: float, step_s: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight sampled every ``step_s`` seconds from ``t0``.

    Returns:
        ``(times_s [n], in_flight [n])``.
    """
    if not records:
        return np.zeros(0), np.zeros(0)
    end = max(r.end_time for r in records) - t0
    times = np.arange(0.0, end + step_s, step_s)
    starts = np.sort([r.start_time - t0 for r in records])
    ends = np.sort([r.end_time - t0 for r in records])
    return times, np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")


def plot_serve(records: Sequence[RequestRecord], t0: float, path: str | os.PathLike[str],
               slos_ms: dict[str, float] | None = None, title: str = "") -> Path:
    """Latency CDFs (TTFT, TPOT, ITL, E2EL; ms) and output tokens/s and requests
    in flight over time, saved as one PNG.

    Args:
        records: per-request records of one run.
        t0: benchmark start (``perf_counter``, s).
        path: output file.
        slos_ms: SLO limits drawn as vertical lines.
        title: figure title.
    """
    plt = _plt()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, metric in zip(axes.flat[:4], PERCENTILE_METRICS):
        short, long = METRIC_NAMES[metric]
        v = _metric_values_ms(records, metric)
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(v, p), color="grey", ls=":", lw=0.8)
        if slos_ms and metric in slos_ms:
            ax.axvline(slos_ms[metric], color="red", ls="--", label=f"SLO {slos_ms[metric]:g} ms")
            ax.legend(loc="lower right")
        ax.set_title(f"{short} CDF")
        ax.set_xlabel(f"{long} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if metric == "itl" else "requests"))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    tl = output_tokens_timeline(records, t0)
    ax = axes.flat[4]
    ax.bar(np.arange(tl.size) + 0.5, tl, width=1.0, color="tab:green", alpha=0.7)
    ax.set_title("Output tokens/s over time (1 s buckets)")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    times, inflight = in_flight_timeline(records, t0)
    ax.plot(times, inflight, color="tab:purple")
    fails = [r.start_time - t0 for r in records if not r.success]
    if fails:
        ax.plot(fails, np.zeros(len(fails)), "rx", label=f"failed ({len(fails)})")
        ax.legend(loc="upper right")
    ax.set_title("Requests in flight")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_goodput(curve: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
                 target: float, answer_rate: float | None, slos_ms: dict[str, float],
                 title: str = "") -> Path:
    """The goodput search curve: SLO attainment, p99 TTFT/TPOT and throughput
    against request rate (req/s), with the target and the answer marked.

    Args:
        curve: probes with keys ``request_rate``, ``slo_attainment``,
            ``p99_ttft_ms``, ``p99_tpot_ms``, ``request_throughput``,
            ``output_throughput``.
        path: output PNG.
        target: attainment target (fraction).
        answer_rate: goodput found, req/s (``None``/0 when none).
        slos_ms: SLO limits, ms.
    """
    plt = _plt()
    pts = sorted(curve, key=lambda c: c["request_rate"])
    x = [c["request_rate"] for c in pts]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    ax.plot(x, [100 * c["slo_attainment"] for c in pts], "o-")
    ax.axhline(100 * target, color="red", ls="--", label=f"target {100 * target:g}%")
    if answer_rate:
        ax.axvline(answer_rate, color="green", ls=":", label=f"goodput {answer_rate:.3g} req/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.legend()
    ax = axes[1]
    ax.plot(x, [c["p99_ttft_ms"] for c in pts], "o-", label="p99 TTFT")
    ax.plot(x, [c["p99_tpot_ms"] for c in pts], "s-", label="p99 TPOT")
    for k, style in (("ttft", "C0"), ("tpot", "C1")):
        if k in slos_ms:
            ax.axhline(slos_ms[k], color=style, ls="--", lw=0.8, label=f"{k.upper()} SLO {slos_ms[k]:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.legend()
    ax = axes[2]
    ax.plot(x, [c["request_throughput"] for c in pts], "o-", label="request throughput")
    ax.plot(x, [c.get("request_goodput") or 0.0 for c in pts], "s-", label="request goodput")
    ax.plot(x, x, color="grey", ls=":", lw=0.8, label="offered rate")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    ax2 = ax.twinx()
    ax2.plot(x, [c["output_throughput"] for c in pts], "^-", color="tab:green", label="output tok/s")
    ax2.set_ylabel("output tokens/s")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    for a in axes:
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
