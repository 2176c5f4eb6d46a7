"""Prefill server + decode server, both serving a LoRA adapter, behind ``tokenmill router --pd-disaggregation``
(tiny random Llama, float32, TCP connector), over HTTP: a request for the adapter goes through both legs under its
name, the decode server takes the prompt's KV from the prefill server, and the greedy tokens equal peft's for that
adapter in one process (the adapter travels with the request); a base request on the same pair gives the base's
tokens; an adapter no server lists is a 404 from the router. Every server is stopped even on failure."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.kv_transfer.test_pd_router import _metric
from tests.lora.conftest import peft_model, reference_greedy
from tests.lora.test_server_lora import tokens_of
from tests.router.fake_backend import RouterThread
from tests.server.server_proc import start_server
from tokenmill.router.app import RouterConfig
from tokenmill.router.backends import BackendSpec

PROMPT = [3 + (7 * i) % 60 for i in range(21)]    # 5 full blocks of 4 and one partial


def _kv(role: str) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": 0,
                       "kv_connector_extra_config": {"abort_timeout_s": 15, "transfer_timeout_s": 10}})


@pytest.fixture(scope="module")
def pd(lora_root):
    base, ads = lora_root
    servers, router = [], None
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append(start_server(base, "--dtype", "float32", "--served-model-name", "base", "--enable-lora",
                                        "--lora-modules", f"r4={ads['r4']}", "--max-loras", "2",
                                        "--max-lora-rank", "16", "--block-size", "4", "--num-kv-blocks", "96",
                                        "--max-model-len", "256", "--kv-transfer-config", _kv(role)))
        router = RouterThread(RouterConfig(pd_disaggregation=True, prefill=[BackendSpec(servers[0].url)],
                                           decode=[BackendSpec(servers[1].url)], health_check_interval=0.5,
                                           connect_timeout=30.0, health_check_timeout=30.0)).start()
        yield servers[0], servers[1], router
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


def test_adapter_request_through_the_pd_router_equals_peft(pd, lora_root):
    base, ads = lora_root
    _, decode, router = pd
    src = "tokenmill:prompt_tokens_by_source_total"
    assert reference_greedy(peft_model(base, ads["r4"]), PROMPT, 8) != reference_greedy(peft_model(base, None),
                                                                                         PROMPT, 8)
    for model, adapter in (("r4", ads["r4"]), ("base", None)):
        before = _metric(decode.url, src, source="external_kv_transfer")
        r = httpx.post(router.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert tokens_of(r.json()) == reference_greedy(peft_model(base, adapter), PROMPT, 8), model
        # the decode server computed only the last prompt token: the rest came from the prefill server
        assert _metric(decode.url, src, source="external_kv_transfer") - before == len(PROMPT) - 1, model
    assert 'lora_name="r4"' in httpx.get(decode.url + "/metrics", timeout=10).text
    r = httpx.post(router.url + "/v1/completions", timeout=30, json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
