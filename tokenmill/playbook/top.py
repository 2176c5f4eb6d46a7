"""``tokenmill top``: a live terminal view of a running server's ``/metrics``.

For people who will not start Grafana: every ``--interval`` seconds it scrapes
``/metrics`` and prints requests running / waiting, KV cache usage, request
and token rates, preemptions, prefix-cache hit rate, refusals and p50/p99 of
TTFT, ITL and end-to-end latency. Rates and percentiles cover the last
interval (counter and histogram-bucket deltas between two scrapes); the first
screen shows totals since the server started. Percentiles are interpolated
linearly inside the histogram bucket, as Prometheus' ``histogram_quantile``
does, so they are as coarse as the exporter's (vLLM's) buckets.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

P = "tokenmill:"
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "itl": "inter_token_latency_seconds",
              "e2e": "e2e_request_latency_seconds", "queue": "request_queue_time_seconds"}
COUNTERS = {"prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total",
            "preemptions": "num_preemptions_total", "prefix_queries": "prefix_cache_queries_total",
            "prefix_hits": "prefix_cache_hits_total", "finished": "request_success_total",
            "refused": "request_refused_total", "spec_draft_tokens": "spec_decode_num_draft_tokens_total",
            "spec_accepted": "spec_decode_num_accepted_tokens_total"}


@dataclass
class Snapshot:
    """One scrape, summed over ``model_name`` (and other) labels.

    Attributes:
        time: ``time.monotonic()`` of the scrape, s.
        gauges: running, waiting, kv_usage (fraction 0–1).
        counters: cumulative counts keyed as in :data:`COUNTERS`.
        buckets: histogram key → sorted ``[(upper bound s, cumulative count)]``.
        models: ``model_name`` label values seen.
    """

    time: float
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    models: set[str] = field(default_factory=set)


def parse_metrics(text: str, now: float | None = None) -> Snapshot:
    """Parse Prometheus exposition text into a :class:`Snapshot`.

    Raises:
        ValueError: the text is not Prometheus exposition format, or has no ``tokenmill:`` metric.
    """
    snap = Snapshot(time=time.monotonic() if now is None else now)
    by_sample: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {k: {} for k in HISTOGRAMS}
    hist_names = {P + v + "_bucket": k for k, v in HISTOGRAMS.items()}
    seen = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(P):
                continue
            seen = True
            if "model_name" in s.labels:
                snap.models.add(s.labels["model_name"])
            if s.name in hist_names:
                le = float(s.labels["le"])
                b = buckets[hist_names[s.name]]
                b[le] = b.get(le, 0.0) + s.value
            else:
                by_sample[s.name] = by_sample.get(s.name, 0.0) + s.value
    if not seen:
        raise ValueError("no tokenmill: metrics in the response (is this a tokenmill server?)")
    snap.gauges = {"running": by_sample.get(P + "num_requests_running", 0.0),
                   "waiting": by_sample.get(P + "num_requests_waiting", 0.0),
                   "kv_usage": by_sample.get(P + "kv_cache_usage_perc", 0.0)}
    if snap.models:  # kv usage is per server: report the mean, not the sum, when several models are scraped
        snap.gauges["kv_usage"] /= len(snap.models)
    snap.counters = {k: by_sample.get(P + v, 0.0) for k, v in COUNTERS.items()}
    snap.buckets = {k: sorted(v.items()) for k, v in buckets.items()}
    return snap


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Quantile ``q`` (0–1) of a cumulative histogram ``[(upper bound, count)]``, as PromQL's.

    Linear interpolation inside the bucket holding the rank; the lowest bucket starts at 0; a rank in the
    ``+Inf`` bucket returns the highest finite bound. NaN when the histogram is empty.
    """
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _delta_buckets(cur: list[tuple[float, float]], prev: list[tuple[float, float]] | None):
    if not prev:
        return cur
    p = dict(prev)
    return [(b, max(0.0, c - p.get(b, 0.0))) for b, c in cur]


def compute_view(cur: Snapshot, prev: Snapshot | None) -> dict[str, Any]:
    """The figures one screen shows: gauges, per-second rates over the interval, p50/p99 in ms.

    Without ``prev`` the rates are NaN and the percentiles cover everything since start-up.
    """
    dt = (cur.time - prev.time) if prev is not None else 0.0
    view: dict[str, Any] = dict(cur.gauges)
    view["interval_s"] = dt
    d = {k: cur.counters[k] - (prev.counters.get(k, 0.0) if prev else 0.0) for k in cur.counters}
    rate = (lambda k: d[k] / dt) if dt > 0 else (lambda k: math.nan)
    view.update({"requests_per_s": rate("finished"), "prompt_tok_per_s": rate("prompt_tokens"),
                 "generation_tok_per_s": rate("generation_tokens"), "preemptions_per_s": rate("preemptions"),
                 "refused_per_s": rate("refused"), "finished_total": cur.counters["finished"],
                 "preemptions_total": cur.counters["preemptions"], "refused_total": cur.counters["refused"]})
    view["prefix_hit_rate"] = d["prefix_hits"] / d["prefix_queries"] if d["prefix_queries"] > 0 else math.nan
    view["spec_acceptance"] = (d["spec_accepted"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] > 0
                               else math.nan)  # speculative decoding: accepted / proposed draft tokens
    for key in HISTOGRAMS:
        b = _delta_buckets(cur.buckets.get(key, []), prev.buckets.get(key) if prev else None)
        view[f"{key}_count"] = b[-1][1] if b else 0.0
        view[f"p50_{key}_ms"] = 1000 * histogram_quantile(0.5, b)
        view[f"p99_{key}_ms"] = 1000 * histogram_quantile(0.99, b)
    return view


def _f(v: float, fmt: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def render(view: dict[str, Any], url: str, models: set[str] | None = None) -> str:
    """The screen for one view (plain text, 80 columns)."""
    window = f"last {view['interval_s']:.1f} s" if view["interval_s"] > 0 else "since start-up"
    kv = view["kv_usage"]
    bar = "#" * int(round(20 * min(1.0, max(0.0, kv)))) + "." * (20 - int(round(20 * min(1.0, max(0.0, kv)))))
    lines = [
        f"tokenmill top — {url}" + (f" — {', '.join(sorted(models))}" if models else "")
        + f" — {time.strftime('%H:%M:%S')}",
        "",
        f"requests  running {view['running']:>5.0f}   waiting {view['waiting']:>5.0f}   "
        f"finished {_f(view['requests_per_s'], '.2f')}/s ({view['finished_total']:.0f} total)",
        f"KV cache  [{bar}] {100 * kv:5.1f}%   preemptions {_f(view['preemptions_per_s'], '.2f')}/s "
        f"({view['preemptions_total']:.0f} total)",
        f"tokens    prompt {_f(view['prompt_tok_per_s'])} tok/s   generated {_f(view['generation_tok_per_s'])} tok/s",
        f"prefix    hit rate {_f(100 * view['prefix_hit_rate'])}%"
        f"   refused (429) {_f(view['refused_per_s'], '.2f')}/s ({view['refused_total']:.0f} total)",
    ]
    if not math.isnan(view["spec_acceptance"]):
        lines.append(f"spec      draft acceptance {100 * view['spec_acceptance']:.1f}%")
    lines += [
        "",
        f"latency ({window})        p50 ms      p99 ms   samples",
    ]
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"), ("queue", "queue")):
        lines.append(f"  {name:<22} {_f(view[f'p50_{key}_ms']):>10} {_f(view[f'p99_{key}_ms']):>11} "
                     f"{view[f'{key}_count']:>9.0f}")
    return "\n".join(lines)


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    """GET ``{url}/metrics`` and parse it.

    Raises:
        httpx.HTTPError: the server is unreachable or answered an error status.
        ValueError: the answer has no ``tokenmill:`` metrics.
    """
    import httpx

    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def add_top_args(p) -> None:
    """Flags of ``tokenmill top``."""
    p.add_argument("--url", default=None, help="Server root URL (default http://HOST:PORT).")
    p.add_argument("--host", default="127.0.0.1", help="Server host [default: 127.0.0.1].")
    p.add_argument("--port", type=int, default=8000, help="Server port [default: 8000].")
    p.add_argument("--interval", type=float, default=2.0, help="Seconds between scrapes [default: 2].")
    p.add_argument("--iterations", "-n", type=int, default=0,
                   help="Stop after this many screens (0: until Ctrl-C) [default: 0].")
    p.add_argument("--no-clear", action="store_true", help="Append screens instead of redrawing (logs, pipes).")


def run_top(args) -> int:
    """``tokenmill top``: redraw the view until Ctrl-C or ``--iterations``; 1 if the server never answered."""
    import httpx

    url = args.url or f"http://{args.host}:{args.port}"
    if args.interval <= 0:
        print("tokenmill top: error: --interval must be > 0", file=sys.stderr)
        return 2
    clear = not args.no_clear and sys.stdout.isatty()
    prev: Snapshot | None = None
    shown = answered = 0
    try:
        while args.iterations <= 0 or shown < args.iterations:
            try:
                cur = scrape(url)
                answered += 1
                text = render(compute_view(cur, prev), url, cur.models)
                prev = cur
            except (httpx.HTTPError, ValueError) as e:
                text = f"tokenmill top — {url}: no metrics ({type(e).__name__}: {e}); retrying"
            sys.stdout.write(("\x1b[H\x1b[2J" if clear else "") + text + "\n" + ("" if clear else "\n"))
            sys.stdout.flush()
            shown += 1
            if args.iterations <= 0 or shown < args.iterations:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0 if answered else 1
