"""deploy/: every dashboard query names metrics a live /metrics really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.playbook.dashboard import (ITL_SLO_CHOICES, TTFT_SLO_CHOICES, build_dashboard,
                                          dashboard_metric_names)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tokenmill.json"


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported(text: str) -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """(series names, label names per series, le values per histogram bucket series).

    A family declared with no sample yet (labelled children appear on first use, e.g. spec-decode counters
    before the first draft) counts by its declared type's series names."""
    names, labels, les = set(), {}, {}
    for fam in text_string_to_metric_families(text):
        for suffix in _SUFFIXES.get(fam.type, ()):
            names.add(fam.name + suffix)
            labels.setdefault(fam.name + suffix, {"model_name"})
        for s in fam.samples:
            names.add(s.name)
            labels.setdefault(s.name, set()).update(s.labels)
            if "le" in s.labels:
                les.setdefault(s.name, set()).add(s.labels["le"])
    return names, labels, les


@pytest.fixture(scope="module")
def scraped(live_server):
    live_server.complete("abcdefgh", 4)
    live_server.complete("abcdefgh", 4)  # a prefix-cache query/hit, TTFT, ITL and E2E observations
    return httpx.get(live_server.url + "/metrics", timeout=10).text


def test_committed_dashboard_is_the_generated_one():
    assert json.loads(DASHBOARD.read_text()) == build_dashboard(), \
        "regenerate: python -m tokenmill.playbook.dashboard deploy/grafana/dashboards/tokenmill.json"


def test_every_panel_query_names_exported_metrics(scraped):
    names, labels, les = _exported(scraped)
    dash = json.loads(DASHBOARD.read_text())
    used = dashboard_metric_names(dash)
    assert len(used) >= 12
    missing = sorted(used - names)
    assert not missing, f"dashboard queries metrics /metrics does not export: {missing}"
    # Every label a selector matches on exists on its series; every label grouped by exists in the query.
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"]
            present: set[str] = set()
            for metric, matchers in re.findall(r"(tokenmill:[A-Za-z0-9_:]+)(\{[^}]*\})?", expr):
                refs = set(re.findall(r'(\w+)=~?"', matchers))
                assert refs <= labels[metric], (p["title"], metric, refs - labels[metric])
                present |= labels[metric]
            for group in re.findall(r"by \(([^)]*)\)", expr):
                by = {x.strip() for x in group.split(",") if x.strip()}
                assert by <= present, (p["title"], by - present)
    # The SLO variables only offer bucket boundaries the exporter writes, spelled as it writes them.
    assert set(TTFT_SLO_CHOICES) <= les["tokenmill:time_to_first_token_seconds_bucket"]
    assert set(ITL_SLO_CHOICES) <= les["tokenmill:inter_token_latency_seconds_bucket"]


def test_playbook_panels_present(scraped):
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for word in ("ttft", "itl", "end-to-end", "queue depth", "kv cache", "preemptions", "prefix cache",
                 "slo", "refused"):
        assert word in titles
    names, _, _ = _exported(scraped)
    spec = {n for n in names if "spec_decode" in n}
    used = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    # Spec-decode acceptance is on the dashboard exactly when the exporter has the metrics.
    assert bool(spec) == any("spec_decode" in n for n in used), \
        ("the exporter's spec-decode metrics and the dashboard's spec panel disagree: edit PANELS "
         "in tokenmill/playbook/dashboard.py, then run "
         "python -m tokenmill.playbook.dashboard deploy/grafana/dashboards/tokenmill.json")


def test_provisioning_files_parse_and_point_at_the_dashboard():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert {"prometheus", "grafana"} <= set(compose["services"])
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "tokenmill.yml").read_text())
    mounted = [v for v in compose["services"]["grafana"]["volumes"] if "dashboards" in v and "provisioning" not in v]
    assert mounted and mounted[0].split(":")[1] == prov["providers"][0]["options"]["path"]


def test_every_dashboard_series_has_a_sample_on_a_default_server(scraped):
    """Issue 30: each series a panel queries is *exported* by a default server (a sample, at 0 where the
    feature is off, as Prometheus expects of counters), not merely declared: a panel over a family with
    no sample shows "no data" (the spec-decode panel did, on every server without a draft model)."""
    sampled: dict[str, float] = {}
    for fam in text_string_to_metric_families(scraped):
        for s in fam.samples:
            sampled[s.name] = sampled.get(s.name, 0.0) + s.value
    used = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    missing = sorted(used - set(sampled))
    assert not missing, f"dashboard series without a sample on a default server: {missing}"
    # speculative decoding is off here: its counters exist, at zero
    for name in ("tokenmill:spec_decode_num_accepted_tokens_total", "tokenmill:spec_decode_num_draft_tokens_total"):
        assert name in used and sampled[name] == 0.0
