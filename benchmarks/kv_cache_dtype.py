"""Ablation of the KV cache dtype for a float32 model: decode steps with a float32 and a bfloat16 cache.

A float32 model on the CPU low-bit path (the AVX2 serving path) can keep a
bfloat16 KV cache (``--kv-cache-dtype bfloat16``, or ``auto`` with
``TOKENMILL_CPU_KV_BF16=1``, see :func:`tokenmill.model.layers.kv_quant.auto_kv_bf16`).
This script builds two runners of the same model in one process, one with
``--kv-cache-dtype float32`` and one with ``bfloat16``, and times the same synthetic decode steps
(``B`` requests with ``--context`` cached tokens each; greedy sampling
included) on each, interleaved round by round so both see the same machine
load (the arms' order alternates by round). Prints the median step and its attention part (KV write + paged
attention, from :func:`roofline.step_breakdown`) per batch and the ratio
(steps of at most the low-bit limit run the CPU step graph, whose attention
is not timed apart: 0 there).

    TOKENMILL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/kv_cache_dtype.py --batches 32,64 --context 256

The model defaults to the packaged SmolLM2-135M GGUF (``--model`` for another).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import step_breakdown, synthetic_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: packaged SmolLM2-135M)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prefill step of this many prompts")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each: both arms, every batch)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per arm, batch and round")
    args = ap.parse_args()

    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.cpu_build import cpu_isa
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner

    threads = configure_threads(torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    need_blocks = max(batches) * (-(-(args.context + 1) // 16)) + 8
    runners = {}
    for arm in ("float32", "bfloat16"):
        cfg = EngineConfig.from_kwargs(model=args.model, dtype="float32", num_kv_blocks=need_blocks,
                                       max_model_len=max(args.context + 64, 1024), enforce_eager=True,
                                       max_num_seqs=max(batches), enable_prefix_caching=False, kv_cache_dtype=arm)
        runners[arm] = ModelRunner.from_config(cfg)
    print(f"torch {torch.__version__}, kernel ISA {cpu_isa()}, {threads} threads; KV cache: "
          + ", ".join(f"--kv-cache-dtype {a} -> {str(r.kv_cache_dtype).replace('torch.', '')}"
                      for a, r in runners.items())
          + f"; low-bit steps <= {runners['bfloat16'].lowbit_max_tokens} tokens; load {os.getloadavg()[0]:.1f}")
    # a real pool is written by the prefills: fill it, so no read is served by the kernel's shared zero page
    g = torch.Generator().manual_seed(0)
    for r in runners.values():
        for kv in r.kv_caches:
            kv.copy_(torch.randn(kv.shape, generator=g) * 0.5)
    steps = {(a, b): synthetic_step(r, [1] * b, [args.context] * b) for a, r in runners.items() for b in batches}
    if args.prefill:   # a prefill step: --prefill prompts of --context tokens (the random workload's first steps)
        batches.append(-args.prefill)
        for a, r in runners.items():
            steps[a, -args.prefill] = synthetic_step(r, [args.context] * args.prefill, [0] * args.prefill)
    res: dict = {k: {"step": [], "attention": []} for k in steps}
    arms = list(runners)
    for rnd in range(args.rounds):
        for b in batches:
            # the arms' order alternates by round: the second arm in a row measured up to 30% slower on a busy
            # machine (a 2048-token prefill step, 2026-12-01), which a fixed order would book to its KV dtype
            for a in (arms if rnd % 2 == 0 else arms[::-1]):
                r = runners[a]
                br = step_breakdown(r, steps[a, b], args.reps)
                res[a, b]["step"].append(br["step"])
                res[a, b]["attention"].append(br["attention"])
    print(f"\n{'step':<24}{'f32 KV ms':>11}{'bf16 KV ms':>12}{'speed-up':>10}"
          f"{'attn f32':>10}{'attn bf16':>11}{'speed-up':>10}")
    for b in batches:
        f = {k: statistics.median(res['float32', b][k]) for k in ("step", "attention")}
        h = {k: statistics.median(res['bfloat16', b][k]) for k in ("step", "attention")}
        label = f"B={b} ctx={args.context}" if b > 0 else f"prefill {-b}x{args.context}"
        print(f"{label:<24}{f['step'] * 1e3:>11.1f}{h['step'] * 1e3:>12.1f}"
              f"{f['step'] / h['step']:>9.2f}x{f['attention'] * 1e3:>10.1f}{h['attention'] * 1e3:>11.1f}"
              f"{f['attention'] / max(h['attention'], 1e-9):>9.2f}x")
    print(f"load after: {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
