"""What tensor and pipeline parallelism cost on this machine: communication per step, its share, KV capacity.

On a 2-core CPU parallelism cannot add compute (both layouts share the same
two cores), so this script measures the price: for TP 2 vs 1 and PP 2 vs 1,
side by side in one run on the same seeded workload, it runs decode steps at
batch 1 and 32 on a tiny random-weight Llama sized so TP 2 divides it, and
reports per layout:

* ``step ms``: the executor's wall time per decode step (step description
  out, forward, sampled tokens back), median over the decode steps;
* ``fwd ms``: each worker's forward time (prepare + model + sample), median;
* ``comm ms`` / ``share``: time inside ``torch.distributed`` calls per step on
  each rank (TP: the two all-reduces per layer and the logits all-gather; PP:
  the stage hand-over; a PP ``recv`` includes waiting for the previous stage
  to finish, which on one batch is the pipeline bubble, not wire time) and its
  share of the forward time;
* the step description's size (diff-shaped vs. the full scheduler output).

Layouts: ``uniproc`` (the model in the engine process, 1 and 2 threads), ``mp 1x1``
(one worker process with both cores: the cost of the process boundary alone),
``mp tp2`` (2 workers, one core and thread each), ``mp pp2`` (2 stages, one core and thread each).
On a loaded machine a 2-thread OpenMP step suffers from descheduled threads at every barrier; the
1-thread rows are the fair baseline for the 1-thread-per-worker layouts.

Then the KV capacity per layout, computed from the real SmolLM2-135M
architecture (9 query / 3 KV heads, 30 layers) and the tiny model: blocks,
tokens and requests at full context each rank's budget (``--kv-cache-memory``,
per rank) buys.

Usage: ``python benchmarks/parallel.py [--dtype float32] [--steps 24] [--device cpu]``.
CUDA + NCCL runs the same code (``--device cuda``); no GPU was lent, so those
figures are missing from docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import envs  # noqa: E402

TINY = dict(layers=8, hidden=512, heads=8, kv_heads=4, ffn=1536, vocab=8192)


def build_tiny(folder: str) -> str:
    from tests.distributed.conftest import save_tiny_llama

    return save_tiny_llama(folder, layers=TINY["layers"], hidden=TINY["hidden"], heads=TINY["heads"],
                           kv_heads=TINY["kv_heads"], ffn=TINY["ffn"], vocab=TINY["vocab"], seed=0)


def run_layout(path: str, name: str, batch: int, args, threads: int | None = None, **kw) -> dict:
    """Decode ``args.steps`` steps at ``batch`` requests; per-step timings (``threads``: torch threads per process)."""
    from tokenmill import LLM, SamplingParams

    saved = envs.raw("TOKENMILL_NUM_THREADS")
    if threads:
        envs.set("TOKENMILL_NUM_THREADS", str(threads))
    try:
        llm = _make_llm(LLM, path, batch, args, kw)
    finally:
        if saved is None:
            envs.unset("TOKENMILL_NUM_THREADS")
        else:
            envs.set("TOKENMILL_NUM_THREADS", saved)
    return _measure(llm, name, batch, args)


def _make_llm(LLM, path, batch, args, kw):
    return LLM(path, dtype=args.dtype, device=args.device, num_kv_blocks=1024, block_size=16,
              max_num_seqs=max(batch, 1), max_num_batched_tokens=2048, enable_prefix_caching=False, **kw)


def _measure(llm, name: str, batch: int, args) -> dict:
    from tokenmill import SamplingParams

    ex = llm.engine_core.executor
    rec: list[tuple[int, float, list, int, int]] = []
    orig = ex.execute_model

    def timed(so):
        t0 = time.perf_counter()
        out = orig(so)
        dt = time.perf_counter() - t0
        stats = list(getattr(ex, "last_step_stats", []) or [])
        if not stats and hasattr(ex, "last_timings"):   # uniproc: the runner's own parts
            stats = [type("S", (), {"forward": sum(ex.last_timings.values()), "comm": 0.0})()]
        last = getattr(getattr(ex, "encoder", None), "_last", None)
        diff = len(pickle.dumps(last, protocol=5)) if last is not None else 0
        rec.append((so.total_num_scheduled_tokens, dt, stats, len(pickle.dumps(so, protocol=5)), diff))
        return out

    if hasattr(ex, "encoder"):                # remember the last encoded step to size it
        enc = ex.encoder
        enc_orig = enc.encode

        def encode(so):
            d = enc_orig(so)
            enc._last = d
            return d
        enc.encode = encode
    ex.execute_model = timed
    prompts = [[(7 * i + j) % (TINY["vocab"] - 3) + 3 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))   # warm-up
    rec.clear()
    llm.generate(prompts, params)
    llm.shutdown()
    dec = [r for r in rec if r[0] == batch][2:]      # decode steps, first two dropped
    nranks = len(dec[0][2])
    step = statistics.median(r[1] for r in dec) * 1e3
    fwd = [statistics.median(r[2][k].forward for r in dec) * 1e3 for k in range(nranks)]
    comm = [statistics.median(r[2][k].comm for r in dec) * 1e3 for k in range(nranks)]
    return {"name": name, "batch": batch, "step": step, "fwd": fwd, "comm": comm,
            "full_bytes": statistics.median(r[3] for r in dec),
            "diff_bytes": statistics.median(r[4] for r in dec) if dec[0][4] else 0}


def kv_capacity(budget: int) -> list[tuple]:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.executor.base import plan_kv_blocks
    from tokenmill.model.arch_config import ModelArchConfig
    from tokenmill.model.loader import load_arch_config

    smol = load_arch_config(None)
    tiny = ModelArchConfig(architecture="LlamaForCausalLM", num_hidden_layers=TINY["layers"],
                           hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
                           num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
                           head_dim=TINY["hidden"] // TINY["heads"], vocab_size=TINY["vocab"],
                           max_position_embeddings=8192)
    rows = []
    for label, arch, layouts in (("SmolLM2-135M", smol, [(1, 1), (3, 1), (1, 2), (3, 2)]),
                                 ("tiny", tiny, [(1, 1), (2, 1), (1, 2), (2, 2)])):
        for tp, pp in layouts:
            cfg = EngineConfig.from_kwargs(dtype="bfloat16", kv_cache_memory=str(budget),
                                           tensor_parallel_size=tp, pipeline_parallel_size=pp)
            blocks, per_rank = plan_kv_blocks(cfg, arch)
            tokens = blocks * cfg.cache.block_size
            rows.append((label, f"tp{tp} pp{pp}", max(per_rank), blocks, tokens,
                         tokens / arch.max_position_embeddings, tp * pp))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} UTC, commit {commit}, {cpu}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, dtype {args.dtype}, device {args.device}")
    print(f"# tiny Llama: {TINY}")
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny(d)
        layouts = [("uniproc 1 thread", {"threads": 1}), ("uniproc 2 threads", {"threads": 2}),
                   ("mp 1x1, 2 threads", {"distributed_executor_backend": "mp", "threads": 2}),
                   ("mp tp2, 1 thread each", {"tensor_parallel_size": 2, "threads": 1}),
                   ("mp pp2, 1 thread each", {"pipeline_parallel_size": 2, "threads": 1})]
        print("| batch | layout | step ms | vs uniproc 1 thread | fwd ms per rank | comm ms per rank | comm share | "
              "step msg bytes (diff / full) |")
        print("|---|---|---|---|---|---|---|---|")
        for b in [int(x) for x in args.batches.split(",")]:
            base = None
            for name, kw in layouts:
                r = run_layout(path, name, b, args, **kw)
                base = base or r["step"]
                share = [c / f if f else 0.0 for c, f in zip(r["comm"], r["fwd"])]
                msg = f"{r['diff_bytes']:.0f} / {r['full_bytes']:.0f}" if r["diff_bytes"] else f"- / {r['full_bytes']:.0f}"
                print(f"| {b} | {name} | {r['step']:.2f} | {r['step'] / base:.2f}x | "
                      f"{' / '.join(f'{x:.2f}' for x in r['fwd'])} | {' / '.join(f'{x:.2f}' for x in r['comm'])} | "
                      f"{' / '.join(f'{x:.0%}' for x in share)} | {msg} |", flush=True)
    print()
    budget = 1 << 30
    print(f"KV capacity at --kv-cache-memory 1GiB per rank (bfloat16, block 16):")
    print("| model | layout | KV bytes/token on a rank | blocks | tokens | requests at full context | ranks |")
    print("|---|---|---|---|---|---|---|")
    for row in kv_capacity(budget):
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} | {row[4]} | {row[5]:.1f} | {row[6]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
