"""The cost of batch invariance (``--batch-invariant``, the default) against ``--no-batch-invariant``, side by side.

Two offline engines over the packaged SmolLM2-135M Q4_1 GGUF live in one process, one per arm; every
workload runs on both arms in alternation (A B B A A B ...) ``--reps`` times, so the shared machine's load
drifts over both alike, and the median of each arm is reported with the ratio invariant / plain:

* ``prefill``: ``--prefill-prompts`` prompts of ``--prefill-len`` random tokens, ``max_tokens=1``
  (prompt tokens per second; the prefix cache is off so every run computes its prompts);
* ``decode-B``: B requests of 16-token prompts and ``--decode-tokens`` greedy output tokens each, all
  admitted at once (output tokens per second over the run: mostly decode steps of B tokens);
* ``mixed``: 16 requests of random prompt lengths 16-400 and 64 output tokens, all admitted at once under
  the 2048-token budget (the prompts take two steps, the second beside the first ones' decodes).

Also checks, per workload, that the invariant arm's outputs do not change between repetitions.
``--float32-arm`` adds the invariant mode on the float32 low-bit kernel (``TOKENMILL_CPU_INVARIANT_KERNEL=
float32``; the default invariant kernel is the integer one), interleaved with the other two.

    python benchmarks/batch_invariance.py [--dtype bfloat16] [--reps 3] [--json out.json]

Prints the machine (CPU flags, load average before and after); put figures with that context.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import LLM, SamplingParams, envs  # noqa: E402


def cpu_flags() -> list[str]:
    want = {"amx_tile", "avx512_bf16", "avx512f", "avx2", "avx512_vnni"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return sorted(want & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def workloads(args, vocab: int) -> dict[str, tuple[list[list[int]], list[SamplingParams], str]]:
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(100, vocab) for _ in range(n)]
    out = {"prefill": ([tok(args.prefill_len) for _ in range(args.prefill_prompts)],
                       [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)] * args.prefill_prompts,
                       "prompt")}
    for b in args.batches:
        out[f"decode-{b}"] = ([tok(16) for _ in range(b)],
                              [SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)] * b,
                              "output")
    out["mixed"] = ([tok(rng.randrange(16, 400)) for _ in range(16)],
                    [SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)] * 16, "output")
    return out


def run_once(llm: LLM, prompts, params, count: str) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(p) for p in prompts) if count == "prompt" else sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt, [o.outputs[0].token_ids for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-prompts", type=int, default=2)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--json", default="")
    ap.add_argument("--float32-arm", action="store_true",
                    help="a third arm: the invariant mode on the float32 low-bit kernel "
                         "(TOKENMILL_CPU_INVARIANT_KERNEL=float32)")
    args = ap.parse_args()
    common = dict(dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=64, max_num_batched_tokens=2048,
                  kv_cache_memory="512MiB")
    load0 = loadavg()
    arms = {"invariant": LLM(batch_invariant=True, **common), "plain": LLM(batch_invariant=False, **common)}
    if args.float32_arm:     # the invariant mode on the float32 low-bit kernel (the ablation of the int8 default)
        envs.set("TOKENMILL_CPU_INVARIANT_KERNEL", "float32")
        try:
            arms["invariant-f32"] = LLM(batch_invariant=True, **common)
        finally:
            envs.unset("TOKENMILL_CPU_INVARIANT_KERNEL")
    vocab = arms["plain"].engine_core.executor.arch.vocab_size
    results: dict[str, dict[str, list[float]]] = {}
    stable: dict[str, bool] = {}
    for name, (prompts, params, count) in workloads(args, vocab).items():
        for arm in arms.values():       # warm-up (first-use packing, buffers)
            run_once(arm, prompts[:1], params[:1], count)
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        seen = None
        stable[name] = True
        for rep in range(args.reps):
            order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
            for arm in order:
                rate, ids = run_once(arms[arm], prompts, params, count)
                rates[arm].append(rate)
                if arm == "invariant":
                    stable[name] &= seen is None or ids == seen
                    seen = ids
        results[name] = rates
        inv, pl = statistics.median(rates["invariant"]), statistics.median(rates["plain"])
        f32 = (f"  invariant-f32 {statistics.median(rates['invariant-f32']):8.1f} (ratio "
               f"{statistics.median(rates['invariant-f32']) / pl:5.3f})") if "invariant-f32" in rates else ""
        print(f"{name:>12}: invariant {inv:8.1f} {count} tok/s  plain {pl:8.1f}  ratio {inv / pl:5.3f}{f32}  "
              f"(runs: {' | '.join(', '.join(f'{x:.1f}' for x in r) for r in rates.values())}; "
              f"invariant outputs stable: {stable[name]})", flush=True)
    load1 = loadavg()
    print(f"machine: {' '.join(cpu_flags())}; {os.cpu_count()} CPUs; load average {load0} -> {load1}; "
          f"dtype {args.dtype}; reps {args.reps} interleaved")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flags": cpu_flags(), "load_before": load0, "load_after": load1, "dtype": args.dtype,
                       "reps": args.reps, "results": results, "stable": stable,
                       "ratios": {k: statistics.median(v["invariant"]) / statistics.median(v["plain"])
                                  for k, v in results.items()},
                       "ratios_f32": {k: statistics.median(v["invariant-f32"]) / statistics.median(v["plain"])
                                      for k, v in results.items() if "invariant-f32" in v}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
