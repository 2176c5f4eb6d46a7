"""The router process's HTTP behaviour over fake backends (no model)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.router.fake_backend import FakeBackend, RouterThread
from tokenmill.router.app import RouterConfig
from tokenmill.router.backends import BackendSpec, load_backend_file


@pytest.fixture
def cluster():
    """Factory: ``cluster([FakeBackend, ...], policy=...)`` -> (router, backends); all stopped afterwards."""
    started: list = []

    def make(fakes: list[FakeBackend], **kw):
        for f in fakes:
            started.append(f.start())
        kw.setdefault("health_check_interval", 0.2)
        kw.setdefault("health_check_timeout", 0.5)
        r = RouterThread(RouterConfig(backends=[BackendSpec(f.url) for f in fakes], **kw)).start()
        started.append(r)
        return r, fakes

    yield make
    for s in reversed(started):
        s.stop()


def post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=10, **kw)


def test_round_robin_models_union_and_unknown_model_404(cluster):
    r, (a, b, c) = cluster([FakeBackend("a", ["big"]), FakeBackend("b", ["small"]), FakeBackend("c", ["small"])])
    models = httpx.get(r.url + "/v1/models").json()
    assert sorted(m["id"] for m in models["data"]) == ["big", "small"]
    got = [post(r.url, {"model": "small", "prompt": "hi"}).json()["backend"] for _ in range(4)]
    assert sorted(got) == ["b", "b", "c", "c"]
    assert post(r.url, {"model": "big", "prompt": "hi"}).json()["backend"] == "a"
    resp = post(r.url, {"model": "nope", "prompt": "hi"})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and err["code"] == 404
    assert "big" in err["message"] and "small" in err["message"]
    assert httpx.post(r.url + "/v1/completions", content=b"{not json").status_code == 400
    # /tokenize goes to the model's pool too
    assert httpx.post(r.url + "/tokenize", json={"model": "big", "prompt": "a b"}).json()["backend"] == "a"


def test_streaming_is_relayed_unbuffered(cluster):
    r, (a,) = cluster([FakeBackend("a", chunks=4, itl_s=0.4)])
    arrivals = []
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.time())
    assert len(arrivals) == 4
    # chunks arrive spread out as the backend sends them (0.4 s apart), not all at the end
    assert arrivals[-1] - arrivals[0] > 0.8


def test_429_and_retry_after_are_passed_through(cluster):
    r, (a,) = cluster([FakeBackend("a")])
    a.refuse_429 = True
    resp = post(r.url, {"model": "fake-model", "prompt": "x"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "7"
    assert resp.json()["error"]["type"] == "RateLimitError"


def test_client_disconnect_aborts_upstream(cluster):
    r, (a,) = cluster([FakeBackend("a", chunks=50, itl_s=0.1)])
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break   # leave after the first chunk
    deadline = time.monotonic() + 5
    while a.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.disconnects == 1 and a.completed == 0
    # and a non-streamed request whose client leaves before the answer
    a.chunks, a.itl_s = 1, 3.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x"}, timeout=0.5)
    deadline = time.monotonic() + 5
    while a.disconnects < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.disconnects == 2
    time.sleep(0.3)
    assert r.router.backends[0].in_flight == 0


def test_dead_backend_leaves_rotation_retry_and_recovery(cluster):
    r, (a, b) = cluster([FakeBackend("a"), FakeBackend("b")], policy="round_robin")
    a.stop()
    # every request succeeds: one that hit the dead backend is retried on the other
    got = [post(r.url, {"model": "fake-model", "prompt": "x"}).json()["backend"] for _ in range(6)]
    assert got == ["b"] * 6
    metrics = httpx.get(r.url + "/metrics").text
    assert 'tokenmill:router_backend_healthy{backend="%s"} 0.0' % a.url in metrics
    # an unhealthy /health also takes a backend out within a few check intervals
    b.healthy = False
    deadline = time.monotonic() + 3
    while httpx.get(r.url + "/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(r.url + "/health").status_code == 503
    resp = post(r.url, {"model": "fake-model", "prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    # recovery: a restarted on its port and b healthy again -> both back in rotation
    a.start()
    b.healthy = True
    deadline = time.monotonic() + 5
    while not all(x.healthy for x in r.router.backends) and time.monotonic() < deadline:
        time.sleep(0.05)
    got = {post(r.url, {"model": "fake-model", "prompt": "x"}).json()["backend"] for _ in range(4)}
    assert got == {"a", "b"}


def test_router_metrics_count_requests_and_reasons(cluster):
    r, (a, b) = cluster([FakeBackend("a"), FakeBackend("b")], policy="prefix_aware", cache_threshold=0.5)
    prompt = "a long shared system prompt. " * 20
    homes = {post(r.url, {"model": "fake-model", "prompt": prompt + f"q{i}"}).json()["backend"] for i in range(5)}
    assert len(homes) == 1
    text = httpx.get(r.url + "/metrics").text
    assert 'tokenmill:router_routed_total{policy="prefix_aware",reason="prefix_match"} 4.0' in text
    assert 'tokenmill:router_routed_total{policy="prefix_aware",reason="cache_capacity"} 1.0' in text
    hits = [l for l in text.splitlines() if l.startswith('tokenmill:router_estimated_prefix_cache_hits_total')]
    assert hits and float(hits[0].split()[-1]) >= 4 * len(prompt)


def test_backend_specs_and_file(tmp_path):
    s = BackendSpec.parse("http://10.0.0.5:8000/,kv_events=tcp://*:5557,replay=tcp://*:5558")
    assert s.url == "http://10.0.0.5:8000" and s.kv_events == "tcp://10.0.0.5:5557"
    assert s.replay == "tcp://10.0.0.5:5558"
    with pytest.raises(ValueError):
        BackendSpec.parse("10.0.0.5:8000")
    with pytest.raises(ValueError):
        BackendSpec.parse("http://h:1,bogus=1")
    f = tmp_path / "b.txt"
    f.write_text("# two\nhttp://h1:1\nhttp://h2:2,kv_events=tcp://h2:9\n")
    assert [x.url for x in load_backend_file(str(f))] == ["http://h1:1", "http://h2:2"]
    f.write_text(json.dumps([{"url": "http://h3:3", "kv_events": "tcp://*:7"}]))
    assert load_backend_file(str(f))[0].kv_events == "tcp://h3:7"


class _GatePolicy:
    """Round robin that holds every request while ``closed`` (a stand-in for kv_aware's holds)."""

    name = "gate"
    needs_tokens = False

    def __init__(self) -> None:
        from tokenmill.router.policies import RoundRobin

        self.rr = RoundRobin()
        self.closed = True

    def hold(self, candidates, req):
        return ("busy" if self.closed else None), candidates

    def select(self, candidates, req):
        return self.rr.select(candidates, req)

    def on_finish(self, decision):
        pass

    def on_backend_down(self, backend):
        pass


def test_held_request_goes_on_a_change_times_out_or_is_dropped_with_its_client(cluster):
    import threading

    r, (a,) = cluster([FakeBackend("a")], router_queue_timeout=1.5)
    gate = _GatePolicy()
    r.router.policies["fake-model"] = gate
    got = {}
    t = threading.Thread(target=lambda: got.update(resp=post(r.url, {"model": "fake-model", "prompt": "x"})))
    t.start()
    deadline = time.monotonic() + 3
    while "tokenmill:router_held_requests_now 1.0" not in httpx.get(r.url + "/metrics").text:
        assert time.monotonic() < deadline, "the request was not held"
        time.sleep(0.02)
    assert a.requests == [] and t.is_alive()
    gate.closed = False
    r.router.loop.call_soon_threadsafe(r.router._notify)     # what a finishing request / KV event batch does
    t.join(5)
    assert got["resp"].status_code == 200 and got["resp"].json()["backend"] == "a"
    # still closed at the timeout: routed anyway
    gate.closed = True
    t0 = time.monotonic()
    resp = post(r.url, {"model": "fake-model", "prompt": "x"})
    assert resp.status_code == 200 and 1.4 < time.monotonic() - t0 < 4
    text = httpx.get(r.url + "/metrics").text
    assert 'tokenmill:router_held_requests_total{reason="busy"} 2.0' in text
    assert "tokenmill:router_hold_timeouts_total 1.0" in text
    # a client that leaves while held never reaches the backend
    n = len(a.requests)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x"}, timeout=0.4)
    time.sleep(1.5)
    assert len(a.requests) == n and r.router.backends[0].in_flight == 0
    assert "tokenmill:router_held_requests_now 0.0" in httpx.get(r.url + "/metrics").text


def test_requests_in_flight_to_a_hung_backend_fail_instead_of_hanging(cluster):
    """A backend that stops answering (here: /health fails and the answer never comes, as a hung machine)
    fails its in-flight requests once it has been out of the rotation for --dead-backend-timeout."""
    import threading

    r, (a,) = cluster([FakeBackend("a", chunks=3, itl_s=60.0)], dead_backend_timeout=0.6)
    got = {}

    def plain():
        got["plain"] = post(r.url, {"model": "fake-model", "prompt": "x"})

    t = threading.Thread(target=plain)
    t.start()
    lines = []
    t0 = time.monotonic()
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) == 1:
                    a.healthy = False          # the first chunk arrived; now the machine "hangs"
    took = time.monotonic() - t0
    t.join(10)
    assert took < 5, took
    assert len(lines) == 3 and json.loads(lines[0][6:])["i"] == 0 and lines[2] == "data: [DONE]"
    err = json.loads(lines[1][6:])["error"]
    assert err["code"] == 502 and "stopped answering" in err["message"]
    assert got["plain"].status_code == 502 and got["plain"].json()["error"]["type"] == "BadGatewayError"
    deadline = time.monotonic() + 3
    while r.router.backends[0].in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.router.backends[0].in_flight == 0
    # back in the rotation: requests flow again
    a.healthy, a.itl_s = True, 0.01
    deadline = time.monotonic() + 5
    while not r.router.backends[0].healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert post(r.url, {"model": "fake-model", "prompt": "x"}).status_code == 200


def test_router_queue_timeout_zero_never_holds(cluster):
    r, (a,) = cluster([FakeBackend("a")], router_queue_timeout=0.0)
    r.router.policies["fake-model"] = _GatePolicy()      # would hold forever
    t0 = time.monotonic()
    assert post(r.url, {"model": "fake-model", "prompt": "x"}).status_code == 200
    assert time.monotonic() - t0 < 2
    assert "tokenmill:router_held_requests_total{" not in httpx.get(r.url + "/metrics").text


def test_a_backend_crashing_mid_stream_gives_an_error_event_and_done(cluster):
    """The backend's connection breaks mid-answer (its process died): the client's stream ends with a
    502 error event and [DONE], not a cut-off chunked body."""
    r, (a,) = cluster([FakeBackend("a", chunks=5)])
    a.drop_after = 2
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert [json.loads(ln[6:])["i"] for ln in lines[:2]] == [0, 1]
    err = json.loads(lines[2][6:])["error"]
    assert err["code"] == 502 and "closed the connection" in err["message"]
    assert lines[3:] == ["data: [DONE]"]
    a.drop_after = None
    assert post(r.url, {"model": "fake-model", "prompt": "x"}).status_code == 200


def test_one_slow_health_check_does_not_take_a_backend_out(cluster):
    """A check that times out now and then (a busy machine) leaves the backend in the rotation; three in a
    row (--health-failure-threshold) take it out; an error status from /health takes it out at once."""
    r, (a,) = cluster([FakeBackend("a")], health_check_interval=0.2, health_check_timeout=0.3)
    b = r.router.backends[0]
    a.health_delay_s = 0.5                      # every check times out from now on
    deadline = time.monotonic() + 5
    while b.consecutive_failures < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.consecutive_failures >= 1
    if b.consecutive_failures < 3:
        assert b.healthy                        # one or two timed-out checks: still in
    while b.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not b.healthy and b.consecutive_failures >= 3
    a.health_delay_s = 0.0
    deadline = time.monotonic() + 5
    while not b.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.healthy
    a.healthy = False                           # /health 503: out on the first check
    deadline = time.monotonic() + 5
    while b.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not b.healthy and b.consecutive_failures == 1


def test_router_refuses_a_huge_body_with_413_before_reading_it(cluster):
    r, (a,) = cluster([FakeBackend("a")], max_request_body_bytes=1000)
    resp = httpx.post(r.url + "/v1/completions", content=b"{" + b" " * 5000 + b"}", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    assert "--max-request-body-bytes" in resp.json()["error"]["message"]
    assert post(r.url, {"model": "fake-model", "prompt": "x"}).status_code == 200
    assert not a.requests or all(isinstance(q, dict) for q in a.requests)


def test_a_request_without_model_is_400_when_several_models_are_served(cluster):
    r, (a, b) = cluster([FakeBackend("a", ["smol-a"]), FakeBackend("b", ["smol-b"])])
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = httpx.post(r.url + path, json={"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
                          timeout=10)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "model" and err["type"] == "BadRequestError"
        assert "smol-a" in err["message"] and "smol-b" in err["message"]
    assert not a.requests and not b.requests
    assert post(r.url, {"model": 7, "prompt": "hi"}).status_code == 400
    # a named model still goes to its pool; an empty name is the unknown-model 404
    assert post(r.url, {"model": "smol-b", "prompt": "hi"}).json()["backend"] == "b"
    assert post(r.url, {"model": "", "prompt": "hi"}).status_code == 404
    assert 'tokenmill:router_request_errors_total{reason="bad_request"} 3.0' in httpx.get(r.url + "/metrics").text


def test_a_request_without_model_goes_to_the_only_model(cluster):
    r, (a, b) = cluster([FakeBackend("a", ["smol"]), FakeBackend("b", ["smol"])])
    got = [post(r.url, {"prompt": "hi"}).json()["backend"] for _ in range(4)]
    assert sorted(got) == ["a", "a", "b", "b"]
    # it shares the named model's policy (one rotation), not a second one
    assert set(r.router.policies) == {"smol"}


def _retries(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:router_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_that_hangs_and_dies_before_its_headers_is_retried_elsewhere(cluster, stream):
    """The backend takes the request, answers nothing, and its connection closes (stopped, then killed):
    nothing reached the client, so the router sends it to another backend, counted as a retry."""
    dying, healthy = FakeBackend("dying"), FakeBackend("healthy")
    r, _ = cluster([dying, healthy], policy="round_robin")
    dying.die_before_headers_s = 0.3
    body = {"model": "fake-model", "prompt": "x", "stream": stream}
    for _ in range(2):     # round robin: both go to the dying backend first (the retry is not a turn)
        resp = httpx.post(r.url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
        assert '"backend": "healthy"' in resp.text
    assert len(dying.requests) == 2 and len(healthy.requests) == 2
    assert _retries(httpx.get(r.url + "/metrics").text) == {"no_response": 2.0}
    assert all(b.in_flight == 0 for b in r.router.backends)


def test_headers_without_a_first_byte_are_retried_but_a_started_answer_never(cluster):
    # headers sent, the connection closed before the first body byte: still nothing reached the client
    first, second = FakeBackend("first", chunks=3), FakeBackend("second", chunks=3)
    r, _ = cluster([first, second], policy="round_robin")
    first.drop_after = 0
    lines = []
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert [json.loads(x[6:])["backend"] for x in lines[:-1]] == ["second"] * 3 and lines[-1] == "data: [DONE]"
    # after the first byte, a broken backend is never retried: the stream ends with an error event
    first.drop_after, second.drop_after = 1, 1
    with httpx.stream("POST", r.url + "/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True},
                      timeout=10) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[0][6:])["i"] == 0 and "error" in json.loads(lines[1][6:]) and lines[-1] == "data: [DONE]"
    assert len(first.requests) + len(second.requests) == 3
    assert _retries(httpx.get(r.url + "/metrics").text) == {"no_response": 1.0}


def test_retries_are_bounded_by_max_retries(cluster):
    fakes = [FakeBackend(n) for n in "abc"]
    r, _ = cluster(fakes, policy="round_robin", max_retries=1)
    for f in fakes:
        f.die_before_headers_s = 0.05
    resp = post(r.url, {"model": "fake-model", "prompt": "x"})
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "BadGatewayError"
    assert "before answering" in resp.json()["error"]["message"]
    assert sum(len(f.requests) for f in fakes) == 2        # the first try and one retry
    assert _retries(httpx.get(r.url + "/metrics").text) == {"no_response": 2.0}


def test_pd_legs_are_retried_elsewhere_when_a_server_dies_before_its_headers():
    """--pd-disaggregation: a prefill server and a decode server that hang and die before answering; both
    legs go to the other server of their pool, and the client gets the answer."""
    pa, pb, da, db = (FakeBackend(n) for n in ("pa", "pb", "da", "db"))
    started = []
    try:
        for f in (pa, pb, da, db):
            started.append(f.start())
        pa.die_before_headers_s = da.die_before_headers_s = 0.2
        cfg = RouterConfig(pd_disaggregation=True, prefill=[BackendSpec(pa.url), BackendSpec(pb.url)],
                           decode=[BackendSpec(da.url), BackendSpec(db.url)], policy="round_robin",
                           health_check_interval=0.2, health_check_timeout=0.5)
        r = RouterThread(cfg).start()
        started.append(r)
        resp = post(r.url, {"model": "fake-model", "prompt": "x"})
        assert resp.status_code == 200 and resp.json()["backend"] == "db", resp.text
        assert len(pa.requests) == 1 and len(pb.requests) == 1 and pb.requests[0]["max_tokens"] == 1
        assert len(da.requests) == 1 and len(db.requests) == 1
        assert _retries(httpx.get(r.url + "/metrics").text) == {"no_response": 2.0}
        # a PD request without model, two models served -> 400 before any leg
        db.models = ["other"]
        deadline = time.monotonic() + 3
        while "other" not in r.router.all_models() and time.monotonic() < deadline:
            time.sleep(0.05)
        resp = post(r.url, {"prompt": "x"})
        assert resp.status_code == 400 and "other" in resp.json()["error"]["message"]
    finally:
        for s in reversed(started):
            s.stop()
