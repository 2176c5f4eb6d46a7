"""Soak test: many mixed requests against one server, then check that nothing leaked.

Workload (seeded): prompts of 1-400 words, ``max_tokens`` 1-96, completions and chat, streamed and not,
``n`` up to 4, a share of clients that disconnect at a random point (mid-stream or before the answer),
and a share of bad requests (out-of-range parameters, out-of-vocabulary token ids, unknown model,
malformed JSON) that must get a 4xx. At the end the script checks, through the engine-side invariant
check (``GET /debug/invariants``, served with ``TOKENMILL_DEBUG_ENDPOINTS=1``):

* zero requests in the engine and in the API process, KV blocks all free again (usage back to its
  baseline), no block held by a finished request and every ref count right (no leaked blocks);
* the engine core is the same process as at the start (no restart), no 5xx was answered;
* resident memory of the API and engine core processes flat: growth over the second half of the run
  (RSS after half the requests -> the end), in MiB, against ``--max-rss-growth-mib``; a leak grows in
  the second half as in the first, while caches that fill (below) flatten out. Growth after the
  warm-up (first 10% of requests) is reported too. A started server gets ``TOKENMILL_KV_CACHE_ZERO=1``
  (unless set): the KV pool is allocated unzeroed by default, so its pages would become resident only
  as the block allocator first hands each block out, and the core's RSS would climb by up to the
  pool's size over the run (711 MiB of a 1.07 GB pool in the first real-model run) without any leak.
  It also gets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`` and ``LRU_CACHE_CAPACITY=64`` (unless set): oneDNN's
  primitive cache and ideep's computation cache (torch's CPU linear layers) keep one entry per GEMM
  shape, 1024 each by default, and a mixed workload brings a new token count almost every step, so
  the core's RSS climbs for hours until both fill (+564-841 MiB over 10,000 real-model requests, still
  climbing; flat with both capped: docs/guide/serving.md, "Soak"). Capped, growth measures leaks, not cache fill.
  And ``MALLOC_ARENA_MAX=1`` (unless set): glibc gives each thread its own heap arena, and torch's
  temporaries of ever-new sizes fragment them (second-half growth +79 MiB with 2 arenas per core,
  +23 MiB with one).

Usage::

    python benchmarks/soak.py                       # 10,000 requests against the real default model
    python benchmarks/soak.py --fake --requests 400 # a model-free engine core (what the test suite runs)
    python benchmarks/soak.py --url http://127.0.0.1:8000  # a server you started (with TOKENMILL_DEBUG_ENDPOINTS=1)

Prints one line per 10% and a summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "zebra near cold mountain rivers and golden fields of tall summer grass").split()


@dataclass
class Tally:
    """Counts by outcome, and the statuses seen."""

    ok: int = 0
    bad_rejected: int = 0
    disconnected: int = 0
    busy_429: int = 0
    server_errors: int = 0
    unexpected: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _bad_request(rng: random.Random, model: str) -> tuple[str, dict | bytes]:
    """An invalid request that must be refused with a 4xx."""
    prompt = " ".join(rng.choices(WORDS, k=5))
    kind = rng.randrange(7)
    if kind == 0:
        return "/v1/completions", {"model": model, "prompt": prompt, "temperature": -1}
    if kind == 1:
        return "/v1/completions", {"model": model, "prompt": [1, 2, 10**9]}
    if kind == 2:
        return "/v1/completions", {"model": model, "prompt": prompt, "stop_token_ids": [10**7], "min_tokens": 1}
    if kind == 3:
        return "/v1/completions", {"model": "no-such-model", "prompt": prompt}
    if kind == 4:
        return "/v1/chat/completions", {"model": model, "messages": []}
    if kind == 5:
        return "/v1/completions", b'{"prompt": "unterminated'
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 10**7}


def _good_request(rng: random.Random, model: str, max_words: int, max_tokens: int) -> tuple[str, dict]:
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, max_words)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0, 0.7, 1.0]),
                  "stream": rng.random() < 0.5, "n": rng.choice([1, 1, 1, 2, 4]), "seed": rng.randrange(1000)}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": prompt}]
        if "logprobs" in body:
            body["top_logprobs"] = body.pop("logprobs")
            body["logprobs"] = True
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def _one(client: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally, args: argparse.Namespace) -> None:
    r = rng.random()
    if r < args.bad_share:
        path, body = _bad_request(rng, model)
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        resp = await client.post(path, **kw)
        if 400 <= resp.status_code < 500:
            tally.bad_rejected += 1
        else:
            tally.unexpected.append(f"bad request {body!r:.80} -> {resp.status_code}")
            if resp.status_code >= 500:
                tally.server_errors += 1
        return
    path, body = _good_request(rng, model, args.max_words, args.max_tokens)
    disconnect = rng.random() < args.disconnect_share
    if body["stream"]:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                _status(tally, resp.status_code, resp.text)
                return
            stop_after = rng.randint(0, 8) if disconnect else None
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                if '"error"' in line and '"code":5' in line:
                    tally.server_errors += 1
                    tally.unexpected.append(f"in-stream error {line[:120]}")
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    tally.disconnected += 1
                    return      # leaving the block closes the connection mid-stream
        tally.ok += 1
        return
    if disconnect:
        task = asyncio.ensure_future(client.post(path, json=body))
        await asyncio.sleep(rng.uniform(0, 0.5))
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, httpx.HTTPError):
                pass
            tally.disconnected += 1
            return
        resp = task.result()
    else:
        resp = await client.post(path, json=body)
    _status(tally, resp.status_code, resp.text)


def _status(tally: Tally, code: int, text: str) -> None:
    if code == 200:
        tally.ok += 1
    elif code == 429:
        tally.busy_429 += 1
    else:
        tally.unexpected.append(f"good request -> {code}: {text[:120]}")
        if code >= 500:
            tally.server_errors += 1


async def _wait_idle(client: httpx.AsyncClient, timeout: float) -> dict:
    """Poll the invariant check until no request is left anywhere (or the timeout); return the last report."""
    deadline = time.monotonic() + timeout
    while True:
        rep = (await client.get("/debug/invariants")).json()
        idle = rep["num_requests"] == 0 and rep["api_unfinished_requests"] == 0 and not rep.get("api_detokenizing_requests")
        if idle or time.monotonic() > deadline:
            return rep
        await asyncio.sleep(0.2)


def _site_growth(warm: list[dict], end: list[dict], k: int = 5) -> list[str]:
    """Python allocation sites (tracemalloc, see tokenmill/metrics/memory.py) that grew most since warm-up."""
    before = {s["site"]: s for s in warm}
    rows = [(e["size_kib"] - before.get(e["site"], {}).get("size_kib", 0.0),
             e["count"] - before.get(e["site"], {}).get("count", 0), e["site"]) for e in end]
    rows.sort(reverse=True)
    return [f"{site}: +{dk:.1f} KiB, +{dc} objects" for dk, dc, site in rows[:k] if dk > 0]


async def soak(url: str, args: argparse.Namespace, api_pid: int | None) -> dict:
    """Run the workload against ``url``; return the figures and the list of failed checks."""
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        base = await _wait_idle(client, 5)
        core_pid0 = base["core_pid"]
        start_rss = (_rss_mib(api_pid), _rss_mib(core_pid0))
        tally = Tally()
        sem = asyncio.Semaphore(args.concurrency)
        done = 0
        warm_rss: tuple[float, float] | None = None
        warm_sites: dict = {}
        mid_rss: tuple[float, float] | None = None
        t0 = time.monotonic()

        skipped = 0

        async def run(i: int) -> None:
            nonlocal done, warm_rss, mid_rss, skipped
            async with sem:
                if args.max_duration and time.monotonic() - t0 > args.max_duration:
                    skipped += 1      # the time budget is spent: the rest are not sent
                    return
                try:
                    await _one(client, random.Random(rng.random()), model, tally, args)
                except httpx.HTTPError as e:
                    tally.unexpected.append(f"client error {type(e).__name__}: {e}")
            done += 1
            if done == max(1, args.requests // 10) and warm_rss is None:
                warm_rss = (_rss_mib(api_pid), _rss_mib(core_pid0))
                if args.tracemalloc:
                    warm_sites.update((await client.get("/debug/invariants")).json())
            if done == max(1, args.requests // 2) and mid_rss is None:
                mid_rss = (_rss_mib(api_pid), _rss_mib(core_pid0))
            if args.progress and done % max(1, args.requests // 10) == 0:
                print(f"  {done}/{args.requests} requests, {time.monotonic() - t0:.0f} s, ok {tally.ok}, "
                      f"disconnected {tally.disconnected}, bad {tally.bad_rejected}, 5xx {tally.server_errors}",
                      flush=True)

        await asyncio.gather(*(run(i) for i in range(args.requests)))
        elapsed = time.monotonic() - t0
        end = await _wait_idle(client, args.drain_timeout)
        end_rss = (_rss_mib(api_pid), _rss_mib(core_pid0))
        metrics = (await client.get("/metrics")).text
    warm_rss = warm_rss or end_rss
    mid_rss = mid_rss or warm_rss
    growth = (end_rss[0] - warm_rss[0], end_rss[1] - warm_rss[1])
    growth_second_half = (end_rss[0] - mid_rss[0], end_rss[1] - mid_rss[1])
    failures = []
    if end["problems"]:
        failures.append(f"invariants: {end['problems'][:5]}")
    if end["num_requests"] or end["api_unfinished_requests"] or end.get("api_detokenizing_requests"):
        failures.append(f"requests left: engine {end['num_requests']}, API {end['api_unfinished_requests']}, "
                        f"API output processor {end.get('api_detokenizing_requests')}")
    if end["num_free_blocks"] != base["num_free_blocks"]:
        failures.append(f"KV blocks free {end['num_free_blocks']} != baseline {base['num_free_blocks']}")
    if end["core_pid"] != core_pid0:
        failures.append(f"engine core restarted ({core_pid0} -> {end['core_pid']})")
    if tally.server_errors:
        failures.append(f"{tally.server_errors} server errors")
    if tally.unexpected:
        failures.append(f"{len(tally.unexpected)} unexpected outcomes, e.g. {tally.unexpected[:3]}")
    for name, g in (("API", growth_second_half[0]), ("engine core", growth_second_half[1])):
        if g == g and g > args.max_rss_growth_mib:   # nan: not measurable (remote server)
            failures.append(f"{name} RSS grew {g:.1f} MiB over the second half of the run "
                            f"(limit {args.max_rss_growth_mib})")
    running = [ln for ln in metrics.splitlines() if ln.startswith("tokenmill:num_requests_running")]
    site_growth = {proc: _site_growth(warm_sites.get(f"{proc}_allocation_sites", []),
                                      end.get(f"{proc}_allocation_sites", []))
                   for proc in ("api", "core")} if args.tracemalloc else None
    return {"allocation_site_growth_kib": site_growth,
            "requests": args.requests - skipped, "not_sent_time_budget": skipped, "elapsed_s": round(elapsed, 1),
            "ok": tally.ok,
            "disconnected": tally.disconnected, "bad_rejected": tally.bad_rejected, "busy_429": tally.busy_429,
            "server_errors": tally.server_errors, "kv_free_blocks": [base["num_free_blocks"], end["num_free_blocks"]],
            "kv_blocks": end["num_kv_blocks"], "rss_start_mib": start_rss, "rss_warm_mib": warm_rss, "rss_mid_mib": mid_rss,
            "rss_end_mib": end_rss, "rss_growth_second_half_mib": growth_second_half,
            "rss_growth_mib": growth, "metrics_running": running, "failures": failures}


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    env = dict(os.environ, TOKENMILL_DEBUG_ENDPOINTS="1", TOKENMILL_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    env.setdefault("TOKENMILL_KV_CACHE_ZERO", "1")  # the whole KV pool resident from the start (docstring)
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")  # per-shape caches bounded small (docstring)
    env.setdefault("LRU_CACHE_CAPACITY", "64")
    env.setdefault("MALLOC_ARENA_MAX", "1")   # one glibc heap: fragmentation is not mistaken for a leak
    if args.tracemalloc:
        env["TOKENMILL_TRACEMALLOC"] = "1"
    if args.fake:
        env["TOKENMILL_FAKE_EXECUTOR"] = "make_fake_executor"
        cmd = [sys.executable, "-m", "tests.server.fake_serve"]
    else:
        cmd = [sys.executable, "-m", "tokenmill.server"]
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-soak-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port), "--log-stats-interval", "0",
                                   *args.serve_args], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not healthy within {args.start_timeout} s; log: {log.name}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-share", type=float, default=0.10)
    p.add_argument("--bad-share", type=float, default=0.05)
    p.add_argument("--max-words", type=int, default=400, help="longest prompt, words")
    p.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="an already running server (started with TOKENMILL_DEBUG_ENDPOINTS=1)")
    p.add_argument("--fake", action="store_true", help="start a server with a model-free engine core")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="flags for the started server")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--drain-timeout", type=float, default=60)
    p.add_argument("--max-rss-growth-mib", type=float, default=32,
                   help="largest RSS growth of either process over the second half of the run, MiB")
    p.add_argument("--max-duration", type=float, default=0,
                   help="stop sending new requests after this many seconds (0: send all), then drain and check")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python allocations in both server processes (slower) and report the sites that "
                        "grew after warm-up (a leak's source line)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    proc = None
    try:
        if args.url:
            url, api_pid = args.url.rstrip("/"), None
        else:
            proc, url, log = _start_server(args)
            api_pid = proc.pid
            print(f"server pid {proc.pid} on {url} (log {log})", flush=True)
        res = asyncio.run(soak(url, args, api_pid))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("PASS" if not res["failures"] else "FAIL: " + "; ".join(res["failures"]))
    return 0 if not res["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
