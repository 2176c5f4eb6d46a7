"""Which SLO a goodput probe's requests miss, and which engine steps they lived through.

Reads one probe's raw result (``compare_engines.py --goodput-search``: ``raw/ENGINE-goodput-seedS-rateR.json``)
and, optionally, the server's ``TOKENMILL_STEP_TRACE`` file, and prints:

- per-request TTFT and TPOT distributions (p50/p90/p99/max), how many requests miss TTFT only, TPOT only, both;
- TTFT and TPOT against the request's start time (in tenths of the run), to tell a queue that builds (TTFT grows
  with time: offered load above capacity) from stalls (TPOT misses spread over the run);
- with a trace: steps by kind (decode-only, mixed, prefill-only) with their count, mean and p99 duration, prompt
  tokens and decode batch, the share of wall in each, and the decode batch / waiting queue over the run.

Usage::

    .venv/bin/python benchmarks/goodput_diagnose.py RAW.json [--trace TRACE.jsonl] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs`` by nearest rank; NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def dist(xs: list[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean of ``xs``."""
    return {"n": len(xs), "mean": statistics.fmean(xs) if xs else float("nan"), "p50": pct(xs, 50),
            "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs) if xs else float("nan")}


def requests_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """SLO misses and latency distributions of one probe's raw result (seconds in, ms out)."""
    slo = raw.get("slo_ms") or {"ttft": 2000.0, "tpot": 100.0}
    ttft_ms = [t * 1e3 if t is not None else float("inf") for t in raw["ttfts"]]
    tpot_ms = [t * 1e3 for t in raw["tpots"]]
    ok = raw["successes"]
    miss_t = [not o or t > slo["ttft"] for o, t in zip(ok, ttft_ms)]
    miss_p = [not o or (p > slo["tpot"]) for o, p, n in zip(ok, tpot_ms, raw["output_lens"])]
    n = len(ttft_ms)
    both = sum(a and b for a, b in zip(miss_t, miss_p))
    starts = raw["start_times"]
    span = max(starts) if starts else 1.0
    deciles = []
    for d in range(10):
        idx = [i for i, s in enumerate(starts) if d / 10 * span <= s < (d + 1) / 10 * span or (d == 9 and s == span)]
        deciles.append({"requests": len(idx),
                        "mean_ttft_ms": statistics.fmean(ttft_ms[i] for i in idx) if idx else None,
                        "mean_tpot_ms": statistics.fmean(tpot_ms[i] for i in idx) if idx else None,
                        "miss_ttft": sum(miss_t[i] for i in idx), "miss_tpot": sum(miss_p[i] for i in idx)})
    return {"requests": n, "rate": raw.get("request_rate"), "slo_ms": slo,
            "attainment": sum(not a and not b for a, b in zip(miss_t, miss_p)) / max(n, 1),
            "miss_ttft_only": sum(miss_t) - both, "miss_tpot_only": sum(miss_p) - both, "miss_both": both,
            "ttft_ms": dist(ttft_ms), "tpot_ms": dist(tpot_ms),
            "input_len": dist([float(x) for x in raw["input_lens"]]),
            "output_len": dist([float(x) for x in raw["output_lens"]]), "by_start_decile": deciles}


def trace_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps by kind (decode-only / mixed / prefill-only): count, duration, prompt tokens, decode batch."""
    kinds: dict[str, list[dict[str, Any]]] = {"decode": [], "mixed": [], "prefill": []}
    for r in rows:
        if r["decode"] and r["prefill"]:
            kinds["mixed"].append(r)
        elif r["prefill"]:
            kinds["prefill"].append(r)
        elif r["decode"]:
            kinds["decode"].append(r)
    wall = (rows[-1]["sent"] - rows[0]["loop"]) if rows else 0.0
    out: dict[str, Any] = {"steps": len(rows), "wall_s": wall}
    for k, rs in kinds.items():
        dur = [(r["end"] - r["start"]) * 1e3 for r in rs]
        out[k] = {"steps": len(rs), "wall_share": sum(dur) / 1e3 / wall if wall else None,
                  "ms": dist(dur), "prompt_tokens": dist([float(r["prefill"]) for r in rs]),
                  "decode_batch": dist([float(r["decode"]) for r in rs])}
    # mixed steps by prompt tokens: how long a decode waits on a step that carries that much prompt work
    bins = [(1, 128), (128, 512), (512, 1024), (1024, 1536), (1536, 4096)]
    out["mixed_by_prompt_tokens"] = [
        {"tokens": f"{a}-{b - 1}", "steps": len(rs), "ms": dist([(r["end"] - r["start"]) * 1e3 for r in rs]),
         "decode_batch_mean": statistics.fmean(r["decode"] for r in rs) if rs else None}
        for a, b in bins for rs in [[r for r in kinds["mixed"] if a <= r["prefill"] < b]]]
    out["running"] = dist([float(r["running"]) for r in rows])
    out["waiting"] = dist([float(r["waiting"]) for r in rows])
    out["preemptions"] = rows[-1]["preemptions"] - rows[0]["preemptions"] if rows else 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("raw")
    p.add_argument("--trace", default=None, help="TOKENMILL_STEP_TRACE file of the probe's server")
    p.add_argument("--skip-steps", type=int, default=20, help="trace steps to skip at start (warm-up), default 20")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    raw = json.load(open(a.raw))
    doc: dict[str, Any] = {"requests": requests_summary(raw)}
    if a.trace:
        rows = [json.loads(line) for line in open(a.trace) if line.strip()]
        doc["trace"] = trace_summary(rows[a.skip_steps:])
    print(json.dumps(doc, indent=1, default=lambda x: None))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
