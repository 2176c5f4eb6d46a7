"""The engine core dies (SIGKILL): /health 503 within 1 s, in-flight requests 503, the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from tests.server.live_fake import core_pid, live_fake_server
from tokenmill.server.launch import ENGINE_DEAD_EXIT_CODE, ENGINE_DEAD_EXIT_GRACE_S


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
        time.sleep(1.0)       # both running (400 tokens at 50 ms per step take 20 s)
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
