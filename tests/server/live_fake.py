"""A live ``tests.server.fake_serve`` process (real HTTP + engine core processes, no model) for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import httpx

from tests.server.server_proc import ServerProc, free_port


@contextlib.contextmanager
def live_fake_server(*args: str, executor: str = "make_fake_executor", debug: bool = True,
                     timeout: float = 300.0) -> Iterator[ServerProc]:
    """Start the fake server on a free port, wait for /health 200, and always stop it (and its core) after."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-fake-", suffix=".log", delete=False)
    env = dict(os.environ, TOKENMILL_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1", TOKENMILL_FAKE_EXECUTOR=executor)
    if debug:
        env["TOKENMILL_DEBUG_ENDPOINTS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.fake_serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-stats-interval", "0", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sp = ServerProc(proc, f"http://127.0.0.1:{port}", log.name)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake server exited ({proc.returncode}):\n{sp.log_tail()}")
            try:
                if httpx.get(sp.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake server not healthy in {timeout:.0f}s:\n{sp.log_tail()}")
            time.sleep(0.1)
        yield sp
    finally:
        sp.stop(signal.SIGINT, timeout=20)
        os.unlink(log.name)


def core_pid(sp: ServerProc) -> int:
    """The engine core's pid, as fake_serve prints it."""
    with open(sp.log_path) as f:
        for line in f:
            if line.startswith("engine core pid "):
                return int(line.split()[-1])
    raise RuntimeError("no core pid in the log:\n" + sp.log_tail())
