"""Both pools with ``--data-parallel-size 2`` behind ``tokenmill router --pd-disaggregation`` (tiny random
Llama, float32, TcpConnector), and the router's release of kept KV when the decode leg fails.

Each engine core of a data-parallel server has its own connector (its own side channel on its own port,
its own engine id), so a request's KV may be produced by either prefill core and pulled by either decode
core: concurrent bursts go to both cores of both servers (the data-parallel balancer counts requests the
cores have not seen yet), and the test checks that all four cores took part. Greedy outputs equal the
colocated engine's; the decode server computes only the last prompt token of each request. When the
decode leg fails (the decode server refuses the request, or is dead), the prefill server frees the kept
blocks at once on the router's ``POST /kv_transfer/release``: its ``abort_timeout_s`` is set far beyond
the test, so blocks freed in time were released, not expired. Every server is killed even on failure.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.distributed.conftest import save_tiny_llama
from tests.kv_transfer.test_pd_router import COMMON, PROMPTS, _invariants, _metric, _model
from tests.router.fake_backend import RouterThread
from tests.server.server_proc import start_server
from tokenmill import envs
from tokenmill import LLM, SamplingParams
from tokenmill.router.app import RouterConfig
from tokenmill.router.backends import BackendSpec

ABORT_TIMEOUT_S = 900     # far beyond the test: a hold that ends in time was released, not expired
RELEASE_WITHIN_S = 20     # generous: this machine's load average reaches 25
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_pd_dp"))


@pytest.fixture(scope="module")
def reference(tiny):
    with LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    return [o.outputs[0].text for o in outs]


def _kv(role: str) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": 0,
                       "kv_connector_extra_config": {"abort_timeout_s": ABORT_TIMEOUT_S, "transfer_timeout_s": 20}})


@pytest.fixture(scope="module")
def dp_pd(tiny):
    envs.set("TOKENMILL_DEBUG_ENDPOINTS", "1")
    servers, errors, router = [], [], None
    try:
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(start_server, "--model", tiny, *COMMON, "--data-parallel-size", "2",
                              "--kv-transfer-config", _kv(role)) for role in ("kv_producer", "kv_consumer")]
            for f in futs:
                try:
                    servers.append(f.result())
                except Exception as e:  # noqa: BLE001 - stop the other one, then fail
                    errors.append(e)
        if errors:
            raise errors[0]
        prefill, decode = servers
        router = RouterThread(RouterConfig(pd_disaggregation=True, prefill=[BackendSpec(prefill.url)],
                                           decode=[BackendSpec(decode.url)],
                                           # one health round at start only: the router must find the dead
                                           # decode server by sending it the request, after the prefill
                                           health_check_interval=3600,
                                           connect_timeout=30.0, health_check_timeout=30.0)).start()
        yield prefill, decode, router
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            kids = s.children()
            s.stop(signal.SIGKILL if s.proc.poll() is not None else signal.SIGINT, timeout=60)
            for k in psutil.wait_procs(kids, timeout=10)[1]:   # no engine core left behind
                k.kill()


def _per_engine(url: str, name: str, **labels) -> dict[str, float]:
    return {e: _metric(url, name, engine=e, **labels) for e in ("0", "1")}


def _wait_all_free(url: str, timeout: float) -> tuple[dict, float]:
    """Poll ``/debug/invariants`` until every block is free; (last report, seconds waited)."""
    t0 = time.monotonic()
    while True:
        inv = _invariants(url)
        if inv["num_free_blocks"] == inv["num_kv_blocks"] or time.monotonic() - t0 > timeout:
            return inv, time.monotonic() - t0
        time.sleep(0.05)


def test_both_pools_data_parallel_equal_colocated_and_transfer_every_prompt(dp_pd, reference):
    prefill, decode, router = dp_pd
    model = _model(decode.url)
    src = "tokenmill:prompt_tokens_by_source_total"
    local0 = _metric(decode.url, src, source="local_compute")

    def one(i: int) -> str:
        r = httpx.post(router.url + "/v1/completions", timeout=120,
                       json={"model": model, "prompt": PROMPTS[i % len(PROMPTS)], **GREEDY})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    n_req = 0
    for _ in range(4):    # concurrent bursts until every core of both servers took part
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(one, range(6)))
        n_req += 6
        assert got == [reference[i % len(PROMPTS)] for i in range(6)]
        sent = _per_engine(prefill.url, "tokenmill:kv_transfer_bytes_total", direction="sent")
        received = _per_engine(decode.url, src, source="external_kv_transfer")
        if min(sent.values()) > 0 and min(received.values()) > 0:
            break
    assert min(sent.values()) > 0, f"a prefill engine core produced no KV: {sent}"
    assert min(received.values()) > 0, f"a decode engine core loaded no KV: {received}"
    # every request's prompt came over a connector: the decode cores computed only each last prompt token
    assert _metric(decode.url, src, source="local_compute") - local0 == n_req
    assert _metric(decode.url, "tokenmill:kv_transfer_recomputed_requests_total") == 0
    assert _metric(decode.url, "tokenmill:kv_transfer_time_seconds_count") == n_req
    # the prefill cores report what they sent and freed once pulled, though they are idle then (/metrics
    # only: /debug/invariants would wake the cores up)
    received = _metric(decode.url, "tokenmill:kv_transfer_bytes_total", direction="received")
    deadline = time.monotonic() + RELEASE_WITHIN_S
    while time.monotonic() < deadline:
        sent = _metric(prefill.url, "tokenmill:kv_transfer_bytes_total", direction="sent")
        usage = _metric(prefill.url, "tokenmill:kv_cache_usage_perc")
        if sent == received and usage == 0:
            break
        time.sleep(0.1)
    assert (sent, usage) == (received, 0)
    for url in (prefill.url, decode.url):     # pulled KV is freed on every core, nothing leaks
        inv, _ = _wait_all_free(url, RELEASE_WITHIN_S)
        assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv


def test_a_refused_or_dead_decode_releases_the_prefill_kv_at_once(dp_pd, reference):
    """Runs last: it kills the decode server."""
    prefill, decode, router = dp_pd
    model = _model(decode.url)
    released = "tokenmill:kv_transfer_released_total"
    # the prefill server accepts this one (it asks 1 token) and keeps its KV; the decode server refuses it
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPTS[0],
                                                                     "max_tokens": 1000})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    inv, took = _wait_all_free(prefill.url, RELEASE_WITHIN_S)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    assert _metric(prefill.url, released) == 1 and _metric(prefill.url, "tokenmill:kv_transfer_expired_total") == 0
    # the decode server dies: the router answers 503 and the prefill server frees the KV it kept
    kids = decode.children()
    for proc in kids:
        proc.kill()
    decode.proc.send_signal(signal.SIGKILL)
    decode.proc.wait(30)
    psutil.wait_procs(kids, timeout=30)
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPTS[1],
                                                                     **GREEDY})
    assert r.status_code in (502, 503), r.text      # unreachable (or the kept-alive connection broke)
    inv, took = _wait_all_free(prefill.url, RELEASE_WITHIN_S)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    assert _metric(prefill.url, released) == 2 and _metric(prefill.url, "tokenmill:kv_transfer_expired_total") == 0
    # a release for KV nobody keeps is accepted and frees nothing; a malformed one is a 400
    r = httpx.post(prefill.url + "/kv_transfer/release", timeout=10,
                   json={"kv_transfer_params": {"remote_request_id": "nope"}})
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    r = httpx.post(prefill.url + "/kv_transfer/release", timeout=10, json={"kv_transfer_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_request_id", r.text
    assert _metric(prefill.url, released) == 2
