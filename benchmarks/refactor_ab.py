"""Warm start and c=16 output throughput of two source trees side by side: did a refactor move them?

Each arm is ``NAME=PATH``: a tokenmill source tree (a checkout, or ``git archive COMMIT | tar -x -C PATH``),
run with this script's Python (same ``.venv``, same kernel and weight caches) and ``PYTHONPATH=PATH``. Per
round and arm (arm order alternating between rounds): start ``tokenmill serve`` (packaged SmolLM2 GGUF,
defaults), time launch -> ``/health`` 200 (warm: one untimed start per arm first fills the weight cache), then

    tokenmill bench serve --dataset random --input-len 128 --output-len 64 --ignore-eos \\
        --num-prompts 32 --max-concurrency 16 --seed ROUND

and read its output tokens/s; the server is stopped (its process group) before the next run. Prints one
JSON row per run and a summary; ``--out`` writes them. Run it with the CPU to itself (``/work/bin/quiet``).

Usage::

    python benchmarks/refactor_ab.py base=/tmp/tm_base head=. --rounds 3 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(path: str, port: int, log) -> tuple[subprocess.Popen, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port)],
                            cwd=os.path.abspath(path), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = t0 + 600
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server of {path} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    _stop(proc)
    raise RuntimeError(f"server of {path} not healthy within 600 s")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _bench(port: int, seed: int, num_prompts: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--port", str(port),
                        "--dataset", "random", "--input-len", "128", "--output-len", "64", "--ignore-eos",
                        "--num-prompts", str(num_prompts), "--max-concurrency", "16", "--seed", str(seed),
                        "--save-result", out], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return float(json.load(f)["output_throughput"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", nargs=2, metavar="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = [a.split("=", 1) for a in args.arms]
    rows = []
    with tempfile.TemporaryFile("w+") as log:
        for name, path in arms:            # warm-up: the weight cache entry of each arm's key
            proc, _ = _start(path, _free_port(), log)
            _stop(proc)
        for r in range(args.rounds):
            for name, path in (arms if r % 2 == 0 else arms[::-1]):
                port = _free_port()
                proc, start_s = _start(path, port, log)
                try:
                    tput = _bench(port, r, args.num_prompts)
                finally:
                    _stop(proc)
                row = {"round": r, "arm": name, "warm_start_s": round(start_s, 2),
                       "output_tok_s": round(tput, 1), "load1": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for name, _ in arms:
        mine = [x for x in rows if x["arm"] == name]
        print(f"{name}: warm start median {statistics.median(x['warm_start_s'] for x in mine):.2f} s, "
              f"c=16 output median {statistics.median(x['output_tok_s'] for x in mine):.1f} tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
