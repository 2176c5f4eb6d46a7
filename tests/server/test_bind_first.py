"""The HTTP port is bound before anything slow starts (as vLLM's ``create_server_socket``): a port in use fails
``tokenmill serve`` at once with exit status 3, before the model path is even resolved or an engine core spawned."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tokenmill.server.launch import BIND_FAILED_EXIT_CODE, bind_listen_socket

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def busy_port():
    """A port some other socket is listening on for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_bind_listen_socket_reports_a_port_in_use_and_binds_a_free_one(busy_port):
    with pytest.raises(OSError):
        bind_listen_socket("127.0.0.1", busy_port)
    sock = bind_listen_socket("127.0.0.1", 0)
    try:
        assert sock.getsockname()[1] > 0 and sock.family == socket.AF_INET
        assert not sock.get_inheritable()          # an engine core spawned after it never holds the port
    finally:
        sock.close()


@pytest.mark.parametrize("module", ["tokenmill.server", "tokenmill.cli"])
def test_port_in_use_fails_before_the_model_is_looked_at(busy_port, tmp_path, module):
    """A model path that does not exist: had the model been resolved (or a core started) first, that would be the
    error; the port's comes first, with uvicorn's start-up failure status."""
    missing = str(tmp_path / "no-such-model.gguf")
    argv = [sys.executable, "-m", module, *(["serve"] if module == "tokenmill.cli" else []), missing,
            "--host", "127.0.0.1", "--port", str(busy_port)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, TOKENMILL_LOG_LEVEL="INFO"))
    out = r.stdout + r.stderr
    assert r.returncode == BIND_FAILED_EXIT_CODE, out
    assert f"cannot listen on 127.0.0.1:{busy_port}" in out and "in use" in out, out
    assert "no-such-model" not in out and "engine core" not in out, out


def test_a_failing_app_state_stops_the_engine_and_frees_the_port(monkeypatch):
    """What ``create_server_state`` raises (a LoRA module or chat template that cannot be loaded) reaches the
    caller after the engine core was stopped and the listening socket closed, not at process exit."""
    from tokenmill.config import EngineConfig
    from tokenmill.server import launch

    class Engine:
        stopped = 0

        def shutdown(self):
            Engine.stopped += 1

    def broken(*args, **kwargs):
        raise ValueError("cannot load the chat template")

    monkeypatch.setattr(launch, "create_server_state", broken)
    sock = bind_listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ValueError, match="chat template"):
        launch.serve(EngineConfig.from_kwargs(), Engine(), None, "model", sock=sock)
    assert Engine.stopped == 1 and sock.fileno() == -1
    again = bind_listen_socket("127.0.0.1", port)           # the port is free again
    again.close()
