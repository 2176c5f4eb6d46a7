"""Cache-aware routing, side by side: round_robin, least_load, prefix_aware and kv_aware
over the same replicas and the same seeded shared-prefix workload, in one run.

A miniature of the playbook's routing experiment (issue 14): ``--replicas``
``tokenmill serve`` processes with small KV pools (``--num-kv-blocks``), each
pinned to its own CPU (``os.sched_setaffinity``, like ``taskset -c``), publish
KV events; a ``tokenmill router`` process per policy sits in front of them.

Workload: ``--groups`` groups, each a long shared system prompt of about
``--prefix-tokens`` tokens, and ``--requests-per-group`` short questions per
group, shuffled (seeded); ``--output-len`` tokens each with ``ignore_eos``,
sent by ``tokenmill bench``'s load generator with ``--max-concurrency``
requests in flight. Total prefix demand (groups × prefix blocks) is printed
as a multiple of one replica's pool. Every policy run sends the same token
sequences with its own ``cache_salt``, so no run can hit blocks a previous
run left behind (the salt changes every block hash; the router hashes with it
too).

Printed per policy: output tok/s, TTFT p50/p90/p99, the replicas' prefix-cache
hit rate over the run (tokens hit / tokens queried, from their /metrics),
the router's routing reasons, and the ratio of output tok/s to round_robin's.

    .venv/bin/python benchmarks/routing.py                 # 2 replicas, ~4-6 min on 2 cores
    .venv/bin/python benchmarks/routing.py --replicas 4 --num-kv-blocks 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.bench.client import EndpointConfig  # noqa: E402
from tokenmill.bench.datasets import SampleRequest  # noqa: E402
from tokenmill.bench.loadgen import LoadConfig, run_benchmark  # noqa: E402
from tokenmill.router.local import LocalReplica, free_ports  # noqa: E402

POLICIES = ["round_robin", "prefix_aware", "kv_aware", "kv_aware:1:0:0", "kv_aware:1:1:0", "kv_aware:1:0:1"]
WORDS = ("harbour ship tide berth cargo crane pilot anchor hull deck mast sail rope knot chart compass "
         "lighthouse buoy quay dock storm wave current reef channel manifest customs ledger clerk watch "
         "mountain snow glacier valley river forest meadow stone bridge tower castle village market").split()


def build_workload(tokenizer, groups: int, prefix_tokens: int, per_group: int, question_words: int,
                   output_len: int, seed: int, zipf_s: float = 0.0) -> tuple[list[SampleRequest], list[int]]:
    """Shared-prefix prompts: ``groups`` system prompts of ~``prefix_tokens`` tokens, short questions, shuffled.

    ``zipf_s == 0``: ``per_group`` questions per group. Otherwise the same total, each question's group
    drawn with probability proportional to ``1 / rank ** zipf_s`` (a few hot system prompts).
    """
    rng = random.Random(seed)
    total = groups * per_group
    if zipf_s > 0:
        weights = [1.0 / (g + 1) ** zipf_s for g in range(groups)]
        counts = [0] * groups
        for g in rng.choices(range(groups), weights=weights, k=total):
            counts[g] += 1
    else:
        counts = [per_group] * groups
    samples, prefix_lens = [], []
    for g in range(groups):
        words = [f"Instructions for desk {g}:"]
        text = ""
        while True:
            words.append(rng.choice(WORDS))
            text = " ".join(words) + "."
            if len(tokenizer.encode(text, add_special_tokens=True)) >= prefix_tokens:
                break
        prefix_lens.append(len(tokenizer.encode(text, add_special_tokens=True)))
        for q in range(counts[g]):
            question = " Question %d: %s?" % (q, " ".join(rng.choice(WORDS) for _ in range(question_words)))
            prompt = text + question
            samples.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=True)), output_len))
    rng.shuffle(samples)
    return samples, prefix_lens


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named metric's samples (all label sets) at ``url``/metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                out[n] += float(line.rsplit(" ", 1)[-1])
    return out


def routed_reasons(url: str) -> dict[str, object]:
    """The router's routing reasons and requests per backend (in backend order), from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, object] = {}
    per_backend = []
    for line in text.splitlines():
        if line.startswith("tokenmill:router_routed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = int(float(line.rsplit(" ", 1)[-1]))
        elif line.startswith("tokenmill:router_requests_total{"):
            per_backend.append(int(float(line.rsplit(" ", 1)[-1])))
    out["per_backend"] = per_backend
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, s) of process ``pid`` and its children (a replica: API process + engine core)."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def summarize_decisions(path: Path, block_size: int = 16) -> dict[str, object]:
    """What a kv_aware router's ``--decision-log`` says about its run.

    Returns counts: ``decisions``; ``off_best`` (requests sent to a backend with less overlap than the best
    one's) split by the cost term that made the best-overlap backend dearer (``decode``, ``prefill`` (its
    queued prefills), ``evicted``); ``off_cheapest`` (the softmax temperature chose a costlier backend);
    ``overestimated`` / ``underestimated`` (the router's overlap vs the backend's ``cached_tokens`` differ by a
    block or more), ``est_cached`` / ``cached`` token sums; ``group_backends`` (per shared prefix, how many
    times its requests changed backend); ``lag_p50_ms`` / ``lag_max_ms`` (KV event lag at the end of a request); ``held`` (requests held at the router, by reason), ``held_mean_ms``.
    """
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    out: dict[str, object] = {"decisions": len(recs)}
    if not recs:
        return out
    off = {"decode": 0, "prefill": 0, "evicted": 0}
    n_off = n_temp = over = under = est = got = 0
    last: dict[str, int] = {}
    switches = 0
    lags = []
    held: dict[str, int] = {}
    held_s: list[float] = []
    for r in sorted(recs, key=lambda r: r.get("t", 0.0)):
        c = {int(k): v for k, v in r["candidates"].items()}
        ch = r["chosen"]
        if r["best_overlap"] and ch not in r["best_overlap"]:
            n_off += 1
            b = c[r["best_overlap"][0]]
            diffs = {"decode": b["decode"] - c[ch]["decode"], "prefill": b["queued_prefill"] - c[ch]["queued_prefill"],
                     "evicted": b["evicted"] - c[ch]["evicted"]}
            off[max(diffs, key=diffs.get)] += 1
        if ch not in r["cheapest"]:
            n_temp += 1
        if r.get("cached_tokens") is not None:
            e, a = r["est_cached_tokens"], r["cached_tokens"]
            est += e
            got += a
            over += e >= a + block_size
            under += a >= e + block_size
        if r["prefix"] in last and last[r["prefix"]] != ch:
            switches += 1
        last[r["prefix"]] = ch
        if r.get("event_lag_s") is not None:
            lags.append(r["event_lag_s"])
        if r.get("held_reason"):
            held[r["held_reason"]] = held.get(r["held_reason"], 0) + 1
            held_s.append(r["held_s"])
    lags.sort()
    out.update(off_best=n_off, off_best_by=off, off_cheapest=n_temp, overestimated=over, underestimated=under,
               est_cached=est, cached=got, group_switches=switches,
               lag_p50_ms=round(1000 * lags[len(lags) // 2], 1) if lags else None,
               lag_max_ms=round(1000 * lags[-1], 1) if lags else None, held=held,
               held_mean_ms=round(1000 * sum(held_s) / len(held_s), 1) if held_s else None)
    return out


def start_router(policy: str, replicas: list[LocalReplica], log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "tokenmill.cli", "router", "--port", str(port), "--policy", policy,
           "--health-check-interval", "1", *extra]
    for r in replicas:
        s = r.spec
        cmd += ["--backend", f"{s.url},kv_events={s.kv_events},replay={s.replay}"]
    fh = open(log, "wb")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("router did not get healthy")
        time.sleep(0.2)
    # wait until every backend is in the rotation
    while True:
        with urllib.request.urlopen(url + "/backends", timeout=2) as r:
            if all(b["healthy"] for b in json.loads(r.read())["backends"]):
                return proc, url
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="KV pool per replica, blocks of 16 tokens.")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=384)
    ap.add_argument("--requests-per-group", type=int, default=10)
    ap.add_argument("--question-words", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="Comma list; 'kv_aware:W' runs kv_aware with --kv-overlap-score-weight W, 'kv_aware:W:E' "
                         "also with --kv-eviction-weight E, 'kv_aware:W:E:R' also with --kv-recompute-weight R "
                         "('kv_aware:1:0:0' is Dynamo's cost); '+FLAG' or '+FLAG=VALUE' pieces add router flags "
                         "(e.g. 'kv_aware+no-kv-prefill-wait', 'kv_aware+active-decode-blocks-threshold=1').")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="Runs per policy (order rotated each repeat); the table shows medians.")
    ap.add_argument("--workloads", default="uniform,zipf:1.2",
                    help="Comma list: 'uniform' (equal questions per group) and/or 'zipf:S' (group popularity "
                         "~ 1/rank^S, a few hot prompts).")
    ap.add_argument("--router-args", default="", help="Extra router flags, e.g. '--cache-threshold 0.5'.")
    ap.add_argument("--router-log-level", default="INFO",
                    help="The routers' --log-level (DEBUG logs every routing decision and first byte).")
    ap.add_argument("--no-pin", action="store_true", help="Do not pin replicas to CPUs.")
    ap.add_argument("--json", default=None, help="Write the results here.")
    ap.add_argument("--decision-log", default=None, metavar="DIR",
                    help="Folder for the kv_aware routers' --decision-log files (one JSON-lines file per run, "
                         "decisions-WORKLOAD-POLICY-REPEAT.jsonl; created if missing) [default: the run's "
                         "temporary folder, printed at start].")
    args = ap.parse_args()
    # bad output paths fail here, before minutes of replicas and runs, not in a traceback at the end
    if args.decision_log:
        try:
            os.makedirs(args.decision_log, exist_ok=True)
            probe = Path(args.decision_log) / ".routing-write-probe"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            ap.error(f"--decision-log {args.decision_log!r} is not a writable folder: {e.strerror or e}")
    if args.json:
        try:
            if os.path.isdir(args.json):
                raise IsADirectoryError(21, "is a directory; give a file path")
            with open(args.json, "a", encoding="utf-8"):
                pass
        except OSError as e:
            ap.error(f"--json {args.json!r} cannot be written: {e.strerror or e}")

    from tokenmill.router.prompt import PromptTokenizer

    tok = PromptTokenizer.load(None).tokenizer
    workloads = {}
    for w in args.workloads.split(","):
        zipf_s = float(w.split(":", 1)[1]) if w.startswith("zipf") else 0.0
        workloads[w] = build_workload(tok, args.groups, args.prefix_tokens, args.requests_per_group,
                                      args.question_words, args.output_len, args.seed, zipf_s)
    bs = 16
    samples, prefix_lens = next(iter(workloads.values()))
    demand_blocks = sum(n // bs for n in prefix_lens)
    ncpu = len(os.sched_getaffinity(0))
    print(f"workloads {list(workloads)}: {len(samples)} requests, {args.groups} groups x "
          f"~{sum(prefix_lens) // len(prefix_lens)}-token prefixes, output {args.output_len}; prefix demand "
          f"{demand_blocks} blocks = {demand_blocks / args.num_kv_blocks:.1f}x one replica's pool "
          f"({args.num_kv_blocks} blocks), {demand_blocks / (args.num_kv_blocks * args.replicas):.2f}x all "
          f"{args.replicas}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    reps = [LocalReplica(["--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "2048",
                          "--max-num-seqs", str(args.max_num_seqs)],
                         cpus=None if args.no_pin else [i % ncpu], log_path=str(tmp / f"replica{i}.log"))
            for i in range(args.replicas)]
    results = []
    names = ("tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total",
             "tokenmill:time_to_first_token_seconds_sum", "tokenmill:time_to_first_token_seconds_count",
             "tokenmill:num_preemptions_total", "tokenmill:prompt_tokens_total")
    try:
        t0 = time.monotonic()
        for r in reps:
            r.start()
        for r in reps:
            r.wait_healthy(600)
        print(f"{args.replicas} replicas up in {time.monotonic() - t0:.0f} s (logs in {tmp})", flush=True)
        model = json.loads(urllib.request.urlopen(reps[0].url + "/v1/models").read())["data"][0]["id"]
        # warm up each replica directly (kernels, allocator), with a salt no run uses
        warm = EndpointConfig(base_url=reps[0].url, endpoint="completions", model=model, ignore_eos=True,
                              temperature=0.0, extra_body={"cache_salt": "warmup"})
        for r in reps:
            warm.base_url = r.url
            asyncio.run(run_benchmark(samples[:2], warm, LoadConfig(max_concurrency=2, disable_tqdm=True)))
        pols = args.policies.split(",")
        plan = []
        for rep in range(args.repeats):  # repeats rotate the policy order (machine load drifts over time)
            order = pols[rep % len(pols):] + pols[:rep % len(pols)]
            plan += [(w, p, rep) for w in workloads.items() for p in order]
        for (wname, (samples, _)), policy, rep in plan:
            # "kv_aware:W[:E[:R]]" = kv_aware with --kv-overlap-score-weight W [--kv-eviction-weight E
            # [--kv-recompute-weight R]] (ablations); "+FLAG" / "+FLAG=VALUE" pieces add router flags
            base, *plus = policy.split("+")
            name, _, weights = base.partition(":")
            weight, _, evw = weights.partition(":")
            evw, _, rcw = evw.partition(":")
            flags = []
            for piece in plus:
                k, eq, v = piece.partition("=")
                flags += [f"--{k}"] + ([v] if eq else [])
            extra = args.router_args.split() + (["--kv-overlap-score-weight", weight] if weight else []) \
                + (["--kv-eviction-weight", evw] if evw else []) \
                + (["--kv-recompute-weight", rcw] if rcw else []) + flags \
                + ["--log-level", args.router_log_level]
            tag = f"{wname.replace(':', '_')}-{policy.replace(':', '_').replace('+', '_').replace('=', '_')}-{rep}"
            dlog = (Path(args.decision_log) if args.decision_log else tmp) / f"decisions-{tag}.jsonl"
            if name == "kv_aware":
                extra += ["--decision-log", str(dlog)]
            router, url = start_router(name, reps, tmp / f"router-{tag}.log", extra)
            try:
                before = [scrape(r.url, names) for r in reps]
                cpu0, wall0 = [cpu_seconds(r.proc.pid) for r in reps], time.monotonic()
                rcpu0 = cpu_seconds(router.pid)
                ep = EndpointConfig(base_url=url, endpoint="completions", model=model, ignore_eos=True,
                                    temperature=0.0, extra_body={"cache_salt": f"routing-{wname}-{policy}-{args.seed}-{rep}"})
                res = asyncio.run(run_benchmark(samples, ep, LoadConfig(max_concurrency=args.max_concurrency,
                                                                       disable_tqdm=True, seed=args.seed,
                                                                       percentiles=[50, 90, 99])))
                after = [scrape(r.url, names) for r in reps]
                wall = time.monotonic() - wall0
                cpu_share = [(cpu_seconds(r.proc.pid) - c) / wall for r, c in zip(reps, cpu0)]
                # the router shares the replicas' CPUs here (it is not pinned): its CPU time is taken from them
                router_cpu = (cpu_seconds(router.pid) - rcpu0) / wall
                reasons = routed_reasons(url)
            finally:
                stop(router)
            q = sum(a[names[0]] - b[names[0]] for a, b in zip(after, before))
            h = sum(a[names[1]] - b[names[1]] for a, b in zip(after, before))
            d = res.metrics.to_dict()
            # per replica: requests (TTFT count), mean TTFT, preemptions, prompt tokens computed -- a starved or
            # thrashing replica shows here
            per_replica = []
            for a, b, share in zip(after, before, cpu_share):
                dd = {k.split(":", 1)[1]: a[k] - b[k] for k in names}
                cnt = dd["time_to_first_token_seconds_count"]
                per_replica.append({"requests": int(cnt), "ttft_mean_s": dd["time_to_first_token_seconds_sum"] / cnt
                                    if cnt else 0.0, "preemptions": int(dd["num_preemptions_total"]),
                                    "prompt_tokens": int(dd["prompt_tokens_total"]),
                                    # CPU seconds the replica got per second of the run: a busy replica pinned
                                    # to one CPU gets ~1.0; far less means the machine starved it
                                    "cpu_share": share})
            row = {"workload": wname, "policy": policy, "repeat": rep, "output_tok_s": d["output_throughput"], "completed": d["completed"],
                   "failed": d["failed"], "ttft_p50_ms": d["p50_ttft_ms"], "ttft_p90_ms": d["p90_ttft_ms"],
                   "ttft_p99_ms": d["p99_ttft_ms"], "hit_rate": h / q if q else 0.0, "reasons": reasons,
                   "duration_s": d["duration"], "per_replica": per_replica, "router_cpu_share": router_cpu}
            if name == "kv_aware":
                row["decisions"] = summarize_decisions(dlog)
            results.append(row)
            print(f"  {wname:8s} {policy:13s} {row['output_tok_s']:7.1f} tok/s  TTFT p50/p90/p99 "
                  f"{row['ttft_p50_ms']:6.0f}/{row['ttft_p90_ms']:6.0f}/{row['ttft_p99_ms']:6.0f} ms  "
                  f"hit {row['hit_rate']:5.1%}  failed {row['failed']}  {reasons}  {row['duration_s']:.0f} s  "
                  f"router cpu {router_cpu:.2f}  "
                  f"replicas " + "; ".join(f"{p['requests']} req ttft {p['ttft_mean_s']:.1f}s "
                                           f"preempt {p['preemptions']} prompt {p['prompt_tokens']} cpu {p['cpu_share']:.2f}"
                                           for p in per_replica), flush=True)
            if "decisions" in row:
                print(f"    decisions: {row['decisions']}", flush=True)
    finally:
        for r in reps:
            r.stop()
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.replicas} replicas x {args.num_kv_blocks} blocks, "
          f"{'pinned' if not args.no_pin else 'unpinned'} on {ncpu} CPUs")
    # one row per (workload, policy): the median over repeats of each figure
    import statistics

    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "hit_rate")
    table = []
    for w in workloads:
        for p in pols:
            runs = [r for r in results if r["workload"] == w and r["policy"] == p]
            if runs:
                table.append({"workload": w, "policy": p, "runs": len(runs),
                              **{k: statistics.median(r[k] for r in runs) for k in keys}})
    print(f"(median of {args.repeats} runs per row)" if args.repeats > 1 else "")
    print("| workload | policy | output tok/s | vs round_robin | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prefix hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        base = next((x for x in table if x["policy"] == "round_robin" and x["workload"] == r["workload"]), None)
        ratio = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else 0.0
        print(f"| {r['workload']} | {r['policy']} | {r['output_tok_s']:.1f} | {ratio:.2f}x | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p90_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['hit_rate']:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
