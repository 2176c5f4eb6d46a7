"""A trial's ``tokenmill serve`` process: start on a free port, wait for health, scrape preemptions, stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; another process may take it before the server does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_preemptions(url: str) -> float:
    """``tokenmill:num_preemptions_total`` summed over its series on the server at ``url``.

    Raises:
        httpx.HTTPError: the server did not answer ``/metrics``.
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tokenmill:num_preemptions_total":
                total += s.value
    return total


class ServerProcess:
    """A ``tokenmill serve`` (or ``--serve-command``) process in its own session, stopped with its children.

    Raises (from :meth:`start`):
        RuntimeError: the process exited or did not answer ``/health`` within ``timeout_s`` (log tail included).
    """

    def __init__(self, argv: list[str], port: int, log_path: Path) -> None:
        self.argv, self.port, self.log_path = argv, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        import httpx

        t0 = time.monotonic()
        log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        log.close()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not answer /health within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 15) -> str:
        try:
            return " | ".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT, then SIGKILL to the whole process group after 30 s; always reaps."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and anything else it started
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
