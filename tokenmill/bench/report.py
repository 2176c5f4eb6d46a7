"""Printing and saving benchmark results (vLLM's table layout and JSON keys)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenmill.bench.metrics import (METRIC_NAMES, PERCENTILE_METRICS, BenchmarkMetrics,
                                     RequestRecord, per_request_fields, percentile_key)

WIDTH = 50


def error_kind(error: str) -> str:
    """Short category of a failure message, e.g. ``"HTTP 429"`` or ``"broken stream"``."""
    if not error:
        return ""
    if error.startswith("HTTP "):
        return " ".join(error.split()[:2])
    head = error.split(":", 1)[0].strip()
    return head[:40]


def failure_breakdown(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by :func:`error_kind`, most frequent first."""
    c = Counter(error_kind(r.error) for r in records if not r.success)
    return dict(c.most_common())


def _row(label: str, value: Any, fmt: str = "") -> str:
    if isinstance(value, float) and fmt:
        value = format(value, fmt)
    return f"{label:<40} {value!s:<10}"


def format_table(metrics: BenchmarkMetrics, records: Sequence[RequestRecord], *,
                 request_rate: float = math.inf, max_concurrency: int | None = None,
                 selected_metrics: Sequence[str] = PERCENTILE_METRICS,
                 title: str = " Serving Benchmark Result ") -> str:
    """The results table printed after a run (all latencies in ms).

    Args:
        metrics: aggregated figures.
        records: per-request records (for the failure breakdown).
        request_rate: configured rate, req/s (shown when finite).
        max_concurrency: configured cap (shown when set).
        selected_metrics: which of ttft/tpot/itl/e2el get a section.
        title: banner text.
    """
    out = [f"{title:=^{WIDTH}}"]
    out.append(_row("Successful requests:", metrics.completed))
    out.append(_row("Failed requests:", metrics.failed))
    for kind, n in failure_breakdown(records).items():
        out.append(_row(f"  {kind}:", n))
    if max_concurrency is not None:
        out.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        out.append(_row("Request rate configured (RPS):", float(request_rate), ".2f"))
    out.append(_row("Benchmark duration (s):", metrics.duration_s, ".2f"))
    out.append(_row("Total input tokens:", metrics.total_input))
    out.append(_row("Total generated tokens:", metrics.total_output))
    out.append(_row("Request throughput (req/s):", metrics.request_throughput, ".2f"))
    if metrics.request_goodput is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in metrics.goodput_config.items())
        out.append(_row("Request goodput (req/s):", metrics.request_goodput, ".2f"))
        out.append(_row(f"SLO attainment (%) [{slo} ms]:", 100.0 * (metrics.slo_attainment or 0.0), ".2f"))
    out.append(_row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"))
    out.append(_row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f"))
    out.append(_row("Peak concurrent requests:", metrics.max_concurrent_requests))
    out.append(_row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"))
    for m in PERCENTILE_METRICS:
        if m not in selected_metrics:
            continue
        short, long = METRIC_NAMES[m]
        s = metrics.stats[m]
        out.append(f"{' ' + long + ' ':-^{WIDTH}}")
        out.append(_row(f"Mean {short} (ms):", s["mean"], ".2f"))
        out.append(_row(f"Median {short} (ms):", s["median"], ".2f"))
        for p, v in s["percentiles"]:
            out.append(_row(f"P{percentile_key(p)} {short} (ms):", v, ".2f"))
    out.append("=" * WIDTH)
    return "\n".join(out)


def json_safe(obj: Any) -> Any:
    """Replace NaN by ``None`` and ±inf by ``"inf"``/``"-inf"`` so the JSON is valid."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def result_json(metrics: BenchmarkMetrics, records: Sequence[RequestRecord], t0: float,
                metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``--save-result`` document.

    ``metadata`` first (``date``, ``endpoint_type``, ``model_id``,
    ``request_rate``, ...), then vLLM's metric keys (``request_throughput``,
    ``request_goodput``, ``output_throughput``, ``p99_ttft_ms``, ...), tokenmill's
    additions (``slo_attainment``, ``failure_breakdown``) and the per-request
    arrays (see :func:`tokenmill.bench.metrics.per_request_fields`).
    """
    doc: dict[str, Any] = dict(metadata)
    doc.update(metrics.to_dict())
    doc["failure_breakdown"] = failure_breakdown(records)
    doc.update(per_request_fields(records, t0))
    return json_safe(doc)


def save_json(path: str | os.PathLike[str], doc: dict[str, Any]) -> Path:
    """Write ``doc`` as indented JSON (parent folders created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(json_safe(doc), indent=2) + "\n", encoding="utf-8")
    return p
