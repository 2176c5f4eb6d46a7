"""Prefill server + decode server + ``tokenmill router --pd-disaggregation`` (tiny random Llama, float32).

Greedy outputs equal the colocated engine's for both connectors; the decode server computes only the
last prompt token of a transferred request (``prompt_tokens_by_source{source="local_compute"}`` grows
by 1 per request, ``external_kv_transfer`` by the rest); the prefill server frees its blocks once the
KV was pulled, and at once when the decode server refused the request (the router's release); errors
pass through; a client that disconnects aborts upstream; a prefill server
killed before the pull makes the decode server recompute. Every server is killed even on failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.distributed.conftest import save_tiny_llama
from tests.router.fake_backend import RouterThread
from tests.server.server_proc import start_server
from tokenmill import envs
from tokenmill import LLM, SamplingParams
from tokenmill.router.app import RouterConfig
from tokenmill.router.backends import BackendSpec
from tokenmill.sampling_params import StructuredOutputsParams

COMMON = ("--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "96", "--max-model-len", "256",
          "--max-num-seqs", "8")
# zero-padded words (w003): no word is a prefix of another, so grammars over them never dead-end (conftest)
PROMPTS = [" ".join(f"w{3 + (i * 7 + j) % 90:03d}" for j in range(n)) for i, n in enumerate((21, 34, 9))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_pd_router"), word_width=3)


@pytest.fixture(scope="module")
def reference(tiny):
    with LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


# constraints the decode server must enforce: free choices between forced runs, a regex, a choice
CONSTRAINTS = [{"grammar": 'root ::= ("w021" | "w022") "w040w041w042" ("w028" | "w029")+ "w050w051"'},
               {"regex": r"(w01[1-9]|w03[0-5]){2,5}w099"}, {"choice": ["w070w071w072", "w080w081"]}]


@pytest.fixture(scope="module")
def constrained_reference(tiny):
    with LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0,
                                                     structured_outputs=StructuredOutputsParams(**c))
                                      for c in CONSTRAINTS])
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


ABORT_TIMEOUT_S = 15     # how long the prefill server keeps KV no decode server pulls


def _kv(connector: str, role: str, shm_dir: str) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_port": 0,
                       "kv_connector_extra_config": {"shm_dir": shm_dir, "abort_timeout_s": ABORT_TIMEOUT_S,
                                                     "transfer_timeout_s": 10}})


def _start_pair(tiny: str, connector: str, shm_dir: str):
    envs.set("TOKENMILL_DEBUG_ENDPOINTS", "1")
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(start_server, "--model", tiny, *COMMON, "--kv-transfer-config", _kv(connector, role, shm_dir))
                for role in ("kv_producer", "kv_consumer")]
        servers, errors = [], []
        for f in futs:
            try:
                servers.append(f.result())
            except Exception as e:  # noqa: BLE001 - stop the other one, then fail
                errors.append(e)
    if errors:
        for s in servers:
            s.stop(signal.SIGKILL)
        raise errors[0]
    return servers


# the shared-memory connector's servers are the slow suite's (it is covered in-process by test_engine_kv.py)
@pytest.fixture(scope="module", params=["TcpConnector", pytest.param("SharedMemoryConnector", marks=pytest.mark.slow)])
def pd(request, tiny, tmp_path_factory):
    shm = str(tmp_path_factory.mktemp("shm"))
    prefill, decode = _start_pair(tiny, request.param, shm)
    router = None
    try:
        router = RouterThread(RouterConfig(pd_disaggregation=True, prefill=[BackendSpec(prefill.url)],
                                           decode=[BackendSpec(decode.url)], health_check_interval=0.5,
                                           # generous: this machine's load average reaches 25
                                           connect_timeout=30.0, health_check_timeout=30.0)).start()
        router.connector = request.param
        router.shm_dir = shm
        yield prefill, decode, router
    finally:
        if router is not None:
            router.stop()
        for s in (prefill, decode):
            s.stop()


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"([^{ ]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _invariants(url: str) -> dict:
    return httpx.get(url + "/debug/invariants", timeout=10).json()


def _wait_free(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        inv = _invariants(url)
        if inv["num_free_blocks"] == inv["num_kv_blocks"] or time.monotonic() > deadline:
            return inv
        time.sleep(0.1)


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_greedy_outputs_equal_colocated_and_decode_computes_one_prompt_token(pd, reference):
    prefill, decode, router = pd
    model = _model(decode.url)
    src = "tokenmill:prompt_tokens_by_source_total"
    before = _metric(decode.url, src, source="local_compute")
    got = []
    for p in PROMPTS:
        r = httpx.post(router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == reference
    # streamed, through the chat endpoint too (its own prompt: the chat template)
    text = ""
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == reference[1]
    r = httpx.post(router.url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    n_req = len(PROMPTS) + 2
    # the decode server computed only the last prompt token of each request; the rest came over the connector
    assert _metric(decode.url, src, source="local_compute") - before == n_req
    assert _metric(decode.url, src, source="external_kv_transfer") >= sum(len(p.split()) for p in PROMPTS) - 3
    assert _metric(decode.url, "tokenmill:kv_transfer_recomputed_requests_total") == 0
    assert _metric(decode.url, "tokenmill:kv_transfer_bytes_total", direction="received") > 0
    assert _metric(decode.url, "tokenmill:kv_transfer_time_seconds_count") == n_req
    # the prefill server freed every block once the decode server had pulled them; no leak on either side
    inv = _wait_free(prefill.url)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    inv = _wait_free(decode.url)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv


def test_constrained_outputs_equal_colocated_the_decode_side_owns_the_matcher(pd, constrained_reference):
    """Structured outputs across disaggregation: the prefill server computes the prompt (its one token, also
    constrained, is dropped); the decode server builds the matcher from no output and samples every token
    under its mask, so the outputs are the colocated engine's, streamed or not."""
    prefill, decode, router = pd
    model = _model(decode.url)
    kinds = "tokenmill:structured_output_requests_total"
    before = {k: _metric(decode.url, kinds, kind=k) for k in ("grammar", "regex", "choice")}
    local0 = _metric(decode.url, "tokenmill:prompt_tokens_by_source_total", source="local_compute")
    got = []
    for p, c in zip(PROMPTS, CONSTRAINTS):
        r = httpx.post(router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": p, "max_tokens": 12, "temperature": 0, "structured_outputs": c})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        got.append((ch["text"], ch["finish_reason"]))
    assert got == constrained_reference
    assert any(fr == "stop" for _, fr in got)
    text = ""
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True,
            "structured_outputs": CONSTRAINTS[0]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == constrained_reference[0][0]
    # counted where they were decoded; each decode computed one prompt token, the rest came over the connector
    assert {k: _metric(decode.url, kinds, kind=k) - v for k, v in before.items()} == \
           {"grammar": 2, "regex": 1, "choice": 1}
    assert _metric(decode.url, "tokenmill:prompt_tokens_by_source_total", source="local_compute") - local0 == 4
    # a bad constraint is the prefill server's 400, before any KV is kept
    r = httpx.post(router.url + "/v1/completions", timeout=30, json={
        "model": model, "prompt": PROMPTS[2], "max_tokens": 4, "structured_outputs": {"regex": "(w01"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    for url in (prefill.url, decode.url):
        inv = _wait_free(url)
        assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv


def test_errors_pass_through(pd):
    prefill, decode, router = pd
    model = _model(decode.url)
    r = httpx.post(router.url + "/v1/completions", timeout=30, json={"model": model, "prompt": "w005 w006",
                                                                     "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    # the prefill server accepts this one (it asks 1 token) and keeps its KV; the decode server refuses it
    r = httpx.post(router.url + "/v1/completions", timeout=30, json={"model": model, "prompt": "w005",
                                                                     "max_tokens": 1000})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    r = httpx.post(router.url + "/v1/completions", timeout=30, json={"model": "nope", "prompt": "w5"})
    assert r.status_code == 404, r.text
    r = httpx.post(decode.url + "/v1/completions", timeout=30, json={
        "model": model, "prompt": "w005", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    # nobody will pull the refused request's KV: the router tells the prefill server, which frees it at
    # once (blocks, or the shared-memory file), not after abort_timeout_s
    t0 = time.monotonic()
    inv = _wait_free(prefill.url, timeout=ABORT_TIMEOUT_S + 30)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    assert _metric(prefill.url, "tokenmill:kv_transfer_released_total") == 1
    assert _metric(prefill.url, "tokenmill:kv_transfer_expired_total") == 0
    assert time.monotonic() - t0 < ABORT_TIMEOUT_S
    if router.connector == "SharedMemoryConnector":
        shm = router.shm_dir
        deadline = time.monotonic() + 10
        while any(f.endswith(".kv") for _, _, fs in os.walk(shm) for f in fs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [f for _, _, fs in os.walk(shm) for f in fs if f.endswith(".kv")]


def test_client_disconnect_aborts_upstream(pd):
    prefill, decode, router = pd
    model = _model(decode.url)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: {")
            if n >= 3:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        inv = _invariants(decode.url)
        if inv["num_requests"] == 0 and inv["num_free_blocks"] == inv["num_kv_blocks"]:
            break
        time.sleep(0.1)
    assert inv["num_requests"] == 0 and inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    inv = _wait_free(prefill.url)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv


def test_a_decode_side_refusal_frees_the_prefill_pool_at_once(pd):
    """Issue 30: a client managing kv_transfer_params itself (prefill server first, then the decode
    server, directly or through the router) whose decode request is refused before admission (an
    unknown model) left the prefill server's KV held (usage 0.235 after four) until abort_timeout_s.
    The decode server, and the router when it refuses, now tell the producer at once: the pool is back
    at its baseline, nothing expired, and a later prefill is served."""
    prefill, decode, router = pd
    model = _model(decode.url)
    base = _wait_free(prefill.url)
    assert base["num_free_blocks"] == base["num_kv_blocks"]
    released0 = _metric(prefill.url, "tokenmill:kv_transfer_released_total")
    t0 = time.monotonic()
    for i in range(4):
        r = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": PROMPTS[i % 3] + f" w{i:03d}", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        target = decode.url if i < 3 else router.url      # the last one through the router (it 404s itself)
        r = httpx.post(target + "/v1/completions", timeout=60, json={
            "model": "nope", "prompt": PROMPTS[i % 3] + f" w{i:03d}", "max_tokens": 4, "kv_transfer_params": params})
        assert r.status_code == 404, r.text
    inv = _wait_free(prefill.url, timeout=ABORT_TIMEOUT_S + 30)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    assert time.monotonic() - t0 < ABORT_TIMEOUT_S
    assert _metric(prefill.url, "tokenmill:kv_transfer_expired_total") == 0
    if router.connector == "TcpConnector":
        assert _metric(prefill.url, "tokenmill:kv_transfer_released_total") == released0 + 4
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPTS[0],
                                                                     "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_killed_prefill_server_before_the_pull_recomputes(pd, reference):
    """Runs last for its pair: it kills the prefill server."""
    prefill, decode, router = pd
    if router.connector != "TcpConnector":
        pytest.skip("shared-memory KV outlives its producer (it is a file), so killing the producer fails no load")
    model = _model(decode.url)
    r = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[2], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] > 0
    kids = prefill.children()
    for proc in kids:                     # the engine core (it owns the side channel), then the API process
        proc.kill()
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait(30)
    psutil.wait_procs(kids, timeout=30)   # reparented and reaped once the API process is gone
    recomputed = _metric(decode.url, "tokenmill:kv_transfer_recomputed_requests_total")
    t0 = time.monotonic()
    r = httpx.post(decode.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference[2]
    assert time.monotonic() - t0 < 30
    assert _metric(decode.url, "tokenmill:kv_transfer_recomputed_requests_total") == recomputed + 1
    assert _metric(decode.url, "tokenmill:kv_transfer_failed_total") >= 1
    inv = _wait_free(decode.url)
    assert inv["problems"] == [] and inv["num_free_blocks"] == inv["num_kv_blocks"], inv
    # through the router, with the prefill pool gone: a clear 503, no hang
    r = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPTS[0],
                                                                     "max_tokens": 4})
    assert r.status_code == 503, r.text
