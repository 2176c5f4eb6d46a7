"""Start a real ``python -m tokenmill.server`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

STARTUP_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def children(self) -> list:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> float:
        """Signal the server and wait for it; returns seconds taken. Kills it (and children) on timeout."""
        kids = self.children()
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        took = time.monotonic() - t0
        for k in kids:
            try:
                k.wait(5)
            except Exception:  # noqa: BLE001
                try:
                    k.kill()
                except Exception:  # noqa: BLE001
                    pass
        return took


def start_server(*args: str) -> ServerProc:
    """Launch the server on a free port with ``args`` and wait until /health answers 200.

    Raises:
        RuntimeError: it exited or did not get healthy within STARTUP_TIMEOUT (log tail included).
    """
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-server-", suffix=".log", delete=False)
    env = dict(os.environ, TOKENMILL_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.server", "--host", "127.0.0.1", "--port", str(port),
                             "--log-stats-interval", "0", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    sp = ServerProc(proc, f"http://127.0.0.1:{port}", log.name)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{sp.log_tail()}")
        try:
            if httpx.get(sp.url + "/health", timeout=2).status_code == 200:
                return sp
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sp.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT}s:\n{sp.log_tail()}")
