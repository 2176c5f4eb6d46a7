"""Where a c=64 serving run's wall time goes, and A/B of tokenmill checkouts on that run, in one process.

For each arm (``--arms NAME=CHECKOUT,...``; a checkout's source is put first on ``PYTHONPATH``, so ``main=/work/main``
runs main's engine with this venv), and for each repetition (arms interleaved), one fresh ``tokenmill serve``
(float32 = ``auto`` on AVX2, 2 threads, the engine's defaults plus ``--tokenmill-args``) serves one cell of
``compare_engines.py --quick``: ``--num-prompts`` requests at concurrency ``--concurrency`` (random:
256-token prompts -> 128 tokens, ``ignore_eos``, greedy, ``--seed``; or MT-bench first turns), after the same
warm-up (4 random requests, seed 123). During the cell it takes:

- the client's metrics (output tok/s, mean TPOT, p99 TTFT, vLLM's definitions: ``tokenmill bench serve``);
- CPU seconds (``psutil``, user + system) of the API process (uvicorn, SSE, detokenisation), the engine-core
  process(es) and the load generator (this process), over the cell's wall time;
- with ``TOKENMILL_STEP_TRACE`` (arms whose engine has it): every engine-core step of the cell (see
  :class:`tokenmill.engine.core_proc.StepTrace`), summed into decode-only / mixed (prompt chunks beside decodes)
  / prefill-only steps, the runner's parts, the scheduler's part, the loop outside steps (sending outputs and
  stats, reading inputs, idle waits), batch sizes reached and preemptions.

Every server is stopped before the next starts (and on failure). Run as one quiet slot::

    /work/bin/quiet .venv/bin/python benchmarks/serve_c64_profile.py --arms main=/work/main,branch=. --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import compare_engines as ce  # noqa: E402


def cpu_seconds(proc: Any) -> float:
    """User + system CPU seconds of one psutil process (0 when it is gone)."""
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - a process that ended
        return 0.0


def process_tree(pid: int) -> dict[str, Any]:
    """``{"api": Process, "core:PID": Process, ...}``: the server process and its descendants."""
    import psutil

    root = psutil.Process(pid)
    out = {"api": root}
    for c in root.children(recursive=True):
        out[f"child:{c.pid}:{c.name()}"] = c
    return out


def summarise_trace(rows: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Sums of a step trace's rows whose step started in ``[t0, t1]`` (``time.monotonic`` seconds).

    Returns seconds per kind of step (``decode_only``, ``mixed``, ``prefill_only``: count, total, mean), the
    runner's parts, the scheduler's part, ``send`` (outputs + stats to the API process), ``outside`` (from one
    step's send to the next loop's step start: reading inputs, idle waits), the decode batch sizes reached
    and the preemptions counted in the window.
    """
    rows = [r for r in rows if t0 <= r["start"] <= t1]
    if not rows:
        return {}
    kinds: dict[str, list[float]] = {"decode_only": [], "mixed": [], "prefill_only": []}
    parts = {k: 0.0 for k in ("prepare", "forward", "sample", "schedule", "send", "outside")}
    for prev, r in zip([None] + rows[:-1], rows):
        step = r["end"] - r["start"]
        kind = "decode_only" if r["prefill"] == 0 else ("prefill_only" if r["decode"] == 0 else "mixed")
        kinds[kind].append(step)
        for k in ("prepare", "forward", "sample", "schedule"):
            parts[k] += r.get(k) or 0.0
        parts["send"] += r["sent"] - r["end"]
        if prev is not None:
            parts["outside"] += r["start"] - prev["sent"]
    steps_total = sum(sum(v) for v in kinds.values())
    decode_sizes = [r["decode"] for r in rows if r["prefill"] == 0]
    return {
        "window_s": rows[-1]["sent"] - rows[0]["start"], "steps": len(rows), "steps_s": steps_total,
        "kinds": {k: {"n": len(v), "s": sum(v), "mean_ms": (1e3 * sum(v) / len(v)) if v else None}
                  for k, v in kinds.items()},
        "parts_s": parts,
        "runner_other_s": steps_total - parts["prepare"] - parts["forward"] - parts["sample"] - parts["schedule"],
        "decode_only_batch": {"max": max(decode_sizes, default=0),
                              "median": statistics.median(decode_sizes) if decode_sizes else 0,
                              "mean": statistics.fmean(decode_sizes) if decode_sizes else 0},
        "prefill_tokens": sum(r["prefill"] for r in rows), "decode_tokens": sum(r["decode"] for r in rows),
        "max_running": max(r["running"] for r in rows),
        "preemptions": rows[-1]["preemptions"] - rows[0]["preemptions"],
        "mixed_prefill_tokens_mean": (statistics.fmean(r["prefill"] for r in rows if r["prefill"] and r["decode"])
                                      if kinds["mixed"] else None),
    }


def hide_fast_http_dir(log_dir: Path) -> Path:
    """A directory whose ``uvloop`` and ``httptools`` packages raise ImportError: first on an arm's
    ``PYTHONPATH``, the server runs as installed without them (uvicorn's ``auto`` then picks asyncio's own
    loop and the pure-Python h11 protocol)."""
    d = log_dir / "hide_fast_http"
    for m in ("uvloop", "httptools"):
        (d / m).mkdir(parents=True, exist_ok=True)
        (d / m / "__init__.py").write_text(f"raise ImportError('{m} hidden by serve_c64_profile.py')\n")
    return d


def run_arm(name: str, checkout: Path, hide_fast_http: bool, args: argparse.Namespace, samples: list,
            warm_samples: list, tokenizer: Any, gguf: Path, log_dir: Path, rep: int) -> dict[str, Any]:
    """One fresh server of ``checkout``, one cell; the server is stopped before returning."""
    from tokenmill.bench.client import EndpointConfig
    from tokenmill.bench.loadgen import LoadConfig, fetch_models, run_benchmark
    import psutil

    trace = Path(tempfile.mkstemp(prefix=f"trace-{name}-", suffix=".jsonl", dir=log_dir)[1])
    env = ce.thread_env(args.threads)
    paths = [str(checkout.resolve())]
    if hide_fast_http:
        paths.insert(0, str(hide_fast_http_dir(log_dir)))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["TOKENMILL_STEP_TRACE"] = str(trace)
    port = ce.free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(gguf), "--dtype", "auto",
           "--host", "127.0.0.1", "--port", str(port), *args.tokenmill_args]
    server = ce.Server(f"tokenmill-{name}", cmd, env, port, log_dir / f"{name}-{rep}.log")
    out: dict[str, Any] = {"arm": name, "checkout": str(checkout), "hide_fast_http": hide_fast_http, "rep": rep,
                           "command": cmd}
    try:
        out["startup_s"] = server.start(300)
        model = (asyncio.run(fetch_models(server.base_url)) or [""])[0]
        wl = ce.WORKLOADS[args.workload]
        load = LoadConfig(max_concurrency=4, seed=0, num_warmups=0, disable_tqdm=True, percentiles=[50.0, 99.0])
        warm_cfg = EndpointConfig(base_url=server.base_url, endpoint=wl.endpoint, model=model,
                                  ignore_eos=wl.ignore_eos, temperature=0.0, timeout_s=600)
        asyncio.run(run_benchmark(warm_samples, warm_cfg, load, tokenizer))
        procs = process_tree(server.proc.pid)
        me = psutil.Process()
        cpu0 = {k: cpu_seconds(p) for k, p in procs.items()}
        me0 = cpu_seconds(me)
        la0 = ce.load_average()
        t0m, t0 = time.monotonic(), time.perf_counter()
        load = LoadConfig(max_concurrency=args.concurrency, seed=0, num_warmups=0, disable_tqdm=True,
                          percentiles=[50.0, 90.0, 99.0], goodput={"ttft": 2000.0, "tpot": 100.0})
        res = asyncio.run(run_benchmark(samples, warm_cfg, load, tokenizer))
        wall = time.perf_counter() - t0
        t1m = time.monotonic()
        cpu1 = {k: cpu_seconds(p) for k, p in procs.items()}
        me1 = cpu_seconds(me)
        m = res.metrics.to_dict()
        out.update({
            "wall_s": wall, "load_average_before": la0, "load_average_after": ce.load_average(),
            "output_throughput": m.get("output_throughput"), "mean_tpot_ms": m.get("mean_tpot_ms"),
            "p99_ttft_ms": m.get("p99_ttft_ms"), "mean_ttft_ms": m.get("mean_ttft_ms"),
            "request_goodput": m.get("request_goodput"), "failed": m.get("failed"),
            "cpu_s": {"api": cpu1["api"] - cpu0["api"],
                      "engine_core": sum(cpu1[k] - cpu0[k] for k in procs if k != "api"),
                      "client": me1 - me0},
            "processes": {k: round(cpu1[k] - cpu0[k], 3) for k in procs},
        })
        server.stop()
        rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
        out["trace"] = summarise_trace(rows, t0m, t1m) if rows else None
    finally:
        server.stop()
        trace.unlink(missing_ok=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="branch=.", help="NAME=CHECKOUT[+h11],... (interleaved per repetition; "
                    "+h11: uvloop and httptools hidden from that server)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workload", default="random", choices=sorted(ce.WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (compare_engines uses 0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenmill-args", default="", help="extra serve flags, one string")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.tokenmill_args = args.tokenmill_args.split()
    # a timeout's SIGTERM unwinds through the servers' stop() (they run in their own sessions)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from tokenmill.bench.datasets import build_dataset
    from tokenmill.bench.tokenizer import default_gguf_path, get_tokenizer

    gguf = default_gguf_path()
    tokenizer = get_tokenizer(str(gguf))
    if args.workload == "random":
        samples = build_dataset("random", tokenizer, args.num_prompts, input_len=256, output_len=128, seed=args.seed)
    else:
        samples = build_dataset("mt-bench", tokenizer, args.num_prompts, output_len=128, seed=args.seed)
    warm = build_dataset("random", tokenizer, 4, input_len=256, output_len=8, seed=123)
    arms = []
    for a in args.arms.split(","):
        name, spec = a.split("=", 1)
        arms.append((name, Path(spec.removesuffix("+h11")), spec.endswith("+h11")))
    log_dir = Path(tempfile.mkdtemp(prefix="serve_c64_"))
    results = []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for rep in range(args.reps):
        order = arms if rep % 2 == 0 else arms[::-1]
        for name, checkout, hide in order:
            r = run_arm(name, checkout, hide, args, samples, warm, tokenizer, gguf, log_dir, rep)
            results.append(r)
            c = r["cpu_s"]
            print(f"{name} rep {rep}: {r['output_throughput']:.1f} tok/s, mean TPOT {r['mean_tpot_ms']:.1f} ms, "
                  f"p99 TTFT {r['p99_ttft_ms']:.0f} ms, wall {r['wall_s']:.1f} s; CPU s: api {c['api']:.1f}, "
                  f"core {c['engine_core']:.1f}, client {c['client']:.1f}", flush=True)
            if r.get("trace"):
                t = r["trace"]
                print("   " + json.dumps({k: t[k] for k in ("steps", "steps_s", "kinds", "parts_s",
                                                            "decode_only_batch", "preemptions",
                                                            "mixed_prefill_tokens_mean")}), flush=True)
    doc = {"started_utc": started, "ended_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": ce.machine_info(), "workload": args.workload, "concurrency": args.concurrency,
           "num_prompts": args.num_prompts, "seed": args.seed, "tokenmill_args": args.tokenmill_args,
           "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
