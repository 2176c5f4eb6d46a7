"""The KV offloading tier (``--kv-offloading-backend native``): shared-prefix traffic with a working set
larger than the pool, with and without the tier, side by side in one run.

Workload: documents of ``--doc-tokens`` tokens (random token ids, seeded), each asked ``--questions``
times (a document + a ``--question-tokens`` question, ``--max-tokens`` greedy output tokens), in a
shuffled order, ``--concurrency`` requests in flight (closed loop). The pool is ``--pool-blocks``
blocks; the number of documents makes their blocks ``ratio`` x the pool (``--ratios``, e.g. 2 3 8).
Per ratio and round:

* ``no_tier``: two passes over the workload with prefix caching only;
* ``tier``: the same two passes with the tier (pass 1 writes it, pass 2 reads it);
* ``restart``: a new engine over the tier's directory (the first pass after a restart);
* with ``--ablate-policy``, ``tier_evict``: the tier storing blocks when they leave the pool.

Figures: TTFT mean/p50/p99 (arrival to first token, in the engine core, no HTTP), output tok/s, the
share of prompt tokens served from cache (pool + tier: ``num_cached_tokens``), the tier's bytes and
its load time per block. ``--crossover`` measures, for a lone request, TTFT with a ``k``-block prefix
loaded from the tier against recomputed (prefix caching reset between runs), for several ``k``, and
the prefill time per block: where loading stops paying, ``min_load_blocks`` should be.

Arms are interleaved and their order alternates by round (the machine is shared). The engine loop is
mirrored from ``tokenmill serve``'s engine core (``core_proc._core_loop``): when a step schedules
nothing (all requests wait on loads) it waits 5 ms for input.

Usage: ``python benchmarks/kv_offload.py [--ratios 2 3 8] [--rounds 2] [--crossover] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

BS = 16


def machine() -> dict:
    flags = subprocess.run("grep -o -w 'amx_tile\\|avx512_bf16\\|avx512f\\|avx2' /proc/cpuinfo | sort -u",
                           shell=True, capture_output=True, text=True).stdout.split()
    model = ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {"cpu": model, "flags": flags, "nproc": os.cpu_count()}


def loadavg() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def workload(args, num_docs: int, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(100, 40000) for _ in range(args.doc_tokens)] for _ in range(num_docs)]
    reqs = []
    for q in range(args.questions):
        for d in range(num_docs):
            question = [rng.randrange(100, 40000) for _ in range(args.question_tokens)]
            reqs.append((f"d{d}q{q}", docs[d] + question))
    rng.shuffle(reqs)
    return reqs


def make_core(args, pool_blocks: int, tier_dir: str | None, **options) -> EngineCore:
    kw = dict(dtype=args.dtype, block_size=BS, num_kv_blocks=pool_blocks, max_model_len=4096,
              max_num_seqs=max(8, args.concurrency), max_num_batched_tokens=args.max_num_batched_tokens)
    if args.model:
        kw["model"] = args.model
    if tier_dir is not None:
        kw.update(kv_offloading_backend="native", kv_offloading_size=args.tier_gib, kv_offloading_dir=tier_dir)
    core = EngineCore(EngineConfig.from_kwargs(**kw), kv_offloading_options=options or None)
    # warm-up (weight packing, first-call costs): two unique prompts, then forget them in the pool
    rng = random.Random(12345)
    for i in range(2):
        lone(core, f"warm{i}", [rng.randrange(100, 40000) for _ in range(4 * BS)],
             SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    if core.kv_offload is not None:
        core.kv_offload.flush(60)
    core.scheduler.reset_prefix_cache()
    return core


def run_pass(core: EngineCore, reqs, args, tag: str) -> dict:
    """Closed loop, ``args.concurrency`` in flight; the loop mirrors the served engine core's."""
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    pending = list(reqs)
    inflight: dict[str, int] = {}
    res = []
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < args.concurrency:
            rid, prompt = pending.pop(0)
            core.add_request(EngineCoreRequest(f"{tag}-{rid}", prompt, sp, arrival_time=time.time()))
            inflight[f"{tag}-{rid}"] = 0
        before = core.num_steps
        for o in core.step():
            if o.req_id not in inflight:
                continue
            inflight[o.req_id] += len(o.new_token_ids)
            if o.finish_reason:
                assert o.finish_reason == "length", o.error
                res.append({"ttft": o.first_token_time - o.arrival_time, "cached": o.num_cached_tokens,
                            "prompt": o.num_prompt_tokens, "out": inflight.pop(o.req_id)})
        if core.num_steps == before:
            time.sleep(0.005)        # as core_proc._core_loop: nothing scheduled, wait for input
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in res)
    return {"requests": len(res), "wall_s": wall, "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "output_tok_s": sum(r["out"] for r in res) / wall,
            "cached_frac": sum(r["cached"] for r in res) / sum(r["prompt"] for r in res)}


def tier_figures(core: EngineCore) -> dict:
    st = core.kv_offload.get_tier_stats()
    return {"blocks_stored": st.blocks_stored, "bytes_stored": st.bytes_stored, "blocks_loaded": st.blocks_loaded,
            "load_ms_per_block": 1e3 * st.load_seconds / st.blocks_loaded if st.blocks_loaded else None,
            "store_ms_per_block": 1e3 * st.store_seconds / st.blocks_stored if st.blocks_stored else None,
            "copy_ms_per_block": 1e3 * st.copy_seconds / st.blocks_stored if st.blocks_stored else None,
            "blocks_evicted": st.blocks_evicted, "saves_dropped": st.saves_dropped,
            "failed_loads": st.num_failed_loads, "resident_blocks": st.resident_blocks}


def bench_ratio(args, ratio: float, rnd: int) -> dict:
    pool = args.pool_blocks
    per_req = -(-(args.doc_tokens + args.question_tokens + args.max_tokens) // BS)
    if args.concurrency * per_req > pool:
        raise SystemExit(f"--concurrency {args.concurrency} x {per_req} blocks per request > --pool-blocks {pool}")
    num_docs = max(1, round(ratio * pool / (args.doc_tokens // BS)))
    doc_blocks = num_docs * (args.doc_tokens // BS)
    reqs = workload(args, num_docs, seed=rnd)
    arms = ["no_tier", "tier"] + (["tier_evict"] if args.ablate_policy else [])
    if rnd % 2:
        arms.reverse()
    out = {"ratio": ratio, "round": rnd, "pool_blocks": pool, "doc_blocks": doc_blocks, "docs": num_docs,
           "actual_ratio": doc_blocks / pool, "arms": {}}
    for arm in arms:
        tier_dir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.tier_root) if arm != "no_tier" else None
        opts = {"store_policy": "evict"} if arm == "tier_evict" else {}
        core = make_core(args, pool, tier_dir, **opts)
        try:
            la = loadavg()
            p1 = run_pass(core, reqs, args, "p1")
            if core.kv_offload is not None:
                core.kv_offload.flush(120)
            p2 = run_pass(core, reqs, args, "p2")
            rec = {"pass1": p1, "pass2": p2, "loadavg": la}
            if core.kv_offload is not None:
                rec["tier"] = tier_figures(core)
        finally:
            core.shutdown()
        print(f"ratio {ratio} round {rnd} {arm:10s} pass1 TTFT mean {p1['ttft_mean_s'] * 1e3:7.1f} ms | pass2 "
              f"TTFT mean {p2['ttft_mean_s'] * 1e3:7.1f} p50 {p2['ttft_p50_s'] * 1e3:7.1f} p99 "
              f"{p2['ttft_p99_s'] * 1e3:7.1f} ms, {p2['output_tok_s']:6.1f} tok/s, cached "
              f"{100 * p2['cached_frac']:5.1f}% (load {la[0]:.1f})", flush=True)
        if arm == "tier":
            core = make_core(args, pool, tier_dir)
            try:
                rp = run_pass(core, reqs, args, "r1")
                rec["restart"] = rp
                rec["restart_tier"] = tier_figures(core)
            finally:
                core.shutdown()
            print(f"ratio {ratio} round {rnd} restart    first pass TTFT mean {rp['ttft_mean_s'] * 1e3:7.1f} ms, "
                  f"{rp['output_tok_s']:6.1f} tok/s, cached {100 * rp['cached_frac']:5.1f}%", flush=True)
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)
        out["arms"][arm] = rec
    return out


def crossover(args) -> dict:
    """TTFT of a lone request: a ``k``-block prefix loaded from the tier vs recomputed."""
    tier_dir = tempfile.mkdtemp(prefix="kvtier-cross-", dir=args.tier_root)
    cores = {"recompute": make_core(args, 256, None), "tier": make_core(args, 256, tier_dir)}
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rng = random.Random(7)
    rows = []
    try:
        for k in args.crossover_blocks:
            for rep in range(args.crossover_reps):
                prompt = [rng.randrange(100, 40000) for _ in range(k * BS + BS)]   # k blocks + 1 block computed
                row = {"k": k, "rep": rep}
                names = list(cores) if rep % 2 == 0 else list(reversed(cores))
                for name in names:
                    core = cores[name]
                    lone(core, f"w{k}-{rep}", prompt, sp)           # first run: computes, writes the tier
                    if core.kv_offload is not None:
                        core.kv_offload.flush(60)
                    core.scheduler.reset_prefix_cache()
                    ttft, cached = lone(core, f"m{k}-{rep}", prompt, sp)
                    row[name + "_ttft_ms"] = 1e3 * ttft
                    row[name + "_cached"] = cached
                rows.append(row)
                print(f"crossover k={k:3d} rep {rep}: tier {row['tier_ttft_ms']:7.2f} ms (cached {row['tier_cached']}) "
                      f"recompute {row['recompute_ttft_ms']:7.2f} ms", flush=True)
        tier_fig = tier_figures(cores["tier"])
    finally:
        for c in cores.values():
            c.shutdown()
        shutil.rmtree(tier_dir, ignore_errors=True)
    summary = []
    for k in args.crossover_blocks:
        rs = [r for r in rows if r["k"] == k]
        summary.append({"k": k, "tier_ttft_ms": statistics.median(r["tier_ttft_ms"] for r in rs),
                        "recompute_ttft_ms": statistics.median(r["recompute_ttft_ms"] for r in rs)})
    # prefill time per block: slope of the recompute TTFT over k (least squares)
    ks = [s["k"] for s in summary]
    ys = [s["recompute_ttft_ms"] for s in summary]
    mk, my = statistics.fmean(ks), statistics.fmean(ys)
    slope = sum((a - mk) * (b - my) for a, b in zip(ks, ys)) / max(1e-9, sum((a - mk) ** 2 for a in ks))
    ys_t = [s["tier_ttft_ms"] for s in summary]
    my_t = statistics.fmean(ys_t)
    slope_t = sum((a - mk) * (b - my_t) for a, b in zip(ks, ys_t)) / max(1e-9, sum((a - mk) ** 2 for a in ks))
    return {"rows": rows, "summary": summary, "prefill_ms_per_block": slope, "tier_ttft_ms_per_block": slope_t,
            "tier": tier_fig, "loadavg": loadavg()}


def lone(core: EngineCore, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[float, int]:
    core.add_request(EngineCoreRequest(rid, prompt, sp, arrival_time=time.time()))
    while True:
        before = core.num_steps
        for o in core.step():
            if o.req_id == rid and o.finish_reason:
                return o.first_token_time - o.arrival_time, o.num_cached_tokens
        if core.num_steps == before:
            time.sleep(0.005)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the packaged SmolLM2-135M GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pool-blocks", type=int, default=64, help="KV pool size in blocks of 16 tokens")
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--questions", type=int, default=2, help="requests per document per pass")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--ratios", type=float, nargs="+", default=[3.0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tier-gib", type=float, default=4.0)
    ap.add_argument("--tier-root", default=None, help="where the tiers' temporary directories go (default: $TMPDIR)")
    ap.add_argument("--ablate-policy", action="store_true", help="add the evict store policy as an arm")
    ap.add_argument("--crossover", action="store_true", help="measure load vs recompute TTFT for k-block prefixes")
    ap.add_argument("--crossover-blocks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--crossover-reps", type=int, default=3)
    ap.add_argument("--skip-traffic", action="store_true")
    ap.add_argument("--out", default=None, help="write the raw JSON here (a file path)")
    args = ap.parse_args()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "loadavg_start": loadavg(), "args": vars(args), "traffic": []}
    print(f"machine: {result['machine']}  load {result['loadavg_start']}", flush=True)
    if args.crossover:
        result["crossover"] = crossover(args)
        c = result["crossover"]
        print(f"prefill {c['prefill_ms_per_block']:.2f} ms/block (recompute TTFT slope); tier TTFT slope "
              f"{c['tier_ttft_ms_per_block']:.2f} ms/block; tier load {c['tier']['load_ms_per_block']} ms/block",
              flush=True)
    save(result, args.out)
    if not args.skip_traffic:
        for ratio in args.ratios:
            for rnd in range(args.rounds):
                result["traffic"].append(bench_ratio(args, ratio, rnd))
                save(result, args.out)          # after every round: a killed run keeps what it measured
        summarize(result)
    result["loadavg_end"] = loadavg()
    save(result, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def save(result: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def summarize(result: dict) -> None:
    """Per ratio: means over rounds of pass 2, the tier's against no tier, and the restart's first pass."""
    by_ratio: dict[float, list] = {}
    for t in result["traffic"]:
        by_ratio.setdefault(t["ratio"], []).append(t)
    result["summary"] = []
    for ratio, ts in by_ratio.items():
        row = {"ratio": ratio, "actual_ratio": ts[0]["actual_ratio"], "pool_blocks": ts[0]["pool_blocks"]}
        for arm in ts[0]["arms"]:
            p2 = [t["arms"][arm]["pass2"] for t in ts]
            row[arm] = {k: statistics.fmean(p[k] for p in p2) for k in
                        ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "output_tok_s", "cached_frac")}
            if arm == "tier":
                rp = [t["arms"][arm]["restart"] for t in ts]
                row["restart"] = {k: statistics.fmean(p[k] for p in rp) for k in
                                  ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "output_tok_s", "cached_frac")}
                row["load_ms_per_block"] = statistics.fmean(t["arms"][arm]["tier"]["load_ms_per_block"] or 0 for t in ts)
        if "tier" in row and "no_tier" in row:
            row["ttft_mean_ratio"] = row["tier"]["ttft_mean_s"] / row["no_tier"]["ttft_mean_s"]
            row["target_met"] = row["tier"]["cached_frac"] >= 0.8 and row["ttft_mean_ratio"] <= 0.5
        result["summary"].append(row)
        print(f"== ratio {ratio} (pool {row['pool_blocks']} blocks): pass 2 cached "
              f"{100 * row['tier']['cached_frac']:.1f}% with the tier vs {100 * row['no_tier']['cached_frac']:.1f}% "
              f"without; TTFT mean {1e3 * row['tier']['ttft_mean_s']:.1f} vs {1e3 * row['no_tier']['ttft_mean_s']:.1f} ms "
              f"({row['ttft_mean_ratio']:.2f}x); restart first pass {1e3 * row['restart']['ttft_mean_s']:.1f} ms, "
              f"cached {100 * row['restart']['cached_frac']:.1f}%; target met: {row['target_met']}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
