"""Time to first token of short requests queued behind long prompts, with and without
``--long-prefill-token-threshold``, side by side in one run.

Workload (seeded, identical for every server): ``--num-prompts`` requests at a
Poisson ``--request-rate``; every ``--long-every``-th prompt has about
``--long-words`` words (~1.2 tokens each), the others ``--short-words``; each
asks for ``--output-len`` tokens with ``ignore_eos``. Without a cap a long
prompt takes the whole step budget (``--max-num-batched-tokens``) until it is
done, and short requests that arrive meanwhile wait; with the cap it leaves
budget for them every step (vLLM's flag of the same name; Sarathi-Serve,
arXiv 2403.02310, §4.2 on chunk sizes).

For each threshold a fresh ``tokenmill serve`` runs the same workload through
``tokenmill bench serve``; printed: TTFT p50/p90/p99 of the short and of the
long requests, TPOT p99 and output throughput. The last column pair is the
ratio against the first threshold.

    .venv/bin/python benchmarks/long_prefill_threshold.py --thresholds 0,256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_engines import REPO, Server, free_port, load_average, thread_env  # noqa: E402

WORDS = ("the of paged attention stores key value cache fixed size blocks memory scheduler batch decode "
         "prefill token latency goodput request step budget").split()


def write_workload(path: Path, num_prompts: int, long_every: int, long_words: int, short_words: int,
                   output_len: int, seed: int) -> list[bool]:
    """Write the jsonl prompts file; returns, per request, whether it is a long one."""
    rng = random.Random(seed)
    is_long = []
    with open(path, "w") as f:
        for i in range(num_prompts):
            long = i % long_every == 0
            words = " ".join(rng.choice(WORDS) for _ in range(long_words if long else short_words))
            f.write(json.dumps({"prompt": ("Summarise: " if long else "Continue: ") + words,
                                "output_len": output_len}) + "\n")
            is_long.append(long)
    return is_long


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation, as numpy's default."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def run_one(threshold: int, args, workload: Path, out_dir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--long-prefill-token-threshold", str(threshold)]
    server = Server(f"tokenmill-t{threshold}", cmd, thread_env(args.threads), port,
                    out_dir / f"server-t{threshold}.log")
    server.start(args.startup_timeout)
    result = out_dir / f"bench-t{threshold}.json"
    try:
        subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", server.base_url,
                        "--dataset", "jsonl", "--dataset-path", str(workload), "--num-prompts",
                        str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", str(args.seed),
                        "--ignore-eos", "--num-warmups", "1", "--disable-tqdm", "--save-result",
                        "--result-filename", str(result)],
                       check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)
    finally:
        server.stop()
    return json.loads(result.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", default="0,256", help="comma-separated; 0 = no cap (the baseline)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=1.5, help="Poisson arrivals, requests/s")
    ap.add_argument("--long-every", type=int, default=6)
    ap.add_argument("--long-words", type=int, default=1400)
    ap.add_argument("--short-words", type=int, default=25)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300)
    args = ap.parse_args()

    thresholds = [int(t) for t in args.thresholds.split(",")]
    out_dir = Path(tempfile.mkdtemp(prefix="long-prefill-"))
    workload = out_dir / "mixed.jsonl"
    is_long = write_workload(workload, args.num_prompts, args.long_every, args.long_words, args.short_words,
                             args.output_len, args.seed)
    print(f"workload: {args.num_prompts} requests at {args.request_rate:g} req/s, {sum(is_long)} long "
          f"(~{args.long_words} words), the rest ~{args.short_words} words, {args.output_len} output tokens; "
          f"step budget {args.max_num_batched_tokens}; load average {load_average():.2f}; files in {out_dir}")
    rows = []
    for t in thresholds:
        res = run_one(t, args, workload, out_dir)
        ttfts, lens = res["ttfts"], res["input_lens"]
        cut = statistics.median(lens)   # long prompts are far above the median, short ones at or below
        short = [x * 1e3 for x, n in zip(ttfts, lens) if x is not None and n <= cut]
        long = [x * 1e3 for x, n in zip(ttfts, lens) if x is not None and n > cut]
        rows.append((t, short, long, res.get("p99_tpot_ms", float("nan")), res.get("output_throughput", 0.0)))
    base = rows[0]
    print(f"\n{'threshold':>9} {'short TTFT p50/p90/p99 ms':>28} {'long TTFT p50/p99 ms':>22} "
          f"{'p99 TPOT ms':>11} {'out tok/s':>9} {'short p90 vs base':>17}")
    for t, short, long, tpot, tput in rows:
        print(f"{t:>9} {pct(short, 50):>10.0f}/{pct(short, 90):>7.0f}/{pct(short, 99):>7.0f} "
              f"{pct(long, 50):>12.0f}/{pct(long, 99):>7.0f} {tpot:>11.1f} {tput:>9.1f} "
              f"{pct(base[1], 90) / pct(short, 90):>16.2f}x")
    print(f"load average at the end {load_average():.2f}")


if __name__ == "__main__":
    main()
