"""A/B of the greedy sampler's argmax inside real decode steps: the C kernel vs the torch ops, interleaved.

Builds the float32 runner as ``benchmarks/roofline.py`` does (packaged SmolLM2-135M, batch-invariant default),
fills the KV pool with finite values (the synthetic steps attend over positions no prefill wrote), then for each
batch size times ``runner.execute_model`` of a synthetic greedy decode step with the sampler's argmax served by
``fused_cpu.argmax_rows`` ("kernel") and by ``torch.argmax`` + ``gather`` ("torch", the code before the kernel),
alternating per repetition; also the sampler alone on that step's logits. Checks that both arms give the same
tokens. Prints medians and writes the raw samples (``--json``).

    /work/bin/quiet .venv/bin/python benchmarks/sampling_ab.py --batches 1,64 --reps 9 --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    import roofline as rl

    from tokenmill.config import EngineConfig
    from tokenmill.model.layers import fused_cpu
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner

    threads = configure_threads(torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * (-(-(args.context + 1) // 16)) + 8
    cfg = EngineConfig.from_kwargs(model=None, dtype="float32", num_kv_blocks=blocks, max_model_len=1024,
                                   enforce_eager=True, max_num_seqs=max(batches), enable_prefix_caching=False)
    runner = ModelRunner.from_config(cfg)
    wait_for_packing(runner.model)
    rl.fill_kv_pool(runner)
    g = torch.Generator().manual_seed(0)
    kernel = fused_cpu.argmax_rows
    arms = {"torch": lambda x: None, "kernel": kernel}
    clock = time.perf_counter
    out = {"threads": threads, "load_avg_before": open("/proc/loadavg").read().split()[:3],
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "batches": {}}
    try:
        for b in batches:
            so = rl.synthetic_step(runner, [1] * b, [args.context] * b)
            sampling = [r for r in so.scheduled if r.sample]
            res = {a: {"step_ms": [], "sample_ms": [], "sampler_ms": []} for a in arms}
            tokens = {}
            hidden = torch.randn(b, runner.arch.hidden_size, generator=g)
            logits = runner.model.compute_logits(hidden)
            for a, fn in arms.items():      # warm-up, and the tokens of each arm
                fused_cpu.argmax_rows = fn
                tokens[a] = runner.execute_model(so).sampled_token_ids
            for _ in range(args.reps):
                for a, fn in arms.items():
                    fused_cpu.argmax_rows = fn
                    t0 = clock()
                    runner.execute_model(so)
                    res[a]["step_ms"].append((clock() - t0) * 1e3)
                    res[a]["sample_ms"].append(runner.last_timings["sample"] * 1e3)
                    t0 = clock()
                    runner.sampler(logits, sampling)
                    res[a]["sampler_ms"].append((clock() - t0) * 1e3)
            same = tokens["torch"] == tokens["kernel"]
            out["batches"][b] = {"same_tokens": same, **res}
            med = {a: {k: statistics.median(v) for k, v in r.items()} for a, r in res.items()}
            print(f"B={b}: same tokens {same}; " + "; ".join(
                f"{k} torch {med['torch'][k]:.3f} / kernel {med['kernel'][k]:.3f} ms "
                f"({med['torch'][k] / med['kernel'][k]:.2f}x)" for k in ("step_ms", "sample_ms", "sampler_ms")))
    finally:
        fused_cpu.argmax_rows = kernel
    out["load_avg_after"] = open("/proc/loadavg").read().split()[:3]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
