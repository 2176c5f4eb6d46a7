"""The Grafana dashboard shipped in ``deploy/grafana/dashboards/tokenmill.json``, built from one table.

Each panel of the playbook (latency percentiles, queue depth, KV usage,
preemptions, prefix-cache hit rate, SLO attainment, refused requests, ...)
is a list of PromQL queries over the ``tokenmill:`` metrics that
:class:`tokenmill.metrics.prometheus.PrometheusStatLogger` exports (a test
checks every name against a live ``/metrics``). Regenerate the file after
editing :data:`PANELS`::

    python -m tokenmill.playbook.dashboard deploy/grafana/dashboards/tokenmill.json

SLO attainment from histograms: the share of requests whose TTFT is within
the SLO is ``rate(ttft_bucket{le=SLO}) / rate(ttft_count)``, so the SLO
variables offer only the exporter's bucket boundaries (vLLM's). Per-request
TPOT is not a histogram in the exporter; the ITL panel gives the share of
*tokens* within the ITL limit instead (a lower bound on smoothness, not the
DistServe per-request figure that ``tokenmill bench goodput`` measures).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

SEL = '{model_name=~"$model_name"}'
RI = "[$__rate_interval]"


def _q(metric: str, extra: str = "") -> str:
    inner = 'model_name=~"$model_name"' + (", " + extra if extra else "")
    return f"{metric}{{{inner}}}"


def _quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({_q(hist + '_bucket')}{RI})))"


def _pcts(hist: str, what: str) -> list[tuple[str, str]]:
    return [(_quantile(0.5, hist), f"p50 {what}"), (_quantile(0.99, hist), f"p99 {what}")]


_LE_TTFT = 'le="$ttft_slo"'
_LE_ITL = 'le="$itl_slo"'

# (title, unit, [(PromQL, legend)], grid position (w, h), description)
PANELS: list[tuple[str, str, list[tuple[str, str]], tuple[int, int], str]] = [
    ("Time to first token (TTFT)", "s", _pcts("tokenmill:time_to_first_token_seconds", "TTFT"), (8, 8),
     "Arrival to first token, per request (p50, p99 over the rate window)."),
    ("Inter-token latency (ITL)", "s", _pcts("tokenmill:inter_token_latency_seconds", "ITL"), (8, 8),
     "Gap between consecutive token batches of a request."),
    ("End-to-end latency", "s", _pcts("tokenmill:e2e_request_latency_seconds", "E2E"), (8, 8),
     "Arrival to last token, per finished request."),
    ("Queue depth", "short",
     [(f"sum(tokenmill:num_requests_waiting{SEL})", "waiting"),
      (f"sum(tokenmill:num_requests_running{SEL})", "running")], (8, 8),
     "Requests waiting to be scheduled and requests in the running batch."),
    ("KV cache usage", "percentunit",
     [(f"max(tokenmill:kv_cache_usage_perc{SEL})", "KV blocks in use")], (8, 8),
     "Share of KV cache blocks held by requests. Near 100% with preemptions: give the pool more memory "
     "or lower --max-num-seqs (tokenmill plan)."),
    ("Preemptions", "ops",
     [(f"sum(rate(tokenmill:num_preemptions_total{SEL}{RI}))", "preemptions/s")], (8, 8),
     "Requests evicted (recomputed later) because KV blocks ran out. The playbook sizes memory and batch "
     "until this is zero."),
    ("Prefix cache hit rate", "percentunit",
     [(f"sum(rate(tokenmill:prefix_cache_hits_total{SEL}{RI})) / "
       f"sum(rate(tokenmill:prefix_cache_queries_total{SEL}{RI}))", "hit rate (tokens)")], (8, 8),
     "Prompt tokens found cached / prompt tokens looked up."),
    ("SLO attainment (goodput against the SLO)", "percentunit",
     [(f'sum(rate({_q("tokenmill:time_to_first_token_seconds_bucket", _LE_TTFT)}{RI})) / '
       f"sum(rate(tokenmill:time_to_first_token_seconds_count{SEL}{RI}))", "requests with TTFT ≤ $ttft_slo s"),
      (f'sum(rate({_q("tokenmill:inter_token_latency_seconds_bucket", _LE_ITL)}{RI})) / '
       f"sum(rate(tokenmill:inter_token_latency_seconds_count{SEL}{RI}))", "tokens with ITL ≤ $itl_slo s"),
      ("vector($attainment)", "target attainment")], (8, 8),
     "Share of requests meeting the TTFT SLO and of tokens meeting the ITL limit, against the attainment "
     "target (DistServe goodput: the highest rate at which the target share meets the SLO; measure it "
     "with tokenmill bench goodput)."),
    ("Refused requests (429)", "reqps",
     [(f"sum by (reason) (rate(tokenmill:request_refused_total{SEL}{RI}))", "{{reason}}")], (8, 8),
     "Requests refused by admission control, by the limit that refused them."),
    ("Token throughput", "short",
     [(f"sum(rate(tokenmill:prompt_tokens_total{SEL}{RI}))", "prompt tok/s"),
      (f"sum(rate(tokenmill:generation_tokens_total{SEL}{RI}))", "generated tok/s")], (8, 8),
     "Prefill and generated tokens per second."),
    ("Finished requests", "reqps",
     [(f"sum by (finished_reason) (rate(tokenmill:request_success_total{SEL}{RI}))", "{{finished_reason}}")],
     (8, 8), "Finished requests per second by finish reason (stop, length, abort, error)."),
    ("Queue time", "s", _pcts("tokenmill:request_queue_time_seconds", "queue"), (8, 8),
     "Arrival to first scheduled: where TTFT goes under overload."),
    ("Speculative decoding acceptance", "percentunit",
     [(f"sum(rate(tokenmill:spec_decode_num_accepted_tokens_total{SEL}{RI})) / "
       f"sum(rate(tokenmill:spec_decode_num_draft_tokens_total{SEL}{RI}))", "acceptance rate")], (8, 8),
     "Accepted draft tokens / proposed draft tokens (empty unless the server runs --speculative-config)."),
]

# SLO variables: bucket boundaries of the exporter's histograms (prometheus_client writes them as floats).
TTFT_SLO_CHOICES = ["0.1", "0.25", "0.5", "1.0", "2.5", "5.0"]
ITL_SLO_CHOICES = ["0.025", "0.05", "0.1", "0.2", "0.5"]


def _custom_var(name: str, label: str, choices: list[str], current: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "custom", "query": ",".join(choices),
            "current": {"text": current, "value": current},
            "options": [{"text": c, "value": c, "selected": c == current} for c in choices]}


def build_dashboard(panels: list | None = None) -> dict[str, Any]:
    """The dashboard as a Grafana JSON model (schema 39, a ``${DS_PROMETHEUS}`` data source variable)."""
    panels = PANELS if panels is None else panels
    ds = {"type": "prometheus", "uid": "${datasource}"}
    out = []
    x = y = 0
    for i, (title, unit, queries, (w, h), desc) in enumerate(panels):
        if x + w > 24:
            x, y = 0, y + h
        out.append({
            "id": i + 1, "type": "timeseries", "title": title, "description": desc, "datasource": ds,
            "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend, "datasource": ds}
                        for j, (expr, legend) in enumerate(queries)],
        })
        x += w
    return {
        "title": "tokenmill", "uid": "tokenmill-serving", "schemaVersion": 39, "version": 1,
        "tags": ["tokenmill", "llm", "serving"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "description": "The serving playbook's panels over tokenmill's /metrics (prefix tokenmill:).",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": ds,
             "query": "label_values(tokenmill:num_requests_running, model_name)", "includeAll": True,
             "multi": True, "current": {"text": "All", "value": "$__all"}, "refresh": 2},
            _custom_var("ttft_slo", "TTFT SLO (s)", TTFT_SLO_CHOICES, "2.5"),
            _custom_var("itl_slo", "ITL limit (s)", ITL_SLO_CHOICES, "0.1"),
            _custom_var("attainment", "Target attainment", ["0.9", "0.95", "0.99"], "0.9"),
        ]},
        "panels": out,
    }


METRIC_RE = re.compile(r"tokenmill:[A-Za-z0-9_:]+")


def dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Every ``tokenmill:`` series name used by a panel or variable query of ``dashboard``."""
    names: set[str] = set()
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            names.update(METRIC_RE.findall(t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        names.update(METRIC_RE.findall(str(v.get("query", ""))))
    return names


def main(argv: list[str] | None = None) -> int:
    """Write the dashboard JSON to the path given (default: stdout)."""
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(build_dashboard(), indent=2, ensure_ascii=False) + "\n"
    if argv:
        with open(argv[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
