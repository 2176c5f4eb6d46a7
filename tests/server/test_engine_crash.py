"""The engine core dies (SIGKILL): /health 503 within 1 s, in-flight requests 503, the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.server.live_fake import core_pid, live_fake_server
from tokenmill.server.launch import ENGINE_DEAD_EXIT_CODE, ENGINE_DEAD_EXIT_GRACE_S


def _wait_running(url: str, n: int, timeout: float = 20.0) -> None:
    """Wait until the server's ``tokenmill:num_requests_running`` gauge reads ``n`` (a fixed sleep raced a
    slow machine: a request that reached the API after the kill was answered before it streamed)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=5).text
        running = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("tokenmill:num_requests_running")]
        if running and sum(running) >= n:
            return
        assert time.monotonic() < deadline, f"num_requests_running never reached {n}: {running}"
        time.sleep(0.05)


def test_killed_core_turns_health_503_fails_requests_and_exits_nonzero():
    with live_fake_server(executor="make_slow_fake_executor") as sp:
        url = sp.url
        results: dict[str, object] = {}

        def non_streamed() -> None:
            r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 400, "ignore_eos": True},
                           timeout=30)
            results["plain"] = (r.status_code, r.json())

        def streamed() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=30,
                              json={"prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                results["stream"] = (r.status_code, r.read().decode())

        threads = [threading.Thread(target=non_streamed), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        _wait_running(url, 2)     # both in the core (400 tokens at 50 ms per step take 20 s)
        if os.path.exists(f"/proc/{core_pid(sp)}/comm"):   # Linux: the core is named for top / pgrep / killall
            with open(f"/proc/{core_pid(sp)}/comm") as f:
                assert f.read().strip() == "tokenmill-core"
        os.kill(core_pid(sp), signal.SIGKILL)
        t_kill = time.monotonic()
        while True:
            try:
                code = httpx.get(url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                code = None
            if code == 503:
                break
            assert time.monotonic() - t_kill < 1.0, f"/health still {code} after 1 s"
            time.sleep(0.02)
        health_s = time.monotonic() - t_kill
        for t in threads:
            t.join(10)
        status, body = results["plain"]
        assert status == 503 and body["error"]["code"] == 503, body
        status, text = results["stream"]
        assert status == 200 and '"code":503' in text and text.rstrip().endswith("data: [DONE]"), text[-300:]
        new = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=5)
        assert new.status_code == 503
        rc = sp.proc.wait(ENGINE_DEAD_EXIT_GRACE_S + 15)
        assert rc == ENGINE_DEAD_EXIT_CODE != 0, sp.log_tail()
        print(f"/health 503 after {health_s * 1000:.0f} ms; exit code {rc}")


def test_sigterm_stops_the_core_and_exits_zero():
    """SIGTERM (what a supervisor sends) shuts down gracefully: the engine core is stopped and the
    server exits 0, as after SIGINT (uvicorn re-raises the signal it caught; unhandled, SIGTERM's
    default killed the process with 143 before the core was stopped)."""
    with live_fake_server() as sp:
        kids = sp.children()
        assert kids
        sp.stop(signal.SIGTERM, timeout=30)
        assert sp.proc.returncode == 0, sp.log_tail()
        assert "Traceback" not in sp.log_tail(200), sp.log_tail(200)
        for k in kids:
            assert not k.is_running() or k.status() == "zombie"


def test_send_to_a_core_that_is_gone_is_engine_dead_not_an_internal_error():
    """A request sent in the window after the core died and before the monitor noticed: the PUSH socket
    has no peer and refuses the message (zmq.Again); that is the engine being dead (503), not a 500."""
    import zmq

    from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
    from tokenmill.engine.messages import AbortRequests

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind("inproc://no-core-here")         # bound, nobody connected: what a dead core leaves
    engine = object.__new__(AsyncEngine)
    engine._in_sock, engine._closed = sock, False
    engine._dead, engine._proc = None, None
    try:
        with pytest.raises(EngineDeadError):
            engine._send(AbortRequests(["r"]))
    finally:
        sock.close()
        ctx.term()
