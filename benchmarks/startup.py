"""Start-up time of ``tokenmill serve``: first start (empty caches) and second start, side by side.

For each repeat, a fresh ``TOKENMILL_CACHE_DIR`` (processed-weight cache, converted tokenizer) is used
for a first start, then the same directory for a second start. Each start runs ``tokenmill serve`` with
the default model (or ``--model``), polls ``/health`` every 10 ms, then sends one 1-token completion.
Reported per start, in seconds from process launch:

* ``healthy``: ``/health`` answered 200 (the server accepts requests);
* ``first_response``: the first completion came back;
* the breakdown, from the two processes' log timestamps: engine core process spawned, torch and the model
  runner imported in the core, weights ready (converted, or mapped from the cache), KV cache allocated,
  core ready, API process's HTTP stack + tokenizer done, serving; and when the background oneDNN
  packing finished.

The compiled C kernels live in the per-user kernel cache (``$XDG_CACHE_HOME/tokenmill/kernels``) and are
built once per machine; ``--cold-kernels`` gives the first start an empty kernel cache too.
Ablations: ``--no-weight-cache`` (``TOKENMILL_WEIGHT_CACHE=0``), ``--env TOKENMILL_KV_CACHE_ZERO=1``,
``--env TOKENMILL_CPU_PACK_BACKGROUND=0``: pass them as ``--arm NAME:ENV=V,ENV=V`` to run them in the
same session, interleaved with the default.

Usage::

    flock /work/bench.lock .venv/bin/python benchmarks/startup.py [--repeats 2] [--arm zeroed-kv:TOKENMILL_KV_CACHE_ZERO=1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# milestone -> regex on a log message (first match wins)
MILESTONES = [
    ("core_spawned", r"started engine core process pid"),
    ("core_torch_imported", r"imported torch and the model runner in"),
    ("weights_ready", r"loaded .* in [0-9.]+ s on "),
    ("kv_allocated", r"allocating the KV cache"),
    ("core_ready", r"engine core ready in"),
    ("api_tokenizer_done", r"API process: HTTP stack imported"),
    ("serving", r"serving .* on http"),
    ("packing_done", r"packed \d+ linear layers for oneDNN .* in the background in"),
]
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (?:\[core\d*\] )?[\w.]+: (.*)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_cmd() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "tokenmill.cli"]


def one_start(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """Launch, wait for /health and one response, stop; return the timings (s since launch)."""
    port = _free_port()
    cmd = _serve_cmd() + ["serve", *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", str(port),
                          "--log-stats-interval", "0"]
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-startup-", suffix=".log", delete=False)
    t_wall0 = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    out: dict = {}
    try:
        with httpx.Client(base_url=url, timeout=5) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; log {log.name}")
                if time.perf_counter() - t0 > args.timeout:
                    raise RuntimeError(f"not healthy within {args.timeout} s; log {log.name}")
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)
            out["healthy"] = time.perf_counter() - t0
            model = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1}, timeout=args.timeout)
            r.raise_for_status()
            out["first_response"] = time.perf_counter() - t0
            deadline = time.perf_counter() + 30      # let the background packing log its end
            while time.perf_counter() < deadline:
                with open(log.name, errors="replace") as f:
                    if "in the background in" in f.read():
                        break
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with open(log.name, errors="replace") as f:
        lines = f.read().splitlines()
    for line in lines:
        m = _TS.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t_wall0
        for name, pattern in MILESTONES:
            if name not in out and re.search(pattern, m.group(2)):
                out[name] = t
        if "from the processed-weight cache" in m.group(2):
            out["weight_cache_hit"] = True
    out.setdefault("weight_cache_hit", False)
    out["log"] = log.name
    if not args.keep_logs:
        os.unlink(log.name)
    return out


def _arm_env(spec: str) -> tuple[str, dict[str, str]]:
    name, _, assigns = spec.partition(":")
    env = {}
    for a in filter(None, assigns.split(",")):
        k, _, v = a.partition("=")
        env[k] = v
    return name, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the packaged SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--arm", action="append", default=[],
                   help="NAME:ENV=V,... an extra configuration measured in the same run (e.g. "
                        "no-cache:TOKENMILL_WEIGHT_CACHE=0)")
    p.add_argument("--cold-kernels", action="store_true", help="first start with an empty C-kernel cache too")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    arms = [("default", {})] + [_arm_env(a) for a in args.arm]
    results: dict[str, dict[str, list[dict]]] = {name: {"first": [], "second": []} for name, _ in arms}
    for rep in range(args.repeats):
        for name, extra in arms:
            tmp = tempfile.mkdtemp(prefix="tokenmill-startup-cache-")
            env = dict(os.environ, TOKENMILL_CACHE_DIR=tmp, PYTHONUNBUFFERED="1", TOKENMILL_LOG_LEVEL="INFO", **extra)
            if args.cold_kernels:
                env["XDG_CACHE_HOME"] = os.path.join(tmp, "xdg")
            try:
                for which in ("first", "second"):
                    r = one_start(args, env)
                    results[name][which].append(r)
                    print(f"[{rep + 1}/{args.repeats}] {name:>12} {which:>6} start: healthy {r['healthy']:.2f} s, "
                          f"first response {r['first_response']:.2f} s, weight cache hit {r['weight_cache_hit']}",
                          flush=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {os.cpu_count()} CPUs; medians over "
          f"{args.repeats} repeat(s), seconds since launch")
    keys = ["healthy", "first_response"] + [m for m, _ in MILESTONES]
    header = f"{'milestone':<22}" + "".join(f"{n + ' ' + w:>22}" for n, _ in arms for w in ("first", "second"))
    print(header)
    for k in keys:
        row = f"{k:<22}"
        for name, _ in arms:
            for which in ("first", "second"):
                vals = [r[k] for r in results[name][which] if k in r]
                row += f"{statistics.median(vals):>22.2f}" if vals else f"{'-':>22}"
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
