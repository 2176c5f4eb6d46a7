"""The exporter's declared metric tables (tokenmill/metrics/prometheus.py) build what /metrics exports."""

from __future__ import annotations

from tokenmill.metrics.prometheus import API_METRICS, CACHE_CONFIG_INFO, ENGINE_METRICS, PREFIX, PrometheusStatLogger


def test_every_declared_family_is_exported_once():
    specs = (*ENGINE_METRICS, *API_METRICS, CACHE_CONFIG_INFO)
    assert len({s.key for s in specs}) == len(specs) and len({s.name for s in specs}) == len(specs)
    text = PrometheusStatLogger("m", 4096).render().decode()
    for s in specs:
        assert f"# HELP {PREFIX}{s.name}" in text, s.name
        assert s.doc.split()[0] in text


def test_token_histograms_take_the_context_limit():
    text = PrometheusStatLogger("m", 50).render().decode()
    assert 'tokenmill:request_prompt_tokens_bucket{engine="0",le="50.0",model_name="m"}' in text
    assert 'le="100.0",model_name="m"}' not in text.split("request_prompt_tokens_bucket")[1].split("\n# ")[0]
