"""Cross-check ``tokenmill bench serve`` against guidellm on one server and workload.

Runs the same closed-loop workload twice against one OpenAI-compatible server —
first with tokenmill's load generator, then with guidellm — and prints TTFT,
ITL and throughput side by side with their relative difference (pass: within
``--tolerance``, default 10%).

Workload: random prompts of ``--input-len`` tokens, ``--output-len`` output
tokens (``ignore_eos``), ``--num-prompts`` requests, ``--concurrency``
requests in flight (tokenmill: ``--max-concurrency`` with rate inf; guidellm:
``--profile kind=concurrent,streams=N``). A closed loop is used because the
two tools' open-loop arrival processes differ; under a fixed concurrency the
server alone sets the pace.

Definitions compared (guidellm's JSON names in brackets):
  * TTFT mean/median, ms        [time_to_first_token_ms]
  * ITL mean, ms                [inter_token_latency_ms: (latency − TTFT)/(tokens − 1),
                                 weighted per token; equal to tokenmill's ITL mean when
                                 each chunk carries one token]
  * output throughput, tok/s    [output tokens / benchmark duration]
  * request throughput, req/s   [successful requests / benchmark duration]

On a small machine the load generators take CPU from the server while they
run, and each tool does so differently (guidellm runs worker processes), which
skews the comparison: pin the server to some cores and the clients to others
(``taskset -c 0 tokenmill serve ...`` and ``--client-cpus 1``), and alternate
the tools (``--rounds N``) so that slow drift of the machine averages out.

guidellm is run as a subprocess with ``HF_HUB_OFFLINE=1`` and the benchmark
tokenizer exported to a local folder. Install it in its own virtual
environment (it pins versions of click and multidict that differ from
tokenmill's)::

    python -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm
    python benchmarks/crosscheck_bench.py --guidellm /tmp/guidellm-venv/bin/guidellm --fake-server
    python benchmarks/crosscheck_bench.py --guidellm ... --base-url http://127.0.0.1:8000

Exit status: 0 when every figure agrees within the tolerance, 1 otherwise,
2 when guidellm cannot be run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tokenmill.bench.client import EndpointConfig  # noqa: E402
from tokenmill.bench.datasets import build_dataset  # noqa: E402
from tokenmill.bench.loadgen import LoadConfig, fetch_models, run_benchmark  # noqa: E402
from tokenmill.bench.tokenizer import get_tokenizer, resolve_tokenizer_path  # noqa: E402


def run_tokenmill(base_url: str, model: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, float]:
    """tokenmill's figures for the workload (ms, tok/s, req/s)."""
    samples = build_dataset("random", tokenizer, args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, seed=args.seed)
    cfg = EndpointConfig(base_url=base_url, endpoint="completions", model=model, ignore_eos=True)
    load = LoadConfig(max_concurrency=args.concurrency, num_warmups=args.concurrency, seed=args.seed,
                      disable_tqdm=True, percentiles=[50, 99])
    res = asyncio.run(run_benchmark(samples, cfg, load, tokenizer))
    m = res.metrics
    return {
        "completed": m.completed, "failed": m.failed,
        "ttft_mean_ms": m.stats["ttft"]["mean"], "ttft_median_ms": m.stats["ttft"]["median"],
        "itl_mean_ms": m.stats["itl"]["mean"], "tpot_mean_ms": m.stats["tpot"]["mean"],
        "output_throughput": m.output_throughput, "request_throughput": m.request_throughput,
        "duration_s": m.duration_s, "total_output_tokens": m.total_output,
    }


def run_guidellm(exe: str, base_url: str, model: str, tok_dir: Path, out_json: Path,
                 args: argparse.Namespace) -> dict[str, float]:
    """guidellm's figures for the workload, read from its JSON report."""
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
           "--tokenizer", f"kind=huggingface_auto,model={tok_dir}",
           "--constraint", f"kind=max_requests,count={args.num_prompts}",
           "--output", f"kind=json,path={out_json}",
           "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not out_json.is_file():
        raise RuntimeError(f"guidellm exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    doc = json.loads(out_json.read_text())
    b = doc["benchmarks"][0]
    m = b["metrics"]

    def stat(key: str, field: str = "mean") -> float:
        return float(m[key]["successful"][field])

    duration = float(b["duration"])
    completed = int(m["request_totals"]["successful"])
    out_tokens = float(m["output_token_count"]["successful"]["total_sum"])
    return {
        "completed": completed, "failed": int(m["request_totals"]["errored"]),
        "ttft_mean_ms": stat("time_to_first_token_ms"), "ttft_median_ms": stat("time_to_first_token_ms", "median"),
        "itl_mean_ms": stat("inter_token_latency_ms"), "tpot_mean_ms": stat("inter_token_latency_ms"),
        "output_throughput": out_tokens / duration, "request_throughput": completed / duration,
        "duration_s": duration, "total_output_tokens": out_tokens,
    }


COMPARED = [("TTFT mean (ms)", "ttft_mean_ms"), ("TTFT median (ms)", "ttft_median_ms"),
            ("ITL mean (ms)", "itl_mean_ms"), ("Output throughput (tok/s)", "output_throughput"),
            ("Request throughput (req/s)", "request_throughput")]


def compare(tm: dict[str, float], gl: dict[str, float], tolerance: float) -> tuple[list[dict[str, Any]], bool]:
    """Rows of (metric, tokenmill, guidellm, relative difference, ok) and overall ok."""
    rows = []
    ok_all = True
    for name, key in COMPARED:
        a, b = tm[key], gl[key]
        rel = abs(a - b) / max(abs(b), 1e-12)
        ok = rel <= tolerance
        ok_all &= ok
        rows.append({"metric": name, "tokenmill": a, "guidellm": b, "rel_diff": rel, "ok": ok})
    return rows, ok_all


def mean_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of several runs' figures (counts are summed)."""
    return {k: (sum(r[k] for r in runs) if k in ("completed", "failed", "total_output_tokens")
                else sum(r[k] for r in runs) / len(runs)) for k in runs[0]}


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The comparison as a Markdown table (for docs/benchmarks/crosscheck.md)."""
    lines = [header, "", "| metric | tokenmill | guidellm | difference |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['metric']} | {r['tokenmill']:.2f} | {r['guidellm']:.2f} | "
                     f"{100 * r['rel_diff']:.1f}% {'✓' if r['ok'] else '✗'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="Server to test (default with --fake-server: a fake one).")
    ap.add_argument("--fake-server", action="store_true",
                    help="Start tests/bench/fake_server.py in-process (TTFT 50 ms, ITL 10 ms).")
    ap.add_argument("--model", default=None, help="Model id (default: first from /v1/models).")
    ap.add_argument("--tokenizer", default=None, help="Local tokenizer (default: tokenmill's default model).")
    ap.add_argument("--guidellm", default=shutil.which("guidellm"), help="guidellm executable.")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--timeout", type=float, default=1800.0, help="guidellm time limit, s.")
    ap.add_argument("--rounds", type=int, default=1,
                    help="Alternate the tools: tokenmill, then ROUNDS x (guidellm, tokenmill); compare the mean of "
                         "guidellm's runs with the mean of tokenmill's, and report tokenmill's own run-to-run "
                         "spread (server or machine drift).")
    ap.add_argument("--client-cpus", default=None,
                    help="Pin this script and guidellm to these CPUs (e.g. '1'; Linux only), so that the load "
                         "generators do not take CPU from a server pinned elsewhere (taskset -c 0 ...).")
    ap.add_argument("--output", default=None, help="Write the comparison (JSON) here; a .md twin is written too.")
    args = ap.parse_args(argv)

    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})   # guidellm inherits it
    if not args.guidellm or not Path(args.guidellm).exists():
        print("guidellm not found: install it (see this script's docstring) and pass --guidellm PATH",
              file=sys.stderr)
        return 2
    fake = None
    base_url = args.base_url
    if args.fake_server or not base_url:
        from tests.bench.fake_server import FakeOpenAIServer, FakeServerConfig
        fake = FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01))
        fake.start()
        base_url = fake.base_url
    try:
        model = args.model or asyncio.run(fetch_models(base_url))[0]
        tok_path = resolve_tokenizer_path(args.tokenizer, model)
        tokenizer = get_tokenizer(str(tok_path))
        with tempfile.TemporaryDirectory(prefix="crosscheck-") as tmp:
            tok_dir = Path(tmp) / "tokenizer"
            tokenizer.save_pretrained(str(tok_dir))
            print(f"server {base_url}, model {model}, {args.num_prompts} requests, input {args.input_len}, "
                  f"output {args.output_len}, concurrency {args.concurrency}", flush=True)
            tm_runs: list[dict[str, float]] = []
            gl_runs: list[dict[str, float]] = []
            for i in range(2 * args.rounds + 1):
                t = time.perf_counter()
                if i % 2 == 0:
                    tm_runs.append(run_tokenmill(base_url, model, tokenizer, args))
                    print(f"tokenmill run {len(tm_runs)} done in {time.perf_counter() - t:.1f} s", flush=True)
                    continue
                try:
                    gl_runs.append(run_guidellm(args.guidellm, base_url, model, tok_dir,
                                                Path(tmp) / f"guidellm{i}.json", args))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"guidellm failed: {exc}", file=sys.stderr)
                    return 2
                print(f"guidellm run {len(gl_runs)} done in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        if fake is not None:
            fake.stop()
    # tokenmill ran before and after every guidellm run: compare the means, and
    # show tokenmill's own spread (server or machine noise) between its runs.
    spread = {key: (max(r[key] for r in tm_runs) - min(r[key] for r in tm_runs)) / max(
        min(r[key] for r in tm_runs), 1e-12) for _, key in COMPARED}
    print("tokenmill run-to-run spread (max-min)/min over its runs: " +
          ", ".join(f"{name} {100 * spread[key]:.1f}%" for name, key in COMPARED))
    tm, gl = mean_runs(tm_runs), mean_runs(gl_runs)
    rows, ok = compare(tm, gl, args.tolerance)
    header = (f"tokenmill vs guidellm — {'fake server' if fake else base_url}, model {model}, "
              f"{args.num_prompts} requests × {args.input_len} in / {args.output_len} out, "
              f"concurrency {args.concurrency}, means of {len(tm_runs)} tokenmill and {len(gl_runs)} guidellm "
              f"runs alternated")
    md = markdown(rows, header)
    print(md)
    print(f"requests: tokenmill {tm['completed']} ok / {tm['failed']} failed; "
          f"guidellm {gl['completed']} ok / {gl['failed']} failed")
    print("AGREE within {:.0%}".format(args.tolerance) if ok else "DISAGREE beyond {:.0%}".format(args.tolerance))
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"header": header, "rows": rows, "tokenmill": tm, "guidellm": gl,
                                   "tokenmill_runs": tm_runs, "guidellm_runs": gl_runs,
                                   "tokenmill_spread": spread,
                                   "args": vars(args)}, indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(md + "\n")
    return 0 if ok and not math.isnan(sum(r["rel_diff"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
