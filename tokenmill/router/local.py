"""Local replicas for experiments and tests: ``tokenmill serve`` subprocesses with KV events on free ports.

Used by ``benchmarks/routing.py`` and the router's end-to-end test. Each
replica may be pinned to CPUs (``taskset``-style, via ``os.sched_setaffinity``
in the child) so replicas on one machine do not fight over cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import IO

from tokenmill.router.backends import BackendSpec


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free right now on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalReplica:
    """One ``tokenmill serve`` subprocess publishing KV events.

    Attributes:
        args: extra ``serve`` flags (e.g. ``["--num-kv-blocks", "64"]``).
        cpus: CPUs to pin the process (and its engine core) to; None: no pinning.
        log_path: where stdout/stderr go (None: discarded).
    """

    args: list[str] = field(default_factory=list)
    cpus: list[int] | None = None
    log_path: str | None = None
    port: int = 0
    events_port: int = 0
    replay_port: int = 0
    proc: subprocess.Popen | None = None
    _log: IO | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> BackendSpec:
        """The router's view: URL plus KV event and replay endpoints."""
        return BackendSpec(self.url, f"tcp://127.0.0.1:{self.events_port}", f"tcp://127.0.0.1:{self.replay_port}")

    def start(self) -> "LocalReplica":
        """Spawn the server (returns at once; see :meth:`wait_healthy`)."""
        self.port, self.events_port, self.replay_port = free_ports(3)
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}",
              "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--kv-events-config", json.dumps(kv), "--log-stats-interval", "0", *self.args]
        self._log = open(self.log_path, "wb") if self.log_path else None
        cpus = self.cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(cmd, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=pin)
        return self

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Block until ``GET /health`` answers 200.

        Raises:
            RuntimeError: the process exited or did not get healthy in time (with the log's tail).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited ({self.proc.returncode if self.proc else None}): "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tokenmill serve not healthy after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.3)

    def log_tail(self, n: int = 3000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")

    def stop(self) -> None:
        """Terminate (then kill) the server; safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
